package proxy

import (
	"fmt"
	"testing"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("rowlocks", bypassRowLocks) }

// bypassRowLocks: a role that may not act on a lease or a consumer's
// watermark neither holds nor waits for its row (issue 30, A-M1 and the
// lease functions). Holds: each attempt runs in a transaction left open,
// and the row it named must then be free (the cast's superuser locks it
// with NOWAIT: 55P03 if anyone holds it). An attempt that raises releases
// its locks at once (PostgreSQL aborts the transaction at the error), so
// the holds that mattered were calls that return: fence.accept_event
// under another role's consumer (it answered, holding the watermark row,
// and could move it), and fence.retire of a retired job (it returned,
// holding the fence row that the next fence.acquire of the key locks).
// Waits: while the job's owner holds its fence row in a gated
// transaction, another role's fence.renew, fence.release and fence.retire
// are answered at once (lock_timeout 1ms: a call that waits for the row
// fails with 55P03 instead of its answer).
func bypassRowLocks(t *testing.T) {
	c := newCast(t)
	w2, cur := c.worker2, c.current
	// worker's consumer "billing" has accepted the current generation.
	c.as(t, c.worker, fmt.Sprintf("select fence.accept_event('billing', 'job', %d, %d)", cur.Epoch, cur.Token))
	fenceRow := "select 1 from fence.fences where job_key = 'job' for update nowait"
	doneRow := "select 1 from fence.fences where job_key = 'done' for update nowait"
	// "done": a job worker acquired and retired.
	done, err := fence.Acquire(ctxT(t), c.connectPgx(t, "direct", c.worker, nil), "done", "d", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	c.as(t, c.worker, fmt.Sprintf("select fence.retire('done', %d)", done.Token))
	watermarkRow := "select 1 from fence.consumer_watermarks where consumer = 'billing' and job_key = 'job' for update nowait"
	type lockCase struct {
		name, role, sql, code, row string
	}
	cases := []lockCase{
		{"renew_current_token", w2, fmt.Sprintf("select fence.renew('job', %d, '1 minute')", cur.Token), "FN001", fenceRow},
		{"renew_stale_token", w2, fmt.Sprintf("select fence.renew('job', %d, '1 minute')", c.stale.Token), "FN001", fenceRow},
		{"renew_own_token_on_other_job", w2, fmt.Sprintf("select fence.renew('job', %d, '1 minute')", c.other.Token), "FN001", fenceRow},
		{"release_current_token", w2, fmt.Sprintf("select fence.release('job', %d)", cur.Token), "FN001", fenceRow},
		{"release_stale_token", w2, fmt.Sprintf("select fence.release('job', %d)", c.stale.Token), "FN001", fenceRow},
		{"retire_current_token", w2, fmt.Sprintf("select fence.retire('job', %d)", cur.Token), "FN001", fenceRow},
		{"retire_without_token", w2, "select fence.retire('job')", "FN011", fenceRow},
		{"retire_forced_without_token", w2, "select fence.retire('job', null, true)", "FN011", fenceRow},
		{"retire_retired_job", w2, "select fence.retire('done', 1)", "", doneRow},
		{"retire_retired_job_without_token", w2, "select fence.retire('done')", "", doneRow},
		{"accept_event_other_consumer_newer", w2, fmt.Sprintf("select fence.accept_event('billing', 'job', %d, %d)", cur.Epoch, cur.Token), "42501", watermarkRow},
		{"accept_event_other_consumer_own_job", w2, fmt.Sprintf("select fence.accept_event('billing', 'job2', %d, %d)", c.other.Epoch, c.other.Token), "42501", watermarkRow},
		{"accept_event_other_consumer_stale", w2, fmt.Sprintf("select fence.accept_event('billing', 'job', %d, %d)", c.stale.Epoch, c.stale.Token), "42501", watermarkRow},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, route := range castRoutes {
				t.Run(route, func(t *testing.T) {
					before := c.state(t)
					conn := c.connect(t, route, tc.role, nil)
					if _, err := conn.Exec(ctxT(t), "begin").ReadAll(); err != nil {
						t.Fatal(err)
					}
					_, err := conn.Exec(ctxT(t), tc.sql).ReadAll()
					if got := pgtest.SQLState(err); got != tc.code { // "": it returns
						t.Fatalf("%s as %s: got %v (SQLSTATE %q), want SQLSTATE %s", tc.sql, tc.role, err, got, tc.code)
					}
					// The attacker's transaction is still open: the row must be free.
					tx, err := c.admin.Begin(ctxT(t))
					if err != nil {
						t.Fatal(err)
					}
					_, err = tx.Exec(ctxT(t), tc.row)
					tx.Rollback(ctxT(t))
					if err != nil {
						t.Fatalf("after %s as %s (transaction open): %v: the attacker holds the row", tc.sql, tc.role, err)
					}
					c.unchanged(t, before)
				})
			}
		})
	}
	t.Run("waits", func(t *testing.T) {
		for _, route := range castRoutes {
			t.Run(route, func(t *testing.T) {
				before := c.state(t)
				// worker holds job's fence row: a gated write in an open
				// transaction.
				owner := c.connect(t, "direct", c.worker, &c.current)
				if _, err := owner.Exec(ctxT(t), "set fence.step = 'hold-"+route+"'; begin; insert into inh values (77, 'job', 'held')").ReadAll(); err != nil {
					t.Fatal(err)
				}
				conn := c.connect(t, route, w2, nil)
				if _, err := conn.Exec(ctxT(t), "set lock_timeout = '1ms'").ReadAll(); err != nil {
					t.Fatal(err)
				}
				for _, a := range []struct{ sql, code string }{
					{fmt.Sprintf("select fence.renew('job', %d, '1 minute')", cur.Token), "FN001"},
					{fmt.Sprintf("select fence.release('job', %d)", cur.Token), "FN001"},
					{fmt.Sprintf("select fence.retire('job', %d)", cur.Token), "FN001"},
					{fmt.Sprintf("select fence.retire('job', %d, true)", c.stale.Token), "FN001"},
					{"select fence.retire('job')", "FN011"},
				} {
					_, err := conn.Exec(ctxT(t), a.sql).ReadAll()
					if got := pgtest.SQLState(err); got != a.code {
						t.Errorf("%s as %s while the owner holds the row: got %v (SQLSTATE %q), want SQLSTATE %s", a.sql, w2, err, got, a.code)
					}
				}
				if _, err := owner.Exec(ctxT(t), "rollback").ReadAll(); err != nil {
					t.Fatal(err)
				}
				c.unchanged(t, before)
			})
		}
	})
	t.Run("owner_of_consumer_still_advances", func(t *testing.T) {
		// After every attempt, worker's consumer accepts its own current
		// generation and rejects the stale one.
		conn := c.connectPgx(t, "direct", c.worker, nil)
		var ok bool
		if err := conn.QueryRow(ctxT(t), "select fence.accept_event('billing', 'job', $1, $2)", cur.Epoch, cur.Token).Scan(&ok); err != nil || !ok {
			t.Fatalf("accept_event(current) by its consumer's role: %v, %v; want true", ok, err)
		}
		if err := conn.QueryRow(ctxT(t), "select fence.accept_event('billing', 'job', $1, $2)", c.stale.Epoch, c.stale.Token).Scan(&ok); err != nil || ok {
			t.Fatalf("accept_event(stale) by its consumer's role: %v, %v; want false", ok, err)
		}
		// worker2 has consumers of its own.
		w2c := c.connectPgx(t, "direct", w2, nil)
		if err := w2c.QueryRow(ctxT(t), "select fence.accept_event('billing2', 'job2', $1, $2)", c.other.Epoch, c.other.Token).Scan(&ok); err != nil || !ok {
			t.Fatalf("accept_event under worker2's own consumer: %v, %v; want true", ok, err)
		}
	})
}
