//go:build unix

package proxy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/wire"
)

// FuzzLoopFraming: the event loop's pass-through relay (relay.take,
// scan and flush, around wire.Scanner: the rules themselves are
// FuzzScanner's), fed the input in arbitrary pieces, never panics and
// agrees with the goroutine path (Session.nextClient) reading the whole
// input: every complete valid message is passed on, in order, and a
// message over the limit of a type PostgreSQL answers is dropped and its
// substitute (limits.go) passed on in its place, up to the first message
// that ends the relay, of which nothing is passed on — a bad message
// (invalid length, unknown type, over the limit for a type that cannot
// be answered: a ProtocolError) or a Terminate. A header not yet whole at
// the end of the input is not passed on either: it is held back
// (pipe.heldBack) and scanned again with the next piece; nor is the
// substitute of a message over the limit not yet whole.
func FuzzLoopFraming(f *testing.F) {
	pipeline, _ := pgbenchExchange(2)
	f.Add(pipeline, []byte{3, 200, 7}, uint16(0))
	f.Add([]byte{'Q', 0, 0, 0, 9, 'S', 'E', 'L', 0, 'X', 0, 0, 0, 4, 'Q'}, []byte{1}, uint16(8))
	f.Add([]byte{'Q', 0xff, 0xff, 0xff, 0xff}, []byte{2, 2}, uint16(64))
	f.Add([]byte{'Q', 0, 0, 0, 5, 0, 'z', 0, 0, 0, 4}, []byte{}, uint16(0))
	f.Add([]byte{'S', 0, 0, 0, 4, 'P', 0, 0, 0, 40, 1, 2, 3}, []byte{6, 1}, uint16(16))
	f.Add([]byte{'S', 0, 0, 0, 4, 'E', 0, 0, 0, 40, 1, 2, 3}, []byte{0, 0, 0, 0, 0, 0}, uint16(16))
	f.Add(append(append([]byte{'Q', 0, 0, 0, 30}, make([]byte, 26)...), 'S', 0, 0, 0, 4, 'X', 0, 0, 0, 4), []byte{2, 9, 0, 30}, uint16(16))
	f.Fuzz(func(t *testing.T, in, cuts []byte, max uint16) {
		srv := &Server{oversizedTag: oversizedPrefix + "fuzz"}
		// Reference: the goroutine path's framer over the whole input.
		ref := &Session{srv: srv}
		ref.cf = wire.Framer{R: bufio.NewReaderSize(bytes.NewReader(in), 1024), Max: int(max), From: "client", Client: true}
		var want []byte
		var wantEnd error
		for off := 0; off < len(in); {
			typ, total, err := ref.nextClient()
			switch {
			case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
				// a partial header
			case err != nil:
				wantEnd = err
			case total-headerLen > int(max) && max > 0:
				if off+total <= len(in) {
					want = append(want, srv.substitute(typ, total-headerLen)...)
					ref.cf.Stream(io.Discard, total)
					off += total
					continue
				}
			case typ == 'X':
				wantEnd = errClientTerminate
			default:
				want = append(want, in[off:min(off+total, len(in))]...) // a short body: the input ends in it
				ref.cf.Stream(io.Discard, total)
				off += total
				continue
			}
			break
		}

		s := &Session{srv: srv}
		r := &relay{s: s}
		p := &r.toServer
		*p = pipe{fromClient: true, dst: &r.server, buf: make([]byte, len(in)+headerLen), sc: wire.Scanner{Max: int(max), From: "client", Client: true}}
		s.sw = bufio.NewWriter(insWriter{p})
		got, end := feedPipe(t, r, p, in, cuts)
		var pe *ProtocolError
		switch {
		case wantEnd == nil && end != nil:
			t.Fatalf("valid input: ended with %v", end)
		case errors.Is(wantEnd, errClientTerminate) && !errors.Is(end, errClientTerminate):
			t.Fatalf("Terminate: ended with %v", end)
		case errors.As(wantEnd, &pe) && !errors.As(end, &pe):
			t.Fatalf("bad message (%v): ended with %v, want a ProtocolError", wantEnd, end)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("passed on\n\t%q\nwant\n\t%q (the relay ends with %v)", got, want, wantEnd)
		}
	})
}

// feedPipe passes in through r's pipe p as the loop would read it, in
// pieces cut at cuts (none larger than the buffer's room), its
// destination one end of a socketpair read at the other; it returns what
// reached the destination and how the relay ended.
func feedPipe(t *testing.T, r *relay, p *pipe, in, cuts []byte) ([]byte, error) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fds[0])
	defer syscall.Close(fds[1])
	*p.dst = sock{fd: fds[0]}
	var got []byte
	read := func() {
		var b [4096]byte
		for {
			n, err := syscall.Read(fds[1], b[:])
			if n <= 0 || err != nil {
				return
			}
			got = append(got, b[:n]...)
		}
	}
	var end error
	for i, off := 0, 0; off < len(in) && end == nil; i++ {
		n := min(len(in)-off, len(p.buf)-p.end-p.heldBack)
		if i < len(cuts) {
			n = min(n, int(cuts[i])+1)
		}
		if n == 0 {
			t.Fatalf("no room in the buffer: %d bytes passed, %d held", p.end, p.heldBack)
		}
		copy(p.buf[p.end+p.heldBack:], in[off:off+n])
		off += n
		end = r.passOn(p, n)
		for end == nil && (p.start < p.end || p.stalled) { // the socket was full
			read()
			end = r.flush(p)
		}
		read()
	}
	return got, end
}

// interceptedRelay returns the relay of the only session of p whose server side
// is on the event loop (an intercepted session), once there is one.
func interceptedRelay(t *testing.T, p *testProxy) *relay {
	t.Helper()
	return loopRelayWhere(t, p, "an intercepted session", func(r *relay) bool { return r.intercept != nil })
}

// loopRelayWhere returns the loop relay of a session of p for which ok
// holds, once there is one; what names it in the failure.
func loopRelayWhere(t *testing.T, p *testProxy, what string, ok func(*relay) bool) *relay {
	t.Helper()
	return pollFind(t, what+" on the event loop", func() (*relay, bool) {
		for _, s := range p.srv.sessions() {
			if r := loopRelayNow(s); r != nil && ok(r) {
				return r, true
			}
		}
		return nil, false
	})
}

// loopRelayNow is s's relay on the event loop, nil before s is on it
// (once set, a session's loopRelay stays).
func loopRelayNow(s *Session) *relay {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	return s.loopRelay
}

// bigResult is a query whose result (20 MB) is far larger than the
// socket buffers and the session's buffer.
const bigResult = "SELECT repeat('x', 1000) FROM generate_series(1, 20000)"

// sendRaw writes a simple Query on c's socket behind pgconn's back.
func sendRaw(t *testing.T, c *pgconn.PgConn, sql string) {
	t.Helper()
	msg, err := (&pgproto3.Query{String: sql}).Encode(nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Conn().Write(msg); err != nil {
		t.Fatal(err)
	}
}

// TestInterceptLoopSlowClient: an intercepted session whose client does not
// read makes the loop stop reading that server (its buffer for the client
// is full) without holding up other sessions; once the client reads, it
// gets every row, in order, and the session goes on.
func TestInterceptLoopSlowClient(t *testing.T) {
	p := startProxy(t, Config{Interceptor: newGate(t), BufferSize: 4096})
	db := cluster.NewDatabase(t)
	ctx := ctxT(t)
	slow := connect(t, p.dsn(db))
	r := interceptedRelay(t, p)

	sendRaw(t, slow, bigResult)
	if err := pgtest.Poll(ctx, func() (bool, error) { return r.intercept.serverReadsPaused.Load(), nil }); err != nil {
		t.Fatalf("the loop never paused the server of a client that does not read: %v", err)
	}
	// Another session is served meanwhile.
	other := connect(t, p.dsn(db))
	wantValue(t, other, "SELECT 'other'", "other")

	rows := 0
	if err := receiveEach(slow, 30*time.Second, func(m pgproto3.BackendMessage) bool {
		switch m := m.(type) {
		case *pgproto3.DataRow:
			if len(m.Values) != 1 || len(m.Values[0]) != 1000 {
				t.Fatalf("row %d is %d values, %d bytes", rows, len(m.Values), len(m.Values[0]))
			}
			rows++
		case *pgproto3.ErrorResponse:
			t.Fatalf("error after %d rows: %s", rows, m.Message)
		case *pgproto3.ReadyForQuery:
			return false
		}
		return true
	}); err != nil {
		t.Fatalf("after %d rows: %v", rows, err)
	}
	if rows != 20000 {
		t.Fatalf("got %d rows, want 20000", rows)
	}
	if r.intercept.serverReadsPaused.Load() {
		t.Fatal("still paused after the client read everything")
	}
	wantValue(t, slow, "SELECT 'again'", "again")
}

// TestInterceptLoopShutdownWhilePaused: graceful shutdown ends an intercepted
// session stalled on a client that does not read (the loop is not waiting
// for that server, yet sees it closed), and Shutdown returns.
func TestInterceptLoopShutdownWhilePaused(t *testing.T) {
	p := startProxy(t, Config{Interceptor: newGate(t), BufferSize: 4096})
	db := cluster.NewDatabase(t)
	slow := connect(t, p.dsn(db))
	r := interceptedRelay(t, p)
	sendRaw(t, slow, bigResult)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return r.intercept.serverReadsPaused.Load(), nil }); err != nil {
		t.Fatalf("not paused: %v", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if err := p.srv.Shutdown(sctx); err == nil {
		t.Fatal("Shutdown reported no busy session; the paused session was mid-query")
	}
	// The client's socket ends (after whatever was on its way).
	slow.Conn().SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, slow.Conn()); err != nil {
		t.Fatalf("the paused session's client was not closed: %v", err)
	}
}

// panicky panics in ServerMessage on a row reading "boom".
type panicky struct{}

func (panicky) Open(s *Session) (Handler, error)                      { return panicky{}, nil }
func (panicky) Close(s *Session)                                      {}
func (panicky) ClientMessage(s *Session, msg []byte) (Verdict, error) { return Forward, nil }
func (panicky) ServerMessage(s *Session, msg []byte, req *Request) (Verdict, error) {
	if msg[0] == 'D' && strings.Contains(string(msg), "boom") {
		panic("boom")
	}
	return Forward, nil
}

// TestInterceptLoopHandlerPanic: a Handler that panics on the loop thread ends
// its own session only; the loop and the other sessions go on.
func TestInterceptLoopHandlerPanic(t *testing.T) {
	p, db, other, bad := panicSessions(t, panicky{})
	wantBoomEnds(t, bad)
	if p.srv.ops.stats.SessionsLoop.Load() != 2 {
		t.Fatalf("%d sessions on the loop, want 2", p.srv.ops.stats.SessionsLoop.Load())
	}
	wantOthersFine(t, p, db, other)
}

// panicSessions is a proxy with h, a Handler that panics at a query
// saying boom, and two sessions of one new database: other, and bad, the
// one to panic.
func panicSessions(t *testing.T, h Interceptor) (p *testProxy, db string, other, bad *pgconn.PgConn) {
	t.Helper()
	p = startProxy(t, Config{Interceptor: h})
	db = cluster.NewDatabase(t)
	return p, db, connect(t, p.dsn(db)), connect(t, p.dsn(db))
}

// wantBoomEnds sends bad the query that makes its Handler panic; it must
// get no answer.
func wantBoomEnds(t *testing.T, bad *pgconn.PgConn) {
	t.Helper()
	if _, err := bad.Exec(ctxT(t), "SELECT 'boom'").ReadAll(); err == nil {
		t.Fatal("the panicking session answered")
	}
}

// wantOthersFine checks that the panic of another session's Handler left
// p going: other, opened before it, and a session opened now answer.
func wantOthersFine(t *testing.T, p *testProxy, db string, other *pgconn.PgConn) {
	t.Helper()
	for _, c := range []*pgconn.PgConn{other, connect(t, p.dsn(db))} {
		wantValue(t, c, "SELECT 'fine'", "fine")
	}
}

// chunkReader hands out its input one chunk per "readable event", as the
// loop's server reader does: a chunk's bytes, then errWouldBlock until
// the next chunk is armed, then io.EOF after the last.
type chunkReader struct {
	in   []byte
	cuts []byte
	i    int // next chunk
	left []byte
}

func (c *chunkReader) arm() bool {
	if len(c.in) == 0 {
		return false
	}
	n := len(c.in)
	if c.i < len(c.cuts) {
		n = min(n, int(c.cuts[c.i])+1)
	}
	c.i++
	c.left, c.in = c.in[:n], c.in[n:]
	return true
}

func (c *chunkReader) Read(b []byte) (int, error) {
	if len(c.left) == 0 {
		if len(c.in) == 0 {
			return 0, io.EOF
		}
		return 0, errWouldBlock
	}
	n := copy(b, c.left)
	c.left = c.left[n:]
	return n, nil
}

// forwardAll is a Handler that lets every message through.
type forwardAll struct{}

func (forwardAll) Open(*Session) (Handler, error)                            { return forwardAll{}, nil }
func (forwardAll) Close(*Session)                                            {}
func (forwardAll) ClientMessage(*Session, []byte) (Verdict, error)           { return Forward, nil }
func (forwardAll) ServerMessage(*Session, []byte, *Request) (Verdict, error) { return Forward, nil }

// FuzzServerMessageResume: on the event loop the server side reads a
// non-blocking socket, so Session.serverMessage returns errWouldBlock
// whenever a message has not arrived whole and is called again when more
// has. Fed a valid server stream cut at arbitrary points, with a buffer
// smaller than some messages (which are passed on in pieces), it passes
// on every byte unchanged and in order, and tracks ReadyForQuery.
func FuzzServerMessageResume(f *testing.F) {
	f.Add([]byte{'D', 10, 'C', 3, 'Z', 1, 'T', 0}, []byte{0, 3, 1}, uint16(3000))
	f.Add([]byte{'Z', 0}, []byte{}, uint16(0))
	f.Add([]byte{'D', 200, 'D', 255, 'Z', 9}, []byte{4, 4, 255, 0, 7}, uint16(65535))
	f.Fuzz(func(t *testing.T, spec, cuts []byte, big uint16) {
		// Build a valid stream: pairs of (type, body length) from spec, a
		// ReadyForQuery with a status byte when the type is Z, and one
		// message of big bytes (larger than the buffer when big > 1024).
		var stream []byte
		msg := func(typ byte, n int) {
			stream = append(stream, typ, byte((n+4)>>24), byte((n+4)>>16), byte((n+4)>>8), byte(n+4))
			for k := range n {
				stream = append(stream, byte(k))
			}
		}
		rfq := 0
		for k := 0; k+1 < len(spec); k += 2 {
			switch typ := spec[k]; typ {
			case 'Z':
				stream = append(stream, 'Z', 0, 0, 0, 5, "ITE"[int(spec[k+1])%3])
				rfq++
			default:
				t := 'A' + typ%25 // A..Y: not Z, whose status byte is counted
				msg(t, int(spec[k+1]))
			}
		}
		msg('D', int(big))

		var out bytes.Buffer
		cr := &chunkReader{in: stream, cuts: cuts}
		s := &Session{srv: &Server{}, h: forwardAll{}, cw: &clientWriter{Writer: bufio.NewWriterSize(&out, 1024)}}
		s.sf = wire.Framer{R: bufio.NewReaderSize(cr, 1024), Flush: s.cw.Flush, From: "server"}
		var bm bigMessage
		cr.arm()
		for {
			err := s.serverMessage(&bm)
			if err == errWouldBlock {
				if !cr.arm() {
					t.Fatalf("would block with the whole stream read (%d bytes passed on of %d)", out.Len(), len(stream))
				}
				continue
			}
			if err != nil {
				if !errors.Is(err, io.EOF) {
					t.Fatalf("serverMessage: %v", err)
				}
				break
			}
		}
		s.cw.Flush()
		if !bytes.Equal(out.Bytes(), stream) {
			t.Fatalf("passed on %d bytes, want the %d of the stream unchanged", out.Len(), len(stream))
		}
		if got := -s.st.Pending(); got != int64(rfq) {
			t.Fatalf("counted %d ReadyForQuery, want %d", got, rfq)
		}
	})
}

// TestInterceptLoopInlineClient: a write gate session's client messages are
// handled on the loop itself, and a message that must wait (a write
// pipelined behind a SET that has not been answered) parks the client
// side there, in order, after which the client is read again; no client
// message is ever handled off the loop.
func TestInterceptLoopInlineClient(t *testing.T) {
	p := startProxy(t, Config{Interceptor: newGate(t)})
	db := cluster.NewDatabase(t)
	ctx := ctxT(t)
	c := connect(t, p.dsn(db))
	r := interceptedRelay(t, p)
	parks := &p.srv.ops.stats.ClientParks

	for _, sql := range []string{
		"CREATE TABLE t (v int)",
		"SET fence.step = 'a'",
		"BEGIN",
		"INSERT INTO t VALUES (1)",
		"COMMIT",
	} {
		if _, err := c.Exec(ctx, sql).ReadAll(); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	if n := parks.Load(); n != 0 {
		t.Fatalf("%d parks in lockstep; the gate never had to wait", n)
	}

	// Both queries in one write: the INSERT arrives before the SET has
	// even been sent, so the gate must wait for it (settle).
	sendQueries(t, c, "SET fence.step = 'b'", "INSERT INTO t VALUES (2)")
	tags := commandTags(t, c, 2)
	if strings.Join(tags, ",") != "SET,INSERT 0 1" {
		t.Fatalf("command tags %v, want [SET INSERT 0 1]", tags)
	}
	if n := parks.Load(); n != 1 {
		t.Fatalf("%d parks, want 1 (the pipelined INSERT)", n)
	}
	res, err := c.Exec(ctx, "SELECT count(*), current_setting('fence.step') FROM t").ReadAll()
	if err != nil || string(res[0].Rows[0][0]) != "2" || string(res[0].Rows[0][1]) != "b" {
		t.Fatalf("after the park: %v %v", res, err)
	}
	if n := parks.Load(); n != 1 {
		t.Fatalf("%d parks after the client was read again, want still 1", n)
	}
	if n := r.s.offLoop.Load(); n != 0 {
		t.Fatalf("%d client messages handled off the loop, want 0", n)
	}
}

// TestInterceptLoopSlowServer: when the upstream does not read (its backend
// waits for a lock) the loop keeps what the server socket cannot take and
// stops reading that client, without holding up other sessions; once the
// lock goes, every query runs, in order, the pipeline's last write (for
// which the gate must park the client side) included.
func TestInterceptLoopSlowServer(t *testing.T) {
	p, db, holder, c, r := lockedGateSession(t)
	ctx := ctxT(t)

	// More than the sockets between the proxy and the backend hold
	// (a few MB on loopback): about 12 MB of queries behind the lock.
	const n = 12000
	pad := strings.Repeat("x", 1000)
	raw, _ := (&pgproto3.Query{String: "SELECT pg_advisory_lock(42)"}).Encode(nil)
	for i := 1; i <= n; i++ {
		raw, _ = (&pgproto3.Query{String: fmt.Sprintf("SELECT %d, '%s'", i, pad)}).Encode(raw)
	}
	for _, sql := range []string{"SET fence.step = 'z'", "INSERT INTO t VALUES (1)"} {
		raw, _ = (&pgproto3.Query{String: sql}).Encode(raw)
	}
	werr := make(chan error, 1)
	go func() { _, err := c.Conn().Write(raw); werr <- err }()
	if err := pgtest.Poll(ctx, func() (bool, error) { return r.intercept.clientReadsPaused.Load(), nil }); err != nil {
		t.Fatalf("the loop never held a client whose server does not read: %v", err)
	}
	// While held, the client's socket is not watched: its unread bytes
	// must not wake the loop again and again (a level-triggered watch
	// left on would). Another session's round trips pass meanwhile.
	if d := clientEventsMeanwhile(t, p, db, r); d > 0 || !r.intercept.clientReadsPaused.Load() {
		t.Errorf("while the client was held (%v): %d events for its socket, want 0", r.intercept.clientReadsPaused.Load(), d)
	}
	mustExec(t, holder, "SELECT pg_advisory_unlock(42)")

	fe := pgproto3.NewFrontend(c.Conn(), c.Conn())
	c.Conn().SetReadDeadline(time.Now().Add(60 * time.Second))
	next := 0 // the lock's row first, then 1..n
	var tags []string
	for rfq := 0; rfq <= n+2; {
		m, err := fe.Receive()
		if err != nil {
			t.Fatalf("after row %d: %v", next, err)
		}
		switch m := m.(type) {
		case *pgproto3.CommandComplete:
			if rfq > n {
				tags = append(tags, string(m.CommandTag))
			}
		case *pgproto3.DataRow:
			if rfq > 0 {
				if got := string(m.Values[0]); got != strconv.Itoa(next) {
					t.Fatalf("row %q after row %d", got, next-1)
				}
			}
			next++
		case *pgproto3.ErrorResponse:
			t.Fatalf("error after row %d: %s", next, m.Message)
		case *pgproto3.ReadyForQuery:
			rfq++
		}
	}
	c.Conn().SetReadDeadline(time.Time{})
	if err := <-werr; err != nil {
		t.Fatal(err)
	}
	if next != n+1 {
		t.Fatalf("got %d rows, want %d", next, n+1)
	}
	if strings.Join(tags, ",") != "SET,INSERT 0 1" {
		t.Fatalf("the pipeline ended with %v, want [SET INSERT 0 1]", tags)
	}
	if n := r.intercept.parks.Load(); n != 1 {
		t.Fatalf("%d parks, want 1 (the INSERT behind the SET)", n)
	}
	if n := r.s.offLoop.Load(); n != 0 {
		t.Fatalf("%d client messages handled off the loop, want 0", n)
	}
	if r.intercept.clientReadsPaused.Load() {
		t.Fatal("still holding the client after the server took everything")
	}
	wantValue(t, c, "SELECT 'again'", "again")
}

// TestInterceptLoopParkUnwatched: while a session's client side is parked (a
// write waits for an answer held up by a lock), the loop does not watch
// the client's socket for reading: bytes the client sends meanwhile must
// not wake the loop again and again (a level-triggered watch left on
// would). Once the lock goes, everything is answered in order, on the
// loop, and the client is read again.
func TestInterceptLoopParkUnwatched(t *testing.T) {
	p, db, holder, c, r := lockedGateSession(t)
	ctx := ctxT(t)
	// The INSERT must wait for the SET's answer, which waits behind the
	// lock: the client side parks.
	sendQueries(t, c, "SELECT pg_advisory_lock(42)", "SET fence.step = 'b'", "INSERT INTO t VALUES (1)")
	if err := pgtest.Poll(ctx, func() (bool, error) { return r.intercept.parks.Load() == 1, nil }); err != nil {
		t.Fatalf("the client side never parked: %v", err)
	}
	// More bytes from the client, which nobody reads until the lock goes.
	sendQueries(t, c, "SELECT 'after'")
	if d := clientEventsMeanwhile(t, p, db, r); d > 0 {
		t.Errorf("while parked: %d events for the client's socket, want 0", d)
	}
	mustExec(t, holder, "SELECT pg_advisory_unlock(42)")
	wantTags(t, c, 4, "SELECT 1,SET,INSERT 0 1,SELECT 1")
	wantValue(t, c, "SELECT 'again'", "again")
	if n := r.intercept.parks.Load(); n != 1 {
		t.Fatalf("%d parks, want 1", n)
	}
	if n := r.s.offLoop.Load(); n != 0 {
		t.Fatalf("%d client messages handled off the loop, want 0", n)
	}
}

// TestLoopClientWaitsForServerPending: the loop handles no client
// message while bytes for the server wait in serverPending (they would
// be passed by the next message's, or a parked wait would stand behind
// its own request unsent): it pauses the client instead.
func TestLoopClientWaitsForServerPending(t *testing.T) {
	s := &Session{onLoop: true}
	s.cf.R = bufio.NewReaderSize(strings.NewReader(string(wire.Terminate)), 64)
	r := &relay{s: s, intercept: &interceptState{serverPending: []byte("Q"), clientSize: 64}}
	if err := r.clientSteps(); err != errPaused {
		t.Errorf("client steps with %d bytes in serverPending: %v, want errPaused", len(r.intercept.serverPending), err)
	}
	if s.cf.R.Buffered() != 0 {
		t.Errorf("%d bytes of the client's read with serverPending full, want none", s.cf.R.Buffered())
	}
}

// TestInterceptLoopCopyFrom: a COPY FROM STDIN the gate leaves alone (an
// unprotected table, no gated transaction) is relayed on the loop
// without a park; one into a protected table is gated, which waits for
// its CopyInResponse and its end, so the client side parks (on the loop:
// no message off it), and commits with its receipt. Both with psql's way
// (the data after CopyInResponse).
func TestInterceptLoopCopyFrom(t *testing.T) {
	e := newFenceEnv(t)
	ctx := ctxT(t)
	l := e.acquire(t, "copyjob", "a", time.Minute)
	w := e.worker(t, &l)
	parks := &e.proxy.srv.ops.stats.ClientParks
	r := interceptedRelay(t, e.proxy)

	tag, err := w.PgConn().CopyFrom(ctx, strings.NewReader("one\ntwo\n"), "COPY audit (note) FROM STDIN")
	if err != nil || tag.RowsAffected() != 2 {
		t.Fatalf("COPY into the unprotected table: %v %v", tag, err)
	}
	if n := parks.Load(); n != 0 {
		t.Fatalf("%d parks for a COPY the gate leaves alone, want 0", n)
	}
	tag, err = w.PgConn().CopyFrom(ctx, strings.NewReader(fmt.Sprintf("copyjob\tcopied\t%d\n", l.Token)), "COPY results (job_key, payload, token) FROM STDIN")
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("COPY into the protected table: %v %v", tag, err)
	}
	if n := parks.Load(); n < 1 {
		t.Fatal("the gated COPY never parked the client side, want it to wait for its CopyInResponse")
	}
	if n := r.s.offLoop.Load(); n != 0 {
		t.Fatalf("%d client messages handled off the loop, want 0", n)
	}
	if n := e.count(t, "SELECT count(*) FROM fence.receipts WHERE job_key = 'copyjob'"); n != 1 {
		t.Fatalf("%d receipts for the gated COPY, want 1", n)
	}
	if n := e.count(t, "SELECT count(*) FROM audit"); n != 2 {
		t.Fatalf("%d audit rows, want 2", n)
	}
}

// sendQueries writes simple queries to c's socket in one write, without
// waiting for their answers (a pipeline, as some clients send).
func sendQueries(t *testing.T, c *pgconn.PgConn, sqls ...string) {
	t.Helper()
	var raw []byte
	for _, sql := range sqls {
		raw, _ = (&pgproto3.Query{String: sql}).Encode(raw)
	}
	if _, err := c.Conn().Write(raw); err != nil {
		t.Fatal(err)
	}
}

// wantTags fails t unless the command tags of c's next n queries, joined
// by commas, are want.
func wantTags(t *testing.T, c *pgconn.PgConn, n int, want string) {
	t.Helper()
	if got := strings.Join(commandTags(t, c, n), ","); got != want {
		t.Fatalf("command tags %s, want %s", got, want)
	}
}

// commandTags reads c's answers up to the n-th ReadyForQuery and returns
// their command tags; an ErrorResponse fails the test.
func commandTags(t *testing.T, c *pgconn.PgConn, n int) []string {
	t.Helper()
	var tags []string
	rfq := 0
	if err := receiveEach(c, 30*time.Second, func(m pgproto3.BackendMessage) bool {
		switch m := m.(type) {
		case *pgproto3.CommandComplete:
			tags = append(tags, string(m.CommandTag))
		case *pgproto3.ErrorResponse:
			t.Fatalf("error after %v: %s", tags, m.Message)
		case *pgproto3.ReadyForQuery:
			rfq++
		}
		return rfq < n
	}); err != nil {
		t.Fatalf("after %v: %v", tags, err)
	}
	return tags
}

// receiveEach reads c's answers as raw messages, handing each to f (valid
// only during the call) until f returns false, with a read deadline of d
// from now, reset at the end. It returns Receive's error, which ends it
// too.
func receiveEach(c *pgconn.PgConn, d time.Duration, f func(pgproto3.BackendMessage) bool) error {
	fe := pgproto3.NewFrontend(c.Conn(), c.Conn())
	c.Conn().SetReadDeadline(time.Now().Add(d))
	defer c.Conn().SetReadDeadline(time.Time{})
	for {
		m, err := fe.Receive()
		if err != nil {
			return err
		}
		if !f(m) {
			return nil
		}
	}
}

// lockedGateSession starts a proxy with the write gate and a session
// through it on the loop (c, relayed by r) in a new database db with a
// table t; holder, a direct connection, holds advisory lock 42.
func lockedGateSession(t *testing.T) (p *testProxy, db string, holder, c *pgconn.PgConn, r *relay) {
	t.Helper()
	p = startProxy(t, Config{Interceptor: newGate(t)})
	db = cluster.NewDatabase(t)
	holder = connect(t, cluster.Primary.DSN(db))
	mustExec(t, holder, "SELECT pg_advisory_lock(42)")
	c = connect(t, p.dsn(db))
	r = interceptedRelay(t, p)
	mustExec(t, c, "CREATE TABLE t (v int)")
	return p, db, holder, c, r
}

// clientEventsMeanwhile runs 20 round trips of another session through p
// and returns how many events the loop had for r's client socket
// meanwhile.
func clientEventsMeanwhile(t *testing.T, p *testProxy, db string, r *relay) uint64 {
	t.Helper()
	events := r.intercept.clientEventCount.Load()
	other := connect(t, p.dsn(db))
	for range 20 {
		wantValue(t, other, "SELECT 'other'", "other")
	}
	return r.intercept.clientEventCount.Load() - events
}

// TestLoopPerServer: each Server relays its sessions on a loop of its
// own, and Shutdown stops it (its thread ends, its descriptors closed)
// while another Server's loop goes on.
func TestLoopPerServer(t *testing.T) {
	db := cluster.NewDatabase(t)
	relayOf := func(p *testProxy) *relay {
		t.Helper()
		return loopRelayWhere(t, p, "session", func(*relay) bool { return true })
	}
	p1, p2 := startProxy(t, Config{}), startProxy(t, Config{})
	c1, c2 := connect(t, p1.dsn(db)), connect(t, p2.dsn(db))
	wantValue(t, c1, "SELECT 'one'", "one")
	wantValue(t, c2, "SELECT 'two'", "two")
	r1, r2 := relayOf(p1), relayOf(p2)
	if r1.l == nil || r1.l == r2.l {
		t.Fatalf("the two servers' sessions are on loops %p and %p, want two loops", r1.l, r2.l)
	}
	c1.Close(ctxT(t))
	if err := p1.srv.Shutdown(ctxT(t)); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	select {
	case <-r1.l.done:
	default:
		t.Fatal("Shutdown returned with its loop still running")
	}
	if _, err := p1.srv.loop.get(); !errors.Is(err, errLoopStopped) {
		t.Errorf("the loop after Shutdown: %v, want errLoopStopped", err)
	}
	wantValue(t, c2, "SELECT 'still'", "still")
	if l, err := p2.srv.loop.get(); err != nil || l != r2.l {
		t.Errorf("the other server's loop: %p, %v; want %p", l, err, r2.l)
	}
}
