package proxy

import (
	"errors"
	"fmt"
	"io"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/pgfence/pgfence/internal/wire"
)

// This file holds the event loop's half of an intercepted session (one
// with a Handler): its state (interceptState), the readers and writers
// the session's framers and writers use once its sockets are the loop's,
// and the loop's handling of its events; its client side (reading,
// parking, large messages) is evloop_client.go.

// An intercepted session (one with a Handler) is relayed on the loop too,
// message by message rather than byte by byte, both its sides. Its server
// side never blocks: the loop reads the server, frames it, calls the
// Handler's ServerMessage and writes to the client inline
// (Session.serverMessage, the same code as the server goroutine). Its
// client messages are handled on the loop as well (clientInline), and so
// never block either: where a LoopClient Handler must wait for an answer
// (the write gate: a write pipelined behind a SET in flight, a wrapped
// COPY FROM, a settings read-back, a routed read) it parks the client
// side (parkClient) with what it waits for and the rest of its work; the
// loop stops reading that client (its bytes stay buffered, in order),
// and once the server side, which runs on the same thread, has answered,
// it runs the rest there (resumeClient) and reads the client again.
// What cannot be done without blocking (dialing a replica, waiting for a
// replica's poll under fence.read_policy=wait, the ClientMessage of a
// Handler that is not a LoopClient, which may block) runs on a goroutine
// of its own while the client side is parked (offClient), and the loop
// goes on with the rest of the work when it has returned. A message
// larger than the buffer is read there too, without blocking, as it
// arrives (growClient, streamSteps). The session has no client
// goroutine. Both sockets leave Go's netpoller. The loop never blocks:
// what a socket does not take waits (clientPending for the client,
// serverPending for the server) and the other side is not read until it
// has gone.
//
// The Handler's ServerMessage runs on the loop thread, so it must not
// block (fenceSession's holds its mutex only for short bookkeeping); a
// panic in either handler ends that session only.

// interceptState is the loop's state for an intercepted session.
type interceptState struct {
	big                bigMessage
	serverReadArmed    bool   // the server socket may be read (once) in this event
	clientPending      []byte // bytes for the client its socket has not taken yet
	serverInterest     uint32 // poller interest registered for the server socket
	clientWriteWatched bool   // the client socket is registered (for evOut)
	// serverReadsPaused: the server is not read until the client takes
	// what waits in clientPending (for observation: tests).
	serverReadsPaused atomic.Bool

	// The client's reads: clientReadFD, another duplicate of the client
	// socket, is watched level-triggered while the loop reads it
	// (clientWatchEv: what is registered; loop thread only, or
	// attachIntercepted before the loop can see the session).
	clientReadFD    int
	clientWatchEv   uint32
	clientReadArmed bool // the loop may read the client (once) in this event
	// clientEventCount counts the loop's events for clientReadFD (for
	// observation: a watch left armed while the client is not read would
	// spin).
	clientEventCount atomic.Uint64
	serverPending    []byte // bytes for the server its socket has not taken yet (inline)
	// clientReadsPaused: the client is not read until the server takes
	// serverPending, or its backlog of unread answers is down
	// (backlogPaused; for observation: tests).
	clientReadsPaused atomic.Bool

	// park is the parked client side's wait (nil: not parked), parkedLen
	// the bytes of its message left in the client framer (to consume once
	// a continuation is done; a message handled again is whole there).
	// parks counts the session's parks (for observation: tests; the
	// Server's count is Stats.ClientParks).
	park      *clientPark
	parkedLen int
	parks     atomic.Int64
	// clientSize is the client buffer's size; grown is the memory budget
	// taken while the buffer is larger, for one message (growClient).
	clientSize int
	grown      int64
	// backlogPaused: the client is not read while its unread answers
	// are over the bounds (backlogged, evloop_client.go).
	backlogPaused bool
	// heldTimer ends the session when a message held for growClient has
	// not all arrived within message_timeout (stopped once it has).
	heldTimer *time.Timer
	// clientSrc is what the client framer reads: loopClientReader, or the
	// client's tls.Conn over it (sock.Read); a resized buffer reads it too.
	clientSrc io.Reader
	stream    clientStream // a message passed on in pieces (streamSteps)

	// replica is the session's replica connection while the loop reads
	// it (evloop_replica.go). Loop thread only.
	replica *loopReplica

	// off is a blocking call to start once the client side has stopped
	// (offClient); offs counts those running, which the session's end
	// waits for (they may write the upstream sockets).
	off  *offCall
	offs sync.WaitGroup
	// offCalls counts the blocking calls the client side has run off
	// the loop (for observation: tests).
	offCalls atomic.Int64
}

// errPaused ends clientSteps while the server has not taken what waits
// in serverPending.
var errPaused = errors.New("client paused until the server takes what waits")

// loopClientReader is the client framer's reader on the loop: one read
// per readable event, errWouldBlock otherwise (as loopServerReader).
type loopClientReader struct{ r *relay }

func (cr loopClientReader) Read(b []byte) (int, error) {
	return armedRead(cr.r.intercept.clientReadFD, &cr.r.intercept.clientReadArmed, b)
}

// The loop's interest in an intercepted session's client reads.
// clientLevel is level-triggered: while the loop reads the client it
// stays registered, so a message costs no epoll_ctl (re-arming a
// one-shot watch per message cost CPU: docs/proxy.md, Performance).
// clientOff disarms the reads (a reset is still reported, once) while
// the loop must not read the client (paused, PAUSE, parked).
const (
	clientLevel = evIn | evRDHup
	clientOff   = evOneShot
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
	if err := lw.r.client.hold(b); err != nil { // into clientPending
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

// serverWriter is the client side's writer to the server once the server
// socket has left Go's netpoller: on the loop it writes what the socket
// takes and holds the rest (serverPending); off it (a blocking call of
// the client side, offClient) it waits for room in poll(2), as a blocking
// system call (releasing its P).
type serverWriter struct{ r *relay }

func (sw serverWriter) Write(b []byte) (int, error) {
	if sw.r.server.tls != nil {
		return sw.r.server.tls.Write(b) // to raw, through its transport
	}
	return sw.raw(b)
}

// raw writes b to the server socket.
func (sw serverWriter) raw(b []byte) (int, error) {
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

// attachIntercepted moves an intercepted session s, both its sides, onto
// the loop. It reports false, leaving s untouched, when it cannot
// (dupSockets).
func (l *evloop) attachIntercepted(s *Session) (*relay, error) {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	clientFD, serverFD, read, err := dupSockets(s)
	if err != nil {
		return nil, err
	}
	clientReadFD, err := syscall.Dup(clientFD)
	if err != nil {
		syscall.Close(clientFD)
		syscall.Close(serverFD)
		return nil, fmt.Errorf("duplicating the client socket: %w", err)
	}
	syscall.CloseOnExec(clientReadFD)
	r := &relay{
		s: s, l: l, clientFD: clientFD, serverFD: serverFD,
		intercept: &interceptState{serverInterest: evIn | evRDHup, clientReadFD: clientReadFD,
			clientWatchEv: clientLevel, clientSize: s.cf.R.Size()},
		done: make(chan error, 1),
	}
	// Both sockets leave Go's netpoller, or every response would wake it
	// as well as the loop. The loop reads both and writes both, through
	// the duplicates.
	var cr, sr io.Reader = loopClientReader{r}, loopServerReader{r}
	r.client = takeSock(s.client, clientFD, cr, nil, &r.intercept.clientPending)
	r.server = takeSock(s.server, serverFD, sr, serverWriter{r}.raw, &r.intercept.serverPending)
	if r.client.tls != nil {
		cr = &r.client // the plaintext, from its tls.Conn reading loopClientReader
	}
	if r.server.tls != nil {
		sr = &r.server // the same, reading loopServerReader
	}
	r.intercept.clientSrc = cr
	readFirst(s.cf.R, read.client, cr) // what they had read first (dupSockets)
	readFirst(s.sf.R, read.server, sr)
	s.cw.Reset(loopClientWriter{r})
	s.sw.Reset(serverWriter{r})
	s.loopRelay = r
	// A Handler that is not a LoopClient may block in ClientMessage: it
	// runs off the loop (deliverOff).
	lc, ok := s.h.(LoopClient)
	s.blocking = !ok || !lc.LoopClient()
	// The client's writes are watched only while clientPending holds bytes.
	l.publish(r, pollReg{clientReadFD, r.intercept.clientWatchEv}, pollReg{serverFD, r.intercept.serverInterest})
	if r.client.tls != nil || r.server.tls != nil || len(read.client) > 0 || len(read.server) > 0 {
		l.kick(r)
	}
	return r, nil
}

// interceptEvent handles an event of an intercepted session: the server
// socket is readable (or closed), or has room for what waits in
// serverPending, or the client socket has room for what waits in
// clientPending, or the client has sent something. After it, a parked
// client side whose wait is over goes on (resumeClient).
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
			return l.replicaEvent(r, ev) // evloop_replica.go
		}
		if fd == ic.clientReadFD {
			ic.clientEventCount.Add(1)
			if ic.park != nil {
				// Parked: the client is not read, and a reset ends the
				// session, dropping what it waited for. A client that
				// closed (or only shut its writing down) has what it
				// sent, the parked message included, handled once the
				// wait is over, as PostgreSQL handles what a client sent
				// before its end: the reads after it meet the end, and
				// a write to a client that is gone its reset.
				if ev&(evHup|evErr) != 0 {
					return fmt.Errorf("client: gone while parked: %w", io.EOF)
				}
				return nil
			}
			ic.clientReadArmed = true
			err := l.clientInline(r)
			ic.clientReadArmed = false
			return err
		}
		if fd == r.serverFD && ev&evOut != 0 {
			if err := drainHeld(r.serverFD, &ic.serverPending, ic.clientSize); err != nil {
				return fmt.Errorf("server: %w", err)
			}
			if len(ic.serverPending) == 0 && ic.park == nil {
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
		// even if the client is slow, so the end is seen; but not into
		// the middle of the replica's message (its end is read after).
		// A connection lost (reset) meanwhile ends the session there.
		hangup := ev&(evRDHup|evHup|evErr) != 0
		if hangup && !r.serverReadable() {
			if ev&(evHup|evErr) != 0 {
				return errors.New("server: connection lost while the replica's answer was passed on")
			}
			return nil
		}
		if err := r.serverSteps(hangup); err != nil {
			return err
		}
		return l.replicaSteps(r, false) // the replica's held while the primary's message was in pieces
	}()
	if ic := r.intercept; err == nil && ic.backlogPaused && ic.park == nil && !r.backlogged() &&
		len(ic.serverPending) == 0 && !r.replicaPending() {
		// The backlog that stopped the client's reads is down (answers
		// arrive, or the client took what waited for it, only in these
		// events): read on, the messages already buffered first, for
		// which no event comes. With serverPending, the server's taking
		// it reads on.
		err = r.s.guard("client", func() error { return l.clientInline(r) })
	}
	if err == nil && r.intercept.park != nil {
		// The Handler's continuation, or its message handled again: a
		// panic there ends this session only, as in ClientMessage.
		err = r.s.guard("client", func() error { return l.resumeClient(r) })
	}
	if err == nil {
		err = l.interceptInterest(r)
	}
	if err != nil {
		l.end(r, err)
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
	// The server's end is watched only while it may be read: a hang-up
	// watched (level-triggered) while the replica is in the middle of a
	// message would have to be read into it, or spin.
	var serverInterest uint32
	if r.serverReadable() {
		serverInterest = evRDHup
		if len(ic.clientPending) < r.s.sf.R.Size() {
			serverInterest |= evIn
		}
	}
	if len(ic.serverPending) > 0 {
		serverInterest |= evOut
	}
	r.s.answersHeld.Store(len(ic.clientPending) >= r.s.sf.R.Size())
	if serverInterest != ic.serverInterest {
		if err := l.p.modify(r.serverFD, serverInterest); err != nil {
			return err
		}
		ic.serverInterest = serverInterest
		ic.serverReadsPaused.Store(serverInterest&evIn == 0)
	}
	if paused := serverInterest&evOut != 0 || ic.backlogPaused; paused != ic.clientReadsPaused.Load() {
		ic.clientReadsPaused.Store(paused)
	}
	if want := len(ic.clientPending) > 0; want != ic.clientWriteWatched {
		var err error
		if want {
			err = l.p.add(r.clientFD, evOut)
		} else {
			err = l.p.remove(r.clientFD)
		}
		if err != nil {
			return err
		}
		ic.clientWriteWatched = want
	}
	return l.replicaInterest(r) // evloop_replica.go
}

// runIntercepted runs an intercepted session on the loop, both its
// sides, until it ends.
func (s *Session) runIntercepted(l *evloop) error {
	r, err := l.attachIntercepted(s)
	if err != nil {
		return s.refuse(err)
	}
	s.srv.ops.stats.SessionsLoop.Add(1)
	err = <-r.done
	r.replicaLeft() // evloop_replica.go
	return s.end(interceptEnd{relayEnd{r}}, err)
}

// interceptEnd is the end of an intercepted session on the loop
// (Session.end).
type interceptEnd struct{ relayEnd }

// stop shuts the upstreams down (the loop sees it and lets go of r; a
// blocking call of the client side off the loop writing them gives up).
func (e interceptEnd) stop() {
	if !e.r.s.keepServer { // else nothing runs off the loop: the client left (pools.go)
		e.r.s.closeServer()
	}
	e.r.s.stopReplica() // replica.go
}

// wait waits for the client side's blocking calls still running off the
// loop (offClient) that may use the session's sockets: the loop has let
// go of r already.
func (e interceptEnd) wait() error {
	e.r.intercept.offs.Wait()
	return nil
}

// endServer closes the upstream sockets: stop told the backends to end
// (stopServer, stopReplica), when the sockets could take it and are not
// TLS.
//
// A backend the session may keep (Session.keepServer) that is idle with
// nothing in flight (quietServer) is left open, for the session
// goroutine to park (Server.park); one that is not is told to end here,
// stop having left it.
func (e interceptEnd) endServer() {
	r := e.r.letGo()
	switch {
	case r.s.keepServer && r.quietServer():
		r.s.kept, r.s.keptFD = true, r.serverFD
	case r.s.keepServer:
		r.server.writeAll(wire.Terminate, 100*time.Millisecond)
		r.server.close(100 * time.Millisecond)
	default:
		r.server.close(100 * time.Millisecond)
	}
	e.r.s.closeReplica()
}

// quietServer reports whether r's backend is idle, outside a
// transaction, with nothing in flight, sent or unsent, and nothing of
// its answers unread: at a message boundary, where DISCARD ALL's answer
// is the next thing it sends (Server.park).
func (r *relay) quietServer() bool {
	s := r.s
	s.connMu.Lock()
	stopped := s.serverStopped
	s.connMu.Unlock()
	return !stopped && r.server.tls == nil && s.rt.fatal.Load() == nil &&
		s.q.Len() == 0 && s.st.Tx() == 'I' && s.lastServerType == 'Z' &&
		s.sf.R.Buffered() == 0 && r.intercept.big.left == 0 &&
		len(r.intercept.serverPending) == 0 && s.sw.Buffered() == 0
}

// flushClient passes on, blocking, what the loop still held for the
// client: in the client writer and in clientPending.
func (e interceptEnd) flushClient() {
	e.r.s.cw.Flush()
	e.r.client.writeAll(nil, time.Second) // clientPending
}

// closeClient closes the client's sockets and gives back a client buffer
// grown for a message.
func (e interceptEnd) closeClient() {
	e.r.client.close(time.Second)
	syscall.Close(e.r.intercept.clientReadFD)
	e.r.stopHeldTimer()
	if g := e.r.intercept.grown; g > 0 {
		e.r.s.srv.mem.give(g)
		e.r.intercept.grown = 0
	}
}
