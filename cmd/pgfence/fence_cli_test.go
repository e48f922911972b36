package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestFenceCLI(t *testing.T) {
	ctx := context.Background()
	// migrate runs on a database without the schema.
	name := cluster.NewDatabase(t)
	admin := connect(t, name)
	// The template is migrated; drop and re-migrate to see the first run.
	mustExec(t, admin, "drop schema fence cascade; drop table public.pgfence_schema_version")
	dsn := cluster.Primary.DSN(name)
	if out := mustRun(t, "migrate", "--database", dsn); !strings.Contains(out, "migrated from version 0 to") {
		t.Fatalf("migrate: %q", out)
	}
	if out := mustRun(t, "migrate", "--database", dsn); !strings.Contains(out, "up to date") {
		t.Fatalf("migrate again: %q", out)
	}
	// It says how leases are taken: job authorization off (with the way to
	// turn it on), the TTL limit.
	if out := mustRun(t, "migrate", "--database", dsn); !strings.Contains(out, "job authorization is off") ||
		!strings.Contains(out, "fence.set_job_authorization(true)") || !strings.Contains(out, "limited to 1 day") {
		t.Fatalf("migrate does not say how leases are taken: %q", out)
	}
	// And how consumer names are claimed (consumer authorization off).
	if out := mustRun(t, "migrate", "--database", dsn); !strings.Contains(out, "consumer authorization is off") ||
		!strings.Contains(out, "fence.set_consumer_authorization(true)") {
		t.Fatalf("migrate does not say how consumer names are claimed: %q", out)
	}
	if out := mustRun(t, "migrate", "--database", dsn, "--json"); !strings.Contains(out, `"job_authorization":false`) ||
		!strings.Contains(out, `"consumer_authorization":false`) || !strings.Contains(out, `"max_lease_ttl":"1 day"`) {
		t.Fatalf("migrate --json: %q", out)
	}
	// And names protected tables with a column whose values read through
	// the catalog (protected before pgfence refused such columns, or by an
	// administrator), with what to do.
	mustExec(t, admin, "create table cv (k int, job_key text, r regclass); select fence.protect('cv', 'job_key')")
	if out := mustRun(t, "migrate", "--database", dsn); !strings.Contains(out, "protected table public.cv has a column r of type regclass whose values read the current names of catalog objects") ||
		!strings.Contains(out, "ALTER TABLE … ALTER COLUMN … TYPE text") {
		t.Fatalf("migrate does not name the table with a regclass column: %q", out)
	}
	if out := mustRun(t, "migrate", "--database", dsn, "--json"); !strings.Contains(out, `"catalog_value_columns":[{"table":"public.cv","column":"column r of type regclass"}]`) {
		t.Fatalf("migrate --json does not name the table with a regclass column: %q", out)
	}
	mustExec(t, admin, "select fence.unprotect('cv'); drop table cv")
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

	mustExec(t, admin, "create table results (job_key text primary key, payload text, token bigint)")
	if out := mustRun(t, "protect", "add", "results", "--database", dsn); !strings.Contains(out, "protected results") {
		t.Fatalf("protect add: %q", out)
	}
	mustRun(t, "protect", "add", "results", "--database", dsn) // no-op
	_, err := pgfence(t, "protect", "add", "no_such_table", "--database", dsn)
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
	mustExec(t, admin, "update fence.leases set expires_at = now() - interval '1 second'")
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
	tx, err := connect(t, name).Begin(ctx)
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
