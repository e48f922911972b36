package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// rawConn is a session through the proxy driven message by message: a
// pgconn connection whose socket the test has taken over.
type rawConn struct {
	net.Conn
	fe *pgproto3.Frontend
}

func rawConnect(t testing.TB, dsn string) *rawConn {
	t.Helper()
	return rawFrom(t, connect(t, dsn))
}

// rawFrom takes over c's socket as a rawConn, closed when the test ends.
func rawFrom(t testing.TB, c *pgconn.PgConn) *rawConn {
	t.Helper()
	hj := hijack(t, c)
	return &rawConn{Conn: hj.Conn, fe: pgproto3.NewFrontend(hj.Conn, hj.Conn)}
}

// hijack takes over c's socket from pgconn, closed when the test ends.
func hijack(t testing.TB, c *pgconn.PgConn) *pgconn.HijackedConn {
	t.Helper()
	hj, err := c.Hijack()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hj.Conn.Close() })
	return hj
}

// rawStart opens a raw connection to addr, before any startup.
func rawStart(t testing.TB, addr string) *rawConn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawConn{Conn: c, fe: pgproto3.NewFrontend(c, c)}
}

// copyIn sends a COPY FROM STDIN query and waits for CopyInResponse.
func (r *rawConn) copyIn(t testing.TB, sql string) {
	t.Helper()
	r.send(t, &pgproto3.Query{String: sql})
	r.SetReadDeadline(time.Now().Add(30 * time.Second))
	if m, err := r.fe.Receive(); err != nil {
		t.Fatal(err)
	} else if _, ok := m.(*pgproto3.CopyInResponse); !ok {
		t.Fatalf("got %T, want CopyInResponse", m)
	}
}

// send writes messages, encoded, in one write.
func (r *rawConn) send(t testing.TB, msgs ...pgproto3.FrontendMessage) {
	t.Helper()
	var b []byte
	for _, m := range msgs {
		var err error
		if b, err = m.Encode(b); err != nil {
			t.Fatal(err)
		}
	}
	r.SetWriteDeadline(time.Now().Add(30 * time.Second))
	if _, err := r.Write(b); err != nil {
		t.Fatalf("write: %v", err)
	}
}

// untilReady reads up to the next ReadyForQuery and returns the messages'
// summaries: the type name, and for an ErrorResponse its SQLSTATE
// ("E:54000"), for ReadyForQuery its status ("Z:I").
func (r *rawConn) untilReady(t testing.TB) ([]string, []*pgproto3.ErrorResponse) {
	t.Helper()
	r.SetReadDeadline(time.Now().Add(30 * time.Second))
	var got []string
	var errs []*pgproto3.ErrorResponse
	for {
		m, err := r.fe.Receive()
		if err != nil {
			t.Fatalf("receive after %v: %v", got, err)
		}
		switch m := m.(type) {
		case *pgproto3.ErrorResponse:
			e := *m
			errs = append(errs, &e)
			got = append(got, "E:"+m.Code)
		case *pgproto3.ReadyForQuery:
			return append(got, "Z:"+string(m.TxStatus)), errs
		case *pgproto3.NoticeResponse, *pgproto3.ParameterStatus:
		default:
			got = append(got, strings.TrimPrefix(fmt.Sprintf("%T", m), "*pgproto3."))
		}
	}
}

// closedWith reads until the proxy closes the connection and returns the
// SQLSTATE of the last ErrorResponse before the end.
func (r *rawConn) closedWith(t testing.TB) string {
	t.Helper()
	r.SetReadDeadline(time.Now().Add(30 * time.Second))
	code := ""
	for {
		m, err := r.fe.Receive()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("connection still open (last error %q)", code)
			}
			return code
		}
		if e, ok := m.(*pgproto3.ErrorResponse); ok {
			code = e.Code
		}
	}
}

func want(t testing.TB, what string, got []string, wantS ...string) {
	t.Helper()
	if strings.Join(got, " ") != strings.Join(wantS, " ") {
		t.Fatalf("%s: got %v, want %v", what, got, wantS)
	}
}

// countRows counts t's rows on a direct connection to db.
func countRows(t testing.TB, db, table string) int {
	t.Helper()
	c, err := cluster.Primary.Connect(ctxT(t), db)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	var n int
	if err := c.QueryRow(ctxT(t), "SELECT count(*) FROM "+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// wantRows checks that table in db has n rows.
func wantRows(t testing.TB, db, table string, n int) {
	t.Helper()
	if got := countRows(t, db, table); got != n {
		t.Fatalf("%d rows in %s, want %d", got, table, n)
	}
}
