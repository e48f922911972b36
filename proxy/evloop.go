package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"fmt"
	"github.com/pgfence/pgfence/internal/wire"
)

// This file holds the event loop itself: its thread (run, and stop when
// its Server shuts down), the registration of a session's sockets with
// its poller, the relay value both kinds of session have on the loop, the
// system calls, and dupSockets, where a session's sockets come onto the
// loop (Session.run, session.go, brings it there). The pass-through relay is in evloop_relay.go, an intercepted
// session's in evloop_intercept.go, PAUSE on the loop in
// admin_pause_loop.go; the pollers, which are all the loop knows of
// epoll or poll(2), in poller.go.

// The event loop relays every session (pass-through ones byte by byte,
// intercepted ones message by message; TLS through its tls.Conn:
// evloop_tls.go) on one OS thread that waits in epoll_wait (Linux) or
// poll(2) (the other Unixes, or Config.Poller "poll"), the way PgBouncer
// does, instead of two goroutines per session. It is the proxy's one
// relay engine: the goroutine relay it replaced is gone. Each Server owns one (serverLoop), started by
// its first session and stopped, its poller closed, by Shutdown.
//
// Why: with goroutines, every hop of a query (client → proxy → server and
// back) is a netpoller wake-up of a parked goroutine, handed between OS
// threads through the scheduler; on a small machine that costs more than
// the work itself. A thread that blocks in epoll_wait itself and does the
// reads and writes inline has no hand-off at all. (The measurements behind
// this file's choices are in docs/proxy.md, Performance.)
//
// The loop calls epoll_wait (on Linux poll(2) too: ppoll) as a raw
// system call, so the runtime
// does not hand its P to another thread on every wait (through
// syscall.Syscall6 most of the gain is lost). The loop therefore
// keeps one P busy; the process's GOMAXPROCS is raised by one while a loop
// runs, so the rest of the proxy keeps the parallelism it had. The wait
// stays interruptible: the runtime's preemption signal ends the wait
// with EINTR, and the loop is preempted at its next function call, so it
// never holds up a garbage collection.
//
// The sockets leave Go's netpoller (their net.Conns are closed after the
// file descriptors are duplicated), so an event wakes only this thread.
// The loop validates framing with internal/wire's rules (frontend
// message types, the message size limit, Terminate) and keeps the
// session's transaction status and in-flight count, which graceful
// shutdown and the admin console read.

// serverLoop is a Server's event loop: started by its first session
// (get), stopped by Shutdown once every session has ended.
// Each Server has its own; several in one process (tests) each run a loop
// thread.
type serverLoop struct {
	mu      sync.Mutex
	poller  string // Config.Poller
	l       *evloop
	stopped bool
	// used is the name of the poller the loop was started with ("":
	// never started), kept after stop (for observation: tests).
	used string
	// start makes the loop: newEvloop, or a test's stand-in.
	start func(poller string) (*evloop, error)
}

// errLoopStopped: the Server has shut down, and its loop with it.
var errLoopStopped = errors.New("event loop stopped: the server has shut down")

// get returns the Server's event loop, starting it on first use. A loop
// that cannot be made (its poller needs descriptors the process may be
// out of) is tried again by the next session: the one that asked is
// refused meanwhile (Session.refuse).
func (sl *serverLoop) get() (*evloop, error) {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	switch {
	case sl.stopped:
		return nil, errLoopStopped
	case sl.l == nil:
		start := sl.start
		if start == nil {
			start = newEvloop
		}
		l, err := start(sl.poller)
		if err != nil {
			return nil, fmt.Errorf("starting the event loop: %w", err)
		}
		sl.l, sl.used = l, l.p.name()
		runtime.GOMAXPROCS(runtime.GOMAXPROCS(0) + 1)
		go sl.l.run()
	}
	return sl.l, nil
}

// stop ends the loop, if it was started, and waits until its thread has
// closed its poller; the loop is not started again. The Server calls it
// when its sessions have ended; a relay still on the loop then ends with
// a shutdown.
func (sl *serverLoop) stop() {
	sl.mu.Lock()
	l := sl.l
	sl.l, sl.stopped = nil, true
	sl.mu.Unlock()
	if l == nil {
		return
	}
	l.tasks.post(func() { l.quit = true })
	<-l.done
	runtime.GOMAXPROCS(max(runtime.GOMAXPROCS(0)-1, 1)) // what get added
}

type evloop struct {
	p    poller
	quit bool          // loop thread only: stop asked the loop to end
	done chan struct{} // closed when run has returned, its descriptors closed

	mu   sync.RWMutex
	byFD map[int32]*relay // every relay, by each of its sockets

	tasks loopTasks // functions other goroutines run on the loop thread (admin_pause_loop.go)
}

// newEvloop makes a loop waiting in the poller named kind (Config.Poller:
// "" for the platform's default).
func newEvloop(kind string) (*evloop, error) {
	p, err := newPoller(kind)
	if err != nil {
		return nil, err
	}
	l := &evloop{p: p, byFD: map[int32]*relay{}, done: make(chan struct{})}
	if err := l.tasks.init(l); err != nil {
		p.close()
		return nil, err
	}
	return l, nil
}

// relay is one session on the loop. Its pipes are touched only by the
// loop thread until done is sent; then only by the session goroutine.
type relay struct {
	s                  *Session
	l                  *evloop // the loop r is on: its Server's
	clientFD, serverFD int
	// client and server are the sockets as the relay reads and writes
	// them (plain or TLS: evloop_tls.go); their fds are clientFD
	// and serverFD.
	client, server                 sock
	toServer, toClient             pipe
	clientInterest, serverInterest uint32 // interest registered for clientFD and serverFD (evIn...)
	done                           chan error
	ended                          sync.Once

	mu     sync.Mutex // guards closed against stopServer
	closed bool
	// clientEventCount counts the loop's events for a pass-through
	// relay's client socket (for observation: PAUSE must not make it
	// spin).
	clientEventCount atomic.Uint64

	// intercept is set for an intercepted session (one with a Handler),
	// which the loop relays message by message (see attachIntercepted).
	intercept *interceptState
}

// pollReg is a socket and the events to watch it for.
type pollReg struct {
	fd     int
	events uint32
}

// sockets are the file descriptors the loop finds r by.
func (r *relay) sockets() []int {
	if r.intercept != nil {
		if lr := r.intercept.replica; lr != nil { // loop thread only
			return []int{r.clientFD, r.serverFD, r.intercept.clientReadFD, lr.fd}
		}
		return []int{r.clientFD, r.serverFD, r.intercept.clientReadFD}
	}
	return []int{r.clientFD, r.serverFD}
}

// publish registers fds for events and lets the loop find r by its
// sockets. Level-triggered sockets are registered first: an event that
// comes before r can be found is reported again. A one-shot event is
// not, so those are registered last, once r can be found. A
// registration that fails ends r at once.
func (l *evloop) publish(r *relay, regs ...pollReg) (*relay, bool) {
	add := func(oneshot bool) bool {
		for _, g := range regs {
			if (g.events&evOneShot != 0) != oneshot {
				continue
			}
			if err := l.p.add(g.fd, g.events); err != nil {
				l.end(r, err)
				return false
			}
		}
		return true
	}
	if !add(false) {
		return r, true
	}
	l.mu.Lock()
	for _, fd := range r.sockets() {
		l.byFD[int32(fd)] = r
	}
	l.mu.Unlock()
	add(true)
	return r, true
}

// dupSockets duplicates s's client and server sockets for the loop. The
// caller holds s.connMu. It fails, having changed nothing, for a
// connection that is neither a socket nor TLS over our transport (run
// bridges those first), an upstream already closed (errShutdown), or a
// descriptor the process cannot have. A TLS connection is
// relayed through its tls.Conn (takeSock).
//
// What s's writers hold is written first; what its framers have read and
// not handled (read) is the caller's to take with the session, in front
// of what the loop reads. At the start of a session they hold nothing:
// the startup packet, the authentication messages and the upstream's
// startup up to its ReadyForQuery are read exactly, without reading ahead
// (readStartupPacket, frameReader), so what a client or a server sent
// behind them is still in the socket (or, with TLS, in the tls.Conn) for
// the loop; a framer that had read ahead would give it here.
func dupSockets(s *Session) (clientFD, serverFD int, read framed, err error) {
	cc, ok1 := loopConn(s.client)
	sc, ok2 := loopConn(s.server)
	switch {
	case s.serverClosed:
		return -1, -1, framed{}, errShutdown // Shutdown's forced close came first
	case !ok1 || !ok2:
		return -1, -1, framed{}, errors.New("a connection is not a socket (bridgeConns did not bridge it)")
	}
	if err := s.sw.Flush(); err != nil {
		return -1, -1, framed{}, fmt.Errorf("server: %w", err)
	}
	if err := s.cw.Flush(); err != nil {
		return -1, -1, framed{}, fmt.Errorf("client: %w", err)
	}
	if clientFD, err = dupConn(cc); err != nil {
		return -1, -1, framed{}, fmt.Errorf("duplicating the client socket: %w", err)
	}
	if serverFD, err = dupConn(sc); err != nil {
		syscall.Close(clientFD)
		return -1, -1, framed{}, fmt.Errorf("duplicating the upstream socket: %w", err)
	}
	return clientFD, serverFD, framed{client: buffered(s.cf.R), server: buffered(s.sf.R)}, nil
}

// framed is what a session's framers had read from the client and the
// server when it came onto the loop (dupSockets).
type framed struct{ client, server []byte }

// buffered returns a copy of what rd holds, and empties it.
func buffered(rd *bufio.Reader) []byte {
	n := rd.Buffered()
	if n == 0 {
		return nil
	}
	b, _ := rd.Peek(n)
	b = bytes.Clone(b)
	rd.Discard(n)
	return b
}

// readFirst has rd read b, then src.
func readFirst(rd *bufio.Reader, b []byte, src io.Reader) {
	if len(b) > 0 {
		src = io.MultiReader(bytes.NewReader(b), src)
	}
	rd.Reset(src)
}

// dupConn returns a duplicate of c's file descriptor (non-blocking, like
// the original: the flag belongs to the shared open file).
func dupConn(c syscall.Conn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	nfd := -1
	var derr error
	if err := rc.Control(func(fd uintptr) {
		nfd, derr = syscall.Dup(int(fd))
	}); err != nil {
		return -1, err
	}
	if derr != nil {
		return -1, derr
	}
	syscall.CloseOnExec(nfd)
	if err := syscall.SetNonblock(nfd, true); err != nil {
		syscall.Close(nfd)
		return -1, err
	}
	return nfd, nil
}

func (l *evloop) forget(r *relay) {
	l.mu.Lock()
	for _, fd := range r.sockets() {
		delete(l.byFD, int32(fd))
	}
	l.mu.Unlock()
}

// yieldEvery is how often the loop yields to the scheduler. A goroutine
// that has not been rescheduled for 10 ms is preempted by the runtime's
// monitor thread (a signal, and a hand-off), which also keeps that thread
// polling every 20 µs — thousands of wake-ups a second that compete with
// PostgreSQL and the clients for the CPUs. Yielding first (two thread
// hand-offs every 5 ms, the loop being locked to its thread) avoids both;
// the wait's timeout makes an idle loop yield too.
const yieldEvery = 5 * time.Millisecond

// yieldCheck is how many events the loop handles between two readings of
// the clock for yieldEvery. An event is one socket's read, scan and write
// (and the gate's handler for its sessions): 64 of them take well under
// the 10 ms after which the runtime would preempt the loop.
const yieldCheck = 64

// run is the loop. It is locked to its OS thread, which blocks in
// its poller's wait holding its P. Unlocked, the goroutine moved between threads
// and the kernel moved the thread that ran it between CPUs about once per
// transaction, which cost CPU per transaction; a yield now costs two
// thread hand-offs, but the loop yields only every yieldEvery and after
// waking a goroutine.
func (l *evloop) run() {
	runtime.LockOSThread()
	events := make([]pollEvent, 256)
	last := time.Now()
	idle := false
	work := 0 // events (and waits) since the clock was last read
	for !l.quit {
		var n int
		var errno syscall.Errno
		if idle {
			// Nothing for a while: wait as an ordinary system call,
			// giving the P back, so an idle proxy costs nothing.
			n, errno = l.p.waitIdle(events)
		} else {
			n, errno = l.p.wait(events, int(yieldEvery/time.Millisecond))
		}
		idle = errno == 0 && n == 0
		// The clock is read every yieldCheck events, or after a wait
		// that timed out, not on every wake-up, where it showed in the
		// loop's CPU profile.
		work += max(n, 0) + 1 // n is -1 after an error such as EINTR
		if work >= yieldCheck || idle {
			work = 0
			if now := time.Now(); now.Sub(last) >= yieldEvery {
				runtime.Gosched()
				last = now
			}
		}
		if errno != 0 {
			if errno == syscall.EINTR {
				continue // a signal, or the poll poller's wake-up (a change)
			}
			// EBADF/EINVAL cannot happen with our own poller; back off
			// rather than spin if the impossible happens.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		for i := range n {
			ev := &events[i]
			if ev.Fd == int32(l.tasks.fd) {
				l.tasks.run()
				continue
			}
			l.mu.RLock()
			r := l.byFD[ev.Fd]
			l.mu.RUnlock()
			if r == nil {
				continue // ended earlier in this batch
			}
			l.event(r, int(ev.Fd), ev.Events)
		}
	}
	l.close()
}

// close ends the relays still on the loop (none once the Server's
// sessions have ended) and closes the loop's descriptors. Loop thread,
// when stop has asked it to end.
func (l *evloop) close() {
	l.mu.RLock()
	left := map[*relay]bool{}
	for _, r := range l.byFD {
		left[r] = true
	}
	l.mu.RUnlock()
	for r := range left {
		l.end(r, errShutdown)
	}
	l.tasks.close()
	l.p.close()
	runtime.UnlockOSThread()
	close(l.done)
}

const readable = evIn | evRDHup | evHup | evErr

// end takes r off the loop and hands it to its session goroutine with the
// reason, once.
func (l *evloop) end(r *relay, err error) {
	r.ended.Do(func() {
		for _, fd := range r.sockets() {
			l.p.remove(fd) // not registered: ENOENT, harmless
		}
		l.forget(r)
		r.done <- err
	})
}

// stopServer ends the upstream connection of a session on the loop from
// any goroutine (closeServer: graceful shutdown, the admin console, the
// session's own end): shutdown, which the loop sees as the end of the
// stream (it ends the session there) and which ends a wait for room in
// serverWriter. An intercepted session's backend is told to end first, by
// a Terminate if the socket takes it at once; a pass-through session's
// gets its Terminate at the end (passEnd.endServer), after what the loop
// still holds for it. Once the session goroutine has the sockets
// (letGo), it does nothing: the descriptor may be closed, its number
// reused.
func (r *relay) stopServer() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	if r.intercept != nil && r.server.tls == nil && r.s.rt.fatal.Load() == nil {
		// Not through a TLS upstream's tls.Conn, which the loop may be
		// using: its backend sees the end of the stream. Not for a
		// session the proxy ends (endWith), as Session.closeServer: in
		// COPY IN the backend answers a Terminate with 08P01, which could
		// reach the client ahead of the proxy's own reason (FN012).
		rawIO(syscall.SYS_WRITE, r.serverFD, wire.Terminate)
	}
	syscall.Shutdown(r.serverFD, syscall.SHUT_RDWR)
}

// letGo marks r's descriptors as the session goroutine's, to be closed
// (or moved) by it: stopServer leaves them alone from here. It returns r.
func (r *relay) letGo() *relay {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	return r
}

// relayEnd is what the ends of both kinds of relay share (passEnd,
// interceptEnd).
type relayEnd struct{ r *relay }

func (e relayEnd) tellClient(msg []byte) { e.r.client.writeAll(msg, time.Second) }

// writeAvail writes b to the non-blocking socket fd as far as it takes
// it, returning how much it took; a full socket is not an error.
func writeAvail(fd int, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		k, err := rawIO(syscall.SYS_WRITE, fd, b[n:])
		switch err {
		case nil:
			n += k
		case syscall.EINTR:
		case syscall.EAGAIN:
			return n, nil
		default:
			return n, err
		}
	}
	return n, nil
}

// blockingWrite writes b to fd, waiting up to d for room.
func blockingWrite(fd int, b []byte, d time.Duration) {
	if len(b) == 0 {
		return
	}
	syscall.SetNonblock(fd, false)
	tv := syscall.NsecToTimeval(d.Nanoseconds())
	syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, syscall.SO_SNDTIMEO, &tv)
	for len(b) > 0 {
		n, err := syscall.Write(fd, b)
		if err == syscall.EINTR {
			continue
		}
		if err != nil || n <= 0 {
			return
		}
		b = b[n:]
	}
}

// runPassThrough runs a pass-through session on the loop until it ends.
func (s *Session) runPassThrough(l *evloop) error {
	r, err := l.attach(s)
	if err != nil {
		return s.refuse(err)
	}
	s.srv.ops.stats.SessionsLoop.Add(1)
	return s.end(passEnd{relayEnd{r}}, <-r.done)
}
