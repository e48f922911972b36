package main

import (
	"bufio"
	_ "embed"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
)

// floorRelaySource is a relay that does the least any proxy must do: one
// epoll thread, one read and one write per readable socket, no parsing.
// Its ratio to a direct connection is the most a relay hop can reach on
// this machine, the floor the other columns are read against.
//
//go:embed testdata/floorrelay.c
var floorRelaySource []byte

// startFloorRelay compiles the floor relay with the C compiler (cgo needs
// one, so it is there wherever pgfence builds) and starts it in front of
// pgPort. It returns its port, its pid and a stop function.
func startFloorRelay(pgPort int) (int, int, func(), error) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		return 0, 0, nil, errors.New("no C compiler (cc) to build the floor relay")
	}
	dir, err := os.MkdirTemp("", "pgfence-bench-floor-")
	if err != nil {
		return 0, 0, nil, err
	}
	fail := func(err error) (int, int, func(), error) {
		os.RemoveAll(dir)
		return 0, 0, nil, err
	}
	src, bin := filepath.Join(dir, "floorrelay.c"), filepath.Join(dir, "floorrelay")
	if err := os.WriteFile(src, floorRelaySource, 0o644); err != nil {
		return fail(err)
	}
	if out, err := exec.Command(cc, "-O2", "-o", bin, src).CombinedOutput(); err != nil {
		return fail(fmt.Errorf("build the floor relay: %v\n%s", err, out))
	}
	port, err := freePort()
	if err != nil {
		return fail(err)
	}
	cmd := exec.Command(bin, strconv.Itoa(port), strconv.Itoa(pgPort))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return fail(err)
	}
	if err := cmd.Start(); err != nil {
		return fail(err)
	}
	stop := func() {
		cmd.Process.Kill()
		cmd.Wait()
		os.RemoveAll(dir)
	}
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		stop()
		return 0, 0, nil, fmt.Errorf("the floor relay did not start (%q, %v)", line, err)
	}
	return port, cmd.Process.Pid, stop, nil
}
