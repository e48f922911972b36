package main

// The package's test harness: its PostgreSQL, the CLI run in-process (as
// main runs it) or as a built binary, and connections to the cluster.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/testbin"
	"github.com/pgfence/pgfence/migrations"
)

// cluster is the package's PostgreSQL, shared by every test of cmd/pgfence:
// databases cloned from a migrated template.
var cluster *pgtest.Cluster

func TestMain(m *testing.M) {
	code := pgtest.Run(m, pgtest.Options{}, migrations.Prepare, &cluster)
	testbin.Remove() // built once for the tests that run the binary
	os.Exit(code)
}

// pgfence runs the CLI in-process and returns stdout and the error,
// classified as the process would exit with it.
func pgfence(t *testing.T, args ...string) (string, error) {
	t.Helper()
	t.Setenv("PGFENCE_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	root := newRootCmd()
	var out, errOut bytes.Buffer
	root.SetArgs(args)
	root.SetOut(&out)
	root.SetErr(&errOut)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := runRoot(ctx, root)
	return out.String(), err
}

// pgfenceExit runs the CLI in-process as main does: it returns the exit
// code, stdout and stderr.
func pgfenceExit(t *testing.T, env map[string]string, args ...string) (int, string, string) {
	t.Helper()
	t.Setenv("PGFENCE_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	for k, v := range env {
		t.Setenv(k, v)
	}
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	code := execute(ctx, args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func mustRun(t *testing.T, args ...string) string {
	t.Helper()
	out, err := pgfence(t, args...)
	if err != nil {
		t.Fatalf("pgfence %s: %v", strings.Join(args, " "), err)
	}
	return out
}

// kv parses the key=value lines of a lease command.
func kv(t *testing.T, out string) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Fatalf("output line %q is not key=value", line)
		}
		m[k] = v
	}
	return m
}

func wantExit(t *testing.T, err error, code int) {
	t.Helper()
	var ee *exitError
	if !errors.As(err, &ee) || ee.code != code {
		t.Fatalf("got %v, want exit code %d", err, code)
	}
}

// cleanEnv is the test's environment without libpq or psql settings, plus
// extra.
func cleanEnv(extra []string) []string {
	drop := map[string]bool{"PSQLRC": true}
	for _, kv := range extra {
		k, _, _ := strings.Cut(kv, "=")
		drop[k] = true
	}
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "PG") || drop[k] {
			continue
		}
		env = append(env, kv)
	}
	return append(env, extra...)
}

// connect is a connection to db on the cluster's primary as its
// superuser, closed when t ends.
func connect(t *testing.T, db string) *pgx.Conn {
	t.Helper()
	conn, err := cluster.Primary.Connect(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// mustExec runs sql on conn.
func mustExec(t *testing.T, conn *pgx.Conn, sql string, args ...any) {
	t.Helper()
	if _, err := conn.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// createRole creates the login role name (with more of CREATE ROLE's
// options), dropped with what it owns in conn's database when t ends.
func createRole(t *testing.T, conn *pgx.Conn, name, options string) {
	t.Helper()
	mustExec(t, conn, fmt.Sprintf("drop role if exists %[1]s; create role %[1]s login %s", name, options))
	t.Cleanup(func() { conn.Exec(context.Background(), fmt.Sprintf("drop owned by %[1]s; drop role %[1]s", name)) })
}

// freeAddr is a loopback address no one listens on (just now).
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// createDatabase creates the database name on c, from template (or
// PostgreSQL's default template when ""), dropped when t ends.
func createDatabase(t *testing.T, c *pgtest.Cluster, name, template string) {
	t.Helper()
	ctx := context.Background()
	admin, err := c.Primary.Connect(ctx, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	create := fmt.Sprintf("CREATE DATABASE %q", name)
	if template != "" {
		create += fmt.Sprintf(" TEMPLATE %q", template)
	}
	mustExec(t, admin, create)
	t.Cleanup(func() {
		if err := c.DropDatabase(context.Background(), name); err != nil {
			t.Logf("drop %s: %v", name, err)
		}
	})
}
