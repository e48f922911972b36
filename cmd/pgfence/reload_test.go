package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestReloadOnSIGHUP runs `pgfence serve` from a config file, changes the
// file, sends SIGHUP and sees the new max_clients, admin users and log
// level apply, and the listen address reported as needing a restart.
func TestReloadOnSIGHUP(t *testing.T) {
	addr, metrics := freeAddr(t), freeAddr(t)
	file := filepath.Join(t.TempDir(), "pgfence.toml")
	consoleUsers := consoleUsersFile(t, "admin", "ops", "nobody") // ops's password: ops-pw
	write := func(listen string, maxClients int, admins, level string) {
		t.Helper()
		if err := os.WriteFile(file, []byte(fmt.Sprintf(`
listen = %q
primary = %q
auth = "trust"
metrics_listen = %q
max_clients = %d
admin_users = [%s]
console_auth_file = %q
log_level = %q
`, listen, cluster.Primary.DSN("postgres"), metrics, maxClients, admins, consoleUsers, level)), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(addr, 1, `"admin"`, "info")
	cmd := newServeCmd()
	cmd.Flags().String("log-level", "info", "")
	if err := cmd.ParseFlags([]string{"--config", file}); err != nil {
		t.Fatal(err)
	}
	cfg, err := loadServeConfig(cmd)
	if err != nil {
		t.Fatal(err)
	}
	level := zap.NewAtomicLevelAt(zap.InfoLevel)
	cfg.level = &level
	cfg.reload = func() (serveConfig, error) { return loadServeConfig(cmd) }

	db := cluster.NewDatabase(t)
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runServe(ctx, cfg, zaptest.NewLogger(t)) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	tctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dsn := func(user, db string) string {
		return fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", user, addr, db)
	}
	// The listener appearing means SIGHUP is handled (it is installed
	// before the listener opens).
	var first *pgconn.PgConn
	if err := pgtest.Poll(tctx, func() (bool, error) {
		var err error
		first, err = pgconn.Connect(tctx, dsn("postgres", db))
		return err == nil, nil
	}); err != nil {
		t.Fatalf("serve never accepted a connection: %v", err)
	}
	defer first.Close(context.Background())
	if _, err := pgconn.Connect(tctx, dsn("postgres", db)); !strings.Contains(fmt.Sprint(err), "53300") {
		t.Fatalf("second client with max_clients 1: got %v, want 53300", err)
	}

	// Metrics endpoint from metrics_listen.
	resp, err := http.Get("http://" + metrics + "/metrics")
	if err != nil {
		t.Fatalf("metrics: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `pgfence_clients_refused_total{code="53300"} 1`) {
		t.Fatalf("metrics: want one 53300 refusal in\n%s", body)
	}

	write(addr, 5, `"admin", "ops"`, "debug")
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	if err := pgtest.Poll(tctx, func() (bool, error) { return level.Level() == zap.DebugLevel, nil }); err != nil {
		t.Fatalf("log level after SIGHUP: %v, want debug", level.Level())
	}
	second, err := pgconn.Connect(tctx, dsn("postgres", db))
	if err != nil {
		t.Fatalf("second client after reload to max_clients 5: %v", err)
	}
	defer second.Close(context.Background())

	// The console: ops is an admin now; RELOAD reports a listen change
	// as needing a restart.
	write("127.0.0.1:1", 5, `"admin", "ops"`, "debug")
	psql := exec.CommandContext(tctx, "psql", "-X", "-At", "-F", "|", "-c", "RELOAD", "-c", "SHOW CONFIG_SOURCES", dsn("ops", "pgfence"))
	psql.Env = append(os.Environ(), "PGPASSWORD=ops-pw")
	out, err := psql.CombinedOutput()
	if err != nil {
		t.Fatalf("psql RELOAD: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "listen|changed; needs a restart") {
		t.Errorf("psql RELOAD:\n%s\nwant listen needing a restart", out)
	}
	// SHOW CONFIG: key|value|default|changeable|source.
	conf := map[string][]string{}
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Split(line, "|"); len(f) == 5 {
			conf[f[0]] = f
		}
	}
	for key, want := range map[string][2]string{"listen": {addr, "no"}, "log_level": {"debug", "yes"}, "max_clients": {"5", "yes"}, "admin_users": {"admin,ops", "yes"}} {
		if f := conf[key]; f == nil || f[1] != want[0] || f[3] != want[1] {
			t.Errorf("psql SHOW CONFIG %s: %v, want value %s, changeable %s\n%s", key, f, want[0], want[1], out)
		}
	}
	var pg *pgconn.PgError
	if _, err := pgconn.Connect(tctx, dsn("nobody:nobody-pw", "pgfence")); !errors.As(err, &pg) || pg.Code != "42501" {
		t.Errorf("non-admin console user: got %v, want 42501", err)
	}
	if _, err := pgconn.Connect(tctx, dsn("admin", "pgfence")); !errors.As(err, &pg) || pg.Code != "28P01" {
		t.Errorf("console user without a password: got %v, want 28P01", err)
	}
}

// textEntry is the start of a text log line: time, level, message.
var textEntry = regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}(Z|[+-]\d{4})  (DEBUG|INFO|WARN|ERROR)  \S`)

// lockedBuffer is a bytes.Buffer safe for a logger and a test to share.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// A reload that fails on SIGHUP logs the reason on one line, in the text
// format a terminal gets, without a stack trace.
func TestReloadFailureIsOneLine(t *testing.T) {
	clearServeEnv(t)
	addr := freeAddr(t)
	file := filepath.Join(t.TempDir(), "pgfence.toml")
	if err := os.WriteFile(file, []byte(fmt.Sprintf("listen = %q\nprimary = %q\n", addr, cluster.Primary.DSN("postgres"))), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := serveCommand(t, "--config", file)
	cfg, err := loadServeConfig(cmd)
	if err != nil {
		t.Fatal(err)
	}
	var logs lockedBuffer
	log, level, err := buildLogger("info", "text", false, &logs)
	if err != nil {
		t.Fatal(err)
	}
	cfg.level = &level
	cfg.reload = func() (serveConfig, error) { return loadServeConfig(cmd) }
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runServe(ctx, cfg, log) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	tctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := pgtest.Poll(tctx, func() (bool, error) { return strings.Contains(logs.String(), "listening"), nil }); err != nil {
		t.Fatalf("serve never listened; logs:\n%s", logs.String())
	}
	// A TOML syntax error spanning lines, and a bad value.
	if err := os.WriteFile(file, []byte("listen = \"unterminated\nmax_clients = [\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	if err := pgtest.Poll(tctx, func() (bool, error) { return strings.Contains(logs.String(), "reload on SIGHUP failed"), nil }); err != nil {
		t.Fatalf("no reload failure logged:\n%s", logs.String())
	}
	out := logs.String()
	var failed []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if !textEntry.MatchString(line) {
			t.Errorf("a log line that is not an entry (a continuation, a stack frame?): %q", line)
		}
		if strings.Contains(line, "reload on SIGHUP failed") {
			failed = append(failed, line)
		}
	}
	if len(failed) != 1 || !strings.Contains(failed[0], file) || strings.Fields(failed[0])[1] != "ERROR" {
		t.Errorf("want one ERROR line naming %s, got %q", file, failed)
	}
	for _, bad := range []string{"stacktrace", "goroutine", ".go:"} {
		if strings.Contains(out, bad) {
			t.Errorf("the log has %q:\n%s", bad, out)
		}
	}
}
