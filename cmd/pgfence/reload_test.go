package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// TestReloadOnSIGHUP runs `pgfence serve` from a config file, changes the
// file, sends SIGHUP and sees the new max_clients, admin users and log
// level apply, and the listen address reported as needing a restart.
func TestReloadOnSIGHUP(t *testing.T) {
	addr, metrics := freeAddr(t), freeAddr(t)
	file := filepath.Join(t.TempDir(), "pgfence.toml")
	write := func(maxClients int, admins, level string) {
		t.Helper()
		if err := os.WriteFile(file, []byte(fmt.Sprintf(`
listen = %q
primary = %q
auth = "trust"
metrics_listen = %q
max_clients = %d
admin_users = [%s]
log_level = %q
`, addr, cluster.Primary.DSN("postgres"), metrics, maxClients, admins, level)), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(1, `"admin"`, "info")
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

	write(5, `"admin", "ops"`, "debug")
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
	write(5, `"admin", "ops"`, "debug")
	if err := os.WriteFile(file, []byte(strings.Replace(mustRead(t, file), addr, "127.0.0.1:1", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.CommandContext(tctx, "psql", "-X", "-At", "-F", "|", "-c", "RELOAD", "-c", "SHOW CONFIG", dsn("ops", "pgfence")).CombinedOutput()
	if err != nil {
		t.Fatalf("psql RELOAD: %v\n%s", err, out)
	}
	for _, want := range []string{"listen|changed; needs a restart", "listen|" + addr + "|no", "log_level|debug|yes", "max_clients|5|yes", "admin_users|admin,ops|yes"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("psql RELOAD; SHOW CONFIG:\n%s\nwant %q", out, want)
		}
	}
	var pg *pgconn.PgError
	if _, err := pgconn.Connect(tctx, dsn("nobody", "pgfence")); !errors.As(err, &pg) || pg.Code != "42501" {
		t.Errorf("non-admin console user: got %v, want 42501", err)
	}
}

func mustRead(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
