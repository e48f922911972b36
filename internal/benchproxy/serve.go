package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"
)

// startServe runs `bin serve` in front of primary with extra args, as a
// process of its own, and waits until it answers. It returns its port, its
// pid and a stop function.
func startServe(bin, primary string, args ...string) (int, int, func(), error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, 0, nil, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	cmd := exec.Command(bin, append([]string{"serve", "--listen", "127.0.0.1:" + strconv.Itoa(port),
		"--primary", primary, "--log-level", "error"}, args...)...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return 0, 0, nil, fmt.Errorf("start %s serve: %w", bin, err)
	}
	stop := func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := psqlExec(port, "postgres", "SELECT 1"); err == nil {
			return port, cmd.Process.Pid, stop, nil
		} else if time.Now().After(deadline) {
			stop()
			return 0, 0, nil, fmt.Errorf("%s serve did not answer on port %d: %w", bin, port, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
