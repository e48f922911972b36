package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap/zaptest"
)

func TestServeConfigPrecedence(t *testing.T) {
	file := filepath.Join(t.TempDir(), "pgfence.toml")
	os.WriteFile(file, []byte(`
listen = "127.0.0.1:7000"
primary = "postgres://file@localhost/db"
max_clients = 5
max_message_size = "1MiB"
shutdown_timeout = "3s"
no_event_loop = true
[upstream_passwords]
alice = "pw"
`), 0o600)
	t.Setenv("PGFENCE_MAX_CLIENTS", "7")
	t.Setenv("PGFENCE_LISTEN", "127.0.0.1:7001")
	cmd := newServeCmd()
	cmd.Flags().String("log-level", "info", "")
	if err := cmd.ParseFlags([]string{"--config", file, "--listen", "127.0.0.1:7002"}); err != nil {
		t.Fatal(err)
	}
	cfg, err := loadServeConfig(cmd)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Listen != "127.0.0.1:7002" || cfg.MaxClients != 7 || cfg.Primary != "postgres://file@localhost/db" || cfg.UpstreamPasswords["alice"] != "pw" {
		t.Fatalf("got %+v, want flag listen, env max_clients, file primary", cfg)
	}
	pc, err := cfg.proxyConfig()
	if err != nil {
		t.Fatal(err)
	}
	if pc.MaxMessageSize != 1<<20 || pc.ShutdownTimeout != 3*time.Second || !pc.DisableEventLoop {
		t.Fatalf("got size %d timeout %v event loop off %v, want 1MiB 3s true", pc.MaxMessageSize, pc.ShutdownTimeout, pc.DisableEventLoop)
	}
	t.Setenv("PGFENCE_NO_EVENT_LOOP", "false")
	if cfg, err = loadServeConfig(cmd); err != nil || cfg.NoEventLoop {
		t.Fatalf("PGFENCE_NO_EVENT_LOOP=false over the file: got %v %v", cfg.NoEventLoop, err)
	}
	if err := cmd.ParseFlags([]string{"--no-event-loop"}); err != nil {
		t.Fatal(err)
	}
	if cfg, err = loadServeConfig(cmd); err != nil || !cfg.NoEventLoop {
		t.Fatalf("--no-event-loop over the environment: got %v %v", cfg.NoEventLoop, err)
	}
	os.WriteFile(file, []byte("listne = \"x\"\n"), 0o600)
	if _, err := loadServeConfig(cmd); err == nil || !strings.Contains(err.Error(), "listne") {
		t.Fatalf("unknown key: got %v, want an error naming it", err)
	}
}

func TestPasswdAndServeSCRAM(t *testing.T) {
	var out bytes.Buffer
	cmd := newPasswdCmd()
	cmd.SetIn(strings.NewReader("s3cret\n"))
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"postgres"})
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), `"postgres" "SCRAM-SHA-256$4096:`) {
		t.Fatalf("passwd printed %q", out.String())
	}
	users := filepath.Join(t.TempDir(), "users.txt")
	os.WriteFile(users, out.Bytes(), 0o600)

	addr := freeAddr(t)
	db := cluster.NewDatabase(t)
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- runServe(ctx, serveConfig{Listen: addr, Primary: cluster.Primary.DSN("postgres"), Auth: "scram", AuthFile: users}, zaptest.NewLogger(t))
	}()
	dsn := func(pw string) string {
		return fmt.Sprintf("postgres://postgres:%s@%s/%s?sslmode=disable", pw, addr, db)
	}
	var c *pgconn.PgConn
	deadline := time.Now().Add(10 * time.Second)
	for {
		var err error
		if c, err = pgconn.Connect(context.Background(), dsn("s3cret")); err == nil {
			break
		}
		var pg *pgconn.PgError
		if time.Now().After(deadline) || errors.As(err, &pg) {
			t.Fatalf("connect through pgfence serve: %v", err)
		}
		time.Sleep(20 * time.Millisecond) // waiting for the listener to appear, not for ordering
	}
	if _, err := c.Exec(context.Background(), "SELECT 1").ReadAll(); err != nil {
		t.Fatal(err)
	}
	c.Close(context.Background())
	if _, err := pgconn.Connect(context.Background(), dsn("wrong")); err == nil {
		t.Fatal("wrong password accepted")
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("serve: %v", err)
	}
}
