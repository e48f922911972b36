package proxy

import (
	"fmt"
	"syscall"
	"unsafe"
)

// The epoll poller (poller.go): today's Linux default. Its events are
// epoll's own, the loop's bits unchanged.

// pollEvent is one event a wait reports: epoll's struct itself, which
// the poll poller fills in as well.
type pollEvent = syscall.EpollEvent

// The loop's event bits are epoll's (poller.go): each line fails to
// compile if one is not.
var (
	_ [0]struct{} = [evIn ^ syscall.EPOLLIN]struct{}{}
	_ [0]struct{} = [evOut ^ syscall.EPOLLOUT]struct{}{}
	_ [0]struct{} = [evErr ^ syscall.EPOLLERR]struct{}{}
	_ [0]struct{} = [evHup ^ syscall.EPOLLHUP]struct{}{}
	_ [0]struct{} = [evRDHup ^ syscall.EPOLLRDHUP]struct{}{}
	_ [0]struct{} = [evOneShot ^ syscall.EPOLLONESHOT]struct{}{}
)

// defaultPoller is Config.Poller's default here.
const defaultPoller = "epoll"

// checkPoller refuses a Config.Poller this platform does not have.
func checkPoller(kind string) error {
	switch kind {
	case "", "epoll", "poll":
		return nil
	}
	return fmt.Errorf("poller %q: want \"epoll\" or \"poll\" (or empty: epoll)", kind)
}

type epoller struct{ fd int }

func newEpoller() (poller, error) {
	fd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	return &epoller{fd}, nil
}

func (p *epoller) ctl(op, fd int, events uint32) error {
	ev := syscall.EpollEvent{Events: events, Fd: int32(fd)}
	return syscall.EpollCtl(p.fd, op, fd, &ev)
}

func (p *epoller) add(fd int, events uint32) error {
	return p.ctl(syscall.EPOLL_CTL_ADD, fd, events)
}

func (p *epoller) modify(fd int, events uint32) error {
	return p.ctl(syscall.EPOLL_CTL_MOD, fd, events)
}

func (p *epoller) remove(fd int) error { return p.ctl(syscall.EPOLL_CTL_DEL, fd, 0) }

func (p *epoller) wait(events []pollEvent, msec int) (int, syscall.Errno) {
	return epollWait(p.fd, events, msec)
}

func (p *epoller) waitIdle(events []pollEvent) (int, syscall.Errno) {
	return epollWaitIdle(p.fd, events)
}

func (p *epoller) close() error { return syscall.Close(p.fd) }

func (*epoller) name() string { return "epoll" }

// epollWait waits up to msec milliseconds. It is a raw system call (see
// the comment at the top of evloop.go); it is a separate function so the
// loop passes a preemption check after every wake-up.
//
// Both waits are epoll_pwait with a nil signal mask, which is epoll_wait
// exactly (epoll_pwait(2)): linux/arm64 (and riscv64, loong64) has no
// epoll_wait system call at all, and one call on every Linux keeps a
// single code path. A nil mask makes the kernel ignore the mask size.
//
//go:noinline
func epollWait(epfd int, events []syscall.EpollEvent, msec int) (int, syscall.Errno) {
	n, _, errno := syscall.RawSyscall6(syscall.SYS_EPOLL_PWAIT, uintptr(epfd), uintptr(unsafe.Pointer(&events[0])), uintptr(len(events)), uintptr(msec), 0, 0)
	return int(n), errno
}

// epollWaitIdle waits without a timeout through the runtime's system
// call path, which releases the P while blocked.
func epollWaitIdle(epfd int, events []syscall.EpollEvent) (int, syscall.Errno) {
	n, _, errno := syscall.Syscall6(syscall.SYS_EPOLL_PWAIT, uintptr(epfd), uintptr(unsafe.Pointer(&events[0])), uintptr(len(events)), ^uintptr(0), 0, 0)
	return int(n), errno
}
