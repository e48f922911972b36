package proxy

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
)

// Round 8 (attacker O): a retry whose transaction is replayed (rolled
// back, FN00R) loses what that transaction set; a later write of the same
// program must never run under a step or generation other than the first
// attempt's and be applied a second time. Each case runs the same client
// program twice, in two sessions; the program's last write appends '+' to
// the row its first transaction wrote, so a double apply shows as 'A++'.
func init() {
	registerBypass("replay_round8", bypassReplayRound8)
	restoreFault = func(db string) string {
		if v, ok := restoreFaults.Load(db); ok {
			return v.(string)
		}
		return ""
	}
}

// restoreFaults: the statement restoreReplayed adds, by database (tests
// of its failure).
var restoreFaults sync.Map

// replayWriteView is a view whose function writes a protected row: a
// write the proxy cannot see.
const replayWriteView = `
create function wv() returns int language plpgsql as $$ begin insert into results (job_key, payload, token) values ('a', 'A', current_setting('fence.token')::bigint); return 1; end $$;
create view vw as select wv() as x;`

func bypassReplayRound8(t *testing.T) {
	const next = "UPDATE results SET payload = payload || '+' WHERE job_key = 'a'"
	type program func(t *testing.T, e *reservedEnv, conn *pgconn.PgConn)
	ins := func(e *reservedEnv) string {
		return fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('a', 'A', %d)", e.lease.Token)
	}
	pbe := func(fe *pgproto3.Frontend, sql string) {
		fe.Send(&pgproto3.Parse{Query: sql})
		fe.Send(&pgproto3.Bind{})
		fe.Send(&pgproto3.Execute{})
	}
	flush := func(t *testing.T, fe *pgproto3.Frontend) {
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		name    string
		objects string
		run     program
	}{
		// H4: a Query inside an extended batch ends its implicit
		// transaction (the database's guard answers the replay, FN00R);
		// the batch's next messages ran in a new implicit transaction
		// under the step from before, and the write was applied twice.
		{"query_in_batch_then_write", "", func(t *testing.T, e *reservedEnv, conn *pgconn.PgConn) {
			fe := conn.Frontend()
			pbe(fe, "SELECT set_config('fence.step', 's1', false)")
			pbe(fe, ins(e))
			pbe(fe, "SELECT set_config('fence.step', 's2', false)")
			fe.Send(&pgproto3.Query{String: "SELECT 1"})
			pbe(fe, next)
			fe.Send(&pgproto3.Sync{})
			flush(t, fe)
			t.Logf("batch: %v", rawAnswers(t, conn, 2))
		}},
		// H4 with a FunctionCall (pg_backend_pid) in place of the Query.
		{"function_call_in_batch_then_write", "", func(t *testing.T, e *reservedEnv, conn *pgconn.PgConn) {
			fe := conn.Frontend()
			pbe(fe, "SELECT set_config('fence.step', 's1', false)")
			pbe(fe, ins(e))
			pbe(fe, "SELECT set_config('fence.step', 's2', false)")
			fe.Send(&pgproto3.FunctionCall{Function: 2026, ResultFormatCode: 0})
			pbe(fe, next)
			fe.Send(&pgproto3.Sync{})
			flush(t, fe)
			t.Logf("batch: %v", rawAnswers(t, conn, 2))
		}},
		// H4: COMMIT AND CHAIN as a Query inside a batch.
		{"chain_query_in_batch_then_write", "", func(t *testing.T, e *reservedEnv, conn *pgconn.PgConn) {
			fe := conn.Frontend()
			pbe(fe, "BEGIN")
			pbe(fe, "SELECT set_config('fence.step', 's1', false)")
			pbe(fe, ins(e))
			pbe(fe, "SELECT set_config('fence.step', 's2', false)")
			fe.Send(&pgproto3.Query{String: "COMMIT AND CHAIN"})
			pbe(fe, next)
			fe.Send(&pgproto3.Sync{})
			flush(t, fe)
			t.Logf("batch: %v", rawAnswers(t, conn, 2))
			mustExec(t, conn, "COMMIT") // the chained transaction (a warning if none)
		}},
		// H3: the write is a view's function's, which the proxy cannot
		// see: no receipt step, no barrier, and the next batch, pipelined,
		// ran under the step from before the replayed transaction.
		{"view_write_pipelined_batch", replayWriteView, func(t *testing.T, e *reservedEnv, conn *pgconn.PgConn) {
			fe := conn.Frontend()
			pbe(fe, "SELECT set_config('fence.step', 's1', false)")
			pbe(fe, "SELECT * FROM vw")
			pbe(fe, "SELECT set_config('fence.step', 's2', false)")
			fe.Send(&pgproto3.Sync{})
			pbe(fe, next)
			fe.Send(&pgproto3.Sync{})
			flush(t, fe)
			t.Logf("batches: %v", rawAnswers(t, conn, 2))
		}},
		// H3 with an explicit transaction in the first batch.
		{"view_write_explicit_pipelined_batch", replayWriteView, func(t *testing.T, e *reservedEnv, conn *pgconn.PgConn) {
			fe := conn.Frontend()
			pbe(fe, "BEGIN")
			pbe(fe, "SELECT set_config('fence.step', 's1', false)")
			pbe(fe, "SELECT * FROM vw")
			pbe(fe, "SELECT set_config('fence.step', 's2', false)")
			pbe(fe, "COMMIT")
			fe.Send(&pgproto3.Sync{})
			pbe(fe, next)
			fe.Send(&pgproto3.Sync{})
			flush(t, fe)
			t.Logf("batches: %v", rawAnswers(t, conn, 2))
		}},
		// H3 with the first request a simple Query and the write an
		// extended batch sent at once after it.
		{"view_write_query_then_batch", replayWriteView, func(t *testing.T, e *reservedEnv, conn *pgconn.PgConn) {
			fe := conn.Frontend()
			fe.Send(&pgproto3.Query{String: "SELECT set_config('fence.step', 's1', false); SELECT * FROM vw; SELECT set_config('fence.step', 's2', false)"})
			pbe(fe, next)
			fe.Send(&pgproto3.Sync{})
			flush(t, fe)
			t.Logf("requests: %v", rawAnswers(t, conn, 2))
		}},
		// H5: an extended COMMIT AND CHAIN answered as a replay leaves a
		// failed transaction; ROLLBACK AND CHAIN opened another, the
		// replay step was set inside it, and ROLLBACK took it away.
		{"extended_chain_rollback_and_chain", "", func(t *testing.T, e *reservedEnv, conn *pgconn.PgConn) {
			fe := conn.Frontend()
			for _, sql := range []string{"BEGIN", "SET fence.step = 's1'", ins(e), "SET fence.step = 's2'", "COMMIT AND CHAIN"} {
				pbe(fe, sql)
			}
			fe.Send(&pgproto3.Sync{})
			flush(t, fe)
			t.Logf("batch: %v", rawAnswers(t, conn, 1))
			for _, sql := range []string{"ROLLBACK AND CHAIN", "ROLLBACK", next} {
				_, err := conn.Exec(ctxT(t), sql).ReadAll()
				t.Logf("%s: %v", sql, err)
			}
		}},
		// H5 with a savepoint: ROLLBACK TO it recovers the failed
		// transaction (in the first attempt it fails: the chain has no
		// savepoint).
		{"extended_chain_rollback_to_savepoint", "", func(t *testing.T, e *reservedEnv, conn *pgconn.PgConn) {
			fe := conn.Frontend()
			for _, sql := range []string{"BEGIN", "SAVEPOINT x", "SET fence.step = 's1'", ins(e), "SET fence.step = 's2'", "COMMIT AND CHAIN"} {
				pbe(fe, sql)
			}
			fe.Send(&pgproto3.Sync{})
			flush(t, fe)
			t.Logf("batch: %v", rawAnswers(t, conn, 1))
			for _, sql := range []string{"ROLLBACK TO x", "ROLLBACK", next} {
				_, err := conn.Exec(ctxT(t), sql).ReadAll()
				t.Logf("%s: %v", sql, err)
			}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			if c.objects != "" {
				mustExec(t, e.direct(t).PgConn(), c.objects)
			}
			first := e.encConn(t, "UTF8", "-c fence.step=s0")
			c.run(t, e, first)
			if _, err := first.Exec(ctxT(t), "SELECT 1").ReadAll(); err != nil {
				t.Fatalf("first attempt's session: %v", err)
			}
			e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
			retry := e.encConn(t, "UTF8", "-c fence.step=s0")
			c.run(t, e, retry)
			e.wantCount(t, 0, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A++'")
			e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
			// Whatever the retry did, its session writes nothing under an
			// inherited step.
			_, err := retry.Exec(ctxT(t), next).ReadAll()
			wantCode(t, err, fence.CodeFencingRequired)
			e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
		})
	} // H6: the hidden statement that sets the replay step failed (a
	// client's CancelRequest timed to hit it; here a statement the test
	// adds to it) and the proxy went on, believing it set: the next write
	// ran under the step from before the replayed transaction. Now the
	// session ends (FATAL FN008).
	t.Run("restore_fails", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		tx := fmt.Sprintf("BEGIN; SET fence.step = 's1'; INSERT INTO results (job_key, payload, token) VALUES ('a', 'A', %d); SET fence.step = 's2'; COMMIT", e.lease.Token)
		first := e.encConn(t, "UTF8", "-c fence.step=s0")
		mustExec(t, first, tx)
		mustExec(t, first, next)
		e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
		restoreFaults.Store(e.db, "SELECT 1/0")
		retry := e.encConn(t, "UTF8", "-c fence.step=s0")
		mustExec(t, retry, tx) // replayed: answered as committed
		_, err := retry.Exec(ctxT(t), next).ReadAll()
		wantCode(t, err, fence.CodeFencingRequired)
		if _, err := retry.Exec(ctxT(t), "SELECT 1").ReadAll(); err == nil {
			t.Fatal("the session went on after its replay step could not be set")
		}
		e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
		e.wantCount(t, 0, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A++'")
	})
	// H2: a DO block inside the replayed transaction switched the
	// generation; the proxy put back only what it saw (the first job), and
	// the next write, whose client set its step as the docs say, ran under
	// the first job's generation: a new receipt, applied twice. Now the
	// generation is cleared after a replay of a transaction that ran such
	// code: FN008 until the client sets it again.
	for _, proto := range []string{"simple", "extended"} {
		t.Run("do_switches_generation/"+proto, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			other := e.acquire(t, "r2", "w1", time.Minute)
			stmts := []string{"BEGIN", "SET fence.step = 's1'",
				fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('a', 'A', %d)", e.lease.Token),
				fmt.Sprintf("DO $$ BEGIN PERFORM set_config('fence.job_key', 'r2', false); PERFORM set_config('fence.epoch', '%d', false); PERFORM set_config('fence.token', '%d', false); END $$", other.Epoch, other.Token),
				"COMMIT"}
			after := "SET fence.step = 's2'; " + next
			run := func(conn *pgconn.PgConn) {
				if proto == "simple" {
					mustExec(t, conn, strings.Join(stmts, "; "))
					return
				}
				b := &pgconn.Batch{}
				for _, sql := range stmts {
					b.ExecParams(sql, nil, nil, nil, nil)
				}
				if _, err := conn.ExecBatch(ctxT(t), b).ReadAll(); err != nil {
					t.Fatal(err)
				}
			}
			first := e.encConn(t, "UTF8", "-c fence.step=s0")
			run(first)
			mustExec(t, first, after)
			e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
			retry := e.encConn(t, "UTF8", "-c fence.step=s0")
			run(retry)
			_, err := retry.Exec(ctxT(t), after).ReadAll()
			wantCode(t, err, fence.CodeFencingRequired)
			e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
			// With the generation set again, as the first attempt had it:
			// the write is the first attempt's, a replay.
			mustExec(t, retry, fmt.Sprintf("SET fence.job_key = 'r2'; SET fence.epoch = %d; SET fence.token = %d", other.Epoch, other.Token))
			retry.Exec(ctxT(t), after).ReadAll()
			e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
		})
	}
}
