// Package testbin runs the pgfence binary for the tests that need it as a
// process: `pgfence serve` in front of a test cluster (the proxy's
// acceptance tests, the driver matrix), the CLI as a script or cron runs
// it (cmd/pgfence's, internal/runner's tests). It builds cmd/pgfence once
// per test process and starts it as a user would.
//
// It is for tests only; it knows nothing of PostgreSQL (see pgtest).
package testbin

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// Pgfence returns the path of the pgfence binary, built from this module's
// cmd/pgfence the first time a test of the process asks for it. Remove
// deletes it.
func Pgfence(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "pgfence-bin")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "pgfence")
		out, err := exec.Command("go", "build", "-o", binPath, "github.com/pgfence/pgfence/cmd/pgfence").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build cmd/pgfence: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

// Remove deletes the binary Pgfence built, if it built one: TestMain calls
// it once the tests ran.
func Remove() {
	if binPath != "" {
		os.RemoveAll(filepath.Dir(binPath))
	}
}

// Serve starts `pgfence serve` with args (the caller gives --listen with
// port 0, --primary, --auth and the rest), writes its output to log (nil:
// discarded) and returns once it logged "listening", with the process and
// the address it listens on. When t ends, a process still running is
// interrupted, and killed if it has not exited 30 seconds later.
func Serve(t testing.TB, log io.Writer, args ...string) (*exec.Cmd, *net.TCPAddr) {
	t.Helper()
	if log == nil {
		log = io.Discard
	}
	cmd := exec.Command(Pgfence(t), append([]string{"serve"}, args...)...)
	cmd.Env = os.Environ()
	pr, pw := io.Pipe()
	cmd.Stderr = pw
	cmd.Stdout = log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		defer pw.Close()
		if cmd.ProcessState != nil {
			return // the test waited for it
		}
		cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	// Every log line goes to log; the "listening" line names the address.
	found := make(chan string, 1)
	var mu sync.Mutex
	var head bytes.Buffer // the lines before "listening", for a failure
	go func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			log.Write(append(sc.Bytes(), '\n'))
			mu.Lock()
			if head.Len() < 64<<10 {
				head.Write(append(sc.Bytes(), '\n'))
			}
			mu.Unlock()
			var e struct {
				Msg  string `json:"msg"`
				Addr string `json:"addr"`
			}
			if json.Unmarshal(sc.Bytes(), &e) == nil && e.Msg == "listening" {
				select {
				case found <- e.Addr:
				default:
				}
			}
		}
		io.Copy(io.Discard, pr)
	}()
	select {
	case addr := <-found:
		a, err := net.ResolveTCPAddr("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		return cmd, a
	case <-time.After(60 * time.Second):
		mu.Lock()
		defer mu.Unlock()
		t.Fatalf("pgfence serve did not log \"listening\" within 60s:\n%s", head.String())
		return nil, nil
	}
}
