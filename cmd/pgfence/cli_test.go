package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/pgfence/pgfence/internal/runner"
	"github.com/pgfence/pgfence/internal/testbin"
)

func TestParseDuration(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want time.Duration
	}{
		{"30s", 30 * time.Second},
		{"5m", 5 * time.Minute},
		{"7d", 7 * 24 * time.Hour},
		{"1d12h", 36 * time.Hour},
		{"1.5d", 36 * time.Hour},
		{"250ms", 250 * time.Millisecond},
		{"0", 0},
		{"-1d", -24 * time.Hour},
	} {
		got, err := parseDuration(tt.in)
		if err != nil || got != tt.want {
			t.Errorf("parseDuration(%q) = %v, %v; want %v", tt.in, got, err, tt.want)
		}
	}
	for _, bad := range []string{"", "5", "d", "soon", "1x", "1d2", "--1d"} {
		if got, err := parseDuration(bad); err == nil {
			t.Errorf("parseDuration(%q) = %v, want an error", bad, got)
		}
	}
	for d, want := range map[time.Duration]string{7 * 24 * time.Hour: "7d", time.Hour: "1h", 90 * time.Second: "1m30s", 30 * time.Second: "30s", 0: "0s"} {
		if got := formatDuration(d); got != want {
			t.Errorf("formatDuration(%v) = %q, want %q", d, got, want)
		}
	}
}

// Every duration flag of every command accepts days.
func TestEveryDurationFlagAcceptsDays(t *testing.T) {
	var walk func(c *cobra.Command)
	n := 0
	walk = func(c *cobra.Command) {
		c.LocalFlags().VisitAll(func(f *pflag.Flag) {
			if f.Value.Type() != "duration" {
				return
			}
			n++
			if err := f.Value.Set("2d"); err != nil {
				t.Errorf("%s --%s 2d: %v", c.CommandPath(), f.Name, err)
			}
		})
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(newRootCmd())
	if n < 8 {
		t.Errorf("found %d duration flags; the walk is broken", n)
	}
}

// Every command but help and completion has --json and --database where it
// talks to a database (serve: --database names its primary).
func TestEveryCommandHasTheCommonFlags(t *testing.T) {
	noDatabase := map[string]bool{"pgfence version": true, "pgfence passwd": true, "pgfence dev": true}
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		for _, sub := range c.Commands() {
			walk(sub)
		}
		if !c.Runnable() || c.Name() == "help" || c.HasSubCommands() {
			return
		}
		if c.Flag("json") == nil {
			t.Errorf("%s has no --json", c.CommandPath())
		}
		if !noDatabase[c.CommandPath()] && c.Flag("database") == nil {
			t.Errorf("%s has no --database", c.CommandPath())
		}
		if f := c.Flag("holder"); f != nil && f.Usage != holderHelp {
			t.Errorf("%s --holder: %q, want the common default %q", c.CommandPath(), f.Usage, holderHelp)
		}
	}
	root := newRootCmd()
	root.InitDefaultHelpCmd()
	walk(root)
}

// The exit code table: one case per row, with what stdout and stderr say.
func TestExitCodes(t *testing.T) {
	db := cluster.NewDatabase(t)
	dsn := cluster.Primary.DSN(db)
	bare := cluster.NewDatabase(t)
	mustExec(t, connect(t, bare), "drop schema fence cascade")
	// A role without pgfence_worker.
	createRole(t, connect(t, db), "cli_nobody", "")
	nobody := strings.Replace(dsn, "postgres@", "cli_nobody@", 1)
	held := mustRun(t, "lease", "acquire", "--database", dsn, "--job", "held", "--holder", "alice")
	heldToken := kv(t, held)["token"]
	mustRun(t, "lease", "acquire", "--database", dsn, "--job", "held", "--holder", "alice") // alice again: a new token
	unreachable := "postgres://postgres@127.0.0.1:1/x?connect_timeout=2"

	for _, tt := range []struct {
		name   string
		args   []string
		code   int
		stderr string // in the text error
		state  string // the SQLSTATE in the JSON error
	}{
		{"unknown command", []string{"frobnicate"}, exitUsage, "unknown command", ""},
		{"unknown subcommand", []string{"lease", "frobnicate"}, exitUsage, "unknown command", ""},
		{"missing flag", []string{"lease", "acquire", "--database", dsn}, exitUsage, `"job" not set`, ""},
		{"bad duration", []string{"lease", "acquire", "--database", dsn, "--job", "j", "--ttl", "soon"}, exitUsage, "invalid duration", ""},
		{"wait and no-wait", []string{"lease", "acquire", "--database", dsn, "--job", "j", "--wait", "--no-wait"}, exitUsage, "wait", ""},
		{"bad job key", []string{"lease", "renew", "--database", dsn, "--job", strings.Repeat("x", 201), "--token", "1"}, exitDataErr, "200", "22023"},
		{"unknown job", []string{"lease", "show", "--database", dsn, "nope"}, exitDataErr, "unknown", ""},
		{"unknown job renew", []string{"lease", "renew", "--database", dsn, "--job", "nope", "--token", "1"}, exitDataErr, "unknown", "FN005"},
		{"unreachable", []string{"lease", "acquire", "--database", unreachable, "--job", "j"}, exitUnavailable, "connect", ""},
		{"unreachable migrate", []string{"migrate", "--database", unreachable}, exitUnavailable, "connect", ""},
		{"held", []string{"lease", "acquire", "--database", dsn, "--job", "held", "--holder", "bob"}, exitTempFail, "held by", "FN002"},
		{"stale", []string{"lease", "renew", "--database", dsn, "--job", "held", "--token", heldToken}, exitLeaseLost, "", "FN001"},
		{"no pgfence_worker", []string{"lease", "acquire", "--database", nobody, "--job", "j"}, exitNoPerm, "pgfence_worker", "42501"},
		{"no schema", []string{"lease", "list", "--database", cluster.Primary.DSN(bare)}, exitConfig, "pgfence migrate", "42P01"},
		{"no database", []string{"lease", "list", "--database", cluster.Primary.DSN("no_such_db")}, exitConfig, "does not exist", "3D000"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			code, stdout, stderr := pgfenceExit(t, nil, tt.args...)
			if code != tt.code {
				t.Fatalf("exit code %d, want %d; stderr:\n%s", code, tt.code, stderr)
			}
			if stdout != "" {
				t.Errorf("a failed command printed on stdout: %q", stdout)
			}
			if !strings.HasPrefix(stderr, "pgfence: ") || !strings.Contains(stderr, tt.stderr) {
				t.Errorf("stderr %q, want pgfence: ... %q", stderr, tt.stderr)
			}
			// With --json, the same error as one JSON object.
			code, stdout, stderr = pgfenceExit(t, nil, append(tt.args, "--json")...)
			if code != tt.code || stdout != "" {
				t.Fatalf("--json: exit %d, stdout %q; want %d and nothing", code, stdout, tt.code)
			}
			var e errorJSON
			if err := json.Unmarshal([]byte(stderr), &e); err != nil || strings.Count(stderr, "\n") != 1 {
				t.Fatalf("--json: stderr is not one JSON line: %q (%v)", stderr, err)
			}
			if e.ExitCode != tt.code || e.Error == "" || e.SQLSTATE != tt.state {
				t.Errorf("--json error: got %+v, want exit_code %d, sqlstate %q", e, tt.code, tt.state)
			}
		})
	}
}

// lease acquire without --holder names the process that keeps the lease:
// its parent, as pgfence run names itself; PGFENCE_HOLDER wins for both.
func TestHolderDefault(t *testing.T) {
	dsn := cluster.Primary.DSN(cluster.NewDatabase(t))
	host, _ := os.Hostname()
	got := kv(t, mustRun(t, "lease", "acquire", "--database", dsn, "--job", "a"))["holder"]
	if want := host + ":" + strconv.Itoa(os.Getppid()); got != want {
		t.Errorf("default holder %q, want %q", got, want)
	}
	t.Setenv("PGFENCE_HOLDER", "worker-7")
	got = kv(t, mustRun(t, "lease", "acquire", "--database", dsn, "--job", "b"))["holder"]
	if got != "worker-7" {
		t.Errorf("holder with PGFENCE_HOLDER: %q, want worker-7", got)
	}
	c, err := execRun(t, succeed, "--job", "j", "--", "true")
	if err != nil || c.Holder != "worker-7" {
		t.Errorf("run's holder with PGFENCE_HOLDER: %q (%v), want worker-7", c.Holder, err)
	}
}

// --json on every command prints one JSON document on stdout.
func TestJSONOutput(t *testing.T) {
	db := cluster.NewDatabase(t)
	dsn := cluster.Primary.DSN(db)
	mustExec(t, connect(t, db), "create table results (job_key text primary key, payload text, token bigint)")
	var a struct {
		JobKey string `json:"job_key"`
		Token  int64  `json:"token"`
		Epoch  int64  `json:"epoch"`
	}
	out := mustRun(t, "lease", "acquire", "--json", "--database", dsn, "--job", "nightly", "--holder", "alice")
	if err := json.Unmarshal([]byte(out), &a); err != nil || a.Token == 0 {
		t.Fatalf("acquire --json: %q (%v)", out, err)
	}
	tok := strconv.FormatInt(a.Token, 10)
	for _, args := range [][]string{
		{"version"},
		{"migrate", "--database", dsn},
		{"protect", "add", "results", "--database", dsn},
		{"protect", "list", "--database", dsn},
		{"lease", "renew", "--database", dsn, "--job", "nightly", "--token", tok},
		{"lease", "list", "--database", dsn},
		{"lease", "show", "nightly", "--database", dsn},
		{"lease", "release", "--database", dsn, "--job", "nightly", "--token", tok},
		{"lease", "retire", "--database", dsn, "--job", "nightly"},
		{"gc", "--database", dsn, "--keep", "7d"},
		{"audit", "--database", dsn},
		{"era", "show", "--database", dsn},
		{"era", "new", "--reason", "TestJSONOutput", "--database", dsn},
		{"protect", "remove", "results", "--database", dsn},
	} {
		out := mustRun(t, append(args, "--json")...)
		var v any
		if err := json.Unmarshal([]byte(out), &v); err != nil {
			t.Errorf("pgfence %s --json: not JSON: %q (%v)", strings.Join(args, " "), out, err)
		}
	}
}

func TestLeaseListAndShow(t *testing.T) {
	db := cluster.NewDatabase(t)
	dsn := cluster.Primary.DSN(db)
	if out := mustRun(t, "lease", "list", "--database", dsn); !strings.Contains(out, "no jobs") {
		t.Errorf("list of an empty database: %q", out)
	}
	a := kv(t, mustRun(t, "lease", "acquire", "--database", dsn, "--job", "nightly", "--holder", "alice", "--ttl", "1d"))
	mustRun(t, "lease", "acquire", "--database", dsn, "--job", "hourly", "--holder", "bob")
	b := kv(t, mustRun(t, "lease", "acquire", "--database", dsn, "--job", "hourly", "--holder", "bob"))
	mustRun(t, "lease", "release", "--database", dsn, "--job", "hourly", "--token", b["token"])
	mustRun(t, "lease", "acquire", "--database", dsn, "--job", "weekly", "--holder", "carol")
	mustRun(t, "lease", "retire", "--database", dsn, "--job", "weekly", "--force") // carol's lease is live (issue 17 §5)

	list := mustRun(t, "lease", "list", "--database", dsn)
	for _, want := range []string{"JOB KEY", "nightly  held", "alice", "hourly   free", "weekly   retired"} {
		if !strings.Contains(list, want) {
			t.Errorf("lease list lacks %q:\n%s", want, list)
		}
	}
	var li leaseInfo
	out := mustRun(t, "lease", "show", "nightly", "--json", "--database", dsn)
	if err := json.Unmarshal([]byte(out), &li); err != nil {
		t.Fatal(err)
	}
	exp, _ := time.Parse(time.RFC3339Nano, a["expires_at"])
	if li.State != "held" || li.Holder != "alice" || li.Token == nil || strconv.FormatInt(*li.Token, 10) != a["token"] ||
		li.ExpiresAt == nil || !li.ExpiresAt.Equal(exp) || li.HeldSince == nil || li.HeldForMS == nil || *li.HeldForMS < 0 {
		t.Fatalf("show nightly: %s; want held by alice with token %s until %s, and how long", out, a["token"], a["expires_at"])
	}
	text := mustRun(t, "lease", "show", "nightly", "--database", dsn)
	for _, want := range []string{"state", "held", "holder", "alice", "expires_at", "held_since", "held_for", "last_renewal"} {
		if !strings.Contains(text, want) {
			t.Errorf("lease show lacks %q:\n%s", want, text)
		}
	}
	// An application role (pgfence_worker) cannot read the issuance log:
	// the rest is shown without the time held.
	createRole(t, connect(t, db), "cli_worker", "in role pgfence_worker")
	out = mustRun(t, "lease", "show", "nightly", "--json", "--database", strings.Replace(dsn, "postgres@", "cli_worker@", 1))
	li = leaseInfo{}
	if err := json.Unmarshal([]byte(out), &li); err != nil || li.State != "held" || li.Holder != "alice" || li.HeldSince != nil {
		t.Fatalf("show as a worker: %s (%v); want held by alice, without held_since", out, err)
	}
}

// lease acquire blocked by an open transaction on the fence row names the
// blocking session and, after --lock-timeout, exits 75 printing nothing on
// stdout.
func TestLeaseAcquireNamesTheBlockingSession(t *testing.T) {
	ctx := context.Background()
	dsn := cluster.Primary.DSN(cluster.NewDatabase(t))
	a := kv(t, mustRun(t, "lease", "acquire", "--database", dsn, "--job", "nightly", "--holder", "alice"))
	mustRun(t, "lease", "release", "--database", dsn, "--job", "nightly", "--token", a["token"])
	blocker, err := pgx.Connect(ctx, dsn+"&application_name=stalled-worker")
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Close(ctx)
	mustExec(t, blocker, "begin")
	mustExec(t, blocker, "select 1 from fence.fences where job_key = 'nightly' for update")
	pid := blocker.PgConn().PID()
	code, stdout, stderr := pgfenceExit(t, nil, "lease", "acquire", "--database", dsn, "--job", "nightly", "--holder", "bob", "--lock-timeout", "2s", "--log-format", "text")
	if code != exitTempFail || stdout != "" {
		t.Fatalf("exit %d, stdout %q; want %d and nothing; stderr:\n%s", code, stdout, exitTempFail, stderr)
	}
	for _, want := range []string{"locked by an open transaction", fmt.Sprintf("pid %d", pid), "stalled-worker", "still locked after 2s"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr lacks %q:\n%s", want, stderr)
		}
	}
}

// The script idiom the docs give stops at a lease that is not ours; the
// naive eval "$(...)" does not, which is why the docs warn against it.
func TestLeaseAcquireInAScript(t *testing.T) {
	bin := testbin.Pgfence(t)
	dsn := cluster.Primary.DSN(cluster.NewDatabase(t))
	mustRun(t, "lease", "acquire", "--database", dsn, "--job", "nightly", "--holder", "alice")
	run := func(script string) (int, string) {
		cmd := exec.Command("bash", "-c", script)
		cmd.Env = append(cleanEnv(nil), "PGFENCE="+bin, "DATABASE_URL="+dsn)
		out, err := cmd.CombinedOutput()
		if ee, ok := err.(*exec.ExitError); ok {
			return ee.ExitCode(), string(out)
		} else if err != nil {
			t.Fatal(err)
		}
		return 0, string(out)
	}
	code, out := run(`set -e
lease=$("$PGFENCE" lease acquire --job nightly --holder bob)
eval "$lease"
echo "reached with token $token"`)
	if code != exitTempFail || strings.Contains(out, "reached") || !strings.Contains(out, "FN002") {
		t.Errorf("the documented idiom: exit %d, output:\n%s\nwant exit 75 before the script goes on", code, out)
	}
	code, out = run(`set -e
eval "$("$PGFENCE" lease acquire --job nightly --holder bob)"
echo "reached with token '$token'"`)
	if code != 0 || !strings.Contains(out, "reached with token ''") {
		t.Errorf("eval \"$(...)\": exit %d, output:\n%s\n(the docs say this form does not stop a script; if it now does, update them)", code, out)
	}
}

func TestVersion(t *testing.T) {
	out := mustRun(t, "--version")
	if !strings.HasPrefix(out, "pgfence ") || strings.Count(out, "\n") != 1 {
		t.Errorf("--version: %q", out)
	}
	if v := mustRun(t, "version"); !strings.HasPrefix(v, strings.TrimSpace(out)) || !strings.Contains(v, "module   github.com/pgfence/pgfence") {
		t.Errorf("version: %q, want --version's line first and the module", v)
	}
	var bv buildVersion
	if err := json.Unmarshal([]byte(mustRun(t, "version", "--json")), &bv); err != nil || bv.Module != "github.com/pgfence/pgfence" || bv.Version == "" || bv.Go == "" {
		t.Errorf("version --json: %+v, %v", bv, err)
	}
}

// A binary built as the Makefile builds it reports the commit of the
// checkout.
func TestVersionFromMakefileLdflags(t *testing.T) {
	commit, err := exec.Command("git", "rev-parse", "HEAD").Output()
	if err != nil {
		t.Skipf("not a git checkout: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "pgfence")
	cmd := exec.Command("./scripts/build.sh", bin)
	cmd.Env = append(os.Environ(), "GO_LDFLAGS=-X main.version=v9.9.9 -X main.commit="+strings.TrimSpace(string(commit))+"-dirty")
	// build.sh runs go build ./cmd/pgfence from the repository root.
	cmd.Dir = "../.."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("scripts/build.sh: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "version", "--json").Output()
	if err != nil {
		t.Fatal(err)
	}
	var bv buildVersion
	if err := json.Unmarshal(out, &bv); err != nil {
		t.Fatal(err)
	}
	if bv.Version != "v9.9.9" || bv.Commit != strings.TrimSpace(string(commit)) || !bv.Modified {
		t.Errorf("version --json: %+v, want v9.9.9, commit %s, modified", bv, commit)
	}
}

// docs/cli.md's exit code table lists every code the commands use.
func TestExitCodesDocumented(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", "cli.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, code := range []int{exitOK, exitViolations, exitUsage, exitDataErr, exitUnavailable, exitSoftware, exitTempFail, exitLeaseLost,
		exitNoPerm, exitConfig, runner.ExitMaxRuntime, runner.ExitCannotExecute, runner.ExitNotFound} {
		if !strings.Contains(string(b), fmt.Sprintf("\n| %d |", code)) {
			t.Errorf("docs/cli.md's exit code table has no row for %d", code)
		}
	}
}
