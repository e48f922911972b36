//go:build linux

package proxy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/wire"
)

// The tests of this file check that every session starts on the event
// loop and stays there: a message over the limit is answered there, a
// query sent with the end of the startup is read there, and a connection
// that is not a socket is bridged to it.

// passRelay returns the relay of the only pass-through session of p on
// the event loop, once there is one.
func passRelay(t *testing.T, p *testProxy) *relay {
	t.Helper()
	return loopRelayWhere(t, p, "a pass-through session", func(r *relay) bool { return r.intercept == nil })
}

// wantAllOnLoop checks that every session p has opened came onto its
// event loop, and that those still open are on it now.
func wantAllOnLoop(t *testing.T, p *testProxy) {
	t.Helper()
	st := &p.srv.ops.stats
	if looped, total := st.SessionsLoop.Load(), st.SessionsTotal.Load(); looped != total || total == 0 {
		t.Fatalf("%d of %d sessions on the event loop, want all", looped, total)
	}
	for _, s := range p.srv.sessions() {
		if loopRelayNow(s) == nil {
			t.Fatalf("session of backend %d is not on the event loop", s.BackendPID)
		}
	}
}

// TestLoopOversizeStays: a pass-through session answers a message over
// the limit on the loop and stays there (it used to leave the loop for
// goroutines, which answered it): a message far larger than the buffer
// and the socket buffers is dropped as it arrives, its 54000 comes in its
// place, and the session goes on, on the loop; so does one whose
// substitute must wait behind megabytes the server has not read yet
// (pipelined behind a statement that waits for a lock), in its place.
func TestLoopOversizeStays(t *testing.T) {
	const limit = 1 << 20
	p, db := relayed(t, Config{}, Config{MaxMessageSize: limit, BufferSize: 4096})
	setup := connect(t, p.dsn(db))
	mustExec(t, setup, "CREATE TABLE t (a int)")

	t.Run("large", func(t *testing.T) {
		r := rawConnect(t, p.dsn(db))
		passRelay(t, p)
		big := strings.Repeat("x", 16<<20) // 16 times the limit
		r.send(t, &pgproto3.Query{String: "SELECT '" + big + "'"}, &pgproto3.Query{String: "SELECT 'after'"})
		got, errs := r.untilReady(t)
		want(t, "oversized query", got, "E:54000", "Z:I")
		if !strings.Contains(errs[0].Message, "max_message_size") {
			t.Fatalf("error %q does not name max_message_size", errs[0].Message)
		}
		got, _ = r.untilReady(t)
		want(t, "the query after", got, "RowDescription", "DataRow", "CommandComplete", "Z:I")
		wantAllOnLoop(t, p)
		if n := p.srv.mem.peak.Load(); n != 0 {
			t.Fatalf("the oversized message took %d bytes of the memory budget", n)
		}
	})

	t.Run("behind_unread_bytes", func(t *testing.T) {
		holder := connect(t, p.dsn(db))
		mustExec(t, holder, "BEGIN; LOCK TABLE t")
		r := rawConnect(t, p.dsn(db))
		passRelay(t, p)
		// The INSERT waits for the lock: its backend reads nothing of
		// what follows, which fills the socket buffers and the relay's
		// pipe before the message over the limit comes.
		msgs := []pgproto3.FrontendMessage{&pgproto3.Query{String: "INSERT INTO t VALUES (1)"}}
		filler := "SELECT length('" + strings.Repeat("y", limit-100) + "')"
		const fillers = 24 // 24 MB
		for range fillers {
			msgs = append(msgs, &pgproto3.Query{String: filler})
		}
		msgs = append(msgs, &pgproto3.Query{String: "SELECT '" + strings.Repeat("z", limit) + "'"}, &pgproto3.Query{String: "SELECT 'after'"})
		sent := make(chan struct{})
		go func() {
			defer close(sent)
			var b []byte
			for _, m := range msgs {
				b, _ = m.Encode(b)
			}
			r.SetWriteDeadline(time.Now().Add(60 * time.Second))
			r.Write(b)
		}()
		pollFind(t, "INSERT waiting for the lock", func() (bool, bool) {
			res := setup.ExecParams(ctxT(t), "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO t%'", nil, nil, nil, nil).Read()
			if res.Err != nil {
				t.Fatal(res.Err)
			}
			return true, string(res.Rows[0][0]) == "1"
		})
		mustExec(t, holder, "COMMIT")
		got, _ := r.untilReady(t)
		want(t, "the INSERT", got, "CommandComplete", "Z:I")
		for i := range fillers {
			got, _ = r.untilReady(t)
			want(t, fmt.Sprintf("filler %d", i), got, "RowDescription", "DataRow", "CommandComplete", "Z:I")
		}
		got, _ = r.untilReady(t)
		want(t, "the oversized query in its place", got, "E:54000", "Z:I")
		got, _ = r.untilReady(t)
		want(t, "the query after", got, "RowDescription", "DataRow", "CommandComplete", "Z:I")
		<-sent
		wantAllOnLoop(t, p)
	})
}

// TestRelayInsWaits: the substitute of a message over the limit goes in
// its place when the server's socket cannot take what comes before it:
// the relay stops scanning at the message (stalled), does not read the
// client meanwhile, and goes on once the socket has room, in order.
func TestRelayInsWaits(t *testing.T) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fds[0])
	defer syscall.Close(fds[1])
	srv := &Server{oversizedTag: oversizedPrefix + "test"}
	s := &Session{srv: srv}
	r := &relay{s: s, server: sock{fd: fds[0]}}
	p := &r.toServer
	*p = pipe{fromClient: true, dst: &r.server, buf: make([]byte, 64<<10), sc: wire.Scanner{Max: 1000, From: "client", Client: true}}
	s.sw = bufio.NewWriter(insWriter{p})

	// Fill the socket, so that nothing more goes.
	var filled int
	for {
		n, err := writeAvail(fds[0], make([]byte, 4096))
		filled += n
		if err != nil {
			t.Fatal(err)
		}
		if n < 4096 {
			break
		}
	}
	query := func(sql string) []byte { b, _ := (&pgproto3.Query{String: sql}).Encode(nil); return b }
	before, after := query("SELECT 'before'"), query("SELECT 'after'")
	over := query("SELECT '" + strings.Repeat("x", 2000) + "'")
	in := append(append(append([]byte(nil), before...), over...), after...)
	copy(p.buf, in)
	if err := r.passOn(p, len(in)); err != nil {
		t.Fatal(err)
	}
	if !p.stalled || p.end != len(before) || p.heldBack != len(after) {
		t.Fatalf("stalled %v, %d bytes to pass on and %d held, want stalled at the substitute behind %d bytes with %d held", p.stalled, p.end, p.heldBack, len(before), len(after))
	}
	if r.pump(p) != nil || !p.stalled {
		t.Fatal("a stalled pipe read its source")
	}
	// The server reads: what waited goes, in order.
	var got []byte
	for p.stalled || p.start < p.end {
		var b [64 << 10]byte
		n, _ := syscall.Read(fds[1], b[:])
		if n > 0 {
			got = append(got, b[:n]...)
		}
		if err := r.flush(p); err != nil {
			t.Fatal(err)
		}
	}
	for {
		var b [64 << 10]byte
		n, _ := syscall.Read(fds[1], b[:])
		if n <= 0 {
			break
		}
		got = append(got, b[:n]...)
	}
	got = got[filled:]
	want := append(append(append([]byte(nil), before...), srv.substitute('Q', len(over)-headerLen)...), after...)
	if !bytes.Equal(got, want) {
		t.Fatalf("passed on\n\t%q\nwant\n\t%q", got, want)
	}
}

// TestLoopEarlyQuery: a query sent in the same write as the end of the
// client's startup (its startup message with auth trust, its last SCRAM
// message with auth scram) is still in the socket when the session
// comes onto the loop, which reads it there: nothing was read ahead.
func TestLoopEarlyQuery(t *testing.T) {
	t.Run("trust", func(t *testing.T) {
		p, db := relayed(t, Config{}, Config{})
		c := rawStart(t, p.addr.String())
		c.send(t, &pgproto3.StartupMessage{ProtocolVersion: pgproto3.ProtocolVersionNumber,
			Parameters: map[string]string{"user": "postgres", "database": db}}, &pgproto3.Query{String: "SELECT 'early'"})
		if got, _ := c.untilReady(t); got[len(got)-1] != "Z:I" {
			t.Fatalf("startup: got %q, want ReadyForQuery last", got)
		}
		got, _ := c.untilReady(t)
		want(t, "the early query", got, "RowDescription", "DataRow", "CommandComplete", "Z:I")
		passRelay(t, p)
		wantAllOnLoop(t, p)
	})
	t.Run("scram", func(t *testing.T) {
		p, db := relayed(t, Config{}, scramConfig(t))
		cfg, err := pgconn.ParseConfig(fmt.Sprintf("postgres://%s:%s@%s/%s?sslmode=disable", scramUser, strings.ReplaceAll(scramPassword, " ", "%20"), p.addr, db))
		if err != nil {
			t.Fatal(err)
		}
		early, _ := (&pgproto3.Query{String: "SELECT 'early'"}).Encode(nil)
		cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			return &earlyConn{Conn: c, early: early}, err
		}
		c := connectConfig(t, cfg)
		hj := hijack(t, c)
		fe := hj.Frontend // it may have read part of the answer already
		hj.Conn.SetReadDeadline(time.Now().Add(30 * time.Second))
		var got []string
		for {
			m, err := fe.Receive()
			if err != nil {
				t.Fatalf("after %q: %v", got, err)
			}
			got = append(got, strings.TrimPrefix(fmt.Sprintf("%T", m), "*pgproto3."))
			if _, ok := m.(*pgproto3.ReadyForQuery); ok {
				break
			}
		}
		want(t, "the early query", got, "RowDescription", "DataRow", "CommandComplete", "ReadyForQuery")
		passRelay(t, p)
		wantAllOnLoop(t, p)
	})
}

// earlyConn writes early in the same write as the client's last SCRAM
// message (its second 'p').
type earlyConn struct {
	net.Conn
	early []byte
	ps    int
}

func (c *earlyConn) Write(b []byte) (int, error) {
	if len(b) > 0 && b[0] == 'p' {
		if c.ps++; c.ps == 2 {
			if _, err := c.Conn.Write(append(append([]byte(nil), b...), c.early...)); err != nil {
				return 0, err
			}
			return len(b), nil
		}
	}
	return c.Conn.Write(b)
}

// wrappedListener yields its connections wrapped in a type of its own,
// which hides their socket (as golang.org/x/net/netutil.LimitListener's
// do).
type wrappedListener struct{ net.Listener }

type wrappedConn struct{ net.Conn }

func (l wrappedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return wrappedConn{c}, nil
}

// pipeListener yields the server ends of net.Pipes, dialed by dial.
type pipeListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newPipeListener() *pipeListener {
	return &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error { l.once.Do(func() { close(l.done) }); return nil }

func (l *pipeListener) Addr() net.Addr { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)} }

func (l *pipeListener) dial(ctx context.Context, _, _ string) (net.Conn, error) {
	c, s := net.Pipe()
	select {
	case l.conns <- s:
		return c, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// TestLoopBridged: a connection that is not a socket, from a custom
// net.Listener given to Serve (one that wraps its sockets, one of
// net.Pipes), is bridged to the event loop: its session is relayed
// there, with a pass-through or the gate, a 20 MB result and a message
// over the limit included, and ends there when its client goes (its
// backend exits).
func TestLoopBridged(t *testing.T) {
	for _, tc := range []struct {
		name string
		gate bool
		pipe bool
	}{{"wrapped", false, false}, {"wrapped_gate", true, false}, {"pipe", false, true}, {"pipe_gate", true, true}} {
		t.Run(tc.name, func(t *testing.T) {
			// A pipe has no loopback address: trust must be allowed for it.
			cfg := Config{Primary: cluster.Primary.DSN("postgres"), Auth: AuthTrust, AllowRemoteTrust: tc.pipe, MaxMessageSize: 1 << 20}
			if tc.gate {
				cfg.Interceptor = newGate(t)
			}
			srv, err := New(cfg, zaptest.NewLogger(t))
			if err != nil {
				t.Fatal(err)
			}
			var ln net.Listener
			var dial func(ctx context.Context, network, addr string) (net.Conn, error)
			if tc.pipe {
				pl := newPipeListener()
				ln, dial = pl, pl.dial
			} else {
				tl, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				ln = wrappedListener{tl}
			}
			done := make(chan error, 1)
			go func() { done <- srv.Serve(context.Background(), ln) }()
			p := &testProxy{srv: srv, addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 5432}}
			if a, ok := ln.Addr().(*net.TCPAddr); ok && !tc.pipe {
				p.addr = a
			}
			t.Cleanup(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				srv.Shutdown(ctx)
				<-done
			})
			db := cluster.NewDatabase(t)
			pc, err := pgconn.ParseConfig(p.dsn(db))
			if err != nil {
				t.Fatal(err)
			}
			if dial != nil {
				pc.DialFunc = dial
			}
			c := connectConfig(t, pc)
			wantValue(t, c, "SELECT 'bridged'", "bridged")
			res, err := c.Exec(ctxT(t), bigResult).ReadAll()
			if err != nil || len(res[0].Rows) != 20000 {
				t.Fatalf("the big result: %d rows, %v", len(res[0].Rows), err)
			}
			if _, err := c.Exec(ctxT(t), "SELECT '"+strings.Repeat("x", 2<<20)+"'").ReadAll(); !strings.Contains(fmt.Sprint(err), "54000") {
				t.Fatalf("a query over the limit: %v, want 54000", err)
			}
			wantValue(t, c, "SELECT 'after'", "after")
			wantAllOnLoop(t, p)
			pid := c.PID()
			c.Close(ctxT(t))
			direct := connect(t, cluster.Primary.DSN(db))
			if err := pgtest.Poll(ctxT(t), func() (bool, error) {
				res := direct.ExecParams(ctxT(t), "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", [][]byte{[]byte(fmt.Sprint(pid))}, nil, nil, nil).Read()
				if res.Err != nil {
					return false, res.Err
				}
				return string(res.Rows[0][0]) == "0", nil
			}); err != nil {
				t.Fatalf("the backend of a bridged session whose client closed is still there: %v", err)
			}
		})
	}
}

// TestLoopTakesFramed: what a session's framers have read and not
// handled when it comes onto the loop (a whole message and part of the
// next, each way) is passed on by the loop first, in front of what it
// reads, framed as the rest: the session is not refused the loop for it.
func TestLoopTakesFramed(t *testing.T) {
	p := startProxy(t, Config{})
	l, err := p.srv.loop.get()
	if err != nil {
		t.Fatal(err)
	}
	client, clientSide := tcpPair(t) // the client, and the proxy's socket for it
	server, serverSide := tcpPair(t) // the backend, and the proxy's socket for it
	size := p.srv.cfg.BufferSize
	s := &Session{srv: p.srv, log: zaptest.NewLogger(t), client: clientSide, backend: backend{server: serverSide}, closing: make(chan struct{})}
	s.cw = newClientWriter(clientSide, size, false)
	s.sw = bufio.NewWriterSize(serverSide, size)
	s.cf = wire.Framer{R: bufio.NewReaderSize(clientSide, size), Max: p.srv.cfg.MaxMessageSize, From: "client", Client: true}
	s.sf = wire.Framer{R: bufio.NewReaderSize(serverSide, size), From: "server"}

	q1, _ := (&pgproto3.Query{String: "SELECT 1"}).Encode(nil)
	q2, _ := (&pgproto3.Query{String: "SELECT 2"}).Encode(nil)
	z, _ := (&pgproto3.ReadyForQuery{TxStatus: 'I'}).Encode(nil)
	c1, _ := (&pgproto3.CommandComplete{CommandTag: []byte("SELECT 1")}).Encode(nil)
	// The framers read a message and 3 bytes of the next, each way.
	client.Write(append(append([]byte(nil), q1...), q2[:3]...))
	server.Write(append(append([]byte(nil), c1...), z[:3]...))
	if _, err := s.cf.R.Peek(len(q1) + 3); err != nil {
		t.Fatal(err)
	}
	if _, err := s.sf.R.Peek(len(c1) + 3); err != nil {
		t.Fatal(err)
	}
	r, err := l.attach(s)
	if err != nil {
		t.Fatalf("a session whose framers had read bytes was refused the loop: %v", err)
	}
	client.Write(q2[3:])
	server.Write(z[3:])
	read := func(c net.Conn, n int) []byte {
		b := make([]byte, n)
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(c, b); err != nil {
			t.Fatal(err)
		}
		return b
	}
	if got, want := read(server, len(q1)+len(q2)), append(append([]byte(nil), q1...), q2...); !bytes.Equal(got, want) {
		t.Fatalf("the server got %q, want %q", got, want)
	}
	if got, want := read(client, len(c1)+len(z)), append(append([]byte(nil), c1...), z...); !bytes.Equal(got, want) {
		t.Fatalf("the client got %q, want %q", got, want)
	}
	client.Close()
	if err := <-r.done; !errors.Is(err, io.EOF) {
		t.Fatalf("the relay ended with %v, want the client's end", err)
	}
	r.letGo()
	syscall.Close(r.clientFD)
	syscall.Close(r.serverFD)
}

// FuzzLoopServerErrors: once a session has answered a message over the
// limit, the pass-through relay's server side (scan, serverError, take,
// flush), fed the server's stream in arbitrary pieces, passes on what
// the goroutine path's server side (Session.upstreamMessage) does: every
// message as it is, but an ErrorResponse that answers a substitute,
// which the proxy's 54000 replaces (oversizedError); an ErrorResponse
// larger than the buffer as it is. It stops at a bad header, and passes
// on no part of an ErrorResponse that fits the buffer before it is
// whole.
func FuzzLoopServerErrors(f *testing.F) {
	srv := &Server{oversizedTag: oversizedPrefix + "fuzz", cfg: Config{MaxMessageSize: 1000}}
	ours, _ := (&pgproto3.ErrorResponse{Severity: "ERROR", Code: "26000", Message: `prepared statement "` + srv.oversizedTag + `_Q_5000" does not exist`}).Encode(nil)
	theirs, _ := (&pgproto3.ErrorResponse{Severity: "ERROR", Code: "42P01", Message: "relation does not exist"}).Encode(nil)
	z, _ := (&pgproto3.ReadyForQuery{TxStatus: 'I'}).Encode(nil)
	f.Add(append(append(append(append([]byte(nil), theirs...), z...), ours...), z...), []byte{3, 40, 1, 0}, uint8(0))
	f.Add(append(append([]byte(nil), ours...), 'D', 0, 0, 1, 0), []byte{200}, uint8(60))
	f.Add(append(append([]byte(nil), ours...), z...), []byte{10, 0, 2}, uint8(40)) // ours in pieces

	f.Fuzz(func(t *testing.T, in, cuts []byte, extra uint8) {
		size := 64 + int(extra)
		// Reference: whole messages, as the goroutine path reads them.
		var want []byte
		var wantBad bool
		fr := &wire.Framer{R: bufio.NewReaderSize(bytes.NewReader(in), 64), From: "server"}
		for off := 0; off < len(in); {
			typ, total, err := fr.Next()
			if err != nil {
				var pe *ProtocolError
				wantBad = errors.As(err, &pe)
				break
			}
			errFits := typ == 'E' && total <= size
			if off+total > len(in) { // the input ends in it
				if !errFits {
					want = append(want, in[off:]...)
				}
				break
			}
			msg := in[off : off+total]
			if errFits {
				msg = srv.oversizedError(msg)
			}
			want = append(want, msg...)
			fr.Stream(io.Discard, total)
			off += total
		}

		s := &Session{srv: srv}
		s.oversized.Store(true)
		r := &relay{s: s}
		p := &r.toClient
		*p = pipe{dst: &r.client, buf: make([]byte, size), sc: wire.Scanner{From: "server"}}
		got, end := feedPipe(t, r, p, in, cuts)
		if wantBad != (end != nil) {
			t.Fatalf("ended with %v, want a bad header: %v", end, wantBad)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("passed on\n\t%q\nwant\n\t%q", got, want)
		}
	})
}
