//go:build linux

package proxy

import (
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"
)

// This file holds the event loop's half of an intercepted session (one
// with a Handler): its state (interceptState), the readers and writers
// the session's framers and writers use once its sockets are the loop's,
// the loop's handling of its events, and the hand-off of its client side
// between the loop and the client goroutine.

// An intercepted session (one with a Handler) is relayed on the loop too,
// message by message rather than byte by byte. Its server side never
// blocks: the loop reads the server, frames it, calls the Handler's
// ServerMessage and writes to the client inline (Session.serverMessage,
// the same code as the server goroutine). Its client side may block (a
// Handler may wait for the answer to an earlier request), so it has a
// goroutine, but a LoopClient Handler's messages are handled on the loop
// as well (clientInline) until one must wait: that one (ErrWait) and
// those after it go to the goroutine (interceptClient), which gives the
// client back to the loop once its socket is empty. A Handler that is not a
// LoopClient keeps its client side on the goroutine for good
// (Session.clientLoop). Both sockets leave Go's netpoller: the goroutine
// reads the client itself and, when it must wait for bytes, re-arms the
// loop's one-shot watch (clientReader); the loop wakes it and yields at
// once, so it runs on the loop's own thread instead of waking another (on
// a small VM a thread's wake-up costs tens of microseconds). The goroutine
// writes the server itself, blocking; the loop never blocks: what a socket
// does not take waits (clientPending for the client, serverPending for
// the server) and the other side is not read until it has gone.
//
// The Handler's ServerMessage runs on the loop thread, so it must not
// block (fenceSession's holds its mutex only for short bookkeeping); a
// panic in either handler ends that session only.

// interceptState is the loop's state for an intercepted session.
type interceptState struct {
	big                bigMessage
	serverReadArmed    bool   // the server socket may be read (once) in this event
	clientPending      []byte // bytes for the client its socket has not taken yet
	serverInterest     uint32 // epoll interest registered for the server socket
	clientWriteWatched bool   // the client socket is registered (for EPOLLOUT)
	// serverReadsPaused: the server is not read until the client takes
	// what waits in clientPending (for observation: tests).
	serverReadsPaused atomic.Bool

	// The client's reads: clientReadFD, another duplicate of the client
	// socket, is watched one-shot for the client goroutine, which the
	// loop wakes through clientReady (and runs on its own thread: see
	// run); stop ends a wait at the session's end.
	clientReadFD int
	clientReady  chan struct{}
	stop         chan struct{}

	// A LoopClient Handler's client messages are handled on the loop
	// too (clientInline), until one must wait: then it and what follows
	// go to the client goroutine (clientWork), which hands the client back
	// when the socket is empty. clientOnGoroutine says who has the client
	// side now; its atomic store and load order the hand-back.
	inlineClient      bool        // a LoopClient: fixed when attached
	clientOnGoroutine atomic.Bool // true: the client goroutine; false: the loop
	clientReadArmed   bool        // the loop may read the client (once) in this event
	// clientLevelTriggered: clientReadFD is watched level-triggered
	// (clientLevel), as it is while the loop owns the client side and
	// reads it; otherwise one-shot. Only the loop thread (or
	// attachIntercepted, before the loop can see the session) reads or
	// writes it.
	clientLevelTriggered bool
	// clientEventCount counts the loop's events for clientReadFD (for
	// observation: a watch left armed while the client is not read would
	// spin).
	clientEventCount atomic.Uint64
	blockingRead     bool   // client goroutine: wait for the client's bytes
	serverPending    []byte // bytes for the server its socket has not taken yet (inline)
	// clientReadsPaused: the client is not read until the server takes
	// serverPending (for observation: tests).
	clientReadsPaused atomic.Bool
	clientWork        chan struct{}

	// replica is the session's replica connection while the loop reads
	// it (evloop_replica_linux.go). Loop thread only.
	replica *loopReplica
}

// errHandoff ends clientSteps on the loop: the next message must be
// handled on the client goroutine. errPaused ends it while the server
// has not taken what waits in serverPending.
var (
	errHandoff = errors.New("client message handed to the client goroutine")
	errPaused  = errors.New("client paused until the server takes what waits")
)

// clientReader is the client framer's reader once the client socket has
// left Go's netpoller: the client goroutine reads the socket itself and,
// when it is empty, re-arms the loop's one-shot watch and waits for it.
type clientReader struct {
	l *evloop
	r *relay
}

func (cr clientReader) Read(b []byte) (int, error) {
	ic := cr.r.intercept
	if cr.r.s.onLoop {
		return armedRead(ic.clientReadFD, &ic.clientReadArmed, b) // as loopServerReader
	}
	for {
		ready := true // the goroutine reads whenever it is asked to
		n, err := armedRead(ic.clientReadFD, &ready, b)
		if err != errWouldBlock || !ic.blockingRead {
			return n, err // errWouldBlock between messages: back to the loop
		}
		if err := cr.l.ctl(syscall.EPOLL_CTL_MOD, ic.clientReadFD, clientWatch); err != nil {
			return 0, err
		}
		select {
		case <-ic.clientReady:
		case <-ic.stop:
			return 0, errSessionClosing
		}
	}
}

// The loop's interest in an intercepted session's client reads.
// clientLevel is level-triggered: while the loop owns the client side
// it stays registered, so a message costs no epoll_ctl (re-arming a
// one-shot watch per message cost CPU: docs/proxy.md, Performance).
// clientWatch is one-shot: the client goroutine arms it when
// it must wait for bytes, and it arms it once to hand the client back.
// clientOff disarms the reads (a hang-up is still reported, once) while
// the goroutine owns the client or the loop must not read it (paused).
const (
	clientLevel = syscall.EPOLLIN | syscall.EPOLLRDHUP
	clientWatch = syscall.EPOLLIN | syscall.EPOLLRDHUP | syscall.EPOLLONESHOT
	clientOff   = syscall.EPOLLONESHOT
)

// loopServerReader is the server framer's reader on the loop: one read per
// readable event, errWouldBlock otherwise.
type loopServerReader struct{ r *relay }

func (lr loopServerReader) Read(b []byte) (int, error) {
	return armedRead(lr.r.serverFD, &lr.r.intercept.serverReadArmed, b)
}

// armedRead reads the non-blocking socket fd once if *armed (the loop
// saw it readable in this event), disarming it; otherwise, or when it
// has nothing, it returns errWouldBlock.
func armedRead(fd int, armed *bool, b []byte) (int, error) {
	if !*armed {
		return 0, errWouldBlock
	}
	*armed = false
	n, err := rawIO(syscall.SYS_READ, fd, b)
	switch {
	case err == syscall.EAGAIN || err == syscall.EINTR:
		return 0, errWouldBlock
	case err != nil:
		return 0, err
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

// loopClientWriter is the client writer's destination on the loop: it writes
// what the socket takes and keeps the rest in clientPending, never
// blocking.
type loopClientWriter struct{ r *relay }

func (lw loopClientWriter) Write(b []byte) (int, error) {
	if err := writeOrHold(lw.r.clientFD, &lw.r.intercept.clientPending, b); err != nil {
		return 0, err
	}
	return len(b), nil
}

// writeOrHold writes b to the non-blocking socket fd as far as it takes
// it and appends the rest to *held; while bytes are held it writes
// nothing, so they keep their order.
func writeOrHold(fd int, held *[]byte, b []byte) error {
	if len(*held) == 0 {
		k, err := writeAvail(fd, b)
		if err != nil {
			return err
		}
		b = b[k:]
	}
	*held = append(*held, b...)
	return nil
}

// serverWriter is the client goroutine's writer to the server once the
// server socket has left Go's netpoller: it writes what the socket takes
// and, when it is full, waits for room in poll(2), as a blocking system
// call (releasing its P).
type serverWriter struct{ r *relay }

func (sw serverWriter) Write(b []byte) (int, error) {
	if sw.r.s.onLoop {
		// On the loop: what the socket does not take waits in serverPending,
		// and the client is not read until it has gone.
		if err := writeOrHold(sw.r.serverFD, &sw.r.intercept.serverPending, b); err != nil {
			return 0, err
		}
		return len(b), nil
	}
	return pollWrite(sw.r.serverFD, b)
}

// attachIntercepted moves an intercepted session s onto the loop (its client
// side too, for a LoopClient Handler). It reports false, leaving s
// untouched, when it cannot (TLS, or bytes already buffered).
func (l *evloop) attachIntercepted(s *Session) (*relay, bool) {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	clientFD, serverFD, ok := dupSockets(s)
	if !ok {
		return nil, false
	}
	clientReadFD, err := syscall.Dup(clientFD)
	if err != nil {
		syscall.Close(clientFD)
		syscall.Close(serverFD)
		return nil, false
	}
	syscall.CloseOnExec(clientReadFD)
	r := &relay{
		s: s, l: l, clientFD: clientFD, serverFD: serverFD,
		intercept: &interceptState{serverInterest: syscall.EPOLLIN | syscall.EPOLLRDHUP, clientReadFD: clientReadFD,
			clientReady: make(chan struct{}, 1), stop: make(chan struct{}), clientWork: make(chan struct{}, 1)},
		done: make(chan error, 1),
	}
	// Both sockets leave Go's netpoller, or every response would wake it
	// as well as the loop. The client goroutine reads the client
	// (clientReader) and writes the server (serverWriter); the loop reads
	// the server and writes the client; all through the duplicates.
	s.server.Close()
	s.client.Close()
	s.cf.R.Reset(clientReader{l, r})
	s.sf.R.Reset(loopServerReader{r})
	s.cw.Reset(loopClientWriter{r})
	s.sw.Reset(serverWriter{r})
	s.loopRelay = r
	clientInterest := uint32(clientWatch)
	// With read routing the client side stays on the goroutine: routing
	// decisions wait (routeWait, evloop_replica_linux.go).
	if lc, ok := s.h.(LoopClient); ok && lc.LoopClient() && s.srv.rs == nil {
		r.intercept.inlineClient = true
		r.intercept.clientLevelTriggered = true
		clientInterest = clientLevel
	} else {
		// The client side is the goroutine's for good, and it waits.
		r.intercept.clientOnGoroutine.Store(true)
		r.intercept.blockingRead = true
	}
	// The client's writes are watched only while clientPending holds bytes.
	return l.publish(r, epollReg{clientReadFD, clientInterest}, epollReg{serverFD, r.intercept.serverInterest})
}

// interceptEvent handles an event of an intercepted session: the server
// socket is readable (or closed), or the client socket has room for what
// waits in clientPending.
func (l *evloop) interceptEvent(r *relay, fd int, ev uint32) {
	err := func() (err error) {
		defer func() {
			if p := recover(); p != nil {
				r.s.log.Error("panic in session", zap.String("side", "server"), zap.Any("panic", p), zap.ByteString("stack", debug.Stack()))
				err = fmt.Errorf("server loop panic: %v", p)
			}
		}()
		ic := r.intercept
		if lr := ic.replica; lr != nil && fd == lr.fd {
			return l.replicaEvent(r, ev) // evloop_replica_linux.go
		}
		if fd == ic.clientReadFD {
			ic.clientEventCount.Add(1)
			if !ic.clientOnGoroutine.Load() {
				ic.clientReadArmed = true
				err := l.clientInline(r)
				ic.clientReadArmed = false
				return err
			}
			select {
			case ic.clientReady <- struct{}{}:
			default:
			}
			l.wokeGoroutine = true
			return nil
		}
		if fd == r.serverFD && ev&syscall.EPOLLOUT != 0 {
			if err := drainHeld(r.serverFD, &ic.serverPending, r.s.cf.R.Size()); err != nil {
				return fmt.Errorf("server: %w", err)
			}
			if len(ic.serverPending) == 0 && !ic.clientOnGoroutine.Load() {
				// Go on with the client's messages held meanwhile.
				if err := l.clientInline(r); err != nil {
					return err
				}
			}
			if ev&readable == 0 {
				return nil
			}
		}
		if fd == r.clientFD {
			if err := drainHeld(r.clientFD, &ic.clientPending, r.s.sf.R.Size()); err != nil {
				return fmt.Errorf("client: %w", err)
			}
			if len(ic.clientPending) >= r.s.sf.R.Size() {
				return nil
			}
			return l.upstreamSteps(r) // messages held while clientPending was full
		}
		ic.serverReadArmed = true
		// The server closed (or shutdown closed it): take what is left
		// even if the client is slow, so the end is seen.
		if err := r.serverSteps(ev&(syscall.EPOLLRDHUP|syscall.EPOLLHUP|syscall.EPOLLERR) != 0); err != nil {
			return err
		}
		return l.replicaSteps(r, false) // the replica's held while the primary's message was in pieces
	}()
	if err == nil {
		err = l.interceptInterest(r)
	}
	if err != nil {
		l.end(r, err)
	}
}

// clientInline handles the client messages that have arrived on the loop
// (a LoopClient Handler), until the client has no more, the server has
// no room for more, or one must wait: that one goes to the client
// goroutine.
func (l *evloop) clientInline(r *relay) error {
	s, ic := r.s, r.intercept
	s.onLoop = true
	err := func() error {
		defer func() { s.onLoop = false }() // a Handler's panic too
		return r.clientSteps()
	}()
	switch err {
	case errWouldBlock:
		if len(ic.serverPending) > 0 {
			// Read on once the server has taken it (interceptEvent).
			return l.watchClient(r, false)
		}
		return l.watchClient(r, true)
	case errPaused:
		return l.watchClient(r, false)
	case errHold:
		return l.parkIntercepted(r) // admin_pause_linux.go
	case errHandoff:
		// The goroutine reads the client now and arms the one-shot
		// watch itself when it must wait.
		if err := l.watchClient(r, false); err != nil {
			return err
		}
		s.srv.ops.stats.ClientHandoffs.Add(1)
		ic.clientOnGoroutine.Store(true)
		ic.clientWork <- struct{}{}
		l.wokeGoroutine = true
		return nil
	}
	return err
}

// watchClient makes the loop's watch of an intercepted session's client
// level-triggered (reads on) or disarmed (reads off), changing the
// registration only when it differs. Loop thread only.
func (l *evloop) watchClient(r *relay, on bool) error {
	ic := r.intercept
	if ic.clientLevelTriggered == on {
		return nil
	}
	ev := uint32(clientOff)
	if on {
		ev = clientLevel
	}
	if err := l.ctl(syscall.EPOLL_CTL_MOD, ic.clientReadFD, ev); err != nil {
		return err
	}
	ic.clientLevelTriggered = on
	return nil
}

// clientSteps handles the client messages that have arrived, reading the
// socket without blocking: on the loop (s.onLoop) or on the client
// goroutine after a hand-off. It returns errWouldBlock when the client
// has nothing more (a message may be partly read: it stays buffered).
func (r *relay) clientSteps() error {
	s, ic := r.s, r.intercept
	size := s.cf.R.Size()
	for {
		if s.onLoop && len(ic.serverPending) > 0 {
			return errPaused
		}
		typ, total, err := s.nextClient()
		if err != nil {
			return err
		}
		big := total > size || total-headerLen > s.cf.Max
		if big && s.onLoop {
			return r.handoff() // read whole (or dropped), waiting for it, on the goroutine
		}
		if s.holdMessage(typ) { // PAUSE: admin_pause.go
			if s.onLoop {
				return errHold
			}
			if err := s.waitResume(); err != nil {
				return err
			}
			continue
		}
		// A message larger than the buffer is read whole, waiting for
		// it; a smaller one not yet whole stays buffered (errWouldBlock).
		ic.blockingRead = big
		err = s.clientMessage(typ, total, size)
		ic.blockingRead = false
		s.releaseMessage(err == nil) // otherwise it is handled again
		switch {
		case err == nil:
		case errors.Is(err, errWouldBlock):
			return errWouldBlock
		case err == ErrWait && s.onLoop:
			return r.handoff() // nothing was done: the message stays
		default:
			return err
		}
		if typ == 'X' {
			s.sw.Flush()
			return errClientTerminate
		}
	}
}

// handoff is what clientSteps returns on the loop for a message that
// must go to the client goroutine. Not while bytes wait in serverPending: the
// goroutine writes the server directly, which would pass them. (serverPending
// only grows within a message's own writes, and clientSteps stops at the
// next message then, so this is a guard for that invariant.) The message
// stays unread (ErrWait: nothing was done) and is handled again once the
// server has taken them.
func (r *relay) handoff() error {
	if len(r.intercept.serverPending) > 0 {
		return errPaused
	}
	return errHandoff
}

// interceptClient is the client goroutine of a LoopClient session: it handles
// the client's messages from a hand-off until the client has nothing
// more, then gives the client back to the loop.
func (r *relay) interceptClient(l *evloop) error {
	ic := r.intercept
	for {
		select {
		case <-ic.clientWork:
		case <-ic.stop:
			return errSessionClosing
		}
		if err := r.clientSteps(); err != errWouldBlock {
			return err
		}
		// Hand back: the one-shot watch, armed after the store, wakes the
		// loop for the next bytes (the loop then makes it level-triggered:
		// watchClient). Nothing else makes the loop change the watch
		// meanwhile: serverPending is empty while the goroutine owns the
		// client.
		ic.clientOnGoroutine.Store(false)
		if err := l.ctl(syscall.EPOLL_CTL_MOD, ic.clientReadFD, clientWatch); err != nil {
			return err
		}
	}
}

// serverSteps forwards the server messages that have arrived, while the
// client keeps up (or always, with force), then flushes.
func (r *relay) serverSteps(force bool) error {
	s, ic := r.s, r.intercept
	limit := s.sf.R.Size()
	for force || len(ic.clientPending) < limit {
		if err := s.serverMessage(&ic.big); err != nil {
			if err == errWouldBlock {
				break
			}
			return err
		}
	}
	ic.serverReadArmed = false
	return s.cw.Flush()
}

// drainHeld writes what waits in *held to the non-blocking socket fd as
// far as it takes it, keeping the rest (and not pinning a buffer larger
// than 4 × size once empty).
func drainHeld(fd int, held *[]byte, size int) error {
	n, err := writeAvail(fd, *held)
	if err != nil {
		return err
	}
	b := (*held)[n:]
	switch {
	case len(b) > 0:
		*held = append((*held)[:0], b...)
	case cap(*held) > 4*size:
		*held = nil
	default:
		*held = (*held)[:0]
	}
	return nil
}

// interceptInterest keeps the registrations in step with clientPending:
// the server is read while it has room, the client socket is watched
// while it holds bytes.
func (l *evloop) interceptInterest(r *relay) error {
	ic := r.intercept
	var serverInterest uint32 = syscall.EPOLLRDHUP
	if len(ic.clientPending) < r.s.sf.R.Size() && r.serverReadable() {
		serverInterest |= syscall.EPOLLIN
	}
	if len(ic.serverPending) > 0 {
		serverInterest |= syscall.EPOLLOUT
	}
	if serverInterest != ic.serverInterest {
		if err := l.ctl(syscall.EPOLL_CTL_MOD, r.serverFD, serverInterest); err != nil {
			return err
		}
		ic.serverInterest = serverInterest
		ic.serverReadsPaused.Store(serverInterest&syscall.EPOLLIN == 0)
		ic.clientReadsPaused.Store(serverInterest&syscall.EPOLLOUT != 0)
	}
	if want := len(ic.clientPending) > 0; want != ic.clientWriteWatched {
		op := syscall.EPOLL_CTL_DEL
		if want {
			op = syscall.EPOLL_CTL_ADD
		}
		if err := l.ctl(op, r.clientFD, syscall.EPOLLOUT); err != nil {
			return err
		}
		ic.clientWriteWatched = want
	}
	return l.replicaInterest(r) // evloop_replica_linux.go
}

// runIntercepted runs an intercepted session with its server side on the loop
// (the client side on a goroutine); it returns false, having done
// nothing, when the session must use goroutines for both.
func (s *Session) runIntercepted(l *evloop) (error, bool) {
	r, ok := l.attachIntercepted(s)
	if !ok {
		return nil, false
	}
	s.srv.ops.stats.SessionsLoop.Add(1)
	sd := newSides()
	client := s.clientLoop
	if r.intercept.inlineClient {
		client = func() error { return r.interceptClient(l) }
	}
	sd.run(func() error { return s.guard("client", client) })
	sd.run(func() error { // the server side, on the loop
		err := <-r.done
		r.replicaLeft() // evloop_replica_linux.go
		return err
	})
	return s.end(interceptEnd{relayEnd{r}, sd}, sd.first()), true
}

// interceptEnd is the end of an intercepted session on the loop
// (Session.end): its client side on a goroutine, its server side on the
// loop.
type interceptEnd struct {
	relayEnd
	*sides
}

// stop shuts the upstream down (the loop sees it and lets go of r) and
// ends the client goroutine's wait for bytes.
func (e interceptEnd) stop() {
	e.r.s.closeServer()
	e.r.s.stopReplica() // ends a client goroutine's write to it (replica.go)
	close(e.r.intercept.stop)
}

// endServer closes the upstream sockets: stop told the backends to end
// (stopServer, stopReplica), when the sockets could take it.
func (e interceptEnd) endServer() {
	syscall.Close(e.r.letGo().serverFD)
	e.r.s.closeReplica()
}

// flushClient passes on, blocking, what the loop still held for the
// client: in the client writer and in clientPending.
func (e interceptEnd) flushClient() {
	e.r.s.cw.Flush()
	blockingWrite(e.r.clientFD, e.r.intercept.clientPending, time.Second)
}

func (e interceptEnd) closeClient() {
	syscall.Close(e.r.clientFD)
	syscall.Close(e.r.intercept.clientReadFD)
}
