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

func init() { registerBypass("stmtcopy_answers", bypassStmtCopyAnswers) }

// bypassStmtCopyAnswers (issue 30, round 3, attacker H's H2): what the
// router believes exists on each upstream was updated when a Parse or
// Close (the client's, or its own hidden copy) was sent, not when the
// server answered it. One the server skipped (after an earlier error in
// the batch) or refused (42P05: the name exists) left the belief wrong,
// and a later Bind ran an older version on the other upstream than the
// one the gate judged: on a lagging replica, a read of the previous
// generation the gate took for a harmless SET; on the primary, any
// statement the gate took for another. Each case ends with a Bind of s1
// in a read-only transaction opened on the replica before the takeover
// (or, for the primary, outside one), which must run the version the
// server accepted.
func bypassStmtCopyAnswers(t *testing.T) {
	const read = "SELECT payload, token, pg_is_in_recovery() FROM results WHERE job_key = 'job'"
	const set = "SET LOCAL statement_timeout = 0"
	fail := []pgproto3.FrontendMessage{&pgproto3.Parse{Query: "SELECT 1/0"}, &pgproto3.Bind{}, &pgproto3.Execute{}}
	with := func(ms ...pgproto3.FrontendMessage) []pgproto3.FrontendMessage {
		return append(append([]pgproto3.FrontendMessage(nil), fail...), ms...)
	}
	type reader struct {
		name    string
		conn    *pgconn.PgConn
		primary bool   // the last Bind runs on the primary
		want    string // the command tag of the accepted version
	}
	var readers []reader
	cases := []struct {
		name    string
		primary bool
		want    string
		steps   func(t *testing.T, c *pgconn.PgConn, roTx func())
	}{
		{"skipped_parse", false, "SET", func(t *testing.T, c *pgconn.PgConn, roTx func()) {
			roTx()
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: read})
			stmtExec(t, c, "COMMIT")
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: set})
			roTx()
			stmtBatch(t, c, with(&pgproto3.Parse{Name: "s1", Query: set})...)
			stmtExec(t, c, "ROLLBACK")
			roTx()
		}},
		{"refused_parse", false, "SET", func(t *testing.T, c *pgconn.PgConn, roTx func()) {
			roTx()
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: read})
			stmtExec(t, c, "COMMIT")
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: set})
			roTx()
			// The client's Close of s1 on the replica is skipped ...
			stmtBatch(t, c, with(&pgproto3.Close{ObjectType: 'S', Name: "s1"})...)
			stmtExec(t, c, "ROLLBACK")
			roTx()
			// ... so s1 is still there: this Parse is refused (42P05),
			// or parsed after the router closed what it did not know.
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: set})
			stmtExec(t, c, "ROLLBACK")
			roTx()
		}},
		{"skipped_copy", false, "SET", func(t *testing.T, c *pgconn.PgConn, roTx func()) {
			roTx()
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: read})
			stmtExec(t, c, "COMMIT")
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: set})
			roTx()
			// The hidden Close and Parse copying s1 here are skipped.
			stmtBatch(t, c, with(&pgproto3.Bind{PreparedStatement: "s1"})...)
			stmtExec(t, c, "ROLLBACK")
			roTx()
		}},
		{"skipped_copy_primary", true, "SELECT 1", func(t *testing.T, c *pgconn.PgConn, roTx func()) {
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: "SELECT 'old'"})
			roTx()
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: "SELECT 'new'"})
			stmtExec(t, c, "COMMIT")
			// On the primary, the hidden copy of 'new' is skipped.
			stmtBatch(t, c, with(&pgproto3.Bind{PreparedStatement: "s1"})...)
		}},
		{"skipped_close_primary", true, "SELECT 1", func(t *testing.T, c *pgconn.PgConn, roTx func()) {
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: "SELECT 'old'"})
			roTx()
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: "SELECT 'new'"})
			stmtExec(t, c, "COMMIT")
			// On the primary: the hidden Close of 'old' before the
			// client's Parse is skipped with it, then the client's Parse
			// is refused (42P05) or follows a Close the router sends.
			stmtBatch(t, c, with(&pgproto3.Parse{Name: "s1", Query: "SELECT 'new'"})...)
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: "SELECT 'new'"})
		}},
	}
	newReadsScene(t, false, readsSchema, nil, func(sc *readsScene) {
		for _, k := range cases {
			c := sc.e.reader(t, nil, "-c fence.read_policy=pending", "-c fence.read_wait=50ms")
			roTx := func() {
				t.Helper()
				if err := pgtest.Poll(ctxT(t), func() (bool, error) {
					_, rep, err := where(t, c, "BEGIN READ ONLY; SELECT pg_is_in_recovery()")
					if err != nil || rep {
						return rep, err
					}
					_, err = c.Exec(ctxT(t), "ROLLBACK").ReadAll()
					return false, err
				}); err != nil {
					t.Fatalf("%s: no read-only transaction on the replica: %v", k.name, err)
				}
			}
			k.steps(t, c, roTx)
			readers = append(readers, reader{k.name, c, k.primary, k.want})
		}
	})
	for _, r := range readers {
		t.Run(r.name, func(t *testing.T) {
			ms := stmtBatch(t, r.conn, &pgproto3.Bind{PreparedStatement: "s1"}, &pgproto3.Describe{ObjectType: 'P'}, &pgproto3.Execute{})
			var tag string
			for _, m := range ms {
				switch m := m.(type) {
				case *pgproto3.DataRow:
					for _, v := range m.Values {
						if string(v) == "A" || string(v) == "old" {
							t.Fatalf("s1 ran a version the server did not accept last (the gate judged another): row %q", m.Values)
						}
					}
				case *pgproto3.CommandComplete:
					tag = string(m.CommandTag)
				case *pgproto3.ErrorResponse:
					if r.primary || !strings.HasPrefix(m.Code, "FN") {
						t.Fatalf("s1: %s %s", m.Code, m.Message)
					}
					t.Logf("s1 refused: %s %s", m.Code, m.Message)
					tag = r.want // a pending read is refused: safe
				}
			}
			if tag != r.want {
				t.Fatalf("s1 ran %q, want the accepted version's %q", tag, r.want)
			}
			r.conn.Exec(context.Background(), "ROLLBACK").ReadAll()
		})
	}
}

// stmtBatch sends msgs and a Sync, and returns what the server answered
// up to its ReadyForQuery.
func stmtBatch(t *testing.T, c *pgconn.PgConn, msgs ...pgproto3.FrontendMessage) []pgproto3.BackendMessage {
	t.Helper()
	fe := c.Frontend()
	for _, m := range msgs {
		fe.Send(m)
	}
	fe.Send(&pgproto3.Sync{})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	var out []pgproto3.BackendMessage
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		switch m := m.(type) {
		case *pgproto3.ReadyForQuery:
			return out
		case *pgproto3.DataRow:
			vals := make([][]byte, len(m.Values))
			for i, v := range m.Values {
				vals[i] = append([]byte(nil), v...)
			}
			out = append(out, &pgproto3.DataRow{Values: vals})
		case *pgproto3.CommandComplete:
			out = append(out, &pgproto3.CommandComplete{CommandTag: append([]byte(nil), m.CommandTag...)})
		case *pgproto3.ErrorResponse:
			e := *m
			out = append(out, &e)
		}
	}
}

func stmtExec(t *testing.T, c *pgconn.PgConn, sql string) {
	t.Helper()
	if _, err := c.Exec(ctxT(t), sql).ReadAll(); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}
