package proxy

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/pgfence/pgfence/internal/wire"
	"golang.org/x/sys/unix"
)

// This file holds the event loop's half of a session's replica connection
// (read routing: replica.go): its registration on the loop as the
// session's second upstream socket, the reading of it, and its end.

// A session with read routing runs on the loop as any intercepted
// session does, both its sides. The routing decisions that wait park the
// client side (routeThen: the routed read's answer, the fence row check),
// and what blocks runs off the loop meanwhile (offClient: the dial, the
// replica's poll under fence.read_policy=wait). The replica connection
// the client side opens becomes a second upstream socket of the session's
// relay: the loop reads it, frames it and passes its messages on with the
// code that passes on the primary's (Session.upstreamMessage, with the
// replica's rules: replicaDrop, replicaFailed), into the same client writer and clientPending. So
// the client gets one stream in order, and the replica is not read while
// the client is behind, as the primary is not. A message larger than the
// buffer, passed on in pieces, is never cut by the other upstream's:
// neither upstream is read (but to see it close) while the other is in
// the middle of one. The loop writes requests to it as it writes the
// primary: what the socket does not take waits (loopReplica.pending) and
// the client is not read until it has gone.
//
// The replica's socket is a duplicate of the connection's, which leaves
// Go's netpoller as the primary's does. Who does what with it, all on the
// loop thread:
//
//   - the client side opens the connection (the dial off the loop) and
//     registers it (replicaOnLoop, registerReplica), and writes requests
//     to it;
//   - the loop reads it, and ends it at its end of stream or a failure
//     (endReplica): unregistered and forgotten first, then rc.done
//     closed, which routeThen waits for;
//   - the client side dropping it ends it at once (endOnLoop), then
//     closes it (release);
//   - when the session leaves the loop, l.end unregisters it with the
//     relay's other sockets (relay.sockets), and the session's goroutine
//     closes rc.done (replicaLeft) and, at its end, the socket
//     (closeReplica). stop (Terminate and shutdown, from any goroutine)
//     never closes it, so that its number is not reused under the loop.

// loopReplica is a replica connection the event loop reads.
type loopReplica struct {
	rc   *replicaConn
	r    *relay
	fd   int  // the duplicate of rc's socket
	sock sock // fd, and rc's tls.Conn over it for TLS

	// Loop thread only, once registered (interceptState.replica):
	armed    bool       // the socket may be read (once) in this event
	pending  []byte     // bytes for the replica its socket has not taken yet
	big      bigMessage // the part of a large message still to pass on
	interest uint32     // poller interest registered
	// readsPaused: the replica is not read until the client takes what
	// waits in clientPending (for observation: tests).
	readsPaused atomic.Bool
	// writesHeld: bytes wait in pending for the socket to take them (for
	// observation: tests).
	writesHeld atomic.Bool

	mu      sync.Mutex
	stopped bool // stop has shut the socket down
	ended   bool // rc.done is closed: the loop has let go of fd
	closed  bool // release has closed fd
}

// replicaOnLoop hands the new replica connection rc to the session's event
// loop, which reads it as a second upstream socket of the session's relay.
// A TLS connection is read through its tls.Conn, over pgfence's transport
// (takeSock); one the loop cannot take (no socket to duplicate) is an
// error, and the caller reads from the primary. Client side, in
// openReplica.
func (s *Session) replicaOnLoop(rc *replicaConn) error {
	s.connMu.Lock()
	r := s.loopRelay
	s.connMu.Unlock()
	if r == nil || r.intercept == nil {
		return errors.New("replica connection: the session is not relayed by the event loop")
	}
	sc, ok := loopConn(rc.conn)
	if !ok {
		return errors.New("replica connection: the event loop needs a socket, plain or TLS over pgfence's transport")
	}
	fd, err := dupConn(sc)
	if err != nil {
		return fmt.Errorf("replica connection: %w", err)
	}
	// Out of Go's netpoller; its RemoteAddr still answers (cancelRoute).
	// A TLS connection's tls.Conn reads the socket as the framer's reader
	// does and writes it as the client side does (takeSock).
	lr := &loopReplica{rc: rc, r: r, fd: fd}
	w := loopReplicaWriter{lr}
	lr.sock = takeSock(rc.conn, fd, loopReplicaReader{lr}, w.Write, nil)
	rc.loop = lr
	if lr.sock.tls != nil {
		rc.sw.Reset(lr.sock.tls)
		rc.sf.R.Reset(&lr.sock)
	} else {
		rc.sw.Reset(w)
		rc.sf.R.Reset(loopReplicaReader{lr})
	}
	r.l.registerReplica(r, lr)
	return nil
}

// loopReplicaWriter is the client side's writer to the replica on the
// loop: it writes what the socket takes and holds the rest in pending,
// never blocking (as serverWriter does the primary's); off the loop it
// waits for room (pollWrite).
type loopReplicaWriter struct{ lr *loopReplica }

func (w loopReplicaWriter) Write(b []byte) (int, error) {
	lr := w.lr
	if !lr.r.s.onLoop {
		return pollWrite(lr.fd, b)
	}
	if err := writeOrHold(lr.fd, &lr.pending, b); err != nil {
		return 0, err
	}
	return len(b), nil
}

// replicaPending reports whether bytes wait for r's replica socket to
// take them: the client is not read meanwhile. Loop thread.
func (r *relay) replicaPending() bool {
	lr := r.intercept.replica
	return lr != nil && len(lr.pending) > 0
}

// endOnLoop ends the replica connection on the loop at once, as its end
// of stream would: the client side drops it (dropReplica), and the loop
// thread, where it runs, could not wait for the loop to see its end.
func (lr *loopReplica) endOnLoop() {
	if r := lr.r; r.intercept.replica == lr {
		r.l.endReplica(r, errSessionClosing)
		return
	}
	lr.end(errSessionClosing)
}

// registerReplica makes lr the replica socket of r on the loop. If r has
// left the loop already, lr ends at once. Loop thread.
func (l *evloop) registerReplica(r *relay, lr *loopReplica) {
	lr.mu.Lock()
	defer lr.mu.Unlock()
	switch {
	case lr.ended:
		return
	case !l.owns(r):
		lr.endLocked(errSessionClosing)
		return
	}
	lr.interest = evIn | evRDHup
	if err := l.p.add(lr.fd, lr.interest); err != nil {
		lr.endLocked(fmt.Errorf("replica: poller: %w", err))
		return
	}
	l.mu.Lock()
	l.byFD[int32(lr.fd)] = r
	l.mu.Unlock()
	r.intercept.replica = lr
}

// loopReplicaReader is the replica framer's reader on the loop: one read
// per readable event, errWouldBlock otherwise (as loopServerReader).
type loopReplicaReader struct{ lr *loopReplica }

func (rr loopReplicaReader) Read(b []byte) (int, error) {
	return armedRead(rr.lr.fd, &rr.lr.armed, b)
}

// replicaEvent handles an event of r's replica socket: readable, or
// closed. Loop thread, from interceptEvent; an error ends the session.
func (l *evloop) replicaEvent(r *relay, ev uint32) error {
	lr := r.intercept.replica
	if ev&evOut != 0 {
		if err := drainHeld(lr.fd, &lr.pending, r.intercept.clientSize); err != nil {
			l.endReplica(r, fmt.Errorf("replica: %w", err))
			return nil
		}
		if len(lr.pending) == 0 && len(r.intercept.serverPending) == 0 && r.intercept.park == nil {
			// Go on with the client's messages held meanwhile.
			if err := l.clientInline(r); err != nil {
				return err
			}
		}
		if ev&readable == 0 || r.intercept.replica != lr {
			return nil
		}
	}
	lr.armed = true
	hangup := ev&(evRDHup|evHup|evErr) != 0
	if hangup && r.intercept.big.left > 0 {
		// Not into the middle of the primary's message: its end is read
		// after (replicaInterest). A connection lost meanwhile is the
		// replica's failure (endReplica), as a read error would be.
		if ev&(evHup|evErr) != 0 {
			l.endReplica(r, errors.New("replica: connection lost"))
		}
		return nil
	}
	if err := l.replicaSteps(r, hangup); err != nil {
		return err
	}
	if r.replicaMidMessage() {
		return nil
	}
	return r.serverSteps(false) // the primary's messages held meanwhile, if any
}

// replicaSteps passes on the replica's messages that have arrived, while
// the client keeps up and the primary is not in the middle of a message
// (or always, with force: the replica closed), then flushes. A failure of
// the replica ends its connection (endReplica), not the session:
// the replica's rules (upstreamMessage: replicaFailed) decide what it
// means for the session. Loop thread.
func (l *evloop) replicaSteps(r *relay, force bool) error {
	s, ic := r.s, r.intercept
	lr := ic.replica
	if lr == nil {
		return nil
	}
	limit := s.sf.R.Size()
	for force || len(ic.clientPending) < limit && ic.big.left == 0 {
		err := s.upstreamMessage(&lr.rc.sf, lr.rc, &lr.big)
		if err == errWouldBlock {
			break
		}
		if err != nil {
			l.endReplica(r, err)
			break
		}
	}
	lr.armed = false
	return s.cw.Flush()
}

// upstreamSteps passes on what both upstreams of r hold for the client
// once it has taken what waited: the one in the middle of a message
// first. Loop thread.
func (l *evloop) upstreamSteps(r *relay) error {
	if r.replicaMidMessage() {
		if err := l.replicaSteps(r, false); err != nil || r.replicaMidMessage() {
			return err
		}
	}
	if err := r.serverSteps(false); err != nil {
		return err
	}
	return l.replicaSteps(r, false)
}

// replicaMidMessage reports whether r's replica has passed on part of a
// message larger than the buffer. Loop thread.
func (r *relay) replicaMidMessage() bool {
	lr := r.intercept.replica
	return lr != nil && lr.big.left > 0
}

// serverReadable reports whether the loop may read r's primary: not while
// its replica is in the middle of a message. Loop thread.
func (r *relay) serverReadable() bool { return !r.replicaMidMessage() }

// replicaInterest keeps the replica's registration in step with
// clientPending, as interceptInterest keeps the primary's: read while the
// client has room and the primary is not in the middle of a message.
// Loop thread.
func (l *evloop) replicaInterest(r *relay) error {
	ic := r.intercept
	lr := ic.replica
	if lr == nil {
		return nil
	}
	// Its end is watched only while it may be read, as the primary's
	// (interceptInterest).
	var want uint32
	if ic.big.left == 0 {
		want = evRDHup
		if len(ic.clientPending) < r.s.sf.R.Size() {
			want |= evIn
		}
	}
	if len(lr.pending) > 0 {
		want |= evOut
	}
	if want == lr.interest {
		return nil
	}
	if err := l.p.modify(lr.fd, want); err != nil {
		return err
	}
	lr.interest = want
	lr.readsPaused.Store(want&evIn == 0 && ic.big.left == 0)
	lr.writesHeld.Store(want&evOut != 0)
	return nil
}

// endReplica ends r's replica connection on the loop: its socket
// unregistered and forgotten (with what still waited for it), then
// rc.done closed with err (the client side's dropReplica closes the
// socket). Loop thread.
func (l *evloop) endReplica(r *relay, err error) {
	lr := r.intercept.replica
	r.intercept.replica = nil
	lr.pending = nil
	l.p.remove(lr.fd)
	l.mu.Lock()
	delete(l.byFD, int32(lr.fd))
	l.mu.Unlock()
	lr.end(err)
}

// replicaLeft ends the replica connection the loop was reading when r
// left the loop (l.end has unregistered its socket with r's). The
// session's server-side goroutine, once r is off the loop.
func (r *relay) replicaLeft() {
	if lr := r.intercept.replica; lr != nil {
		lr.end(errSessionClosing)
	}
}

// end closes rc.done with err, once: the loop has let go of the socket.
func (lr *loopReplica) end(err error) {
	lr.mu.Lock()
	defer lr.mu.Unlock()
	lr.endLocked(err)
}

func (lr *loopReplica) endLocked(err error) {
	if lr.ended {
		return
	}
	lr.ended = true
	lr.rc.err = err
	close(lr.rc.done)
}

// stop tells the replica backend to end (Terminate, if the socket takes
// it at once) and shuts the socket down, which the loop sees as its end.
// Any goroutine (replicaConn.close).
func (lr *loopReplica) stop() {
	lr.mu.Lock()
	defer lr.mu.Unlock()
	if lr.stopped || lr.closed {
		return
	}
	lr.stopped = true
	if lr.sock.tls == nil { // in a TLS stream it would be garbage: the end tells the backend
		rawIO(syscall.SYS_WRITE, lr.fd, wire.Terminate)
	}
	syscall.Shutdown(lr.fd, syscall.SHUT_RDWR)
}

// release closes the socket, once the loop has let go of it: rc.done is
// closed, or the session has left the loop (its end: the loop then never
// registers it, registerReplica). Its owner only (replicaConn.release).
func (lr *loopReplica) release() {
	lr.mu.Lock()
	defer lr.mu.Unlock()
	lr.endLocked(errSessionClosing)
	if !lr.closed {
		lr.closed = true
		syscall.Close(lr.fd)
	}
}

// pollWrite writes b to the non-blocking socket fd, waiting for room in
// poll(2), as a blocking system call (releasing its P), when it is full.
func pollWrite(fd int, b []byte) (int, error) {
	n := 0
	for {
		k, err := writeAvail(fd, b[n:])
		if n += k; err != nil || n == len(b) {
			return n, err
		}
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		if _, err := unix.Poll(fds, -1); err != nil && err != unix.EINTR {
			return n, err
		}
	}
}
