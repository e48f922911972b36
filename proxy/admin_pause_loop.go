//go:build linux

package proxy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"syscall"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// PAUSE on the event loop (admin_pause.go). The loop must not block, so
// a session whose next message PAUSE holds is parked: the loop stops
// reading its client (the pass-through relay keeps the bytes it has
// already read after its pipe's end, an intercepted session's message
// stays in its framer) and registers a wake-up with the pause. RESUME
// posts the session back to the loop thread through loopTasks, where it
// goes on exactly where it stopped, checking the pause again. A parked
// session costs no CPU: no socket of it is watched for reading (a
// client that hangs up is still noticed: EPOLLHUP is always reported, and
// ends the session).

// errHold ends a scan or a client step on the loop: PAUSE holds the
// client's next message.
var errHold = errors.New("client message held by PAUSE")

// loopTasks runs functions on the loop thread for other goroutines: an
// eventfd the loop watches, and a queue.
type loopTasks struct {
	fd     int
	mu     sync.Mutex
	q      []func()
	closed bool // the loop has stopped: posts are dropped
}

func (t *loopTasks) init(l *evloop) error {
	fd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return fmt.Errorf("eventfd: %w", err)
	}
	if err := l.ctl(syscall.EPOLL_CTL_ADD, fd, syscall.EPOLLIN); err != nil {
		unix.Close(fd)
		return fmt.Errorf("epoll_ctl eventfd: %w", err)
	}
	t.fd = fd
	return nil
}

// post has f run on the loop thread soon; after the loop has stopped,
// never. Any goroutine.
func (t *loopTasks) post(f func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return
	}
	t.q = append(t.q, f)
	var one [8]byte
	binary.NativeEndian.PutUint64(one[:], 1)
	unix.Write(t.fd, one[:]) // EAGAIN only when the counter is full: an event is due anyway
}

// close closes the eventfd and drops what is still queued. Loop thread,
// as the loop stops.
func (t *loopTasks) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	t.q = nil
	unix.Close(t.fd)
}

// run runs the posted functions. Loop thread.
func (t *loopTasks) run() {
	var b [8]byte
	unix.Read(t.fd, b[:])
	t.mu.Lock()
	q := t.q
	t.q = nil
	t.mu.Unlock()
	for _, f := range q {
		f()
	}
}

// counted counts n bytes read into p, for SHOW STATS.
func (r *relay) counted(p *pipe, n int) {
	if p.fromClient {
		r.s.info.stats.recv.Add(int64(n))
	} else {
		r.s.info.stats.sent.Add(int64(n))
	}
}

// owns reports whether r is still on the loop. Loop thread.
func (l *evloop) owns(r *relay) bool {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.byFD[int32(r.serverFD)] == r
}

// onLoopThread runs f for r on the loop thread if r is still there,
// ending r when f fails or panics.
func (l *evloop) onLoopThread(r *relay, f func() error) {
	if !l.owns(r) {
		return
	}
	err := func() (err error) {
		defer func() {
			if p := recover(); p != nil {
				r.s.log.Error("panic in session", zap.String("side", "client"), zap.Any("panic", p), zap.ByteString("stack", debug.Stack()))
				err = fmt.Errorf("client loop panic: %v", p)
			}
		}()
		return f()
	}()
	if err != nil {
		l.end(r, err)
	}
}

// parkRelay parks a pass-through relay whose client's message PAUSE
// holds (its bytes wait in toServer's heldBack).
func (r *relay) parkRelay() error {
	l := r.l
	wake := func() { l.tasks.post(func() { l.onLoopThread(r, func() error { return l.unhold(r) }) }) }
	if !r.s.park(wake) {
		wake() // resumed meanwhile
	}
	return nil
}

// unhold goes on with a parked pass-through relay's held bytes.
func (l *evloop) unhold(r *relay) error {
	p := &r.toServer
	if !p.held {
		return nil
	}
	p.held = false
	stop := r.take(p, 0)
	if err := r.flush(p); err != nil {
		return err
	}
	if stop != nil {
		return stop
	}
	if err := r.pumpMore(p); err != nil {
		return err
	}
	return l.interest(r)
}

// parkIntercepted parks an intercepted session whose client's message PAUSE
// holds on the loop (the message stays in the client framer).
func (l *evloop) parkIntercepted(r *relay) error {
	if err := l.watchClient(r, clientOff); err != nil {
		return err
	}
	wake := func() {
		l.tasks.post(func() {
			l.onLoopThread(r, func() error {
				if err := l.clientInline(r); err != nil {
					return err
				}
				return l.interceptInterest(r)
			})
		})
	}
	if !r.s.park(wake) {
		wake()
	}
	return nil
}
