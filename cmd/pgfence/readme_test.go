package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// readmeSection returns the ```sh blocks of the README section headed
// title, in order.
func readmeSection(t *testing.T, title string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	i := strings.Index(text, "\n## "+title+"\n")
	if i < 0 {
		t.Fatalf("README.md has no section %q", title)
	}
	text = text[i+len(title)+5:]
	if j := strings.Index(text, "\n## "); j >= 0 {
		text = text[:j]
	}
	var blocks []string
	var cur *strings.Builder
	for _, line := range strings.Split(text, "\n") {
		switch {
		case cur == nil && line == "```sh":
			cur = &strings.Builder{}
		case cur != nil && line == "```":
			blocks = append(blocks, cur.String())
			cur = nil
		case cur != nil:
			cur.WriteString(line + "\n")
		}
	}
	if cur != nil {
		t.Fatalf("README section %q: a ```sh block is not closed", title)
	}
	return blocks
}

// goEnv is `go env NAME`.
func goEnv(t *testing.T, name string) string {
	t.Helper()
	out, err := exec.Command("go", "env", name).Output()
	if err != nil {
		t.Fatalf("go env %s: %v", name, err)
	}
	return strings.TrimSpace(string(out))
}

// TestReadmeQuickstart runs the README's "Use it with your own database"
// as written, top to bottom in one bash, as a newcomer would on a fresh
// machine: a fresh HOME (make install puts the binary in ~/.local/bin, not
// on PATH until the README says so), no pgfence on PATH, no PG* variables,
// and a throwaway cluster standing for "your own database", where the
// application role must authenticate with a password (so the proxy's
// upstream password is exercised). The test only presets the variables
// the README lets the reader preset (DBA_URL, PGFENCE_LISTEN).
func TestReadmeQuickstart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and installs the binary and starts a cluster")
	}
	for _, tool := range []string{"bash", "psql", "pg_isready", "make"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not found: %v (the README needs it)", tool, err)
		}
	}
	blocks := readmeSection(t, "Use it with your own database")
	if len(blocks) < 6 {
		t.Fatalf("found %d sh blocks in the README's quickstart, want the install, set-up, schema, proxy, cron and zombie steps", len(blocks))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c, err := pgtest.Start(ctx, pgtest.Options{HBA: []string{"host all app 127.0.0.1/32 scram-sha-256"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	createDatabase(t, c, "app", "")
	listen := freeAddr(t)

	home := t.TempDir()
	// PATH without any pgfence already installed: the README must install it.
	var path []string
	for _, d := range filepath.SplitList(os.Getenv("PATH")) {
		if _, err := os.Stat(filepath.Join(d, "pgfence")); err == nil {
			continue
		}
		path = append(path, d)
	}
	env := []string{
		"HOME=" + home,
		"PATH=" + strings.Join(path, string(os.PathListSeparator)),
		"DBA_URL=" + c.Primary.DSN("app"),
		"PGFENCE_LISTEN=" + listen,
		// The Go toolchain's caches stay where they are (a fresh HOME
		// would move them and download every module again).
		"GOPATH=" + goEnv(t, "GOPATH"), "GOCACHE=" + goEnv(t, "GOCACHE"), "GOMODCACHE=" + goEnv(t, "GOMODCACHE"),
		"GOFLAGS=" + goEnv(t, "GOFLAGS"), "GOTOOLCHAIN=" + goEnv(t, "GOTOOLCHAIN"),
	}
	for _, kv := range cleanEnv(nil) {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case k == "HOME", k == "PATH", strings.HasPrefix(k, "GO"), strings.HasPrefix(k, "PGFENCE"), k == "DATABASE_URL":
			continue
		}
		env = append(env, kv)
	}
	// One bash, the blocks in order; the prelude only makes a failure
	// stop the script and leaves no background process behind.
	script := "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + strings.Join(blocks, "")
	cmd := exec.CommandContext(ctx, "bash", "-c", script)
	cmd.Dir = filepath.Join("..", "..") // the clone
	cmd.Env = env
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	// Standard output and error apart: the background pgfence serve logs
	// to its standard error at any moment, and in one stream a log line
	// could land in the middle of a line the checks below look for (it
	// split the lease list's "nightly-report  held" once).
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	t.Logf("the README's quickstart:\n%s\n--- standard output:\n%s\n--- standard error:\n%s", script, stdout.Bytes(), stderr.Bytes())
	if err != nil {
		t.Fatalf("the README's quickstart failed: %v", err)
	}
	o := stdout.String() + "\n" + stderr.String()
	for _, want := range []string{
		"installed " + filepath.Join(home, ".local", "bin", "pgfence"),
		"pgfence ",
		"fence schema migrated from version 0",
		"protected results",
		"lease acquired", "lease released", // pgfence run's log
		"ERROR:  FN001", // the zombie's write
		"refused, as it should be",
		"nightly-report  held", // lease list
	} {
		if !strings.Contains(o, want) {
			t.Errorf("the quickstart's output lacks %q", want)
		}
	}
	// On a separate connection: the result is the job's, not the zombie's,
	// and was written through the fence (a receipt).
	conn, err := c.Primary.Connect(context.Background(), "app")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var payload string
	var receipts int
	if err := conn.QueryRow(context.Background(), `SELECT payload, (SELECT count(*) FROM fence.receipts WHERE job_key = 'nightly-report') FROM results`).Scan(&payload, &receipts); err != nil {
		t.Fatal(err)
	}
	if payload != "1" || receipts != 1 {
		t.Errorf("results: payload %q with %d receipts, want the job's \"1\" with one receipt", payload, receipts)
	}
	if _, err := os.Stat(filepath.Join(home, "pgfence-demo", "pgfence.toml")); err != nil {
		t.Errorf("the quickstart's files are not in ~/pgfence-demo: %v", err)
	}
}
