package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/proxy"
)

// consoleUsersFile writes a console users file for users, each with the
// password user + "-pw".
func consoleUsersFile(t *testing.T, users ...string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "console.txt")
	var lines []string
	for _, u := range users {
		v, err := proxy.MakeVerifier(u, u+"-pw")
		if err != nil {
			t.Fatal(err)
		}
		lines = append(lines, proxy.QuoteUserLine(u, v))
	}
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestServeConsole runs `pgfence serve` with the console's flags
// (--console-auth-file, --admin-users, --stats-users, through the
// environment): the stats user reads but may not SHUTDOWN, the admin's
// SHUTDOWN ends serve cleanly (exit 0, as SIGTERM would).
func TestServeConsole(t *testing.T) {
	users := consoleUsersFile(t, "dba", "grafana")
	addr := freeAddr(t)
	t.Setenv("PGFENCE_CONSOLE_AUTH_FILE", users)
	t.Setenv("PGFENCE_STATS_USERS", "grafana")
	cmd := newServeCmd()
	cmd.Flags().String("log-level", "info", "")
	if err := cmd.ParseFlags([]string{"--listen", addr, "--primary", cluster.Primary.DSN("postgres"), "--admin-users", "dba"}); err != nil {
		t.Fatal(err)
	}
	cfg, err := loadServeConfig(cmd)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- runServe(context.Background(), cfg, zaptest.NewLogger(t)) }()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := pgtest.Poll(ctx, func() (bool, error) {
		c, err := pgconn.Connect(ctx, fmt.Sprintf("postgres://grafana:grafana-pw@%s/pgfence?sslmode=disable", addr))
		if err == nil {
			c.Close(ctx)
		}
		return err == nil, nil
	}); err != nil {
		t.Fatalf("the stats user never got into the console: %v", err)
	}
	psql := func(user, sql string) (string, error) {
		c := exec.CommandContext(ctx, "psql", "-X", "-At", "-c", sql, fmt.Sprintf("postgres://%s@%s/pgfence?sslmode=disable", user, addr))
		c.Env = append(os.Environ(), "PGPASSWORD="+user+"-pw")
		out, err := c.CombinedOutput()
		return string(out), err
	}
	if out, err := psql("grafana", "SHOW STATE"); err != nil || !strings.Contains(out, "paused|no") {
		t.Fatalf("stats user SHOW STATE: %v\n%s", err, out)
	}
	if out, err := psql("grafana", "SHUTDOWN"); err == nil || !strings.Contains(out, "admin access needed") {
		t.Fatalf("stats user SHUTDOWN: %v\n%s, want refused", err, out)
	}
	if out, err := psql("dba", "SHUTDOWN"); err != nil || !strings.Contains(out, "SHUTDOWN") {
		t.Fatalf("admin SHUTDOWN: %v\n%s", err, out)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve after the console's SHUTDOWN: %v, want nil", err)
		}
	case <-ctx.Done():
		t.Fatal("serve did not end after the console's SHUTDOWN")
	}
}
