package proxy

import (
	"encoding/binary"
	"fmt"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// pollRaw is poll(2) with a timeout of msec milliseconds as a raw system
// call (ppoll: every Linux architecture has it), as epollWait is
// (evloop.go).
//
//go:noinline
func pollRaw(fds []unix.PollFd, msec int) (int, syscall.Errno) {
	ts := unix.NsecToTimespec(int64(msec) * 1e6)
	n, _, errno := syscall.RawSyscall6(unix.SYS_PPOLL, uintptr(unsafe.Pointer(&fds[0])), uintptr(len(fds)), uintptr(unsafe.Pointer(&ts)), 0, 0, 0)
	return int(n), errno
}

// pollBlock is poll(2) without a timeout, an ordinary system call, which
// gives the P back while it blocks.
func pollBlock(fds []unix.PollFd) (int, syscall.Errno) {
	n, _, errno := syscall.Syscall6(unix.SYS_PPOLL, uintptr(unsafe.Pointer(&fds[0])), uintptr(len(fds)), 0, 0, 0, 0)
	return int(n), errno
}

// newWakeFD makes a wake-up descriptor: readable once wake has written
// to it, until drainWake has read it. On Linux an eventfd, read and
// written as one descriptor.
func newWakeFD() (r, w int, err error) {
	fd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return -1, -1, fmt.Errorf("eventfd: %w", err)
	}
	return fd, fd, nil
}

// wake makes the wake-up readable. Any goroutine.
func wake(w int) {
	var one [8]byte
	binary.NativeEndian.PutUint64(one[:], 1)
	unix.Write(w, one[:]) // EAGAIN only when the counter is full: it is readable anyway
}

// drainWake reads the wake-up until it is not readable.
func drainWake(r int) {
	var b [8]byte
	unix.Read(r, b[:])
}

func closeWakeFD(r, _ int) { unix.Close(r) }
