//go:build unix

package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/pgfence/pgfence/internal/wire"
)

// This file holds the event loop's pass-through relay (a session with no
// Handler): its two pipes, the bytes read, framing-checked (scan) and
// written on inline, the poller interest kept in step with the buffers,
// the end of the session on the loop (passEnd), and leaveLoop, which
// moves a session onto goroutines for a message over the limit.

// pipe is one direction of a relay: bytes read from src wait in
// buf[start:end] until written to dst. Its scanner tracks message framing
// across reads without copying (wire.Scanner); a header split between
// reads is held back in buf[end:end+heldBack], not passed on, until it is
// whole, so that a message the loop must not pass on (see scan) never
// leaves a piece behind it.
type pipe struct {
	src, dst   *sock
	buf        []byte
	start, end int
	heldBack   int
	sc         wire.Scanner
	fromClient bool
	// held: PAUSE holds the client's next message (admin_pause_loop.go):
	// it and what follows wait in heldBack, not passed on, and the source
	// is not read.
	held bool
}

// attach moves s onto the loop. It reports false, leaving s untouched,
// when s cannot be relayed there (TLS not over our transport, bytes already
// buffered by the goroutine path, or the upstream already closed).
func (l *evloop) attach(s *Session) (*relay, bool) {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	clientFD, serverFD, ok := dupSockets(s)
	if !ok {
		return nil, false
	}
	// Out of Go's netpoller: only the loop waits on these sockets now.
	size := s.srv.cfg.BufferSize
	r := &relay{
		s: s, l: l, clientFD: clientFD, serverFD: serverFD,
		client:         takeSock(s.client, clientFD, nil, nil, nil),
		server:         takeSock(s.server, serverFD, nil, nil, nil),
		toServer:       pipe{buf: make([]byte, size), fromClient: true, sc: wire.Scanner{Max: s.srv.cfg.MaxMessageSize, From: "client", Client: true}},
		toClient:       pipe{buf: make([]byte, size), sc: wire.Scanner{From: "server"}},
		clientInterest: evIn | evRDHup,
		serverInterest: evIn | evRDHup,
		done:           make(chan error, 1),
	}
	r.toServer.src, r.toServer.dst = &r.client, &r.server
	r.toClient.src, r.toClient.dst = &r.server, &r.client
	s.loopRelay = r
	l.publish(r, pollReg{clientFD, r.clientInterest}, pollReg{serverFD, r.serverInterest})
	if r.client.tls != nil || r.server.tls != nil {
		l.kickTLS(r)
	}
	return r, true
}

func (l *evloop) event(r *relay, fd int, ev uint32) {
	if r.intercept != nil {
		l.interceptEvent(r, fd, ev)
		return
	}
	var err error
	if fd == r.clientFD {
		r.clientEventCount.Add(1)
		if r.toServer.held && ev&(evHup|evErr) != 0 {
			err = fmt.Errorf("client: %w", io.EOF) // gone while PAUSE held it
		}
		if err == nil && ev&evOut != 0 {
			err = r.flush(&r.toClient)
		}
		if err == nil && ev&readable != 0 {
			r.client.arm()
			err = r.pump(&r.toServer)
		}
	} else {
		if ev&evOut != 0 {
			err = r.flush(&r.toServer)
		}
		if err == nil && ev&readable != 0 {
			r.server.arm()
			err = r.pump(&r.toClient)
		}
	}
	if err == nil {
		err = r.pumpMore(&r.toServer)
	}
	if err == nil {
		err = r.pumpMore(&r.toClient)
	}
	if err == nil {
		err = l.interest(r)
	}
	if err != nil {
		l.end(r, err)
	}
}

// interest keeps the poller registration in step with the buffers: read a
// side only while its pipe has room, wait for writability only while
// bytes wait for that side. On the common path nothing changes.
func (l *evloop) interest(r *relay) error {
	want := func(in *pipe, out *pipe) uint32 {
		var e uint32
		if !in.held { // PAUSE holds the client: do not read it
			e = evRDHup
			if in.end+in.heldBack < len(in.buf) {
				e |= evIn
			}
		}
		if out.start < out.end || out.dst.pending() {
			e |= evOut
		}
		return e
	}
	if e := want(&r.toServer, &r.toClient); e != r.clientInterest {
		if err := l.p.modify(r.clientFD, e); err != nil {
			return err
		}
		r.clientInterest = e
	}
	if e := want(&r.toClient, &r.toServer); e != r.serverInterest {
		if err := l.p.modify(r.serverFD, e); err != nil {
			return err
		}
		r.serverInterest = e
	}
	return nil
}

// pump reads what p's source has, checks its framing and writes it on.
func (r *relay) pump(p *pipe) error {
	if p.held {
		return nil // PAUSE holds it; RESUME goes on (unhold)
	}
	if p.end+p.heldBack == len(p.buf) && p.start > 0 {
		copy(p.buf, p.buf[p.start:p.end+p.heldBack])
		p.end -= p.start
		p.start = 0
	}
	if p.end+p.heldBack == len(p.buf) {
		return nil // full: the destination is slow; evOut resumes us
	}
	n, err := p.src.read(p.buf[p.end+p.heldBack:])
	if err == syscall.EAGAIN || err == syscall.EINTR {
		return nil
	}
	side := "server"
	if p.fromClient {
		side = "client"
	}
	if err != nil {
		return fmt.Errorf("%s: %w", side, err)
	}
	if n == 0 {
		return fmt.Errorf("%s: %w", side, io.EOF)
	}
	r.counted(p, n) // SHOW STATS: admin_pause_loop.go
	stop := r.take(p, n)
	if err := r.flush(p); err != nil {
		return err
	}
	return stop
}

// pumpMore reads what p's TLS source's tls.Conn still holds (sock.more),
// for which no event comes, while p has room: the socket is not read
// again (its next bytes come with an event), so this ends.
func (r *relay) pumpMore(p *pipe) error {
	for p.src.more && !p.held && (p.start > 0 || p.end+p.heldBack < len(p.buf)) {
		if err := r.pump(p); err != nil {
			return err
		}
	}
	return nil
}

// kickTLS reads, on the loop thread, what a session's tls.Conns held
// when it came onto the loop: no event comes for it.
func (l *evloop) kickTLS(r *relay) {
	l.tasks.post(func() {
		l.onLoopThread(r, func() error {
			if r.intercept != nil {
				return l.kickIntercepted(r)
			}
			if err := r.pumpMore(&r.toServer); err != nil {
				return err
			}
			if err := r.pumpMore(&r.toClient); err != nil {
				return err
			}
			return l.interest(r)
		})
	})
}

// take scans the n bytes just read into p (after the heldBack bytes of a
// header held back) and passes on what scan accepts. A partial header at
// the end is held back; from a message the session must leave the loop
// for, everything is kept in r.rest.
func (r *relay) take(p *pipe, n int) error {
	b := p.buf[p.end : p.end+p.heldBack+n]
	cut, stop := r.scan(p, b)
	p.end += cut
	p.heldBack = len(b) - cut
	switch stop {
	case errLeaveLoop:
		r.rest = append(r.rest[:0], b[cut:]...)
		p.heldBack = 0
	case errHold:
		// The held message and what follows it wait in heldBack.
		p.held, stop = true, r.parkRelay()
	}
	return stop
}

// flush writes p's waiting bytes as far as the destination takes them.
func (r *relay) flush(p *pipe) error {
	n, err := p.dst.write(p.buf[p.start:p.end])
	p.start += n
	if err != nil {
		side := "client"
		if p.fromClient {
			side = "server"
		}
		return fmt.Errorf("%s: %w", side, err)
	}
	if p.start == p.end {
		if p.heldBack > 0 {
			copy(p.buf, p.buf[p.end:p.end+p.heldBack])
		}
		p.start, p.end = 0, 0
	}
	return nil
}

// errLeaveLoop ends a pass-through relay at a client message over the
// limit: answering it needs the goroutine path (limits.go), to which the
// session moves (leaveLoop).
var errLeaveLoop = errors.New("client message over the limit: leaving the event loop")

// scan walks the message boundaries in b, newly read into p (its
// scanner checks the framing as the goroutine path's framer does:
// FuzzScanner). It returns how many bytes of b to pass on and, when the
// session must end after them, why: a protocol error, the client's
// Terminate, the end of a graceful shutdown after a ReadyForQuery, or a
// client message over the limit (errLeaveLoop). A header not yet whole at
// the end of b is not passed on.
func (r *relay) scan(p *pipe, b []byte) (int, error) {
	s := r.s
	i := 0
	for {
		at, ev := p.sc.Next(b, i)
		switch ev {
		case wire.More:
			return at, nil
		case wire.Bad:
			return at, fmt.Errorf("server: %w", p.sc.Err())
		case wire.Ready:
			if s.ready(b[at-1]) {
				return at, errShutdown
			}
			i = at
			continue
		}
		// A client message begins (PAUSE: admin_pause.go): it counts as
		// in flight from here until it is accounted.
		if s.holdMessage(b[at]) {
			return at, errHold
		}
		total, ev := p.sc.Check(b, at)
		switch ev {
		case wire.Oversized:
			s.releaseMessage(false) // handled again, on the goroutine path
			return at, errLeaveLoop
		case wire.Bad:
			return at, fmt.Errorf("client: %w", p.sc.Err())
		}
		typ := b[at]
		if !s.account(typ) {
			return at, errShutdown
		}
		s.releaseMessage(true)
		if typ == 'X' {
			// Not passed on: passEnd sends the server a Terminate of its
			// own (whatever length the client's claimed).
			return at, errClientTerminate
		}
		i = p.sc.Enter(b, at, total)
	}
}

// passEnd is the end of a pass-through session on the loop (Session.end),
// on the session goroutine once the loop has let go of r: both sides
// have already stopped, so stop and wait have nothing to do.
type passEnd struct{ relayEnd }

func (passEnd) stop()       {}
func (passEnd) wait() error { return nil }

func (e passEnd) endServer() {
	r := e.r.letGo()
	r.server.writeAll(r.toServer.buf[r.toServer.start:r.toServer.end], 100*time.Millisecond)
	// The client's own Terminate was not passed on (scan): this one is
	// sent whatever ended the session.
	r.server.writeAll(wire.Terminate, 100*time.Millisecond)
	r.server.close(100 * time.Millisecond)
}

func (e passEnd) flushClient() {
	e.r.client.writeAll(e.r.toClient.buf[e.r.toClient.start:e.r.toClient.end], time.Second)
}

func (e passEnd) closeClient() { e.r.client.close(time.Second) }

// leaveLoop moves a pass-through session, which the loop has let go of,
// onto the goroutine path: its sockets back into Go's netpoller, what the
// loop read and had not passed on in front of them, and where the server
// stream stands for the server loop (resumeServer).
func (s *Session) leaveLoop(r *relay) error {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	client, err := fdConn(r.clientFD)
	if err != nil {
		return fmt.Errorf("leave the event loop: %w", err)
	}
	server, err := fdConn(r.serverFD)
	if err != nil {
		client.Close()
		return fmt.Errorf("leave the event loop: %w", err)
	}
	r.letGo() // the relay's own descriptors are closed
	toServer, toClient := &r.toServer, &r.toClient
	if r.client.tls != nil {
		r.client.leave(client) // its tls.Conn stays the session's
		client = s.client
	}
	if r.server.tls != nil {
		r.server.leave(server)
		server = s.server
	}
	s.loopRelay, s.client, s.server = nil, client, server
	s.cf.R.Reset(io.MultiReader(bytes.NewReader(r.rest), client))
	s.sf.R.Reset(io.MultiReader(bytes.NewReader(toClient.buf[toClient.end:toClient.end+toClient.heldBack]), server))
	s.sw.Reset(server)
	s.cw.Reset(client)
	s.sw.Write(toServer.buf[toServer.start:toServer.end])
	s.cw.Write(toClient.buf[toClient.start:toClient.end])
	s.resume.left, s.resume.status = toClient.sc.Rest()
	return nil
}

// fdConn makes a net.Conn of a duplicate of fd, and closes fd.
func fdConn(fd int) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), "")
	defer f.Close()
	return net.FileConn(f)
}
