package proxy

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("stmtcopy", bypassStmtCopy) }

// bypassStmtCopy (issue 30, round 2, attacker F's H1): a named statement
// the client uses on the other upstream is parsed there again from a
// copy. The copy was the client's last Parse of the name as sent, while
// the gate judged the statement as the server had accepted it: a Parse
// the server refused (the name exists: 42P05) or skipped (after an error
// in its batch) left a harmless statement on the primary, the copy
// parsed a read of a protected table on the lagging replica, and a
// reader was served the previous generation after a takeover. Now the
// copy is what the server accepted.
func bypassStmtCopy(t *testing.T) {
	const read = "SELECT payload, pg_is_in_recovery() FROM results WHERE job_key = 'job'"
	type reader struct {
		name string
		conn *pgconn.PgConn
	}
	var readers []reader
	sc := newReadsScene(t, false, readsSchema, nil, func(sc *readsScene) {
		ctx := ctxT(t)
		for _, how := range []string{"refused", "skipped"} {
			c := sc.e.reader(t, nil, "-c fence.read_policy=pending", "-c fence.read_wait=50ms")
			if _, err := c.Prepare(ctx, "s1", "SET LOCAL statement_timeout = 0", nil); err != nil {
				t.Fatalf("%s: prepare s1: %v", how, err)
			}
			switch how {
			case "refused":
				_, err := c.Prepare(ctx, "s1", read, nil)
				wantCode(t, err, "42P05")
			case "skipped":
				// An error first: the server skips the Parse after it.
				fe := c.Frontend()
				fe.Send(&pgproto3.Parse{Query: "SELECT 1/0"})
				fe.Send(&pgproto3.Bind{})
				fe.Send(&pgproto3.Execute{})
				fe.Send(&pgproto3.Parse{Name: "s1", Query: read})
				fe.Send(&pgproto3.Sync{})
				if err := fe.Flush(); err != nil {
					t.Fatal(err)
				}
				for {
					m, err := fe.Receive()
					if err != nil {
						t.Fatal(err)
					}
					if _, ok := m.(*pgproto3.ReadyForQuery); ok {
						break
					}
				}
			}
			// A read-only transaction on the replica, while it is current.
			if err := pgtest.Poll(ctx, func() (bool, error) {
				vals, rep, err := where(t, c, "BEGIN READ ONLY; "+read)
				if err != nil {
					return false, err
				}
				if rep && len(vals) > 0 && vals[0] == "A" {
					return true, nil
				}
				_, err = c.Exec(ctx, "ROLLBACK").ReadAll()
				return false, err
			}); err != nil {
				t.Fatalf("%s: the transaction did not begin on the replica with A's result: %v", how, err)
			}
			readers = append(readers, reader{how, c})
		}
	})
	_ = sc
	for _, r := range readers {
		t.Run(r.name, func(t *testing.T) {
			res := r.conn.ExecPrepared(ctxT(t), "s1", nil, nil, nil).Read()
			for _, row := range res.Rows {
				if len(row) > 0 && string(row[0]) == "A" {
					t.Fatalf("the previous generation's result was served after the takeover: %q", row)
				}
			}
			if res.Err != nil && !strings.Contains(res.Err.Error(), "SQLSTATE") {
				t.Fatalf("s1: %v", res.Err)
			}
			t.Logf("s1 after the takeover: tag %q, rows %d, err %v", res.CommandTag, len(res.Rows), res.Err)
			r.conn.Exec(context.Background(), "ROLLBACK").ReadAll()
		})
	}
}
