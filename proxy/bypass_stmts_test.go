package proxy

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// The gate plans a Bind and an Execute by the prepared statement the
// server will run. Its record of the client's statements must follow the
// server's answers, not the requests: a Parse the server refuses (a name
// in use: 42P05) or skips (after an error earlier in its batch), a Close
// it skips, must change nothing. Otherwise a statement the gate believes
// is SELECT 1 is a COMMIT, which then commits a gated write without the
// gate's receipt step (issue 30, attack round B, H3).
func init() { registerBypass("stmts", bypassStmts) }

// rawBatch sends msgs on c's connection and reads until as many
// ReadyForQuery as msgs hold Syncs and Queries, returning the SQLSTATEs
// of the errors on the way.
func rawBatch(t *testing.T, c *pgconn.PgConn, msgs ...pgproto3.FrontendMessage) []string {
	t.Helper()
	fe := c.Frontend()
	want := 0
	for _, m := range msgs {
		switch m.(type) {
		case *pgproto3.Sync, *pgproto3.Query:
			want++
		}
		fe.Send(m)
	}
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	var codes []string
	for rfq := 0; rfq < want; {
		m, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		switch m := m.(type) {
		case *pgproto3.ErrorResponse:
			codes = append(codes, m.Code)
		case *pgproto3.ReadyForQuery:
			rfq++
		}
	}
	return codes
}

func bypassStmts(t *testing.T) {
	parse := func(name, sql string) *pgproto3.Parse { return &pgproto3.Parse{Name: name, Query: sql} }
	sync := &pgproto3.Sync{}
	failing := []pgproto3.FrontendMessage{parse("", "select 1/0"), &pgproto3.Bind{}, &pgproto3.Execute{}}
	runS1 := []pgproto3.FrontendMessage{&pgproto3.Bind{PreparedStatement: "s1"}, &pgproto3.Execute{}, sync}
	cat := func(parts ...[]pgproto3.FrontendMessage) []pgproto3.FrontendMessage {
		var out []pgproto3.FrontendMessage
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	one := func(m ...pgproto3.FrontendMessage) []pgproto3.FrontendMessage { return m }

	gated := func(e *reservedEnv) []pgproto3.FrontendMessage {
		return one(&pgproto3.Query{String: "BEGIN"},
			&pgproto3.Query{String: fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'stmts', %d)", e.lease.Token)})
	}
	for _, c := range []struct {
		name string
		// setup: batches run one by one, before the gated write; s1 is
		// COMMIT on the server after them, whatever the gate believed.
		setup [][]pgproto3.FrontendMessage
		// pipe is sent in one flight with the gated write and s1's
		// execution, without reading in between: the gate has not seen
		// the answers to pipe when s1 is bound.
		pipe []pgproto3.FrontendMessage
	}{
		{"parse_refused_duplicate", [][]pgproto3.FrontendMessage{
			one(parse("s1", "COMMIT"), sync), one(parse("s1", "SELECT 1"), sync)}, nil},
		{"parse_skipped_after_error", [][]pgproto3.FrontendMessage{
			one(parse("s1", "COMMIT"), sync),
			cat(failing, one(&pgproto3.Close{ObjectType: 'S', Name: "s1"}, parse("s1", "SELECT 1"), sync))}, nil},
		{"close_skipped_after_error", [][]pgproto3.FrontendMessage{
			one(parse("s1", "COMMIT"), sync),
			cat(failing, one(&pgproto3.Close{ObjectType: 'S', Name: "s1"}, sync))}, nil},
		{"parse_skipped_after_describe_error", [][]pgproto3.FrontendMessage{
			one(parse("s1", "COMMIT"), sync),
			one(&pgproto3.Describe{ObjectType: 'S', Name: "nosuch"}, parse("s1", "SELECT 1"), sync)}, nil},
		{"parse_refused_pipelined", [][]pgproto3.FrontendMessage{one(parse("s1", "COMMIT"), sync)},
			one(parse("s1", "SELECT 1"), sync)},
		{"parse_skipped_pipelined", [][]pgproto3.FrontendMessage{one(parse("s1", "COMMIT"), sync)},
			cat(failing, one(parse("s1", "SELECT 1"), sync))},
		{"close_skipped_pipelined", [][]pgproto3.FrontendMessage{one(parse("s1", "COMMIT"), sync)},
			cat(failing, one(&pgproto3.Close{ObjectType: 'S', Name: "s1"}, sync))},
		{"parse_pipelined_all", nil,
			cat(one(parse("s1", "COMMIT"), sync), failing, one(parse("s1", "SELECT 1"), sync))},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			conn := e.encConn(t, "UTF8")
			for _, msgs := range c.setup {
				rawBatch(t, conn, msgs...)
			}
			rawBatch(t, conn, cat(c.pipe, gated(e), runS1)...)
			e.wantCommittedWithReceipt(t, "stmts")
			mustExec(t, conn, "SELECT 1") // the session goes on
		})
	}

	// The unnamed statement: a Parse skipped after an error leaves the
	// last one (the gated write through named statements: a simple Query
	// drops the unnamed statement).
	t.Run("unnamed_parse_skipped", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		conn := e.encConn(t, "UTF8")
		ins := fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'stmts', %d)", e.lease.Token)
		rawBatch(t, conn, cat(one(parse("", "COMMIT"), sync, &pgproto3.Describe{ObjectType: 'S', Name: "nosuch"}, parse("", "SELECT 1"), sync),
			one(parse("b", "BEGIN"), &pgproto3.Bind{PreparedStatement: "b"}, &pgproto3.Execute{},
				parse("ins", ins), &pgproto3.Bind{PreparedStatement: "ins"}, &pgproto3.Execute{}, sync),
			one(&pgproto3.Bind{}, &pgproto3.Execute{}, sync))...)
		e.wantCommittedWithReceipt(t, "stmts")
	})

	// A simple Query drops the unnamed statement: a Bind of it after one
	// fails, and the gate must not plan it as the statement it was.
	t.Run("unnamed_dropped_by_query", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		conn := e.encConn(t, "UTF8")
		rawBatch(t, conn, parse("", "COMMIT"), sync)
		mustExec(t, conn, "BEGIN")
		mustExec(t, conn, fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'stmts', %d)", e.lease.Token))
		if codes := rawBatch(t, conn, &pgproto3.Bind{}, &pgproto3.Execute{}, sync); len(codes) != 1 || codes[0] != "26000" {
			t.Fatalf("Bind of the dropped unnamed statement: errors %v, want [26000]", codes)
		}
		mustExec(t, conn, "ROLLBACK")
		e.wantCount(t, 0, "SELECT count(*) FROM results WHERE payload = 'stmts'")
		e.wantCount(t, 0, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r'")
	})

	// The other way round: the gate must not believe s1 is a COMMIT when
	// the server kept SELECT 1 (it then ended the transaction it believed
	// committed with a ROLLBACK, and the client's COMMIT was answered
	// COMMIT with nothing committed); the transaction commits at the
	// client's COMMIT, once, with its receipt.
	t.Run("parse_refused_commit_believed", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		conn := e.encConn(t, "UTF8")
		rawBatch(t, conn, parse("s1", "SELECT 1"), sync)
		rawBatch(t, conn, parse("s1", "COMMIT"), sync)
		mustExec(t, conn, "BEGIN")
		mustExec(t, conn, fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'stmts', %d)", e.lease.Token))
		if codes := rawBatch(t, conn, runS1...); len(codes) > 0 {
			t.Fatalf("s1 (SELECT 1): errors %v", codes)
		}
		e.wantCount(t, 0, "SELECT count(*) FROM results WHERE payload = 'stmts'")
		mustExec(t, conn, "COMMIT")
		e.wantCommittedWithReceipt(t, "stmts")
	})
}
