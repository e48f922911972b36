package proxy

import (
	"errors"
	"fmt"
	"runtime/debug"
	"sync"

	"go.uber.org/zap"
)

// PAUSE on the event loop (admin_pause.go). The loop must not block, so
// a session whose next message PAUSE holds is parked: the loop stops
// reading its client (the pass-through relay keeps the bytes it has
// already read after its pipe's end, an intercepted session's message
// stays in its framer) and registers a wake-up with the pause. RESUME
// posts the session back to the loop thread through loopTasks, where it
// goes on exactly where it stopped, checking the pause again. A parked
// session costs no CPU: no socket of it is watched for reading (a
// client that hangs up is still noticed: a hang-up, evHup, is always
// reported, and ends the session).

// errHold ends a scan or a client step on the loop: PAUSE holds the
// client's next message.
var errHold = errors.New("client message held by PAUSE")

// loopTasks runs functions on the loop thread for other goroutines: a
// wake-up descriptor the loop watches (an eventfd on Linux, a pipe
// elsewhere: newWakeFD), with either poller, and a queue.
type loopTasks struct {
	fd     int // the wake-up's read side, which the loop watches
	wfd    int // its write side (fd itself for an eventfd)
	mu     sync.Mutex
	q      []func()
	closed bool // the loop has stopped: posts are dropped
}

func (t *loopTasks) init(l *evloop) error {
	fd, wfd, err := newWakeFD()
	if err != nil {
		return err
	}
	if err := l.p.add(fd, evIn); err != nil {
		closeWakeFD(fd, wfd)
		return fmt.Errorf("register the tasks' wake-up: %w", err)
	}
	t.fd, t.wfd = fd, wfd
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
	wake(t.wfd)
}

// close closes the wake-up and drops what is still queued. Loop thread,
// as the loop stops.
func (t *loopTasks) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	t.q = nil
	closeWakeFD(t.fd, t.wfd)
}

// run runs the posted functions. Loop thread.
func (t *loopTasks) run() {
	drainWake(t.fd)
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
