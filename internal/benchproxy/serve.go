package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"

	"github.com/pgfence/pgfence/internal/pgbench"
)

// startServe runs `bin serve` in front of primary with extra args, as a
// process of its own, and waits until it answers. It returns its port, its
// pid and a stop function.
func startServe(bin, primary string, args ...string) (int, int, func(), error) {
	port, err := freePort()
	if err != nil {
		return 0, 0, nil, err
	}
	cmd := exec.Command(bin, append([]string{"serve", "--listen", "127.0.0.1:" + strconv.Itoa(port),
		"--primary", primary, "--auth", "trust", "--log-level", "error"}, args...)...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return 0, 0, nil, fmt.Errorf("start %s serve: %w", bin, err)
	}
	stop := func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
	}
	if err := waitReady(port, 20*time.Second); err != nil {
		stop()
		return 0, 0, nil, fmt.Errorf("%s serve did not answer on port %d: %w", bin, port, err)
	}
	return port, cmd.Process.Pid, stop, nil
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// waitReady waits until a PostgreSQL-speaking relay on port answers a
// query, or for at most limit; it returns the last error then.
func waitReady(port int, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		_, err := pgbench.Psql(port, "postgres", "SELECT 1")
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}
