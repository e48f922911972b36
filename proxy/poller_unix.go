//go:build unix && !linux

package proxy

import (
	"errors"
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"
)

// Outside Linux the loop waits in poll(2) (poller_poll.go): there is no
// epoll.

// pollEvent is one event a wait reports.
type pollEvent struct {
	Events uint32
	Fd     int32
}

// defaultPoller is Config.Poller's default here.
const defaultPoller = "poll"

// checkPoller refuses a Config.Poller this platform does not have.
func checkPoller(kind string) error {
	switch kind {
	case "", "poll":
		return nil
	case "epoll":
		return errors.New(`poller "epoll": epoll is Linux only; use "poll" (or leave it empty: poll)`)
	}
	return fmt.Errorf("poller %q: want \"poll\" (or empty: poll)", kind)
}

func newEpoller() (poller, error) { return nil, errors.New("epoll is Linux only") }

// pollRaw is poll(2) with a timeout of msec milliseconds. Outside Linux it
// is an ordinary system call (macOS's go through libc): the runtime may
// hand the P on while it blocks.
func pollRaw(fds []unix.PollFd, msec int) (int, syscall.Errno) {
	n, err := unix.Poll(fds, msec)
	return n, errnoOf(err)
}

// pollBlock is poll(2) without a timeout.
func pollBlock(fds []unix.PollFd) (int, syscall.Errno) { return pollRaw(fds, -1) }

func errnoOf(err error) syscall.Errno {
	var errno syscall.Errno
	if err == nil || !errors.As(err, &errno) {
		return 0
	}
	return errno
}

// newWakeFD makes a wake-up descriptor pair: r is readable once wake has
// written to w, until drainWake has read it. Outside Linux a pipe.
func newWakeFD() (r, w int, err error) {
	var p [2]int
	if err := unix.Pipe(p[:]); err != nil {
		return -1, -1, fmt.Errorf("pipe: %w", err)
	}
	for _, fd := range p {
		unix.CloseOnExec(fd)
		if err := unix.SetNonblock(fd, true); err != nil {
			unix.Close(p[0])
			unix.Close(p[1])
			return -1, -1, fmt.Errorf("pipe: %w", err)
		}
	}
	return p[0], p[1], nil
}

// wake makes the wake-up readable. Any goroutine.
func wake(w int) {
	unix.Write(w, []byte{1}) // EAGAIN only when the pipe is full: it is readable anyway
}

// drainWake reads the wake-up until it is not readable.
func drainWake(r int) {
	var b [64]byte
	for {
		if n, _ := unix.Read(r, b[:]); n < len(b) {
			return
		}
	}
}

func closeWakeFD(r, w int) {
	unix.Close(r)
	unix.Close(w)
}
