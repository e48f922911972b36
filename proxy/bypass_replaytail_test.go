package proxy

import (
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// A replayed COMMIT in the middle of a query: PostgreSQL runs what
// follows the COMMIT in a new transaction, and the client must get an
// answer for each statement, as it would without the gate (or a clear
// error for each): the gate's replay answer dropped them, and the next
// query met an aborted transaction (issue 30, attack round B, M6).
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
			if err != nil {
				t.Fatalf("retry: %v", err)
			}
			if len(res) != 4 {
				t.Fatalf("retry: %d results, want 4 (the statements after the COMMIT answered)", len(res))
			}
			for i, r := range res {
				if r.Err != nil && i >= 2 {
					t.Fatalf("statement %d after the replayed COMMIT: %v", i+1, r.Err)
				}
			}
			if got := res[3].Rows; len(got) != 1 || string(got[0][0]) != "42" {
				t.Fatalf("SELECT 42: got %q", got)
			}
			e.wantCount(t, 1, "SELECT count(*) FROM audit WHERE note = 'after'")
			e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r'")
			mustExec(t, conn, "SELECT 1") // no aborted transaction left behind
		})
	}
}

// The replayed COMMIT's other shapes: AND CHAIN leaves the client in a new
// transaction as PostgreSQL would; an error after the COMMIT is the
// client's to see, and the session goes on; the same in one
// extended-protocol batch, each statement answered.
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
		t.Parallel()
		e, conn, ins := setup(t)
		mustExec(t, conn, "BEGIN")
		if _, err := conn.Exec(ctxT(t), ins+"; COMMIT AND CHAIN").ReadAll(); err != nil {
			t.Fatalf("retry: %v", err)
		}
		if st := conn.TxStatus(); st != 'T' {
			t.Fatalf("after COMMIT AND CHAIN: transaction status %q, want 'T' (the chained transaction)", st)
		}
		mustExec(t, conn, "INSERT INTO audit (note) VALUES ('chained'); COMMIT")
		e.wantCount(t, 1, "SELECT count(*) FROM audit WHERE note = 'chained'")
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r'")
	})
	t.Run("tail_error", func(t *testing.T) {
		t.Parallel()
		e, conn, ins := setup(t)
		res, err := conn.Exec(ctxT(t), ins+"; COMMIT; SELECT 1/0; INSERT INTO audit (note) VALUES ('skipped')").ReadAll()
		if err == nil {
			t.Fatalf("retry: no error for 1/0 after the replayed COMMIT (results %d)", len(res))
		}
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "22012" {
			t.Fatalf("retry: %v, want the client's own division_by_zero (22012)", err)
		}
		if st := conn.TxStatus(); st != 'I' {
			t.Fatalf("transaction status %q, want idle", st)
		}
		mustExec(t, conn, "SELECT 1")
		e.wantCount(t, 0, "SELECT count(*) FROM audit WHERE note = 'skipped'")
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r'")
	})
	for _, c := range []struct {
		name, begin, commit string
		status              byte
	}{{"extended_batch", "BEGIN", "COMMIT", 'I'}, {"extended_implicit", "", "COMMIT", 'I'}, {"extended_chain", "BEGIN", "COMMIT AND CHAIN", 'T'}} {
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
			if err != nil {
				t.Fatalf("retry batch: %v", err)
			}
			if len(res) != 4 {
				t.Fatalf("retry batch: %d results, want 4", len(res))
			}
			for i, r := range res {
				if r.Err != nil {
					t.Fatalf("batch statement %d: %v", i+1, r.Err)
				}
			}
			if got := res[3].Rows; len(got) != 1 || string(got[0][0]) != "42" {
				t.Fatalf("SELECT 42: got %q", got)
			}
			if st := conn.TxStatus(); st != c.status {
				t.Fatalf("after the batch: transaction status %q, want %q", st, c.status)
			}
			if c.status == 'T' {
				mustExec(t, conn, "COMMIT")
			}
			e.wantCount(t, 1, "SELECT count(*) FROM audit WHERE note = 'after batch'")
			e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r'")
			mustExec(t, conn, "SELECT 1")
		})
	}
}
