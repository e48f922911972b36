package proxy

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// During a simple query's COPY FROM STDIN, PostgreSQL ignores Sync and
// Flush and refuses anything else but COPY data (copyfromparse.c,
// CopyGetData). Through the gate the same must hold, and a gated COPY must
// end as it does without the gate: a Sync during the data made the gate
// wait for its ReadyForQuery, which never comes, with the wrapped
// transaction open and the job's fence row locked past gate_idle_timeout
// and the client's disconnect (issue 30, attack round B, M1, L2).
func init() { registerBypass("copyin", bypassCopyIn) }

// rawUntilReady sends msgs and reads until a ReadyForQuery or until the
// deadline, returning the CommandComplete tags and error codes seen, and
// whether the ReadyForQuery came.
func rawUntilReady(t *testing.T, c *pgconn.PgConn, d time.Duration, msgs ...pgproto3.FrontendMessage) (tags, codes []string, ready bool) {
	t.Helper()
	fe := c.Frontend()
	for _, m := range msgs {
		fe.Send(m)
	}
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	timer := time.AfterFunc(d, func() { c.Conn().SetReadDeadline(time.Now()) }) // unblock Receive
	defer timer.Stop()
	for {
		m, err := fe.Receive()
		if err != nil {
			return tags, codes, false
		}
		switch m := m.(type) {
		case *pgproto3.CommandComplete:
			tags = append(tags, string(m.CommandTag))
		case *pgproto3.ErrorResponse:
			codes = append(codes, m.Code)
			if m.Severity == "FATAL" {
				return tags, codes, false
			}
		case *pgproto3.ReadyForQuery:
			return tags, codes, true
		}
	}
}

func bypassCopyIn(t *testing.T) {
	row := func(e *reservedEnv) []byte { return []byte(fmt.Sprintf("r\tcopied\t%d\n", e.lease.Token)) }
	copyQ := &pgproto3.Query{String: "COPY results (job_key, payload, token) FROM STDIN"}
	for _, c := range []struct {
		name   string
		during pgproto3.FrontendMessage // sent between the data and CopyDone
	}{
		{"sync", &pgproto3.Sync{}},
		{"flush", &pgproto3.Flush{}},
	} {
		// Outside a transaction: the gate wraps the COPY; it commits with
		// its receipt and the client gets COPY 1 and ReadyForQuery.
		t.Run(c.name+"_during_copy_wrapped", func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			conn := e.encConn(t, "UTF8")
			tags, codes, ready := rawUntilReady(t, conn, 20*time.Second, copyQ, &pgproto3.CopyData{Data: row(e)}, c.during, &pgproto3.CopyDone{})
			if !ready || len(codes) > 0 || len(tags) != 1 || tags[0] != "COPY 1" {
				t.Fatalf("got tags %v, errors %v, ReadyForQuery %v; want COPY 1 and ReadyForQuery", tags, codes, ready)
			}
			e.wantCommittedWithReceipt(t, "copied")
			mustExec(t, conn, "SELECT 1")
		})
		// In a transaction: the client's COMMIT commits it, answered
		// COMMIT (not the gate's hidden replies).
		t.Run(c.name+"_during_copy_in_tx", func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			conn := e.encConn(t, "UTF8")
			mustExec(t, conn, "BEGIN")
			tags, codes, ready := rawUntilReady(t, conn, 20*time.Second, copyQ, &pgproto3.CopyData{Data: row(e)}, c.during, &pgproto3.CopyDone{})
			if !ready || len(codes) > 0 || len(tags) != 1 || tags[0] != "COPY 1" {
				t.Fatalf("got tags %v, errors %v, ReadyForQuery %v; want COPY 1 and ReadyForQuery", tags, codes, ready)
			}
			tags, codes, ready = rawUntilReady(t, conn, 20*time.Second, &pgproto3.Query{String: "COMMIT"})
			if !ready || len(codes) > 0 || len(tags) != 1 || tags[0] != "COMMIT" {
				t.Fatalf("COMMIT: got tags %v, errors %v, ReadyForQuery %v; want COMMIT", tags, codes, ready)
			}
			e.wantCommittedWithReceipt(t, "copied")
		})
	}

	// A Query during the data: PostgreSQL refuses it at once (08P01), the
	// COPY fails and nothing is written; through the gate too, and at once
	// (it waited for its idle timeout).
	for _, c := range []struct {
		name string
		msg  pgproto3.FrontendMessage
	}{
		{"query", &pgproto3.Query{String: "SELECT 1"}},
		{"parse", &pgproto3.Parse{Query: "SELECT 1"}},
	} {
		t.Run(c.name+"_during_copy", func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			for _, route := range []string{"direct", "proxy"} {
				var conn *pgconn.PgConn
				if route == "direct" {
					conn = e.directConn(t)
				} else {
					conn = e.encConn(t, "UTF8")
				}
				start := time.Now()
				_, codes, _ := rawUntilReady(t, conn, 20*time.Second, copyQ, &pgproto3.CopyData{Data: row(e)}, c.msg)
				if len(codes) == 0 || codes[0] != "08P01" || time.Since(start) > 5*time.Second {
					t.Fatalf("%s: errors %v after %v; want 08P01 at once", route, codes, time.Since(start))
				}
				e.wantCount(t, 0, "SELECT count(*) FROM results")
			}
		})
	}
}

// directConn is encConn's connection straight to PostgreSQL.
func (e *reservedEnv) directConn(t *testing.T) *pgconn.PgConn {
	t.Helper()
	cfg, err := pgconn.ParseConfig(fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", cluster.Primary.Addr(), e.db))
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["options"] = pgoptions(e.lease)
	return connectConfig(t, cfg)
}
