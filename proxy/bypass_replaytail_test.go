package proxy

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
)

// A replayed COMMIT in the middle of a query: PostgreSQL skips what
// follows the COMMIT. The gate's replay answer dropped those statements
// unanswered, and the next query met an aborted transaction (round 0,
// B-M6); running them after a ROLLBACK ran them without the session
// state the first attempt's transaction left (its SETs: a write under
// another fence.step was applied twice, round 3, G-H1). Now the client
// gets COMMIT, the replay NOTICE and an error (FN00R) for the statements
// after it, none of which ran, and the session goes on.
func init() { registerBypass("replaytail", bypassReplayTail) }

func bypassReplayTail(t *testing.T) {
	for _, c := range []struct {
		name  string
		begin bool
	}{{"after_begin", true}, {"implicit", false}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			conn := e.encConn(t, "UTF8")
			ins := fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'tail', %d)", e.lease.Token)
			mustExec(t, conn, "BEGIN; "+ins+"; COMMIT")
			e.wantCommittedWithReceipt(t, "tail")
			if c.begin {
				mustExec(t, conn, "BEGIN")
			}
			res, err := conn.Exec(ctxT(t), ins+"; COMMIT; INSERT INTO audit (note) VALUES ('after'); SELECT 42").ReadAll()
			wantCode(t, err, fence.CodeReplay)
			if len(res) < 2 || res[1].Err != nil || res[1].CommandTag.String() != "COMMIT" {
				t.Fatalf("retry: %d results, want the COMMIT answered as committed", len(res))
			}
			if st := conn.TxStatus(); st != 'I' {
				t.Fatalf("transaction status %q, want idle", st)
			}
			e.wantCount(t, 0, "SELECT count(*) FROM audit WHERE note = 'after'")
			e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r'")
			mustExec(t, conn, "SELECT 1") // no aborted transaction left behind
		})
	}
}

// The replayed COMMIT's other shapes: AND CHAIN with nothing after it
// leaves the client in a new transaction as PostgreSQL would; a step set
// in the transaction and a write after the COMMIT (G-H1) is not applied
// twice; the same in one extended-protocol batch.
func init() { registerBypass("replaytail_shapes", bypassReplayTailShapes) }

func bypassReplayTailShapes(t *testing.T) {
	setup := func(t *testing.T) (*reservedEnv, *pgconn.PgConn, string) {
		e := newReservedEnv(t)
		conn := e.encConn(t, "UTF8")
		ins := fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'tail', %d)", e.lease.Token)
		mustExec(t, conn, "BEGIN; "+ins+"; COMMIT")
		e.wantCommittedWithReceipt(t, "tail")
		return e, conn, ins
	}
	t.Run("chain", func(t *testing.T) {
		// A replayed COMMIT AND CHAIN is answered as PostgreSQL answers a
		// replay (FN00R, no transaction open): the replay step set in
		// the chained transaction would go with its rollback (round 4,
		// I-H2; round 6: every replay sets it).
		t.Parallel()
		e, conn, ins := setup(t)
		mustExec(t, conn, "BEGIN")
		_, err := conn.Exec(ctxT(t), ins+"; COMMIT AND CHAIN").ReadAll()
		wantCode(t, err, fence.CodeReplay)
		if st := conn.TxStatus(); st != 'I' {
			t.Fatalf("after the replayed COMMIT AND CHAIN: transaction status %q, want idle", st)
		}
		mustExec(t, conn, "INSERT INTO audit (note) VALUES ('chained')")
		e.wantCount(t, 1, "SELECT count(*) FROM audit WHERE note = 'chained'")
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r'")
	})
	// G-H1: the first attempt's write after the COMMIT ran under the step
	// the transaction set; the retry must not apply it again.
	for _, chain := range []string{"COMMIT", "COMMIT AND CHAIN"} {
		t.Run("step_set_in_tx/"+chain, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			q := fmt.Sprintf("BEGIN; SET fence.step = 's1'; INSERT INTO results (job_key, payload, token) VALUES ('r', 'a', %d); "+
				"SET fence.step = 's2'; %s; INSERT INTO audit (note) VALUES ('b')", e.lease.Token, chain)
			if chain != "COMMIT" {
				q += "; COMMIT"
			}
			first := e.encConn(t, "UTF8")
			if _, err := first.Exec(ctxT(t), q).ReadAll(); err != nil {
				t.Fatalf("first attempt: %v", err)
			}
			e.wantCount(t, 1, "SELECT count(*) FROM audit WHERE note = 'b'")
			retry := e.encConn(t, "UTF8")
			_, err := retry.Exec(ctxT(t), q).ReadAll()
			wantCode(t, err, fence.CodeReplay)
			e.wantCount(t, 1, "SELECT count(*) FROM audit WHERE note = 'b'")
			mustExec(t, retry, "SELECT 1")
		})
	}
	// A replayed COMMIT AND CHAIN is answered with FN00R (round 6); in a
	// batch the transaction is left failed, for the client to roll back,
	// and nothing after the COMMIT runs (before, the chained transaction
	// began and the error for what followed failed it: round 4, I-M3).
	for _, c := range []struct {
		name, begin, commit string
		status              byte
	}{{"extended_batch", "BEGIN", "COMMIT", 'I'}, {"extended_implicit", "", "COMMIT", 'I'}, {"extended_chain", "BEGIN", "COMMIT AND CHAIN", 'E'}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e, conn, ins := setup(t)
			if c.begin != "" {
				mustExec(t, conn, c.begin)
			}
			b := &pgconn.Batch{}
			b.ExecParams(ins, nil, nil, nil, nil)
			b.ExecParams(c.commit, nil, nil, nil, nil)
			b.ExecParams("INSERT INTO audit (note) VALUES ('after batch')", nil, nil, nil, nil)
			b.ExecParams("SELECT 42", nil, nil, nil, nil)
			res, err := conn.ExecBatch(ctxT(t), b).ReadAll()
			wantCode(t, err, fence.CodeReplay)
			chain := c.commit != "COMMIT"
			if !chain && (len(res) < 2 || res[1].Err != nil || res[1].CommandTag.String() != "COMMIT") {
				t.Fatalf("retry batch: %d results, want the COMMIT answered as committed", len(res))
			}
			if st := conn.TxStatus(); st != c.status {
				t.Fatalf("after the batch: transaction status %q, want %q", st, c.status)
			}
			if c.status == 'E' {
				mustExec(t, conn, "ROLLBACK")
			}
			e.wantCount(t, 0, "SELECT count(*) FROM audit WHERE note = 'after batch'")
			e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r'")
			mustExec(t, conn, "SELECT 1")
		})
	}
}

// After a replayed COMMIT the session has the settings the transaction
// set (round 3, H-H1): the proxy rolls the replayed transaction back, so
// its SET fence.step went with it, and the client's next request, told
// the COMMIT committed, wrote under the step before, which had no
// receipt: applied twice.
func init() { registerBypass("replay_settings", bypassReplaySettings) }

func bypassReplaySettings(t *testing.T) {
	for _, c := range []struct{ name, commit string }{{"commit", "COMMIT"}, {"lone_commit", ""}, {"extended", "ext"}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			tx := fmt.Sprintf("BEGIN; SET fence.step = 's1'; INSERT INTO results (job_key, payload, token) VALUES ('a', 'A', %d); SET fence.step = 's2'", e.lease.Token)
			next := "UPDATE results SET payload = payload || '+' WHERE job_key = 'a'"
			run := func(conn *pgconn.PgConn) error {
				switch c.commit {
				case "COMMIT":
					_, err := conn.Exec(ctxT(t), tx+"; COMMIT").ReadAll()
					return err
				case "":
					if _, err := conn.Exec(ctxT(t), tx).ReadAll(); err != nil {
						return err
					}
					_, err := conn.Exec(ctxT(t), "COMMIT").ReadAll()
					return err
				}
				if _, err := conn.Exec(ctxT(t), tx).ReadAll(); err != nil {
					return err
				}
				_, err := conn.ExecParams(ctxT(t), "COMMIT", nil, nil, nil, nil).Close()
				return err
			}
			first := e.encConn(t, "UTF8")
			if err := run(first); err != nil {
				t.Fatalf("first attempt: %v", err)
			}
			if _, err := first.Exec(ctxT(t), next).ReadAll(); err != nil {
				t.Fatalf("first attempt's next request: %v", err)
			}
			e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
			retry := e.encConn(t, "UTF8")
			if err := run(retry); err != nil {
				t.Fatalf("retry: %v", err)
			}
			// Round 6: what the transaction left for fence.step is not
			// known to the proxy in general (code it cannot see), so it is
			// replayStep, under which the next write is refused until the
			// client sets a step (it was s2: the transaction's SET, put
			// back by the proxy).
			if v := lastValue(t, retry, "SHOW fence.step"); v != replayStep {
				t.Fatalf("after the replayed COMMIT fence.step is %q, want %q", v, replayStep)
			}
			_, err := retry.Exec(ctxT(t), next).ReadAll()
			wantCode(t, err, fence.CodeFencingRequired)
			e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
		})
	}
}

// Round 4: where the proxy cannot restore what the replayed transaction
// set — a setting changed unseen in the same request (I-H1), or COMMIT
// AND CHAIN, whose chained transaction the client may roll back and the
// restored settings with it (I-H2) — the replayed COMMIT is answered as
// PostgreSQL answers it: an error, FN00R. And an extended COMMIT AND
// CHAIN of a fenced session leaves its chained transaction usable (I-M2).
func init() { registerBypass("replay_unrestorable", bypassReplayUnrestorable) }

func bypassReplayUnrestorable(t *testing.T) {
	for _, c := range []struct{ name, end string }{
		{"chain", "COMMIT AND CHAIN"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			q := fmt.Sprintf("BEGIN; SET fence.step = 's1'; INSERT INTO results (job_key, payload, token) VALUES ('a', 'A', %d); SET fence.step = 'w'; %s", e.lease.Token, c.end)
			first := e.encConn(t, "UTF8")
			mustExec(t, first, q)
			if first.TxStatus() == 'T' {
				mustExec(t, first, "COMMIT")
			}
			retry := e.encConn(t, "UTF8")
			res, err := retry.Exec(ctxT(t), q).ReadAll()
			t.Logf("retry: %d results, err %v", len(res), err)
			wantCode(t, err, fence.CodeReplay)
			if st := retry.TxStatus(); st != 'I' {
				t.Fatalf("after the replay's error: transaction status %q, want idle", st)
			}
			e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a'")
			e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r'")
		})
	}
	t.Run("extended_chain_not_replayed", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		conn := e.encConn(t, "UTF8")
		b := &pgconn.Batch{}
		b.ExecParams("BEGIN", nil, nil, nil, nil)
		b.ExecParams(fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('c', 'C', %d)", e.lease.Token), nil, nil, nil, nil)
		b.ExecParams("COMMIT AND CHAIN", nil, nil, nil, nil)
		if _, err := conn.ExecBatch(ctxT(t), b).ReadAll(); err != nil {
			t.Fatalf("batch: %v", err)
		}
		if st := conn.TxStatus(); st != 'T' {
			t.Fatalf("after COMMIT AND CHAIN: transaction status %q, want 'T'", st)
		}
		mustExec(t, conn, "SELECT 1")
		mustExec(t, conn, "COMMIT")
		e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'c'")
	})
}
