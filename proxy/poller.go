package proxy

import "syscall"

// A poller is all the event loop (evloop.go) knows of the system's
// readiness interface: it watches descriptors for the loop's events and
// waits for them. There are two: epoll (Linux, the default there:
// poller_epoll_linux.go) and poll(2) (every Unix, the default elsewhere:
// poller_poll.go); Config.Poller chooses.
//
// The interest and the events reported are the loop's own bits (evIn...),
// which are epoll's: the epoll poller passes them through unchanged, the
// poll poller maps them. Their meaning is epoll's, level-triggered:
//
//   - evIn, evOut: readable, writable.
//   - evRDHup: the peer shut its writing down (a half-close). Only epoll
//     reports it; poll(2) has no such event outside Linux, so the poll
//     poller never reports it, on Linux either (the loop is tested there
//     as it runs elsewhere): the half-close is then seen as readable,
//     and a read that returns 0. The loop must do the same with either.
//   - evHup, evErr: both directions are closed (a reset, or our own
//     shutdown and the peer's end), an error. Reported whether watched or
//     not, as epoll and poll(2) do.
//   - evOneShot: after one event the descriptor reports nothing, evHup
//     and evErr included, until it is modified again.
//
// The loop thread is the only one that waits; add, modify and remove may
// be called from any goroutine, also while the loop waits (publish runs
// on the session goroutine, a client goroutine re-arms its one-shot
// watch): a wait in progress then sees the new set (epoll does so
// itself; the poll poller is woken, its wait returning EINTR).
type poller interface {
	add(fd int, events uint32) error
	modify(fd int, events uint32) error
	// remove forgets fd; a descriptor not registered is an error
	// (ENOENT) the loop ignores.
	remove(fd int) error
	// wait waits up to msec milliseconds for events, as a raw system call
	// that keeps the thread's P (evloop.go), and returns how many it put
	// in events. EINTR: a signal, or a change woke the wait; wait again.
	wait(events []pollEvent, msec int) (int, syscall.Errno)
	// waitIdle waits without a timeout as an ordinary system call, giving
	// the P back while it blocks: the loop has been idle.
	waitIdle(events []pollEvent) (int, syscall.Errno)
	close() error
	// name is the poller's Config.Poller name: "epoll" or "poll".
	name() string
}

// The loop's event bits: epoll's values (poller_epoll_linux.go checks
// that they are), so that the epoll poller maps nothing.
const (
	evIn      uint32 = 0x1
	evOut     uint32 = 0x4
	evErr     uint32 = 0x8
	evHup     uint32 = 0x10
	evRDHup   uint32 = 0x2000
	evOneShot uint32 = 1 << 30
)

// newPoller makes the poller named kind: "" is the platform's default.
func newPoller(kind string) (poller, error) {
	if kind == "" {
		kind = defaultPoller
	}
	if kind == "poll" {
		return newPollPoller()
	}
	return newEpoller() // checkPoller refuses "epoll" where there is none
}
