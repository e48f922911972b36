package proxy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
)

// A transaction that ends inside CALL or DO (issue 30, HIGH 3, first
// bullet). In one extended-protocol batch outside a transaction block
// PostgreSQL runs CALL and DO non-atomically: a procedure's COMMIT
// commits the gated write, and what follows runs in a new transaction up
// to the Sync. The receipt step planned before the Sync then runs in that
// new transaction, or not at all (a statement fails, the connection
// drops). The database writes the gated transaction's receipt at its
// first fenced write (migration 011), so it commits with it whatever
// ends it; the gate's part is to follow what the server did: its receipt
// step is bound to the transaction it was planned for (the transaction's
// id, taken before the first CALL or DO), and in any other it only does
// what commit_if_written does, so the client gets the answers PostgreSQL
// gives and a retry is a replay, never a second commit.
//
// Through the simple protocol, a CALL or DO in a fenced query runs with
// the gate's steps in the same query, an implicit transaction block, where
// PostgreSQL itself refuses transaction control inside it (2D000), as it
// does inside the client's own transaction block.
func init() { registerBypass("callcommit", bypassCallCommit) }

const callCommitSchema = `
CREATE TABLE notes (n text);
CREATE PROCEDURE p() LANGUAGE plpgsql AS $$ BEGIN COMMIT; INSERT INTO notes VALUES ('after commit'); END $$;
CREATE PROCEDURE p_nocommit() LANGUAGE plpgsql AS $$ BEGIN INSERT INTO notes VALUES ('no commit'); END $$;
CREATE PROCEDURE p_write() LANGUAGE plpgsql AS $$ BEGIN UPDATE results SET payload = 'by p_write' WHERE job_key = 'r'; COMMIT; END $$;
`

func newCallCommitEnv(t *testing.T) *reservedEnv {
	t.Helper()
	e := newReservedEnv(t)
	execOK(t, e.direct(t), callCommitSchema)
	return e
}

// extStmt is one Parse/Bind/Describe/Execute of a batch.
func extMsgs(sqls ...string) []pgproto3.FrontendMessage {
	var out []pgproto3.FrontendMessage
	for _, q := range sqls {
		out = append(out, &pgproto3.Parse{Query: q}, &pgproto3.Bind{}, &pgproto3.Describe{ObjectType: 'P'}, &pgproto3.Execute{})
	}
	return out
}

// batchAnswer sends msgs and a Sync and returns the SQLSTATEs of the
// errors and notices the batch got, and the ReadyForQuery's status.
func batchAnswer(t *testing.T, c *pgconn.PgConn, msgs ...pgproto3.FrontendMessage) (errs, notices []string, status byte) {
	t.Helper()
	fe := c.Frontend()
	for _, m := range msgs {
		fe.Send(m)
	}
	fe.Send(&pgproto3.Sync{})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		switch m := m.(type) {
		case *pgproto3.ErrorResponse:
			errs = append(errs, m.Code)
		case *pgproto3.NoticeResponse:
			notices = append(notices, m.Code)
		case *pgproto3.ReadyForQuery:
			return errs, notices, m.TxStatus
		}
	}
}

func (e *reservedEnv) connRoute(t *testing.T, route string, step string) *pgconn.PgConn {
	t.Helper()
	host := e.proxy.dsn(e.db)
	if route == "direct" {
		host = cluster.Primary.DSN(e.db)
	}
	cfg, err := pgconn.ParseConfig(host)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["options"] = pgoptions(e.lease, "-c fence.step="+step)
	return connectConfig(t, cfg)
}

func bypassCallCommit(t *testing.T) {
	ins := func(e *reservedEnv, payload string) string {
		return fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', '%s', %d) ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload", payload, e.lease.Token)
	}
	// The batch goes on after the procedure's COMMIT: the client gets
	// what PostgreSQL answers (no replay notice, nothing rolled back),
	// and the new transaction's work commits at the Sync, directly and
	// through the proxy alike.
	for _, route := range castRoutes {
		t.Run("commit_inside_then_sync_"+route, func(t *testing.T) {
			t.Parallel()
			e := newCallCommitEnv(t)
			c := e.connRoute(t, route, "s")
			errs, notices, status := batchAnswer(t, c, extMsgs(ins(e, "first"), "CALL p()", "INSERT INTO notes VALUES ('after call')")...)
			if len(errs) != 0 || len(notices) != 0 || status != 'I' {
				t.Fatalf("errors %v, notices %v, status %c: want none, none, I", errs, notices, status)
			}
			e.wantResult(t, "r", "first", e.lease.Token)
			e.wantCount(t, 2, "SELECT count(*) FROM notes WHERE n IN ('after commit', 'after call')")
		})
		// A statement fails after the procedure committed: the write
		// stays committed (as PostgreSQL committed it), and the client
		// gets the statement's error.
		t.Run("commit_inside_then_error_"+route, func(t *testing.T) {
			t.Parallel()
			e := newCallCommitEnv(t)
			c := e.connRoute(t, route, "s")
			errs, _, status := batchAnswer(t, c, extMsgs(ins(e, "first"), "CALL p()", "SELECT 1/0")...)
			if strings.Join(errs, " ") != "22012" || status != 'I' {
				t.Fatalf("errors %v, status %c: want 22012, I", errs, status)
			}
			e.wantResult(t, "r", "first", e.lease.Token)
			e.wantCount(t, 0, "SELECT count(*) FROM notes")
		})
	}

	// Each way the first attempt can end, then its retry: exactly one
	// receipt, and the retry a replay (through the proxy the write alone
	// again is answered as success with the FN00R notice), nothing
	// applied twice.
	for _, end := range []string{"sync", "error", "drop"} {
		for _, route := range castRoutes {
			t.Run("retry_after_"+end+"_"+route, func(t *testing.T) {
				if route == "proxy" {
				}
				t.Parallel()
				e := newCallCommitEnv(t)
				c := e.connRoute(t, route, "once")
				first := extMsgs(ins(e, "first"), "CALL p()")
				switch end {
				case "sync":
					batchAnswer(t, c, first...)
				case "error":
					batchAnswer(t, c, append(first, extMsgs("SELECT 1/0")...)...)
				case "drop":
					// The CALL's answer arrives (it committed), then the
					// connection is gone before the Sync.
					rawUntilN(t, c, 'C', 2, append(first, &pgproto3.Flush{})...)
					c.Close(ctxT(t))
				}
				e.wantResult(t, "r", "first", e.lease.Token)
				e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r' AND step = 'once'")
				before := e.snapshot(t)
				retry := e.connRoute(t, route, "once")
				errs, notices, _ := batchAnswer(t, retry, extMsgs(ins(e, "second"))...)
				switch route {
				case "proxy":
					if len(errs) != 0 || strings.Join(notices, " ") != fence.CodeReplay {
						t.Fatalf("retry: errors %v, notices %v; want the replay's success", errs, notices)
					}
				default:
					if strings.Join(errs, " ") != fence.CodeReplay {
						t.Fatalf("retry: errors %v; want %s", errs, fence.CodeReplay)
					}
				}
				e.unchanged(t, before)
			})
		}
	}

	// A procedure that writes the protected table and commits inside: its
	// write has the receipt, and the batch's own receipt step, in the new
	// transaction, writes none and refuses nothing.
	t.Run("procedure_writes_and_commits", func(t *testing.T) {
		t.Parallel()
		e := newCallCommitEnv(t)
		c := e.connRoute(t, "proxy", "pw")
		errs, notices, _ := batchAnswer(t, c, extMsgs(ins(e, "first"), "CALL p_write()")...)
		if len(errs) != 0 || len(notices) != 0 {
			t.Fatalf("errors %v, notices %v", errs, notices)
		}
		e.wantResult(t, "r", "by p_write", e.lease.Token)
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r' AND step = 'pw'")
	})

	// A procedure that does not commit: the receipt step still runs in
	// the gated transaction, with the proxy's digest.
	for _, call := range []string{"CALL p_nocommit()", "DO $$ BEGIN INSERT INTO notes VALUES ('do'); END $$"} {
		t.Run("no_commit_inside_"+strings.Fields(call)[0], func(t *testing.T) {
			t.Parallel()
			e := newCallCommitEnv(t)
			c := e.connRoute(t, "proxy", "nc")
			errs, notices, _ := batchAnswer(t, c, extMsgs(ins(e, "first"), call)...)
			if len(errs) != 0 || len(notices) != 0 {
				t.Fatalf("errors %v, notices %v", errs, notices)
			}
			e.wantResult(t, "r", "first", e.lease.Token)
			e.wantReceipt(t, "nc")
		})
	}

	// Transaction control inside CALL or DO in a fenced simple query, in
	// the client's transaction or in the same query as the write:
	// PostgreSQL refuses it (2D000), directly and through the proxy, and
	// nothing is committed.
	for _, q := range []struct {
		name string
		sql  func(e *reservedEnv) string
	}{
		{"in_transaction_call", func(e *reservedEnv) string { return "BEGIN; " + ins(e, "x") + "; CALL p()" }},
		{"same_query_call", func(e *reservedEnv) string { return ins(e, "x") + "; CALL p()" }},
		{"same_query_do", func(e *reservedEnv) string { return ins(e, "x") + "; DO $$ BEGIN COMMIT; END $$" }},
	} {
		for _, route := range castRoutes {
			t.Run("simple_refused_"+q.name+"_"+route, func(t *testing.T) {
				t.Parallel()
				e := newCallCommitEnv(t)
				c := e.connRoute(t, route, "simple")
				before := e.snapshot(t)
				wantCode(t, rawExec(ctxT(t), c, []byte(q.sql(e))), "2D000")
				e.unchanged(t, before)
			})
		}
	}

	// A simple Query inside an extended batch commits the batch's
	// implicit transaction when it ends (as the procedure's COMMIT does):
	// the receipt step at the Sync is bound to the gated transaction too.
	t.Run("query_inside_batch", func(t *testing.T) {
		t.Parallel()
		e := newCallCommitEnv(t)
		c := e.connRoute(t, "proxy", "q")
		msgs := append(extMsgs(ins(e, "first")), &pgproto3.Query{String: "SELECT 1"})
		msgs = append(msgs, extMsgs("INSERT INTO notes VALUES ('after query')")...)
		fe := c.Frontend()
		for _, m := range msgs {
			fe.Send(m)
		}
		fe.Send(&pgproto3.Sync{})
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		for rfq := 0; rfq < 2; {
			m, err := fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			switch m := m.(type) {
			case *pgproto3.ErrorResponse:
				t.Fatalf("error %s: %s", m.Code, m.Message)
			case *pgproto3.NoticeResponse:
				t.Fatalf("notice %s: %s", m.Code, m.Message)
			case *pgproto3.ReadyForQuery:
				rfq++
			}
		}
		e.wantResult(t, "r", "first", e.lease.Token)
		e.wantCount(t, 1, "SELECT count(*) FROM notes")
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r' AND step = 'q'")
	})
}

// rawUntilN sends msgs and reads until the n-th message of type want.
func rawUntilN(t *testing.T, c *pgconn.PgConn, want byte, n int, msgs ...pgproto3.FrontendMessage) {
	t.Helper()
	for i := 0; i < n; i++ {
		if i == 0 {
			rawUntil(t, c, want, msgs...)
		} else {
			rawUntil(t, c, want)
		}
	}
}
