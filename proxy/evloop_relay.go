package proxy

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"syscall"
	"time"

	"github.com/pgfence/pgfence/internal/wire"
)

// This file holds the event loop's pass-through relay (a session with no
// Handler): its two pipes, the bytes read, framing-checked (scan) and
// written on inline, the poller interest kept in step with the buffers,
// the end of the session on the loop (passEnd), and a client message
// over the limit, dropped as it arrives and answered in its place
// (limits.go), with the server's answer to it.

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

	// A message the relay does not pass on (limits.go): drop is how many
	// of its bytes are still to be dropped as they arrive, ins what goes
	// in its place. A client's message over the limit (overTyp, overTotal)
	// is answered by its substitute once it has been dropped, a server's
	// ErrorResponse answering a substitute is replaced by the proxy's
	// 54000. While ins waits, what was read after the message is not
	// scanned and the source is not read (stalled): ins goes out once
	// buf[start:end] has, then the scan goes on (flush).
	drop      int
	overTyp   byte
	overTotal int
	ins       []byte
	stalled   bool
}

// insWriter is a pass-through session's server writer on the loop
// (Session.sw): what the session writes upstream of its own, the
// substitute for a message over the limit (substituteOversized), goes
// to the ins of the pipe from the client (toServer), in the dropped
// message's place.
type insWriter struct{ p *pipe }

func (w insWriter) Write(b []byte) (int, error) {
	w.p.ins = append(w.p.ins, b...)
	return len(b), nil
}

// attach moves s onto the loop. It reports false, leaving s untouched,
// when s cannot be relayed there (the upstream already closed, or its
// sockets not taken: dupSockets). What s's framers had read already is
// the pipes' first bytes, scanned on the loop (kick).
func (l *evloop) attach(s *Session) (*relay, error) {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	clientFD, serverFD, read, err := dupSockets(s)
	if err != nil {
		return nil, err
	}
	// Out of Go's netpoller: only the loop waits on these sockets now.
	size := s.srv.cfg.BufferSize
	r := &relay{
		s: s, l: l, clientFD: clientFD, serverFD: serverFD,
		client:         takeSock(s.client, clientFD, nil, nil, nil),
		server:         takeSock(s.server, serverFD, nil, nil, nil),
		toServer:       pipe{buf: make([]byte, max(size, len(read.client))), fromClient: true, sc: wire.Scanner{Max: s.srv.cfg.MaxMessageSize, From: "client", Client: true}},
		toClient:       pipe{buf: make([]byte, max(size, len(read.server))), sc: wire.Scanner{From: "server"}},
		clientInterest: evIn | evRDHup,
		serverInterest: evIn | evRDHup,
		done:           make(chan error, 1),
	}
	r.toServer.src, r.toServer.dst = &r.client, &r.server
	r.toClient.src, r.toClient.dst = &r.server, &r.client
	r.toServer.heldBack = copy(r.toServer.buf, read.client)
	r.toClient.heldBack = copy(r.toClient.buf, read.server)
	s.sw.Reset(insWriter{&r.toServer})
	s.loopRelay = r
	l.publish(r, pollReg{clientFD, r.clientInterest}, pollReg{serverFD, r.serverInterest})
	if r.client.tls != nil || r.server.tls != nil || len(read.client) > 0 || len(read.server) > 0 {
		l.kick(r)
	}
	return r, nil
}

func (l *evloop) event(r *relay, fd int, ev uint32) {
	if r.intercept != nil {
		l.interceptEvent(r, fd, ev)
		return
	}
	var err error
	if fd == r.clientFD {
		r.clientEventCount.Add(1)
		if (r.toServer.held || r.toServer.stalled) && ev&(evHup|evErr) != 0 {
			err = fmt.Errorf("client: %w", io.EOF) // gone while not read (PAUSE, ins)
		}
		if err == nil && ev&evOut != 0 {
			err = r.flush(&r.toClient)
		}
		if err == nil && ev&readable != 0 {
			r.client.arm()
			err = r.pump(&r.toServer)
		}
	} else {
		if r.toClient.stalled && ev&(evHup|evErr) != 0 {
			err = fmt.Errorf("server: %w", io.EOF) // gone while not read (ins)
		}
		if err == nil && ev&evOut != 0 {
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
		if !in.held && !in.stalled { // PAUSE holds the client, or ins waits: do not read it
			e = evRDHup
			if in.end+in.heldBack < len(in.buf) {
				e |= evIn
			}
		}
		if out.start < out.end || len(out.ins) > 0 || out.dst.pending() {
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
	if p.held || p.stalled {
		return nil // PAUSE holds it, RESUME goes on (unhold); or flush goes on once ins has gone
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
	return r.passOn(p, n)
}

// passOn scans the n bytes just read into p and writes on what may go.
func (r *relay) passOn(p *pipe, n int) error {
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
	for p.src.more && !p.held && !p.stalled && (p.start > 0 || p.end+p.heldBack < len(p.buf)) {
		if err := r.pump(p); err != nil {
			return err
		}
	}
	return nil
}

// kick passes on, on the loop thread, what a session brought with it
// when it came onto the loop, for which no event comes: what its framers
// had read (in the pipes' heldBack, or still in the framers of an
// intercepted session) and what its tls.Conns hold.
func (l *evloop) kick(r *relay) {
	l.tasks.post(func() {
		l.onLoopThread(r, func() error {
			if r.intercept != nil {
				return l.kickIntercepted(r)
			}
			for _, p := range []*pipe{&r.toServer, &r.toClient} {
				if p.heldBack > 0 {
					if err := r.passOn(p, 0); err != nil {
						return err
					}
				}
				if err := r.pumpMore(p); err != nil {
					return err
				}
			}
			return l.interest(r)
		})
	})
}

// take scans the n bytes just read into p (after the heldBack bytes of a
// header held back, or not scanned yet) and passes on what scan accepts:
// p.end moves over it. A partial header at the end is held back. The
// bytes of a message not passed on (p.drop) are dropped from the buffer
// as they arrive; what goes in its place (p.ins) stalls the scan until
// flush has written it.
func (r *relay) take(p *pipe, n int) error {
	p.heldBack += n
	for {
		if p.drop > 0 {
			b := p.buf[p.end : p.end+p.heldBack]
			k := min(p.drop, len(b))
			copy(b, b[k:])
			p.heldBack -= k
			if p.drop -= k; p.drop > 0 {
				return nil
			}
			if p.overTotal > 0 {
				if err := r.answerOversized(p); err != nil {
					return err
				}
			}
		}
		if len(p.ins) > 0 {
			p.stalled = true
			return nil
		}
		b := p.buf[p.end : p.end+p.heldBack]
		cut, stop := r.scan(p, b)
		p.end += cut
		p.heldBack = len(b) - cut
		switch stop {
		case errSplice:
			continue // p.drop (and p.ins) set at cut
		case errHold:
			// The held message and what follows it wait in heldBack.
			p.held, stop = true, r.parkRelay()
		}
		return stop
	}
}

// answerOversized answers the client's message over the limit, now
// dropped, as an intercepted session does (clientStream.over): its
// substitute (substituteOversized) goes upstream in its place, into
// p.ins (insWriter).
func (r *relay) answerOversized(p *pipe) error {
	s := r.s
	typ, total := p.overTyp, p.overTotal
	p.overTyp, p.overTotal = 0, 0
	if err := s.substituteOversized(typ, total); err != nil {
		return err
	}
	s.releaseMessage(true)
	return s.sw.Flush()
}

// flush writes p's waiting bytes as far as the destination takes them.
// Once they have all gone, a stalled pipe's ins goes, and then the scan
// goes on with what was read after it (take), whose bytes are written
// too; the error that stops that scan, if any, is returned.
func (r *relay) flush(p *pipe) error {
	side := "client"
	if p.fromClient {
		side = "server"
	}
	var stop error
	for {
		n, err := p.dst.write(p.buf[p.start:p.end])
		p.start += n
		if err != nil {
			return fmt.Errorf("%s: %w", side, err)
		}
		if p.start < p.end {
			return stop
		}
		if p.heldBack > 0 {
			copy(p.buf, p.buf[p.end:p.end+p.heldBack])
		}
		p.start, p.end = 0, 0
		if !p.stalled || stop != nil {
			return stop
		}
		n, err = p.dst.write(p.ins)
		p.ins = p.ins[n:]
		if err != nil {
			return fmt.Errorf("%s: %w", side, err)
		}
		if len(p.ins) > 0 {
			return nil
		}
		p.ins, p.stalled = nil, false
		stop = r.take(p, 0)
	}
}

// errSplice stops scan at a message it does not pass on: p.drop (and
// p.ins, or the client's message over the limit) say what to do instead.
var errSplice = errors.New("message not passed on")

// scan walks the message boundaries in b, newly read into p (its
// scanner checks the framing as an intercepted session's framer does:
// FuzzScanner). It returns how many bytes of b to pass on and, when the
// session must end after them, why: a protocol error, the client's
// Terminate, the end of a graceful shutdown after a ReadyForQuery; or,
// with errSplice, that the message at the cut is not passed on: a client
// message over the limit, or a server's ErrorResponse to replace
// (oversizedError). A header not yet whole at the end of b is not passed
// on.
func (r *relay) scan(p *pipe, b []byte) (int, error) {
	s := r.s
	i := 0
	for {
		lim := len(b)
		if !p.fromClient && s.oversized.Load() {
			// An ErrorResponse may answer a substitute (limits.go), as an
			// intercepted session's server side checks: the scan goes
			// one message at a time.
			var stop error
			if lim, stop = r.serverError(p, b, i); lim < 0 {
				return i, stop
			}
		}
		at, ev := p.sc.Next(b[:lim], i)
		switch ev {
		case wire.More:
			if at == lim && lim < len(b) {
				i = at // the message ended at lim: the next one
				continue
			}
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
			// Dropped as it arrives, then answered (take): it counts as
			// in flight until then.
			p.drop, p.overTyp, p.overTotal = total, b[at], total
			return at, errSplice
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

// serverError is scan's step in a server's stream once the session has
// answered a message over the limit: it returns where the scan from i
// may go, the end of the message there (or of the rest of the body the
// scanner is in), or -1 when it stops at i: with nil, an ErrorResponse
// not yet whole, held back until it is; with errSplice, one answering a
// substitute, to be dropped, the proxy's own 54000 (p.ins) in its place.
// As for an intercepted session (Session.upstreamMessage), a message
// larger than the buffer is passed on as it is.
func (r *relay) serverError(p *pipe, b []byte, i int) (int, error) {
	if left, _ := p.sc.Rest(); left > 0 {
		return min(len(b), i+left), nil
	}
	if len(b)-i < headerLen {
		return len(b), nil
	}
	total := 1 + int(binary.BigEndian.Uint32(b[i+1:]))
	if b[i] == 'E' && total >= headerLen && total <= len(p.buf) {
		if len(b)-i < total {
			return -1, nil
		}
		msg := b[i : i+total]
		if rep := r.s.srv.oversizedError(msg); !bytes.Equal(rep, msg) {
			p.drop, p.ins = total, append(p.ins, rep...)
			return -1, errSplice
		}
	}
	return min(len(b), i+max(total, headerLen)), nil
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
	r.server.writeAll(r.toServer.ins, 100*time.Millisecond) // behind them (stalled)
	// The client's own Terminate was not passed on (scan): this one is
	// sent whatever ended the session.
	r.server.writeAll(wire.Terminate, 100*time.Millisecond)
	r.server.close(100 * time.Millisecond)
}

func (e passEnd) flushClient() {
	e.r.client.writeAll(e.r.toClient.buf[e.r.toClient.start:e.r.toClient.end], time.Second)
	e.r.client.writeAll(e.r.toClient.ins, time.Second)
}

func (e passEnd) closeClient() { e.r.client.close(time.Second) }
