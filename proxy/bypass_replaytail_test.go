package proxy

import (
	"fmt"
	"testing"
)

// A replayed COMMIT in the middle of a query: PostgreSQL runs what
// follows the COMMIT in a new transaction, and the client must get an
// answer for each statement, as it would without the gate (or a clear
// error for each): the gate's replay answer dropped them, and the next
// query met an aborted transaction (issue 30, attack round B, M6).
func init() { registerBypass("replaytail", bypassReplayTail) }

func bypassReplayTail(t *testing.T) {
	t.Skip("issue 30, attack round B, M6: not fixed yet (the replay answer still drops the statements after the COMMIT); the case is kept to be run when it is")
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
