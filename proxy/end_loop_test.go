//go:build unix

package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"golang.org/x/sys/unix"
)

// TestShutdownFlushesClientBeforeReason pins an ordering rule of
// Session.end: what is still buffered for the client is passed on before
// the reason (57P01). A graceful shutdown ends a session at the
// ReadyForQuery of a query whose result the client has not read yet: the
// client must then read the whole result, its CommandComplete and
// ReadyForQuery, and the 57P01 last.
//
// The sizes make "buffered for the client" certain: the client's receive
// buffer and the proxy's send buffer to it are pinned small (together at
// most a few KiB of payload: the proxy's is autotuned up to megabytes
// otherwise), the first statement's result (~64 KiB) is larger than them
// and smaller than the session's buffer (256 KiB), so when the
// ReadyForQuery comes the proxy has read all of it and holds what the
// client's socket has not taken. The second statement waits on an
// advisory lock the test holds, so the shutdown is started before the
// ReadyForQuery is sent.
//
// That remainder (with and without the gate) is what the teardown's
// flushClient writes: the test waits until the session's end has taken
// the sockets (the relay let go) before the client reads a byte.
func TestShutdownFlushesClientBeforeReason(t *testing.T) {
	bothRelays(t, testShutdownFlushesClientBeforeReason)
}

const (
	endFlushRows  = 64   // rows of the first statement
	endFlushWidth = 1000 // bytes of each
	endFlushLock  = 4711 // the advisory lock the second statement waits on
)

func testShutdownFlushesClientBeforeReason(t *testing.T, mode Config) {
	p, db := relayed(t, mode, Config{BufferSize: 256 << 10})
	ctx := ctxT(t)
	admin, err := cluster.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "SELECT pg_advisory_lock($1)", endFlushLock); err != nil {
		t.Fatal(err)
	}

	c, pid := endFlushClient(t, p.dsn(db))
	endFlushPinSendBuffer(t, p)
	c.send(t, &pgproto3.Query{String: fmt.Sprintf(
		"SELECT repeat('x', %d) FROM generate_series(1, %d); SELECT pg_advisory_xact_lock(%d)",
		endFlushWidth, endFlushRows, endFlushLock)})
	// The backend has sent the first result and waits for the lock.
	endFlushBackend(t, admin, pid, "state = 'active' AND wait_event_type = 'Lock'", false)

	done := make(chan error, 1)
	go func() { done <- p.srv.Shutdown(ctx) }()
	pollFind(t, "draining", func() (bool, bool) { return true, p.srv.draining.Load() })
	if _, err := admin.Exec(ctx, "SELECT pg_advisory_unlock($1)", endFlushLock); err != nil {
		t.Fatal(err)
	}
	// The loop has read the ReadyForQuery (the query has finished
	// upstream) and handed the session to its end, which holds the
	// sockets now (letGo), the client still not reading. The client
	// reads at once: flushClient waits a bounded time for room.
	loopRelayWhere(t, p, "a session whose end has begun", func(r *relay) bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.closed
	})

	got := endFlushReadAll(t, c)
	wantS := []string{"RowDescription"}
	for range endFlushRows {
		wantS = append(wantS, fmt.Sprintf("DataRow:%d", endFlushWidth))
	}
	wantS = append(wantS,
		fmt.Sprintf("CommandComplete:SELECT %d", endFlushRows),
		"RowDescription", "DataRow:0", "CommandComplete:SELECT 1",
		"ReadyForQuery:I", "ErrorResponse:FATAL:57P01", "EOF")
	if strings.Join(got, "\n") != strings.Join(wantS, "\n") {
		t.Fatalf("the client read\n%s\nwant\n%s", endFlushSummary(got), endFlushSummary(wantS))
	}
	if err := <-done; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
}

// endFlushClient is a raw session through the proxy whose client socket
// has a small receive buffer (set before connect, so the window is
// small too), and its backend's pid.
func endFlushClient(t *testing.T, dsn string) (*rawConn, uint32) {
	t.Helper()
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, 4096)
		})
		return errors.Join(err, serr)
	}}
	cfg.DialFunc = d.DialContext
	pc := connectConfig(t, cfg)
	pid, err := strconvU32(lastValue(t, pc, "SELECT pg_backend_pid()"))
	if err != nil {
		t.Fatal(err)
	}
	return rawFrom(t, pc), pid
}

// endFlushPinSendBuffer pins the send buffer of the proxy's socket to
// the client of p's one session (on the loop: its duplicate of it).
func endFlushPinSendBuffer(t *testing.T, p *testProxy) {
	t.Helper()
	s := pollFind(t, "the session", func() (*Session, bool) {
		s := endFlushSession(p)
		return s, s != nil
	})
	s.connMu.Lock()
	defer s.connMu.Unlock()
	var err error
	if r := s.loopRelay; r != nil {
		err = unix.SetsockoptInt(r.clientFD, unix.SOL_SOCKET, unix.SO_SNDBUF, 4096)
	} else {
		err = s.client.(*net.TCPConn).SetWriteBuffer(4096)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// endFlushSession is p's one session, nil before it has one.
func endFlushSession(p *testProxy) *Session {
	p.srv.mu.Lock()
	defer p.srv.mu.Unlock()
	for _, s := range p.srv.conns {
		if s != nil {
			return s
		}
	}
	return nil
}

// endFlushBackend waits until pid's row in pg_stat_activity matches cond
// (or, with gone, until it has left).
func endFlushBackend(t *testing.T, admin *pgx.Conn, pid uint32, cond string, gone bool) {
	t.Helper()
	pollFind(t, fmt.Sprintf("backend %d with %s", pid, cond), func() (bool, bool) {
		var ok bool
		err := admin.QueryRow(ctxT(t), "SELECT coalesce((SELECT "+cond+
			" FROM pg_stat_activity WHERE pid = $1), $2)", int(pid), gone).Scan(&ok)
		if err != nil {
			t.Fatal(err)
		}
		return ok, ok
	})
}

// endFlushReadAll reads c until the proxy closes it: each message's
// summary (a DataRow with its first value's length, a CommandComplete
// with its tag, an ErrorResponse with its severity and SQLSTATE), then
// EOF.
func endFlushReadAll(t *testing.T, c *rawConn) []string {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	var got []string
	for {
		m, err := c.fe.Receive()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("connection still open after %s", endFlushSummary(got))
			}
			// pgproto3 reports the close as io.ErrUnexpectedEOF, at a
			// message boundary or not; what came before says which.
			if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
				return append(got, "EOF")
			}
			return append(got, "error: "+err.Error())
		}
		name := strings.TrimPrefix(fmt.Sprintf("%T", m), "*pgproto3.")
		switch m := m.(type) {
		case *pgproto3.DataRow:
			name += fmt.Sprintf(":%d", len(m.Values[0]))
		case *pgproto3.CommandComplete:
			name += ":" + string(m.CommandTag)
		case *pgproto3.ReadyForQuery:
			name += ":" + string(m.TxStatus)
		case *pgproto3.ErrorResponse:
			name += ":" + m.Severity + ":" + m.Code
		case *pgproto3.NoticeResponse, *pgproto3.ParameterStatus:
			continue
		}
		got = append(got, name)
	}
}

// endFlushSummary shortens a run of DataRows to one line with a count.
func endFlushSummary(ms []string) string {
	var b strings.Builder
	for i := 0; i < len(ms); {
		j := i
		for j < len(ms) && ms[j] == ms[i] {
			j++
		}
		if j-i > 1 {
			fmt.Fprintf(&b, "  %s ×%d\n", ms[i], j-i)
		} else {
			fmt.Fprintf(&b, "  %s\n", ms[i])
		}
		i = j
	}
	return b.String()
}
