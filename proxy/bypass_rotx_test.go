package proxy

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestBypass/rotx and TestBypass/rotx_tracked (issue 30, attacker D's H1):
// a BEGIN READ ONLY transaction opened on the replica while it was current
// (its first read saw A's result there), then replay paused, B took over
// and wrote, and the proxy saw it. Inside the same transaction the reader
// presents B's generation (SET LOCAL, set_config, in the same query),
// fence.min_lsn, or nothing, at READ COMMITTED and REPEATABLE READ, reads
// a cursor, calls a function, ends the transaction and reads in the same
// query, uses the extended protocol. Every read is refused with FN007 or
// answered with B's result, never A's. After replay catches up, READ
// COMMITTED reads are served by the replica with B's result, while a
// REPEATABLE READ snapshot, a cursor's (WITH HOLD too, in a later
// transaction) and a portal's still hold A's and are refused.
//
// Only through the proxy: reading a replica is the proxy's routing.
func init() {
	registerBypass("rotx", func(t *testing.T) { testBypassRotx(t, false) })
	registerBypass("rotx_tracked", func(t *testing.T) { testBypassRotx(t, true) })
}

// rotxCase: a reader that opens a transaction (begin, a list of queries,
// the first of which reads the result on the replica) before the pause,
// then runs its attempt.
type rotxCase struct {
	name  string
	opts  []string
	begin []string                 // run before the pause; the last one must read A's result on the replica
	then  []string                 // after the takeover: all but the last must succeed
	pgx   bool                     // begin and then run through pgx's extended protocol in a read-only tx
	code  string                   // FN007, or "" for B's result from the replica (after catch-up)
	late  bool                     // the attempt runs after replay caught up
	sql   func(*readsScene) string // builds the last attempt (overrides then's last)
	last  func(*readsScene) string // builds then's last (after "!" steps)
	// how the last step is sent: "" simple Query; "params" pgconn's
	// ExecParams (Parse/Bind/Execute of the unnamed statement); "prepared"
	// ExecPrepared (Bind/Execute of the statement the step names).
	proto string
}

// A step of then starting with "!" must fail (any SQLSTATE); the "!" is
// not sent.

const rotxRead = "SELECT payload, pg_is_in_recovery() FROM results WHERE job_key = 'job'"

// rotxGen presents B's generation inside the transaction.
func rotxGen(sc *readsScene) string {
	return fmt.Sprintf("SET LOCAL fence.job_key = 'job'; SET LOCAL fence.epoch = %d; SET LOCAL fence.token = %d", sc.b.Epoch, sc.b.Token)
}

func testBypassRotx(t *testing.T, tracked bool) {
	pending := fence.CodePending
	gen := rotxGen
	rc := []string{"BEGIN READ ONLY", rotxRead}
	rr := []string{"BEGIN READ ONLY ISOLATION LEVEL REPEATABLE READ", rotxRead}
	cursor := []string{"BEGIN READ ONLY", "DECLARE c CURSOR FOR " + rotxRead, rotxRead}
	cases := []rotxCase{
		{name: "rc_nometa_pending", opts: []string{"-c fence.read_policy=pending"}, begin: rc, then: []string{rotxRead}, code: pending},
		{name: "rc_nometa_primary", opts: []string{"-c fence.read_wait=50ms"}, begin: rc, then: []string{rotxRead}, code: pending},
		{name: "rc_nometa_wait", opts: []string{"-c fence.read_policy=wait -c fence.read_wait=50ms"}, begin: rc, then: []string{rotxRead}, code: pending},
		{name: "rc_set_local_generation", opts: []string{"-c fence.read_wait=50ms"}, begin: rc, sql: func(sc *readsScene) string { return gen(sc) }, then: []string{"", rotxRead}, code: pending},
		{name: "rc_same_query_generation", opts: []string{"-c fence.read_wait=50ms"}, begin: rc, sql: func(sc *readsScene) string { return gen(sc) + "; " + rotxRead }, code: pending},
		{name: "rc_set_config_generation", opts: []string{"-c fence.read_wait=50ms"}, begin: rc, sql: func(sc *readsScene) string {
			return fmt.Sprintf("SELECT set_config('fence.job_key', 'job', true), set_config('fence.token', '%d', true); %s", sc.b.Token, rotxRead)
		}, code: pending},
		{name: "rc_min_lsn_pending", begin: rc, sql: func(sc *readsScene) string {
			var lsn string
			if err := sc.direct.QueryRow(ctxT(t), "SELECT pg_current_wal_insert_lsn()::text").Scan(&lsn); err != nil {
				t.Fatal(err)
			}
			return fmt.Sprintf("SET LOCAL fence.min_lsn = '%s'; SET LOCAL fence.read_policy = 'pending'", lsn)
		}, then: []string{"", rotxRead}, code: pending},
		{name: "rr_begin", begin: rr, then: []string{rotxRead}, code: pending},
		{name: "rr_set_transaction", begin: []string{"BEGIN READ ONLY", "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", rotxRead}, then: []string{rotxRead}, code: pending},
		{name: "rr_default_isolation", opts: []string{`-c default_transaction_isolation=repeatable\ read`}, begin: rc, then: []string{rotxRead}, code: pending},
		{name: "rc_cursor_fetch", begin: cursor, then: []string{"FETCH ALL FROM c"}, code: pending},
		{name: "rc_function", opts: []string{"-c fence.read_wait=50ms"}, begin: rc, then: []string{"SELECT f_payload('job'), pg_is_in_recovery()"}, code: pending},
		{name: "rc_commit_then_read", opts: []string{"-c fence.read_policy=pending"}, begin: rc, then: []string{"COMMIT; " + rotxRead}, code: pending},
		{name: "rc_commit_then_rr_read", opts: []string{"-c fence.read_policy=pending"}, begin: rc, then: []string{"COMMIT; BEGIN READ ONLY ISOLATION LEVEL REPEATABLE READ; " + rotxRead}, code: pending},
		{name: "pgx_extended", pgx: true, code: pending},
		{name: "pgx_extended_generation", pgx: true, code: pending, sql: func(sc *readsScene) string { return gen(sc) }},
		// After replay caught up: the replica has B's result.
		{name: "late_rc_served", late: true, begin: rc, then: []string{rotxRead}},
		{name: "late_rc_generation_served", late: true, begin: rc, sql: func(sc *readsScene) string { return gen(sc) + "; " + rotxRead }},
		{name: "late_rr_begin", late: true, begin: rr, then: []string{rotxRead}, code: pending},
		{name: "late_rr_generation", late: true, begin: rr, sql: func(sc *readsScene) string { return gen(sc) }, then: []string{"", rotxRead}, code: pending},
		{name: "late_rc_cursor_fetch", late: true, begin: cursor, then: []string{"FETCH ALL FROM c"}, code: pending},
		{name: "late_hold_cursor_next_tx", late: true,
			begin: []string{"BEGIN READ ONLY", "DECLARE h CURSOR WITH HOLD FOR " + rotxRead, rotxRead + "; COMMIT"},
			then:  []string{"BEGIN READ ONLY", "FETCH ALL FROM h"}, code: pending},
		{name: "late_pgx_extended", late: true, pgx: true, code: pending},
	}
	runRotx(t, tracked, cases)
}

// runRotx opens each case's transaction on the current replica, pauses
// replay, has B take over, and runs each case's attempt.
func runRotx(t *testing.T, tracked bool, cases []rotxCase) {
	ctx := ctxT(t)

	type open struct {
		c   rotxCase
		pc  *pgconn.PgConn
		px  *pgx.Conn
		ptx pgx.Tx
	}
	var opened []*open
	sc := newReadsScene(t, tracked, readsSchema, nil, func(sc *readsScene) {
		// The replica is current: each reader's transaction begins there.
		for _, c := range cases {
			o := &open{c: c}
			if err := pgtest.Poll(ctx, func() (bool, error) {
				if c.pgx {
					o.px = readsPgx(t, sc.e, c.opts...)
					tx, err := o.px.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
					if err != nil {
						return false, err
					}
					var payload string
					var rec bool
					if err := tx.QueryRow(ctx, "SELECT payload, pg_is_in_recovery() FROM results WHERE job_key = $1", "job").Scan(&payload, &rec); err != nil {
						if pgtest.SQLState(err) == fence.CodePending {
							// The freshness barrier refused under load (its
							// marker not back within freshWithin): fail
							// closed, as it should; try again.
							tx.Rollback(ctx)
							o.px.Close(ctx)
							return false, nil
						}
						return false, err
					}
					if rec && payload == "A" {
						o.ptx = tx
						return true, nil
					}
					tx.Rollback(ctx)
					o.px.Close(ctx)
					return false, nil
				}
				o.pc = sc.e.reader(t, nil, c.opts...)
				for _, q := range c.begin[:len(c.begin)-1] {
					if _, err := o.pc.Exec(ctx, q).ReadAll(); err != nil {
						return false, fmt.Errorf("%s: %v", q, err)
					}
				}
				vals, rep, err := where(t, o.pc, c.begin[len(c.begin)-1])
				if err != nil {
					if pgtest.SQLState(err) == fence.CodePending {
						o.pc.Close(ctx) // the barrier under load, as above
						return false, nil
					}
					return false, err
				}
				if rep && vals[0] == "A" {
					return true, nil
				}
				o.pc.Close(ctx)
				return false, nil
			}); err != nil {
				t.Fatalf("%s: the transaction never began on the replica: %v", c.name, err)
			}
			opened = append(opened, o)
		}
	})
	attempt := func(t *testing.T, o *open) {
		c := o.c
		if c.pgx {
			if c.sql != nil {
				if _, err := o.ptx.Exec(ctx, c.sql(sc)); err != nil {
					t.Fatalf("%s: %v", c.sql(sc), err)
				}
			}
			var payload string
			var rec bool
			err := o.ptx.QueryRow(ctx, "SELECT payload, pg_is_in_recovery() FROM results WHERE job_key = $1", "job").Scan(&payload, &rec)
			if payload == "A" {
				t.Fatalf("read A's result (replica=%v): the previous generation", rec)
			}
			if c.code != "" {
				wantCode(t, err, c.code)
				return
			}
			if err != nil || payload != "B" {
				t.Fatalf("read %q (%v), want B's", payload, err)
			}
			return
		}
		then := append([]string(nil), c.then...)
		if c.sql != nil {
			if len(then) == 0 {
				then = []string{""}
			}
			then[0] = c.sql(sc)
		}
		if c.last != nil {
			then = append(then, c.last(sc))
		}
		for _, q := range then[:len(then)-1] {
			if strings.HasPrefix(q, "!") {
				if _, err := o.pc.Exec(ctx, q[1:]).ReadAll(); err == nil {
					t.Fatalf("%s: succeeded, want an error", q[1:])
				}
				continue
			}
			if _, err := o.pc.Exec(ctx, q).ReadAll(); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		last := then[len(then)-1]
		var res []*pgconn.Result
		var err error
		switch c.proto {
		case "params":
			r := o.pc.ExecParams(ctx, last, nil, nil, nil, nil).Read()
			res, err = []*pgconn.Result{r}, r.Err
		case "prepared":
			r := o.pc.ExecPrepared(ctx, last, nil, nil, nil).Read()
			res, err = []*pgconn.Result{r}, r.Err
		default:
			res, err = o.pc.Exec(ctx, last).ReadAll()
		}
		var rows [][]string
		for _, r := range res {
			for _, row := range r.Rows {
				var vals []string
				for _, v := range row {
					vals = append(vals, string(v))
				}
				rows = append(rows, vals)
			}
		}
		for _, row := range rows {
			for _, v := range row {
				if v == "A" {
					t.Fatalf("%s: returned A's result %v: the previous generation", last, row)
				}
			}
		}
		if c.code != "" {
			if len(rows) > 0 && rows[len(rows)-1][0] != "" {
				t.Fatalf("%s: returned %v, want %s", last, rows, c.code)
			}
			wantCode(t, err, c.code)
			// The transaction is aborted (the refusal ran on the
			// replica); the session is usable after its end.
			if _, err := o.pc.Exec(ctx, "ROLLBACK").ReadAll(); err != nil {
				t.Fatalf("ROLLBACK after %s: %v", c.code, err)
			}
			if _, err := o.pc.Exec(ctx, "SELECT 1").ReadAll(); err != nil {
				t.Fatalf("session unusable after %s: %v", c.code, err)
			}
			return
		}
		if err != nil {
			t.Fatalf("%s: %v", last, err)
		}
		if len(rows) == 0 || rows[len(rows)-1][0] != "B" || rows[len(rows)-1][1] != "t" {
			t.Fatalf("%s: returned %v, want B's result from the replica (it has replayed the takeover)", last, rows)
		}
	}
	for _, late := range []bool{false, true} {
		if late {
			resumeAndCatchUp(t)
			// The proxy's view of the replica has caught up too.
			waitProxyReplay(t, sc.e.proxy)
		}
		for _, o := range opened {
			if o.c.late != late {
				continue
			}
			t.Run(o.c.name, func(t *testing.T) { attempt(t, o) })
		}
	}
	sc.unchanged(t)
	_ = strings.TrimSpace
	_ = context.Background
}
