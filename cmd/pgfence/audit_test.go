package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
)

func TestAuditCLI(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	dsn := cluster.Primary.DSN(db)
	conn, err := cluster.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, `create table results (job_key text primary key, token bigint not null);
		select fence.protect('results')`); err != nil {
		t.Fatal(err)
	}
	l, err := fence.Acquire(ctx, conn, "nightly", "w1", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	_, err = fence.RunTx(ctx, conn, l.Generation(""), []byte("r1"), func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "insert into results values ($1, $2)", l.JobKey, l.Token)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fence.AcceptEvent(ctx, conn, "mailer", l.JobKey, l.Epoch, l.Token); err != nil {
		t.Fatal(err)
	}

	out := mustRun(t, "audit", "--database", dsn, "--result", "results:job_key:token:upsert")
	if !strings.Contains(out, "OK: no violations") || !strings.Contains(out, "committed=1") {
		t.Fatalf("clean audit: got\n%s\nwant OK with committed=1", out)
	}
	out = mustRun(t, "audit", "--database", dsn, "--since", "1h", "--until", time.Now().Add(time.Hour).Format(time.RFC3339), "--json")
	var rep struct {
		OK         bool             `json:"ok"`
		Checks     []int            `json:"checks"`
		Outcomes   map[string]int64 `json:"outcomes"`
		Violations []struct {
			Check int `json:"check"`
		} `json:"violations"`
	}
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("json: %v\n%s", err, out)
	}
	if !rep.OK || len(rep.Checks) != 4 || rep.Outcomes["committed"] != 1 {
		t.Fatalf("json report: got %+v, want ok, checks 1 2 5 6, committed=1", rep)
	}

	// A row nobody committed through the fence: check 2, exit 1.
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "set local session_replication_role = replica"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "insert into results values ('forged', $1)", l.Token+100); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	out, err = pgfence(t, "audit", "--database", dsn, "--result", "results:job_key:token", "--json")
	wantExit(t, err, 1)
	rep.Violations = nil
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("json: %v\n%s", err, out)
	}
	if rep.OK || len(rep.Violations) != 1 || rep.Violations[0].Check != 2 {
		t.Fatalf("broken audit: got %+v, want one violation of check 2", rep)
	}
	out, err = pgfence(t, "audit", "--database", dsn, "--result", "results:job_key:token")
	wantExit(t, err, 1)
	if !strings.Contains(out, "[check 2]") || !strings.Contains(out, `job "forged"`) {
		t.Fatalf("text report: got\n%s\nwant the forged row under check 2", out)
	}

	for _, tt := range []struct {
		args []string
		code int
	}{
		{[]string{"--since", "yesterday-ish"}, exitUsage},
		{[]string{"--result", "results:job_key"}, exitUsage},
		{[]string{"--result", "results:job_key:token:sometimes"}, exitUsage},
		{[]string{"--no-such-flag"}, exitUsage},
		{[]string{"--result", "no_such_table:a:b"}, exitDataErr},
	} {
		_, err := pgfence(t, append([]string{"audit", "--database", dsn}, tt.args...)...)
		wantExit(t, err, tt.code)
	}
	_, err = pgfence(t, "audit", "--database", "postgres://127.0.0.1:1/x?connect_timeout=2")
	wantExit(t, err, exitUnavailable)
}
