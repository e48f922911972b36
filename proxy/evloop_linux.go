//go:build linux

package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// The event loop relays the bytes of pass-through sessions (no Handler,
// no read routing, no TLS) on one OS thread that waits in epoll_wait, the
// way PgBouncer does, instead of two goroutines per session. Each Server
// owns one (serverLoop), started by its first session and stopped, its
// epoll fd closed, by Shutdown.
//
// Why: with goroutines, every hop of a query (client → proxy → server and
// back) is a netpoller wake-up of a parked goroutine, handed between OS
// threads through the scheduler; on a small machine that costs more than
// the work itself. A thread that blocks in epoll_wait itself and does the
// reads and writes inline has no hand-off at all. (The measurements behind
// this file's choices are in docs/proxy.md, Performance.)
//
// The loop calls epoll_wait as a raw system call, so the runtime
// does not hand its P to another thread on every wait (through
// syscall.Syscall6 most of the gain is lost). The loop therefore
// keeps one P busy; the process's GOMAXPROCS is raised by one while a loop
// runs, so the rest of the proxy keeps the parallelism it had. The wait
// stays interruptible: the runtime's preemption signal ends epoll_wait
// with EINTR, and the loop is preempted at its next function call, so it
// never holds up a garbage collection.
//
// The sockets leave Go's netpoller (their net.Conns are closed after the
// file descriptors are duplicated), so an event wakes only this thread.
// The loop validates framing exactly like the goroutine path (frontend
// message types, the message size limit, Terminate) and keeps the
// session's transaction status and in-flight count, so graceful shutdown
// and the admin console see the same session either way.

// serverLoop is a Server's event loop: started by the first session that
// can use it (runOnLoop), stopped by Shutdown once every session has ended.
// Each Server has its own; several in one process (tests) each run a loop
// thread.
type serverLoop struct {
	mu      sync.Mutex
	l       *evloop
	err     error // newEvloop's, kept: the loop is not tried again
	stopped bool
}

// errLoopStopped: the Server has shut down, and its loop with it.
var errLoopStopped = errors.New("event loop stopped: the server has shut down")

// get returns the Server's event loop, starting it on first use.
func (sl *serverLoop) get() (*evloop, error) {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	switch {
	case sl.stopped:
		return nil, errLoopStopped
	case sl.l == nil && sl.err == nil:
		sl.l, sl.err = newEvloop()
		if sl.err == nil {
			runtime.GOMAXPROCS(runtime.GOMAXPROCS(0) + 1)
			go sl.l.run()
		}
	}
	return sl.l, sl.err
}

// stop ends the loop, if it was started, and waits until its thread has
// closed the epoll fd; the loop is not started again. The Server calls it
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
	epfd          int
	wokeGoroutine bool          // loop thread only: an event woke a client goroutine
	quit          bool          // loop thread only: stop asked the loop to end
	done          chan struct{} // closed when run has returned, its descriptors closed

	mu   sync.RWMutex
	byFD map[int32]*relay // every relay, by each of its sockets

	tasks loopTasks // functions other goroutines run on the loop thread (admin_pause_linux.go)
}

func newEvloop() (*evloop, error) {
	fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	l := &evloop{epfd: fd, byFD: map[int32]*relay{}, done: make(chan struct{})}
	if err := l.tasks.init(l); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	return l, nil
}

// pipe is one direction of a relay: bytes read from src wait in
// buf[start:end] until written to dst. It tracks message framing across
// reads without copying: left counts the body bytes of the current
// message still to come; a header split between reads is held back in
// buf[end:end+heldBack], not passed on, until it is whole, so that a
// message the loop must not pass on (see scan) never leaves a piece behind
// it.
type pipe struct {
	src, dst   int
	buf        []byte
	start, end int
	heldBack   int
	left       int
	status     bool // the next body byte is a ReadyForQuery status
	fromClient bool
	// held: PAUSE holds the client's next message (admin_pause_linux.go):
	// it and what follows wait in heldBack, not passed on, and the source
	// is not read.
	held bool
}

// relay is one session on the loop. Its pipes are touched only by the
// loop thread until done is sent; then only by the session goroutine.
type relay struct {
	s                              *Session
	l                              *evloop // the loop r is on: its Server's
	clientFD, serverFD             int
	toServer, toClient             pipe
	clientInterest, serverInterest uint32 // epoll interest registered for clientFD and serverFD
	maxMessage                     int    // Config.MaxMessageSize
	done                           chan error
	ended                          sync.Once
	// rest is what the client sent from a message over the limit on,
	// when the session leaves the loop for it (leaveLoop).
	rest []byte

	mu     sync.Mutex // guards closed against shutdownServer
	closed bool
	// clientEventCount counts the loop's events for a pass-through
	// relay's client socket (for observation: PAUSE must not make it
	// spin).
	clientEventCount atomic.Uint64

	// intercept is set for an intercepted session (one with a Handler),
	// which the loop relays message by message (see attachIntercepted).
	intercept *interceptState
}

// attach moves s onto the loop. It reports false, leaving s untouched,
// when s cannot be relayed there (a TLS connection, bytes already
// buffered by the goroutine path, or the upstream already closed).
func (l *evloop) attach(s *Session) (*relay, bool) {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	clientFD, serverFD, ok := dupSockets(s)
	if !ok {
		return nil, false
	}
	// Out of Go's netpoller: only the loop waits on these sockets now.
	s.client.Close()
	s.server.Close()
	size := s.srv.cfg.BufferSize
	r := &relay{
		s: s, l: l, clientFD: clientFD, serverFD: serverFD,
		toServer:       pipe{src: clientFD, dst: serverFD, buf: make([]byte, size), fromClient: true},
		toClient:       pipe{src: serverFD, dst: clientFD, buf: make([]byte, size)},
		clientInterest: syscall.EPOLLIN | syscall.EPOLLRDHUP,
		serverInterest: syscall.EPOLLIN | syscall.EPOLLRDHUP,
		maxMessage:     s.srv.cfg.MaxMessageSize,
		done:           make(chan error, 1),
	}
	s.loopRelay = r
	return l.publish(r, epollReg{clientFD, r.clientInterest}, epollReg{serverFD, r.serverInterest})
}

// epollReg is a socket and the events to watch it for.
type epollReg struct {
	fd     int
	events uint32
}

// sockets are the file descriptors the loop finds r by.
func (r *relay) sockets() []int {
	if r.intercept != nil {
		return []int{r.clientFD, r.serverFD, r.intercept.clientReadFD}
	}
	return []int{r.clientFD, r.serverFD}
}

// publish registers fds for events and lets the loop find r by its
// sockets. Level-triggered sockets are registered first: an event that
// comes before r can be found is reported again. A one-shot event is
// not, so those are registered last, once r can be found. A
// registration that fails ends r at once.
func (l *evloop) publish(r *relay, regs ...epollReg) (*relay, bool) {
	add := func(oneshot bool) bool {
		for _, g := range regs {
			if (g.events&syscall.EPOLLONESHOT != 0) != oneshot {
				continue
			}
			if err := l.ctl(syscall.EPOLL_CTL_ADD, g.fd, g.events); err != nil {
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
// caller holds s.connMu. It reports false, having changed nothing, for a
// TLS connection, an upstream already closed, or bytes already buffered
// by the goroutine path.
func dupSockets(s *Session) (clientFD, serverFD int, ok bool) {
	if s.sf.r.Buffered() > 0 || s.sw.Buffered() > 0 || s.cw.Buffered() > 0 || s.cf.r.Buffered() > 0 {
		return -1, -1, false
	}
	cc, ok1 := s.client.(syscall.Conn)
	sc, ok2 := s.server.(syscall.Conn)
	if !ok1 || !ok2 || s.serverClosed {
		return -1, -1, false
	}
	clientFD, err := dupConn(cc)
	if err != nil {
		return -1, -1, false
	}
	if serverFD, err = dupConn(sc); err != nil {
		syscall.Close(clientFD)
		return -1, -1, false
	}
	return clientFD, serverFD, true
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

func (l *evloop) ctl(op, fd int, events uint32) error {
	ev := syscall.EpollEvent{Events: events, Fd: int32(fd)}
	return syscall.EpollCtl(l.epfd, op, fd, &ev)
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
// epoll_wait holding its P. Unlocked, the goroutine moved between threads
// and the kernel moved the thread that ran it between CPUs about once per
// transaction, which cost CPU per transaction; a yield now costs two
// thread hand-offs, but the loop yields only every yieldEvery and after
// waking a goroutine.
func (l *evloop) run() {
	runtime.LockOSThread()
	events := make([]syscall.EpollEvent, 256)
	last := time.Now()
	idle := false
	work := 0 // events (and waits) since the clock was last read
	for !l.quit {
		var n int
		var errno syscall.Errno
		if idle {
			// Nothing for a while: wait as an ordinary system call,
			// giving the P back, so an idle proxy costs nothing.
			n, errno = epollWaitIdle(l.epfd, events)
		} else {
			n, errno = epollWait(l.epfd, events, int(yieldEvery/time.Millisecond))
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
				continue
			}
			// EBADF/EINVAL cannot happen with our own epoll fd; back off
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
		if l.wokeGoroutine {
			// A client goroutine was woken: yield so that it runs now,
			// rather than after another thread steals it from this P.
			l.wokeGoroutine = false
			runtime.Gosched()
			last = time.Now()
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
	syscall.Close(l.epfd)
	runtime.UnlockOSThread()
	close(l.done)
}

// epollWait waits up to msec milliseconds. It is a raw system call (see
// the comment at the top); it is a separate function so the loop passes
// a preemption check after every wake-up.
//
//go:noinline
func epollWait(epfd int, events []syscall.EpollEvent, msec int) (int, syscall.Errno) {
	n, _, errno := syscall.RawSyscall6(syscall.SYS_EPOLL_WAIT, uintptr(epfd), uintptr(unsafe.Pointer(&events[0])), uintptr(len(events)), uintptr(msec), 0, 0)
	return int(n), errno
}

// epollWaitIdle waits without a timeout through the runtime's system
// call path, which releases the P while blocked.
func epollWaitIdle(epfd int, events []syscall.EpollEvent) (int, syscall.Errno) {
	n, _, errno := syscall.Syscall6(syscall.SYS_EPOLL_WAIT, uintptr(epfd), uintptr(unsafe.Pointer(&events[0])), uintptr(len(events)), ^uintptr(0), 0, 0)
	return int(n), errno
}

// rawIO reads or writes a non-blocking socket. It never blocks, so it
// skips the runtime's system call bookkeeping, as epollWait does.
func rawIO(trap uintptr, fd int, b []byte) (int, error) {
	r, _, errno := syscall.RawSyscall(trap, uintptr(fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	if errno != 0 {
		return -1, errno
	}
	return int(r), nil
}

const readable = syscall.EPOLLIN | syscall.EPOLLRDHUP | syscall.EPOLLHUP | syscall.EPOLLERR

func (l *evloop) event(r *relay, fd int, ev uint32) {
	if r.intercept != nil {
		l.interceptEvent(r, fd, ev)
		return
	}
	var err error
	if fd == r.clientFD {
		r.clientEventCount.Add(1)
		if r.toServer.held && ev&(syscall.EPOLLHUP|syscall.EPOLLERR) != 0 {
			err = fmt.Errorf("client: %w", io.EOF) // gone while PAUSE held it
		}
		if err == nil && ev&syscall.EPOLLOUT != 0 {
			err = r.flush(&r.toClient)
		}
		if err == nil && ev&readable != 0 {
			err = r.pump(&r.toServer)
		}
	} else {
		if ev&syscall.EPOLLOUT != 0 {
			err = r.flush(&r.toServer)
		}
		if err == nil && ev&readable != 0 {
			err = r.pump(&r.toClient)
		}
	}
	if err == nil {
		err = l.interest(r)
	}
	if err != nil {
		l.end(r, err)
	}
}

// end takes r off the loop and hands it to its session goroutine with the
// reason, once.
func (l *evloop) end(r *relay, err error) {
	r.ended.Do(func() {
		for _, fd := range r.sockets() {
			l.ctl(syscall.EPOLL_CTL_DEL, fd, 0) // not registered: ENOENT, harmless
		}
		l.forget(r)
		r.done <- err
	})
}

// interest keeps the epoll registration in step with the buffers: read a
// side only while its pipe has room, wait for writability only while
// bytes wait for that side. On the common path nothing changes.
func (l *evloop) interest(r *relay) error {
	want := func(in *pipe, out *pipe) uint32 {
		var e uint32
		if !in.held { // PAUSE holds the client: do not read it
			e = syscall.EPOLLRDHUP
			if in.end+in.heldBack < len(in.buf) {
				e |= syscall.EPOLLIN
			}
		}
		if out.start < out.end {
			e |= syscall.EPOLLOUT
		}
		return e
	}
	if e := want(&r.toServer, &r.toClient); e != r.clientInterest {
		if err := l.ctl(syscall.EPOLL_CTL_MOD, r.clientFD, e); err != nil {
			return err
		}
		r.clientInterest = e
	}
	if e := want(&r.toClient, &r.toServer); e != r.serverInterest {
		if err := l.ctl(syscall.EPOLL_CTL_MOD, r.serverFD, e); err != nil {
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
		return nil // full: the destination is slow; EPOLLOUT resumes us
	}
	n, err := rawIO(syscall.SYS_READ, p.src, p.buf[p.end+p.heldBack:])
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
	r.counted(p, n) // SHOW STATS: admin_pause_linux.go
	stop := r.take(p, n)
	if err := r.flush(p); err != nil {
		return err
	}
	return stop
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
	n, err := writeAvail(p.dst, p.buf[p.start:p.end])
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

// errLeaveLoop ends a pass-through relay at a client message over the
// limit: answering it needs the goroutine path (limits.go), to which the
// session moves (leaveLoop).
var errLeaveLoop = errors.New("client message over the limit: leaving the event loop")

// scan walks the message boundaries in b, newly read into p. It returns
// how many bytes of b to pass on and, when the session must end after
// them, why: a protocol error, the client's Terminate, the end of a
// graceful shutdown after a ReadyForQuery, or a client message over the
// limit (errLeaveLoop). A header not yet whole at the end of b is not
// passed on. It checks what the goroutine path's framer checks
// (parseHeader, frontendTypes, Session.nextClient): FuzzLoopFraming.
func (r *relay) scan(p *pipe, b []byte) (int, error) {
	s := r.s
	i := 0
	for i < len(b) {
		if p.left > 0 {
			if p.status {
				p.status = false
				s.txStatus.Store(uint32(b[i]))
				p.left--
				i++
				n := s.pending.Add(-1)
				s.readyForQuery(n) // admin_pause.go
				if n == 0 && s.srv.draining.Load() && s.tryCloseIdle() {
					return i, errShutdown
				}
				continue
			}
			k := min(p.left, len(b)-i)
			p.left -= k
			i += k
			continue
		}
		if len(b)-i < headerLen {
			break // held back until it is whole
		}
		h := b[i : i+headerLen]
		if !p.fromClient {
			typ, total, err := parseHeader(h, 0, "server")
			if err != nil {
				return i, fmt.Errorf("server: %w", err)
			}
			p.left = total - headerLen
			p.status = typ == 'Z' && total == headerLen+1
			i += headerLen
			continue
		}
		// A client message begins (PAUSE: admin_pause.go): it counts as
		// in flight from here until it is accounted.
		if s.holdMessage(h[0]) {
			return i, errHold
		}
		typ, total, err := parseHeader(h, r.maxMessage, "client")
		switch {
		case errors.Is(err, ErrMessageTooLarge) && answerable(typ):
			s.releaseMessage(false) // handled again, on the goroutine path
			return i, errLeaveLoop
		case err != nil:
			return i, fmt.Errorf("client: %w", err)
		case !frontendTypes[typ]:
			return i, &ProtocolError{Code: "08P01", Msg: fmt.Sprintf("invalid frontend message type %d", typ)}
		}
		if !s.account(typ) {
			return i, errShutdown
		}
		s.releaseMessage(true)
		if typ == 'X' {
			// Not passed on: finish sends the server a Terminate of its
			// own (whatever length the client's claimed).
			return i, errClientTerminate
		}
		p.left = total - headerLen
		i += headerLen
	}
	return i, nil
}

// shutdownServer ends the upstream connection from another goroutine
// (graceful shutdown): the loop sees the end of the stream and finishes
// the session.
func (r *relay) shutdownServer() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.closed {
		syscall.Shutdown(r.serverFD, syscall.SHUT_RDWR)
	}
}

// finish runs on the session goroutine once the loop has let go of r:
// it passes on what was still buffered, tells the client why the session
// ends when that is a protocol error or a shutdown (msg), and closes both
// sockets.
func (r *relay) finish(msg []byte) {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	blockingWrite(r.serverFD, r.toServer.buf[r.toServer.start:r.toServer.end], 100*time.Millisecond)
	blockingWrite(r.serverFD, []byte{'X', 0, 0, 0, 4}, 100*time.Millisecond)
	syscall.Close(r.serverFD)
	blockingWrite(r.clientFD, r.toClient.buf[r.toClient.start:r.toClient.end], time.Second)
	if msg != nil {
		blockingWrite(r.clientFD, msg, time.Second)
	}
	syscall.Close(r.clientFD)
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

// runOnLoop runs s on the loop until it ends; it returns false (having done
// nothing) when s must use the goroutine path.
func (s *Session) runOnLoop() (error, bool) {
	if s.srv.cfg.DisableEventLoop || s.srv.rs != nil {
		return nil, false
	}
	l, err := s.srv.loop.get()
	if err != nil {
		s.log.Warn("event loop unavailable; relaying with goroutines", zap.Error(err))
		return nil, false
	}
	if s.h != nil {
		return s.runIntercepted(l)
	}
	r, ok := l.attach(s)
	if !ok {
		return nil, false
	}
	s.srv.ops.stats.SessionsLoop.Add(1)
	err = <-r.done
	if err == errLeaveLoop {
		if err = s.leaveLoop(r); err == nil {
			return nil, false // on goroutines from here (Session.run)
		}
	}
	close(s.closing)
	msg, err := s.endReason(err, nil)
	r.finish(msg)
	return err, true
}

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
	r.mu.Lock()
	r.closed = true // the relay's own descriptors are closed
	r.mu.Unlock()
	toServer, toClient := &r.toServer, &r.toClient
	s.loopRelay, s.client, s.server = nil, client, server
	s.cf.r.Reset(io.MultiReader(bytes.NewReader(r.rest), client))
	s.sf.r.Reset(io.MultiReader(bytes.NewReader(toClient.buf[toClient.end:toClient.end+toClient.heldBack]), server))
	s.sw.Reset(server)
	s.cw.Reset(client)
	s.sw.Write(toServer.buf[toServer.start:toServer.end])
	s.cw.Write(toClient.buf[toClient.start:toClient.end])
	s.resume.left, s.resume.status = toClient.left, toClient.status
	return nil
}

// fdConn makes a net.Conn of a duplicate of fd, and closes fd.
func fdConn(fd int) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), "")
	defer f.Close()
	return net.FileConn(f)
}

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
	n := 0
	for {
		k, err := writeAvail(sw.r.serverFD, b[n:])
		if n += k; err != nil || n == len(b) {
			return n, err
		}
		fds := []unix.PollFd{{Fd: int32(sw.r.serverFD), Events: unix.POLLOUT}}
		if _, err := unix.Poll(fds, -1); err != nil && err != unix.EINTR {
			return n, err
		}
	}
}

// terminateServer ends an intercepted session's upstream connection from
// any goroutine: a Terminate if the socket takes it at once, then
// shutdown, which the loop sees (and which ends a wait for room in
// serverWriter).
func (r *relay) terminateServer() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.closed {
		rawIO(syscall.SYS_WRITE, r.serverFD, []byte{'X', 0, 0, 0, 4})
		syscall.Shutdown(r.serverFD, syscall.SHUT_RDWR)
	}
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
		maxMessage: s.srv.cfg.MaxMessageSize,
		done:       make(chan error, 1),
	}
	// Both sockets leave Go's netpoller, or every response would wake it
	// as well as the loop. The client goroutine reads the client
	// (clientReader) and writes the server (serverWriter); the loop reads
	// the server and writes the client; all through the duplicates.
	s.server.Close()
	s.client.Close()
	s.cf.r.Reset(clientReader{l, r})
	s.sf.r.Reset(loopServerReader{r})
	s.cw.Reset(loopClientWriter{r})
	s.sw.Reset(serverWriter{r})
	s.loopRelay = r
	clientInterest := uint32(clientWatch)
	if lc, ok := s.h.(LoopClient); ok && lc.LoopClient() {
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
			if err := drainHeld(r.serverFD, &ic.serverPending, r.s.cf.r.Size()); err != nil {
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
			if err := drainHeld(r.clientFD, &ic.clientPending, r.s.sf.r.Size()); err != nil {
				return fmt.Errorf("client: %w", err)
			}
			if len(ic.clientPending) >= r.s.sf.r.Size() {
				return nil
			}
			return r.serverSteps(false) // messages held while clientPending was full
		}
		ic.serverReadArmed = true
		// The server closed (or shutdown closed it): take what is left
		// even if the client is slow, so the end is seen.
		return r.serverSteps(ev&(syscall.EPOLLRDHUP|syscall.EPOLLHUP|syscall.EPOLLERR) != 0)
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
	size := s.cf.r.Size()
	for {
		if s.onLoop && len(ic.serverPending) > 0 {
			return errPaused
		}
		typ, total, err := s.nextClient()
		if err != nil {
			return err
		}
		big := total > size || total-headerLen > s.cf.max
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
	limit := s.sf.r.Size()
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
	if len(ic.clientPending) < r.s.sf.r.Size() {
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
	return nil
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
	errc := make(chan error, 2)
	var wg sync.WaitGroup
	wg.Add(2)
	client := s.clientLoop
	if r.intercept.inlineClient {
		client = func() error { return r.interceptClient(l) }
	}
	go func() { defer wg.Done(); errc <- s.guard("client", client) }()
	go func() { defer wg.Done(); errc <- <-r.done }()
	err := <-errc
	close(s.closing)
	s.closeServer()
	close(r.intercept.stop)
	wg.Wait()
	msg, err := s.endReason(err, <-errc)
	// The loop has let go of r: what is still buffered for the client is
	// passed on here, blocking.
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	s.cw.Flush()
	blockingWrite(r.clientFD, r.intercept.clientPending, time.Second)
	if msg != nil {
		blockingWrite(r.clientFD, msg, time.Second)
	}
	syscall.Close(r.serverFD)
	syscall.Close(r.clientFD)
	syscall.Close(r.intercept.clientReadFD)
	s.q.drain()
	s.h.Close(s)
	return err, true
}
