package proxy

import (
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

func init() { registerBypass("portal_answers", bypassPortalAnswers) }

// bypassPortalAnswers (round 6, attacker M's H1): the proxy took a portal
// name to mean the Bind it had sent, whatever the server answered. A Bind
// the server refused (42P03: the name is a cursor's, or a portal's) or
// skipped (an earlier error in its batch) left the server's older portal
// under the name, a read of the protected table made before the takeover,
// and ROLLBACK TO SAVEPOINT, taken for a statement that touches no portal,
// let the transaction go on: the older portal's Execute, judged as the
// neutral SET LOCAL the proxy had recorded, was served A's result by the
// lagging replica. A portal's meaning now follows the server's answer to
// its Bind; one refused or skipped, and every name after ROLLBACK TO, is
// judged as unknown.
func bypassPortalAnswers(t *testing.T) {
	const set = "SET LOCAL statement_timeout = 0"
	setC := []pgproto3.FrontendMessage{&pgproto3.Parse{Query: set}, &pgproto3.Bind{DestinationPortal: "c"}}
	readC := []pgproto3.FrontendMessage{&pgproto3.Parse{Query: l4Read}, &pgproto3.Bind{DestinationPortal: "c"}}
	failFirst := []pgproto3.FrontendMessage{&pgproto3.Parse{Query: "SELECT 1/0"}, &pgproto3.Bind{}, &pgproto3.Execute{}}
	batch := func(t *testing.T, c *pgconn.PgConn, msgs ...pgproto3.FrontendMessage) {
		stmtBatch(t, c, msgs...) // errors expected: the point is what the server kept
	}
	cases := []struct {
		name  string
		steps func(t *testing.T, c *pgconn.PgConn)
	}{
		{"bind_skipped_after_error", func(t *testing.T, c *pgconn.PgConn) {
			l4RoTx(t, c, "bind_skipped_after_error")
			batch(t, c, readC...)
			stmtExec(t, c, "SAVEPOINT a")
			batch(t, c, append(append([]pgproto3.FrontendMessage{}, failFirst...), setC...)...)
			stmtExec(t, c, "ROLLBACK TO SAVEPOINT a")
		}},
		{"bind_refused_cursor_exists", func(t *testing.T, c *pgconn.PgConn) {
			l4RoTx(t, c, "bind_refused_cursor_exists")
			stmtExec(t, c, "DECLARE c CURSOR FOR "+l4Read)
			stmtExec(t, c, "SAVEPOINT a")
			batch(t, c, setC...) // 42P03
			stmtExec(t, c, "ROLLBACK TO SAVEPOINT a")
		}},
		{"bind_refused_portal_exists", func(t *testing.T, c *pgconn.PgConn) {
			l4RoTx(t, c, "bind_refused_portal_exists")
			batch(t, c, readC...)
			stmtExec(t, c, "SAVEPOINT a")
			batch(t, c, setC...) // 42P03
			stmtExec(t, c, "ROLLBACK TO SAVEPOINT a")
		}},
		{"bind_refused_hold_cursor", func(t *testing.T, c *pgconn.PgConn) {
			l4RoTx(t, c, "bind_refused_hold_cursor")
			stmtExec(t, c, "DECLARE c CURSOR WITH HOLD FOR "+l4Read)
			stmtExec(t, c, "COMMIT")
			l4RoTx(t, c, "bind_refused_hold_cursor")
			stmtExec(t, c, "SAVEPOINT a")
			batch(t, c, setC...) // 42P03
			stmtExec(t, c, "ROLLBACK TO SAVEPOINT a")
		}},
		{"bind_skipped_same_batch_rollback_to", func(t *testing.T, c *pgconn.PgConn) {
			l4RoTx(t, c, "bind_skipped_same_batch_rollback_to")
			batch(t, c, readC...)
			stmtExec(t, c, "SAVEPOINT a")
			// The failure, the skipped Bind and the ROLLBACK TO in one go.
			batch(t, c, append(append([]pgproto3.FrontendMessage{}, failFirst...), setC...)...)
			batch(t, c, &pgproto3.Parse{Query: "ROLLBACK TO SAVEPOINT a"}, &pgproto3.Bind{}, &pgproto3.Execute{})
		}},
		{"bind_skipped_then_execute_later_batch", func(t *testing.T, c *pgconn.PgConn) {
			l4RoTx(t, c, "bind_skipped_then_execute_later_batch")
			batch(t, c, readC...)
			stmtExec(t, c, "SAVEPOINT a")
			// The Execute of the skipped Bind in the same batch is skipped
			// too; the ROLLBACK TO revives nothing the proxy may trust.
			batch(t, c, append(append(append([]pgproto3.FrontendMessage{}, failFirst...), setC...), &pgproto3.Execute{Portal: "c"})...)
			stmtExec(t, c, "ROLLBACK TO SAVEPOINT a")
		}},
	}
	var readers []l4Reader
	newReadsScene(t, false, readsSchema, nil, func(sc *readsScene) {
		for _, k := range cases {
			c := sc.e.reader(t, nil, "-c fence.read_policy=pending", "-c fence.read_wait=50ms")
			k.steps(t, c)
			readers = append(readers, l4Reader{k.name, c, []pgproto3.FrontendMessage{&pgproto3.Execute{Portal: "c"}}})
		}
	})
	l4Check(t, readers)
}
