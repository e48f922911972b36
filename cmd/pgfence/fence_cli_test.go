package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"
)

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

func TestFenceCLI(t *testing.T) {
	ctx := context.Background()
	// migrate runs on a database without the schema.
	name, err := cluster.CreateDatabase(ctx, "cli_migrate")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cluster.DropDatabase(context.Background(), name) })
	admin, err := cluster.Primary.Connect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	// The template is migrated; drop and re-migrate to see the first run.
	if _, err := admin.Exec(ctx, "drop schema fence cascade; drop table public.pgfence_schema_version"); err != nil {
		t.Fatal(err)
	}
	dsn := cluster.Primary.DSN(name)
	if out := mustRun(t, "migrate", "--database", dsn); !strings.Contains(out, "migrated from version 0 to") {
		t.Fatalf("migrate: %q", out)
	}
	if out := mustRun(t, "migrate", "--database", dsn); !strings.Contains(out, "up to date") {
		t.Fatalf("migrate again: %q", out)
	}
	// --database defaults to the environment.
	t.Run("database_from_env", func(t *testing.T) {
		root := newRootCmd()
		t.Setenv("PGFENCE_DATABASE_URL", "")
		t.Setenv("DATABASE_URL", dsn)
		var out bytes.Buffer
		root.SetArgs([]string{"migrate"})
		root.SetOut(&out)
		if err := root.ExecuteContext(ctx); err != nil || !strings.Contains(out.String(), "up to date") {
			t.Fatalf("migrate with DATABASE_URL: %q, %v", out.String(), err)
		}
	})

	if _, err := admin.Exec(ctx, "create table results (job_key text primary key, payload text, token bigint)"); err != nil {
		t.Fatal(err)
	}
	if out := mustRun(t, "protect", "add", "results", "--database", dsn); !strings.Contains(out, "protected results") {
		t.Fatalf("protect add: %q", out)
	}
	mustRun(t, "protect", "add", "results", "--database", dsn) // no-op
	_, err = pgfence(t, "protect", "add", "no_such_table", "--database", dsn)
	if err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("protect a missing table: %v", err)
	}
	list := mustRun(t, "protect", "list", "--database", dsn)
	if !strings.Contains(list, "SCHEMA") || !strings.Contains(list, "public") || !strings.Contains(list, "results") {
		t.Fatalf("protect list:\n%s", list)
	}
	if _, err := admin.Exec(ctx, "insert into results values ('x', 'y', 1)"); err == nil {
		t.Fatal("write to a table protected by the CLI succeeded without a token")
	}

	// lease acquire prints eval-able lines.
	a := kv(t, mustRun(t, "lease", "acquire", "--database", dsn, "--job", "nightly report", "--holder", "alice", "--ttl", "30s"))
	if a["job_key"] != "'nightly report'" || a["holder"] != "alice" || a["epoch"] == "" {
		t.Fatalf("acquire output: %v", a)
	}
	tokA, err := strconv.ParseInt(a["token"], 10, 64)
	if err != nil {
		t.Fatalf("token %q: %v", a["token"], err)
	}
	if _, err := time.Parse(time.RFC3339Nano, a["expires_at"]); err != nil {
		t.Fatalf("expires_at %q: %v", a["expires_at"], err)
	}
	// bob is refused while alice's lease is live: exit 75.
	_, err = pgfence(t, "lease", "acquire", "--database", dsn, "--job", "nightly report", "--holder", "bob")
	wantExit(t, err, exitTempFail)

	r := kv(t, mustRun(t, "lease", "renew", "--database", dsn, "--job", "nightly report", "--token", a["token"], "--ttl", "1m"))
	if r["token"] != a["token"] {
		t.Fatalf("renew output: %v", r)
	}
	if _, err := admin.Exec(ctx, "update fence.leases set expires_at = now() - interval '1 second'"); err != nil {
		t.Fatal(err)
	}
	var b struct {
		Token int64 `json:"token"`
		Epoch int64 `json:"epoch"`
	}
	out := mustRun(t, "lease", "acquire", "--json", "--database", dsn, "--job", "nightly report", "--holder", "bob")
	if err := json.Unmarshal([]byte(out), &b); err != nil || b.Token <= tokA {
		t.Fatalf("acquire --json: %q, %v", out, err)
	}
	// alice's token is stale now: exit 76, lease lost.
	_, err = pgfence(t, "lease", "renew", "--database", dsn, "--job", "nightly report", "--token", a["token"])
	wantExit(t, err, exitLeaseLost)
	_, err = pgfence(t, "lease", "release", "--database", dsn, "--job", "nightly report", "--token", a["token"])
	wantExit(t, err, exitLeaseLost)
	bt := strconv.FormatInt(b.Token, 10)

	// bob writes a result with a receipt, then releases and retires.
	conn, err := cluster.Primary.Connect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = tx.Exec(ctx, `select fence.gate('nightly report', $1, $2), set_config('fence.job_key', 'nightly report', true),
		set_config('fence.epoch', $1::text, true), set_config('fence.token', $2::text, true)`, b.Epoch, b.Token)
	if err == nil {
		_, err = tx.Exec(ctx, "insert into results values ('nightly report', 'ok', $1)", b.Token)
	}
	if err == nil {
		_, err = tx.Exec(ctx, "select fence.commit('nightly report', $1, $2, '', '\\x00', 'v1')", b.Epoch, b.Token)
	}
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		t.Fatalf("bob's write: %v", err)
	}
	if out := mustRun(t, "lease", "release", "--database", dsn, "--job", "nightly report", "--token", bt); !strings.Contains(out, "released=true") {
		t.Fatalf("release: %q", out)
	}
	if out := mustRun(t, "gc", "--database", dsn, "--keep", "0s"); !strings.Contains(out, "pruned 0 receipts") {
		t.Fatalf("gc of a current generation: %q", out)
	}
	if out := mustRun(t, "lease", "retire", "--database", dsn, "--job", "nightly report"); !strings.Contains(out, "retired=true") {
		t.Fatalf("retire: %q", out)
	}
	if out := mustRun(t, "gc", "--database", dsn, "--keep", "0s"); !strings.Contains(out, "pruned 1 receipts") {
		t.Fatalf("gc after retire: %q", out)
	}
	var retired bool
	if err := admin.QueryRow(ctx, "select retired_at is not null from fence.fences where job_key = 'nightly report'").Scan(&retired); err != nil || !retired {
		t.Fatalf("fence after retire: %v, %v", retired, err)
	}
	_, err = pgfence(t, "lease", "acquire", "--database", dsn, "--job", "", "--holder", "x")
	wantExit(t, err, exitUsage)

	if out := mustRun(t, "protect", "remove", "results", "--database", dsn); !strings.Contains(out, "unprotected results") {
		t.Fatalf("protect remove: %q", out)
	}
	if out := mustRun(t, "protect", "list", "--database", dsn); !strings.Contains(out, "no protected tables") {
		t.Fatalf("protect list after remove: %q", out)
	}
	help := mustRun(t, "lease", "acquire", "--help")
	if !strings.Contains(help, "75  the lease is held") || !strings.Contains(help, "76  the token is stale") {
		t.Fatalf("lease acquire --help does not document the exit codes:\n%s", help)
	}
}
