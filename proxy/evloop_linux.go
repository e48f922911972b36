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
// can use it (runFast), stopped by Shutdown once every session has ended.
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
	epfd int
	woke bool          // loop thread only: an event woke a client goroutine
	quit bool          // loop thread only: stop asked the loop to end
	done chan struct{} // closed when run has returned, its descriptors closed

	mu  sync.RWMutex
	fds map[int32]*relay // both fds of every relay

	tasks loopTasks // functions other goroutines run on the loop thread (admin_pause_linux.go)
}

func newEvloop() (*evloop, error) {
	fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	l := &evloop{epfd: fd, fds: map[int32]*relay{}, done: make(chan struct{})}
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
// buf[end:end+pend], not passed on, until it is whole, so that a message
// the loop must not pass on (see scan) never leaves a piece behind it.
type pipe struct {
	src, dst   int
	buf        []byte
	start, end int
	pend       int
	left       int
	status     bool // the next body byte is a ReadyForQuery status
	fromClient bool
	// held: PAUSE holds the client's next message (admin_pause_linux.go):
	// it and what follows wait in pend, not passed on, and the source is
	// not read.
	held bool
}

// relay is one session on the loop. Its pipes are touched only by the
// loop thread until done is sent; then only by the session goroutine.
type relay struct {
	s        *Session
	l        *evloop // the loop r is on: its Server's
	cfd, sfd int
	c2s, s2c pipe
	cEv, sEv uint32 // epoll interest registered for cfd and sfd
	max      int
	done     chan error
	ended    sync.Once
	// rest is what the client sent from a message over the limit on,
	// when the session leaves the loop for it (leaveLoop).
	rest []byte

	mu     sync.Mutex // guards closed against shutdownServer
	closed bool
	// cEvents counts the loop's events for a pass-through relay's client
	// socket (for observation: PAUSE must not make it spin).
	cEvents atomic.Uint64

	// half is set for an intercepted session, of which the loop relays
	// only the server→client direction (see attachHalf).
	half *half
}

// attach moves s onto the loop. It reports false, leaving s untouched,
// when s cannot be relayed there (a TLS connection, bytes already
// buffered by the goroutine path, or the upstream already closed).
func (l *evloop) attach(s *Session) (*relay, bool) {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	cfd, sfd, ok := dupSockets(s)
	if !ok {
		return nil, false
	}
	// Out of Go's netpoller: only the loop waits on these sockets now.
	s.client.Close()
	s.server.Close()
	size := s.srv.cfg.BufferSize
	r := &relay{
		s: s, l: l, cfd: cfd, sfd: sfd,
		c2s:  pipe{src: cfd, dst: sfd, buf: make([]byte, size), fromClient: true},
		s2c:  pipe{src: sfd, dst: cfd, buf: make([]byte, size)},
		cEv:  syscall.EPOLLIN | syscall.EPOLLRDHUP,
		sEv:  syscall.EPOLLIN | syscall.EPOLLRDHUP,
		max:  s.srv.cfg.MaxMessageSize,
		done: make(chan error, 1),
	}
	s.fast = r
	return l.publish(r, epollReg{cfd, r.cEv}, epollReg{sfd, r.sEv})
}

// epollReg is a socket and the events to watch it for.
type epollReg struct {
	fd     int
	events uint32
}

// sockets are the file descriptors the loop finds r by.
func (r *relay) sockets() []int {
	if r.half != nil {
		return []int{r.cfd, r.sfd, r.half.crfd}
	}
	return []int{r.cfd, r.sfd}
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
		l.fds[int32(fd)] = r
	}
	l.mu.Unlock()
	add(true)
	return r, true
}

// dupSockets duplicates s's client and server sockets for the loop. The
// caller holds s.connMu. It reports false, having changed nothing, for a
// TLS connection, an upstream already closed, or bytes already buffered
// by the goroutine path.
func dupSockets(s *Session) (cfd, sfd int, ok bool) {
	if s.sf.r.Buffered() > 0 || s.sw.Buffered() > 0 || s.cw.Buffered() > 0 || s.cf.r.Buffered() > 0 {
		return -1, -1, false
	}
	cc, ok1 := s.client.(syscall.Conn)
	sc, ok2 := s.server.(syscall.Conn)
	if !ok1 || !ok2 || s.serverClosed {
		return -1, -1, false
	}
	cfd, err := dupConn(cc)
	if err != nil {
		return -1, -1, false
	}
	if sfd, err = dupConn(sc); err != nil {
		syscall.Close(cfd)
		return -1, -1, false
	}
	return cfd, sfd, true
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
		delete(l.fds, int32(fd))
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
			r := l.fds[ev.Fd]
			l.mu.RUnlock()
			if r == nil {
				continue // ended earlier in this batch
			}
			l.event(r, int(ev.Fd), ev.Events)
		}
		if l.woke {
			// A client goroutine was woken: yield so that it runs now,
			// rather than after another thread steals it from this P.
			l.woke = false
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
	for _, r := range l.fds {
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
	if r.half != nil {
		l.halfEvent(r, fd, ev)
		return
	}
	var err error
	if fd == r.cfd {
		r.cEvents.Add(1)
		if r.c2s.held && ev&(syscall.EPOLLHUP|syscall.EPOLLERR) != 0 {
			err = fmt.Errorf("client: %w", io.EOF) // gone while PAUSE held it
		}
		if err == nil && ev&syscall.EPOLLOUT != 0 {
			err = r.flush(&r.s2c)
		}
		if err == nil && ev&readable != 0 {
			err = r.pump(&r.c2s)
		}
	} else {
		if ev&syscall.EPOLLOUT != 0 {
			err = r.flush(&r.c2s)
		}
		if err == nil && ev&readable != 0 {
			err = r.pump(&r.s2c)
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
			if in.end+in.pend < len(in.buf) {
				e |= syscall.EPOLLIN
			}
		}
		if out.start < out.end {
			e |= syscall.EPOLLOUT
		}
		return e
	}
	if e := want(&r.c2s, &r.s2c); e != r.cEv {
		if err := l.ctl(syscall.EPOLL_CTL_MOD, r.cfd, e); err != nil {
			return err
		}
		r.cEv = e
	}
	if e := want(&r.s2c, &r.c2s); e != r.sEv {
		if err := l.ctl(syscall.EPOLL_CTL_MOD, r.sfd, e); err != nil {
			return err
		}
		r.sEv = e
	}
	return nil
}

// pump reads what p's source has, checks its framing and writes it on.
func (r *relay) pump(p *pipe) error {
	if p.held {
		return nil // PAUSE holds it; RESUME goes on (unhold)
	}
	if p.end+p.pend == len(p.buf) && p.start > 0 {
		copy(p.buf, p.buf[p.start:p.end+p.pend])
		p.end -= p.start
		p.start = 0
	}
	if p.end+p.pend == len(p.buf) {
		return nil // full: the destination is slow; EPOLLOUT resumes us
	}
	n, err := rawIO(syscall.SYS_READ, p.src, p.buf[p.end+p.pend:])
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

// take scans the n bytes just read into p (after the pend bytes of a
// header held back) and passes on what scan accepts. A partial header at
// the end is held back; from a message the session must leave the loop
// for, everything is kept in r.rest.
func (r *relay) take(p *pipe, n int) error {
	b := p.buf[p.end : p.end+p.pend+n]
	cut, stop := r.scan(p, b)
	p.end += cut
	p.pend = len(b) - cut
	switch stop {
	case errLeaveLoop:
		r.rest = append(r.rest[:0], b[cut:]...)
		p.pend = 0
	case errHold:
		// The held message and what follows it wait in pend.
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
		if p.pend > 0 {
			copy(p.buf, p.buf[p.end:p.end+p.pend])
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
		typ, total, err := parseHeader(h, r.max, "client")
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
		syscall.Shutdown(r.sfd, syscall.SHUT_RDWR)
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
	blockingWrite(r.sfd, r.c2s.buf[r.c2s.start:r.c2s.end], 100*time.Millisecond)
	blockingWrite(r.sfd, []byte{'X', 0, 0, 0, 4}, 100*time.Millisecond)
	syscall.Close(r.sfd)
	blockingWrite(r.cfd, r.s2c.buf[r.s2c.start:r.s2c.end], time.Second)
	if msg != nil {
		blockingWrite(r.cfd, msg, time.Second)
	}
	syscall.Close(r.cfd)
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

// runFast runs s on the loop until it ends; it returns false (having done
// nothing) when s must use the goroutine path.
func (s *Session) runFast() (error, bool) {
	if s.srv.cfg.DisableEventLoop || s.srv.rs != nil {
		return nil, false
	}
	l, err := s.srv.loop.get()
	if err != nil {
		s.log.Warn("event loop unavailable; relaying with goroutines", zap.Error(err))
		return nil, false
	}
	if s.h != nil {
		return s.runHalf(l)
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
	client, err := fdConn(r.cfd)
	if err != nil {
		return fmt.Errorf("leave the event loop: %w", err)
	}
	server, err := fdConn(r.sfd)
	if err != nil {
		client.Close()
		return fmt.Errorf("leave the event loop: %w", err)
	}
	r.mu.Lock()
	r.closed = true // the relay's own descriptors are closed
	r.mu.Unlock()
	c2s, s2c := &r.c2s, &r.s2c
	s.fast, s.client, s.server = nil, client, server
	s.cf.r.Reset(io.MultiReader(bytes.NewReader(r.rest), client))
	s.sf.r.Reset(io.MultiReader(bytes.NewReader(s2c.buf[s2c.end:s2c.end+s2c.pend]), server))
	s.sw.Reset(server)
	s.cw.Reset(client)
	s.sw.Write(c2s.buf[c2s.start:c2s.end])
	s.cw.Write(s2c.buf[s2c.start:s2c.end])
	s.resume.left, s.resume.status = s2c.left, s2c.status
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
// those after it go to the goroutine (halfClient), which gives the client
// back to the loop once its socket is empty. A Handler that is not a
// LoopClient keeps its client side on the goroutine for good
// (Session.clientLoop). Both sockets leave Go's netpoller: the goroutine
// reads the client itself and, when it must wait for bytes, re-arms the
// loop's one-shot watch (clientReader); the loop wakes it and yields at
// once, so it runs on the loop's own thread instead of waking another (on
// a small VM a thread's wake-up costs tens of microseconds). The goroutine
// writes the server itself, blocking; the loop never blocks: what a socket
// does not take waits (out for the client, sout for the server) and the
// other side is not read until it has gone.
//
// The Handler's ServerMessage runs on the loop thread, so it must not
// block (fenceSession's holds its mutex only for short bookkeeping); a
// panic in either handler ends that session only.

// half is the loop's state for an intercepted session.
type half struct {
	big   bigMessage
	armed bool   // the server socket may be read (once) in this event
	out   []byte // bytes for the client its socket has not taken yet
	sEv   uint32 // epoll interest registered for the server socket
	cReg  bool   // the client socket is registered (for EPOLLOUT)
	// paused: the server is not read until the client takes what waits
	// (for observation: tests).
	paused atomic.Bool

	// The client's reads: crfd, another duplicate of the client socket,
	// is watched one-shot for the client goroutine, which the loop wakes
	// through cready (and runs on its own thread: see run); stop ends a
	// wait at the session's end.
	crfd   int
	cready chan struct{}
	stop   chan struct{}

	// A LoopClient Handler's client messages are handled on the loop
	// too (clientInline), until one must wait: then it and what follows
	// go to the client goroutine (cwork), which hands the client back
	// when the socket is empty. owner says who has the client side now;
	// its atomic store and load order the hand-back.
	inline bool        // a LoopClient: fixed when attached
	owner  atomic.Bool // true: the client goroutine
	cArmed bool        // the loop may read the client (once) in this event
	// cLevel: crfd is watched level-triggered (clientLevel), as it is
	// while the loop owns the client side and reads it; otherwise
	// one-shot. Only the loop thread (or attachHalf, before the loop can
	// see the session) reads or writes it.
	cLevel bool
	// cEvents counts the loop's events for crfd (for observation: a
	// watch left armed while the client is not read would spin).
	cEvents atomic.Uint64
	block   bool   // client goroutine: wait for the client's bytes
	sout    []byte // bytes for the server its socket has not taken yet (inline)
	// spaused: the client is not read until the server takes sout (for
	// observation: tests).
	spaused atomic.Bool
	cwork   chan struct{}
}

// errHandoff ends clientSteps on the loop: the next message must be
// handled on the client goroutine. errPaused ends it while the server
// has not taken what waits in sout.
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
	h := cr.r.half
	if cr.r.s.onLoop {
		return armedRead(h.crfd, &h.cArmed, b) // as loopReader
	}
	for {
		ready := true // the goroutine reads whenever it is asked to
		n, err := armedRead(h.crfd, &ready, b)
		if err != errWouldBlock || !h.block {
			return n, err // errWouldBlock between messages: back to the loop
		}
		if err := cr.l.ctl(syscall.EPOLL_CTL_MOD, h.crfd, clientWatch); err != nil {
			return 0, err
		}
		select {
		case <-h.cready:
		case <-h.stop:
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

// loopReader is the server framer's reader on the loop: one read per
// readable event, errWouldBlock otherwise.
type loopReader struct{ r *relay }

func (lr loopReader) Read(b []byte) (int, error) {
	return armedRead(lr.r.sfd, &lr.r.half.armed, b)
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

// loopWriter is the client writer's destination on the loop: it writes
// what the socket takes and keeps the rest in out, never blocking.
type loopWriter struct{ r *relay }

func (lw loopWriter) Write(b []byte) (int, error) {
	if err := writeOrHold(lw.r.cfd, &lw.r.half.out, b); err != nil {
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
		// On the loop: what the socket does not take waits in sout,
		// and the client is not read until it has gone.
		if err := writeOrHold(sw.r.sfd, &sw.r.half.sout, b); err != nil {
			return 0, err
		}
		return len(b), nil
	}
	n := 0
	for {
		k, err := writeAvail(sw.r.sfd, b[n:])
		if n += k; err != nil || n == len(b) {
			return n, err
		}
		fds := []unix.PollFd{{Fd: int32(sw.r.sfd), Events: unix.POLLOUT}}
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
		rawIO(syscall.SYS_WRITE, r.sfd, []byte{'X', 0, 0, 0, 4})
		syscall.Shutdown(r.sfd, syscall.SHUT_RDWR)
	}
}

// attachHalf moves an intercepted session s onto the loop (its client
// side too, for a LoopClient Handler). It reports false, leaving s
// untouched, when it cannot (TLS, or bytes already buffered).
func (l *evloop) attachHalf(s *Session) (*relay, bool) {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	cfd, sfd, ok := dupSockets(s)
	if !ok {
		return nil, false
	}
	crfd, err := syscall.Dup(cfd)
	if err != nil {
		syscall.Close(cfd)
		syscall.Close(sfd)
		return nil, false
	}
	syscall.CloseOnExec(crfd)
	r := &relay{
		s: s, l: l, cfd: cfd, sfd: sfd,
		half: &half{sEv: syscall.EPOLLIN | syscall.EPOLLRDHUP, crfd: crfd,
			cready: make(chan struct{}, 1), stop: make(chan struct{}), cwork: make(chan struct{}, 1)},
		max:  s.srv.cfg.MaxMessageSize,
		done: make(chan error, 1),
	}
	// Both sockets leave Go's netpoller, or every response would wake it
	// as well as the loop. The client goroutine reads the client
	// (clientReader) and writes the server (serverWriter); the loop reads
	// the server and writes the client; all through the duplicates.
	s.server.Close()
	s.client.Close()
	s.cf.r.Reset(clientReader{l, r})
	s.sf.r.Reset(loopReader{r})
	s.cw.Reset(loopWriter{r})
	s.sw.Reset(serverWriter{r})
	s.fast = r
	cEv := uint32(clientWatch)
	if lc, ok := s.h.(LoopClient); ok && lc.LoopClient() {
		r.half.inline = true
		r.half.cLevel = true
		cEv = clientLevel
	} else {
		// The client side is the goroutine's for good, and it waits.
		r.half.owner.Store(true)
		r.half.block = true
	}
	// The client's writes are watched only while out holds bytes.
	return l.publish(r, epollReg{crfd, cEv}, epollReg{sfd, r.half.sEv})
}

// halfEvent handles an event of an intercepted session: the server
// socket is readable (or closed), or the client socket has room for what
// waits in out.
func (l *evloop) halfEvent(r *relay, fd int, ev uint32) {
	err := func() (err error) {
		defer func() {
			if p := recover(); p != nil {
				r.s.log.Error("panic in session", zap.String("side", "server"), zap.Any("panic", p), zap.ByteString("stack", debug.Stack()))
				err = fmt.Errorf("server loop panic: %v", p)
			}
		}()
		h := r.half
		if fd == h.crfd {
			h.cEvents.Add(1)
			if !h.owner.Load() {
				h.cArmed = true
				err := l.clientInline(r)
				h.cArmed = false
				return err
			}
			select {
			case h.cready <- struct{}{}:
			default:
			}
			l.woke = true
			return nil
		}
		if fd == r.sfd && ev&syscall.EPOLLOUT != 0 {
			if err := drainHeld(r.sfd, &h.sout, r.s.cf.r.Size()); err != nil {
				return fmt.Errorf("server: %w", err)
			}
			if len(h.sout) == 0 && !h.owner.Load() {
				// Go on with the client's messages held meanwhile.
				if err := l.clientInline(r); err != nil {
					return err
				}
			}
			if ev&readable == 0 {
				return nil
			}
		}
		if fd == r.cfd {
			if err := drainHeld(r.cfd, &h.out, r.s.sf.r.Size()); err != nil {
				return fmt.Errorf("client: %w", err)
			}
			if len(h.out) >= r.s.sf.r.Size() {
				return nil
			}
			return r.serverSteps(false) // messages held while out was full
		}
		h.armed = true
		// The server closed (or shutdown closed it): take what is left
		// even if the client is slow, so the end is seen.
		return r.serverSteps(ev&(syscall.EPOLLRDHUP|syscall.EPOLLHUP|syscall.EPOLLERR) != 0)
	}()
	if err == nil {
		err = l.halfInterest(r)
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
	s, h := r.s, r.half
	s.onLoop = true
	err := func() error {
		defer func() { s.onLoop = false }() // a Handler's panic too
		return r.clientSteps()
	}()
	switch err {
	case errWouldBlock:
		if len(h.sout) > 0 {
			// Read on once the server has taken it (halfEvent).
			return l.watchClient(r, false)
		}
		return l.watchClient(r, true)
	case errPaused:
		return l.watchClient(r, false)
	case errHold:
		return l.parkHalf(r) // admin_pause_linux.go
	case errHandoff:
		// The goroutine reads the client now and arms the one-shot
		// watch itself when it must wait.
		if err := l.watchClient(r, false); err != nil {
			return err
		}
		s.srv.ops.stats.ClientHandoffs.Add(1)
		h.owner.Store(true)
		h.cwork <- struct{}{}
		l.woke = true
		return nil
	}
	return err
}

// watchClient makes the loop's watch of an intercepted session's client
// level-triggered (reads on) or disarmed (reads off), changing the
// registration only when it differs. Loop thread only.
func (l *evloop) watchClient(r *relay, on bool) error {
	h := r.half
	if h.cLevel == on {
		return nil
	}
	ev := uint32(clientOff)
	if on {
		ev = clientLevel
	}
	if err := l.ctl(syscall.EPOLL_CTL_MOD, h.crfd, ev); err != nil {
		return err
	}
	h.cLevel = on
	return nil
}

// clientSteps handles the client messages that have arrived, reading the
// socket without blocking: on the loop (s.onLoop) or on the client
// goroutine after a hand-off. It returns errWouldBlock when the client
// has nothing more (a message may be partly read: it stays buffered).
func (r *relay) clientSteps() error {
	s, h := r.s, r.half
	size := s.cf.r.Size()
	for {
		if s.onLoop && len(h.sout) > 0 {
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
		h.block = big
		err = s.clientMessage(typ, total, size)
		h.block = false
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
// must go to the client goroutine. Not while bytes wait in sout: the
// goroutine writes the server directly, which would pass them. (sout
// only grows within a message's own writes, and clientSteps stops at the
// next message then, so this is a guard for that invariant.) The message
// stays unread (ErrWait: nothing was done) and is handled again once the
// server has taken them.
func (r *relay) handoff() error {
	if len(r.half.sout) > 0 {
		return errPaused
	}
	return errHandoff
}

// halfClient is the client goroutine of a LoopClient session: it handles
// the client's messages from a hand-off until the client has nothing
// more, then gives the client back to the loop.
func (r *relay) halfClient(l *evloop) error {
	h := r.half
	for {
		select {
		case <-h.cwork:
		case <-h.stop:
			return errSessionClosing
		}
		if err := r.clientSteps(); err != errWouldBlock {
			return err
		}
		// Hand back: the one-shot watch, armed after the store, wakes the
		// loop for the next bytes (the loop then makes it level-triggered:
		// watchClient). Nothing else makes the loop change the watch
		// meanwhile: sout is empty while the goroutine owns the client.
		h.owner.Store(false)
		if err := l.ctl(syscall.EPOLL_CTL_MOD, h.crfd, clientWatch); err != nil {
			return err
		}
	}
}

// serverSteps forwards the server messages that have arrived, while the
// client keeps up (or always, with force), then flushes.
func (r *relay) serverSteps(force bool) error {
	s, h := r.s, r.half
	limit := s.sf.r.Size()
	for force || len(h.out) < limit {
		if err := s.serverMessage(&h.big); err != nil {
			if err == errWouldBlock {
				break
			}
			return err
		}
	}
	h.armed = false
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

// halfInterest keeps the registrations in step with out: the server is
// read while out has room, the client socket is watched while out holds
// bytes.
func (l *evloop) halfInterest(r *relay) error {
	h := r.half
	var sEv uint32 = syscall.EPOLLRDHUP
	if len(h.out) < r.s.sf.r.Size() {
		sEv |= syscall.EPOLLIN
	}
	if len(h.sout) > 0 {
		sEv |= syscall.EPOLLOUT
	}
	if sEv != h.sEv {
		if err := l.ctl(syscall.EPOLL_CTL_MOD, r.sfd, sEv); err != nil {
			return err
		}
		h.sEv = sEv
		h.paused.Store(sEv&syscall.EPOLLIN == 0)
		h.spaused.Store(sEv&syscall.EPOLLOUT != 0)
	}
	if want := len(h.out) > 0; want != h.cReg {
		op := syscall.EPOLL_CTL_DEL
		if want {
			op = syscall.EPOLL_CTL_ADD
		}
		if err := l.ctl(op, r.cfd, syscall.EPOLLOUT); err != nil {
			return err
		}
		h.cReg = want
	}
	return nil
}

// runHalf runs an intercepted session with its server side on the loop
// (the client side on a goroutine); it returns false, having done
// nothing, when the session must use goroutines for both.
func (s *Session) runHalf(l *evloop) (error, bool) {
	r, ok := l.attachHalf(s)
	if !ok {
		return nil, false
	}
	s.srv.ops.stats.SessionsLoop.Add(1)
	errc := make(chan error, 2)
	var wg sync.WaitGroup
	wg.Add(2)
	client := s.clientLoop
	if r.half.inline {
		client = func() error { return r.halfClient(l) }
	}
	go func() { defer wg.Done(); errc <- s.guard("client", client) }()
	go func() { defer wg.Done(); errc <- <-r.done }()
	err := <-errc
	close(s.closing)
	s.closeServer()
	close(r.half.stop)
	wg.Wait()
	msg, err := s.endReason(err, <-errc)
	// The loop has let go of r: what is still buffered for the client is
	// passed on here, blocking.
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	s.cw.Flush()
	blockingWrite(r.cfd, r.half.out, time.Second)
	if msg != nil {
		blockingWrite(r.cfd, msg, time.Second)
	}
	syscall.Close(r.sfd)
	syscall.Close(r.cfd)
	syscall.Close(r.half.crfd)
	s.q.drain()
	s.h.Close(s)
	return err, true
}
