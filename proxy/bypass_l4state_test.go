package proxy

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// Issue 30, round 5 (attacker K): what the proxy believed about the
// replica connection's portals, prepared statements and session state was
// not what the connection had, and a read was judged by the belief.

const l4Read = "SELECT payload, token, pg_is_in_recovery() FROM results WHERE job_key = 'job'"

// l4Reader is a reader prepared before the takeover; run checks it after.
type l4Reader struct {
	name string
	conn *pgconn.PgConn
	run  []pgproto3.FrontendMessage // sent with a Sync after the takeover
}

// l4RoTx opens a read-only transaction on the replica (polling until the
// replica serves it).
func l4RoTx(t *testing.T, c *pgconn.PgConn, name string) {
	t.Helper()
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		_, rep, err := where(t, c, "BEGIN READ ONLY; SELECT pg_is_in_recovery()")
		if err != nil || rep {
			return rep, err
		}
		_, err = c.Exec(ctxT(t), "ROLLBACK").ReadAll()
		return false, err
	}); err != nil {
		t.Fatalf("%s: no read-only transaction on the replica: %v", name, err)
	}
}

// l4Check runs each reader's messages after the takeover: no row of the
// previous generation (A) may come back; a refusal (FN...) is safe.
func l4Check(t *testing.T, readers []l4Reader) {
	for _, r := range readers {
		t.Run(r.name, func(t *testing.T) {
			ms := stmtBatch(t, r.conn, r.run...)
			for _, m := range ms {
				switch m := m.(type) {
				case *pgproto3.DataRow:
					for _, v := range m.Values {
						if string(v) == "A" {
							t.Fatalf("the previous generation's result was served after the takeover: %q", m.Values)
						}
					}
				case *pgproto3.ErrorResponse:
					if !strings.HasPrefix(m.Code, "FN") && m.Code != "34000" && m.Code != "26000" {
						t.Fatalf("%s %s", m.Code, m.Message)
					}
					t.Logf("refused: %s %s", m.Code, m.Message)
				}
			}
			r.conn.Exec(context.Background(), "ROLLBACK").ReadAll()
		})
	}
}

func init() { registerBypass("portal_meaning", bypassPortalMeaning) }

// bypassPortalMeaning (round 5, attacker K's H1): an Execute of a portal
// was judged by the proxy's record of the portal bound under that name,
// even when that portal had ended (its transaction ended, SQL CLOSE, code
// the proxy cannot see) and the name now denoted a cursor made by SQL
// DECLARE or by plpgsql's OPEN: on a lagging replica, a read of the
// previous generation judged as the SET LOCAL bound before. A portal's
// meaning now comes only from a Bind the proxy saw, with nothing since
// that may have touched portals; any other is judged as unknown.
func bypassPortalMeaning(t *testing.T) {
	const set = "SET LOCAL statement_timeout = 0"
	bindC := []pgproto3.FrontendMessage{
		&pgproto3.Parse{Query: set}, &pgproto3.Bind{DestinationPortal: "c"}, &pgproto3.Execute{Portal: "c"},
	}
	cases := []struct {
		name  string
		steps func(t *testing.T, c *pgconn.PgConn)
	}{
		{"ended_by_sync_then_declare", func(t *testing.T, c *pgconn.PgConn) {
			stmtBatch(t, c, bindC...) // autocommit: the portal ends at the Sync
			l4RoTx(t, c, "ended_by_sync_then_declare")
			stmtExec(t, c, "DECLARE c CURSOR FOR "+l4Read)
		}},
		{"closed_by_sql_then_declare", func(t *testing.T, c *pgconn.PgConn) {
			l4RoTx(t, c, "closed_by_sql_then_declare")
			stmtBatch(t, c, bindC...)
			stmtExec(t, c, "CLOSE c")
			stmtExec(t, c, "DECLARE c CURSOR FOR "+l4Read)
		}},
		{"close_all_then_declare", func(t *testing.T, c *pgconn.PgConn) {
			l4RoTx(t, c, "close_all_then_declare")
			stmtBatch(t, c, bindC...)
			stmtExec(t, c, "CLOSE ALL")
			stmtExec(t, c, "DECLARE c CURSOR FOR "+l4Read)
		}},
		{"reopened_by_code", func(t *testing.T, c *pgconn.PgConn) {
			l4RoTx(t, c, "reopened_by_code")
			stmtBatch(t, c, bindC...)
			stmtExec(t, c, "DO $$ DECLARE r refcursor := 'c'; BEGIN CLOSE r; OPEN r FOR "+l4Read+"; END $$")
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
