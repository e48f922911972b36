package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// TestSyncRepCancelFailsTheCommand (round 11, attacker U's H1): in
// failover_mode sync, `pgfence lease acquire`, `lease renew` and `pgfence
// run` whose commit's wait for the synchronous standby was cancelled
// (pg_cancel_backend by another session of the same role: PostgreSQL
// answers success with a WARNING) fail with exit 75 and print no lease, and
// run does not start its command: the standby did not confirm the
// takeover, so a failover may lose it. The standby's WAL receiver is
// stopped after the set-up, so every commit waits until it is cancelled.
func TestSyncRepCancelFailsTheCommand(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := pgtest.Start(ctx, pgtest.Options{Replica: true, Settings: map[string]string{"synchronous_standby_names": "'*'"}})
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	db, err := c.CreateDatabase(ctx, "synccancel")
	if err != nil {
		t.Fatal(err)
	}
	admin, err := c.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	if err := migrations.Apply(ctx, admin); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "create role sc_w login; grant pgfence_worker to sc_w; select fence.set_failover_mode('sync')"); err != nil {
		t.Fatal(err)
	}
	dsn := func(app string) string {
		return fmt.Sprintf("postgres://sc_w@%s/%s?sslmode=disable&application_name=%s", c.Primary.Addr(), db, app)
	}
	wc, err := pgx.Connect(ctx, dsn("sc_setup"))
	if err != nil {
		t.Fatal(err)
	}
	defer wc.Close(context.Background())
	held, err := fence.Acquire(ctx, wc, "sc_renew", "h", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.DetachReplica(ctx); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	ran := filepath.Join(dir, "ran")
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"lease_acquire", []string{"lease", "acquire", "--job", "sc_acquire", "--ttl", "1m"}},
		{"lease_renew", []string{"lease", "renew", "--job", held.JobKey, "--token", fmt.Sprint(held.Token), "--ttl", "1m"}},
		{"run", []string{"run", "--job", "sc_run", "--ttl", "1m", "--", "touch", ran}},
		// Round 12, attacker W's H1: a role default of
		// client_min_messages = error (which the worker's own role may
		// set) kept the WARNING off the wire: exit 0, a lease printed.
		{"lease_acquire_min_messages_error", []string{"lease", "acquire", "--job", "sc_cmm", "--ttl", "1m"}},
		{"run_min_messages_error", []string{"run", "--job", "sc_cmm_run", "--ttl", "1m", "--", "touch", ran}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			app := "sc_" + tc.name
			if strings.HasSuffix(tc.name, "_min_messages_error") {
				if _, err := wc.Exec(ctx, "set synchronous_commit = local; alter role sc_w set client_min_messages = error"); err != nil {
					t.Fatal(err)
				}
				defer func() {
					if _, err := wc.Exec(context.Background(), "set synchronous_commit = local; alter role sc_w reset client_min_messages"); err != nil {
						t.Error(err)
					}
				}()
			}
			type result struct {
				code     int
				out, err string
			}
			done := make(chan result, 1)
			go func() {
				code, out, errOut := pgfenceExit(t, nil, append(tc.args[:1:1], append([]string{"--database", dsn(app)}, tc.args[1:]...)...)...)
				done <- result{code, out, errOut}
			}()
			err := pgtest.Poll(ctx, func() (bool, error) {
				var n int
				err := admin.QueryRow(ctx, "select count(pg_cancel_backend(pid)) from pg_stat_activity where application_name = $1 and wait_event = 'SyncRep'", app).Scan(&n)
				return n > 0, err
			})
			if err != nil {
				t.Fatalf("waiting for the commit to wait for the standby: %v", err)
			}
			r := <-done
			if r.code != exitTempFail || r.out != "" {
				t.Fatalf("pgfence %v with its commit's wait for the standby cancelled: exit %d, stdout %q, stderr %q; want exit %d and no output",
					tc.args, r.code, r.out, r.err, exitTempFail)
			}
			if _, err := os.Stat(ran); err == nil {
				t.Fatal("pgfence run started its command on an unconfirmed takeover")
			}
		})
	}
}
