//go:build unix && !linux

package proxy

import "syscall"

// rawIO reads or writes (trap: syscall.SYS_READ, SYS_WRITE) a
// non-blocking socket. Outside Linux it is an ordinary system call: a
// raw one is not supported everywhere (macOS's system calls go through
// libc); it never blocks, so the runtime does not hand the P on.
func rawIO(trap uintptr, fd int, b []byte) (int, error) {
	var n int
	var err error
	if trap == syscall.SYS_READ {
		n, err = syscall.Read(fd, b)
	} else {
		n, err = syscall.Write(fd, b)
	}
	if err != nil {
		return -1, err
	}
	return n, nil
}
