package proxy

import (
	"syscall"
	"unsafe"
)

// rawIO reads or writes (trap: syscall.SYS_READ, SYS_WRITE) a
// non-blocking socket. It never blocks, so it skips the runtime's system
// call bookkeeping, as the loop's wait does (evloop.go).
func rawIO(trap uintptr, fd int, b []byte) (int, error) {
	r, _, errno := syscall.RawSyscall(trap, uintptr(fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	if errno != 0 {
		return -1, errno
	}
	return int(r), nil
}
