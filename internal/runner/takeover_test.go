package runner

// Runs that lose their lease: the database cut off, the worker paused
// until another holder takes over (directly and through the proxy), and
// the real binary run the way cron runs it.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/internal/testbin"
	"github.com/pgfence/pgfence/proxy"
)

// cutter forwards TCP connections to the database until cut, after which
// it refuses them: a database outage as the runner sees it.
type cutter struct {
	ln    net.Listener
	mu    sync.Mutex
	conns []net.Conn
	cut_  bool
}

func newCutter(t *testing.T, target string) *cutter {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &cutter{ln: ln}
	go func() {
		for {
			down, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				down.Close()
				continue
			}
			c.mu.Lock()
			if c.cut_ {
				c.mu.Unlock()
				down.Close()
				up.Close()
				continue
			}
			c.conns = append(c.conns, down, up)
			c.mu.Unlock()
			go func() { io.Copy(up, down); up.Close() }()
			go func() { io.Copy(down, up); down.Close() }()
		}
	}()
	t.Cleanup(c.cut)
	return c
}

func (c *cutter) addr() string { return c.ln.Addr().String() }

func (c *cutter) cut() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cut_ = true
	c.ln.Close()
	for _, conn := range c.conns {
		conn.Close()
	}
}

func TestRunFailsClosedWhenRenewalsFail(t *testing.T) {
	f := newFixture(t)
	cut := newCutter(t, cluster.Primary.Addr())
	cfg := f.config("nightly-report", "sh", script(t, "ignore_term.sh"))
	cfg.DSN = fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&connect_timeout=2", cut.addr(), strings.TrimPrefix(mustDatabase(t, f.dsn), "/"))
	cfg.TTL = time.Second
	cfg.Grace = 200 * time.Millisecond
	log, logs := observed(t)
	done := runAsync(cfg, log)
	eventually(t, 30*time.Second, "the command to start", func() bool { return f.exists("ready") })
	cut.cut()
	r := await(t, done)
	if r.code != ExitLeaseLost || !errors.Is(r.err, ErrLeaseLost) {
		t.Fatalf("got code %d, err %v; want %d, ErrLeaseLost", r.code, r.err, ExitLeaseLost)
	}
	if logs.FilterMessage("lease renewal failed; retrying until it expires").Len() == 0 {
		t.Error("no renewal failure was logged before the lease was given up")
	}
	if logs.FilterMessage("command still running after grace; killing it").Len() != 1 {
		t.Error("the command, which ignores SIGTERM, was not killed after the grace period")
	}
	if !strings.Contains(r.err.Error(), fmt.Sprintf("exit code %d", ExitSignalBase+int(syscall.SIGKILL))) {
		t.Errorf("error %q does not report the command killed by SIGKILL", r.err)
	}
}

// TestRunZombieTakeover is the scenario pgfence exists for: a worker is
// paused (SIGSTOP, standing in for a GC pause or a frozen VM) until its
// lease expires, another run takes over and writes, and when the first
// resumes its wrapper learns the lease is gone, tells its command, whose
// last write is refused, and exits with ExitLeaseLost. The second's
// result stands. It runs twice: with the commands writing directly to
// the primary, where the backstop trigger refuses the late write, and
// through the proxy, where its write gate does.
func TestRunZombieTakeover(t *testing.T) {
	t.Run("direct", func(t *testing.T) { testZombieTakeover(t, false) })
	t.Run("through_proxy", func(t *testing.T) { testZombieTakeover(t, true) })
}

// startGatedProxy starts an in-process proxy with the write gate in front
// of the test cluster and returns it and the gate.
func startGatedProxy(t *testing.T) (net.Addr, *proxy.Fence) {
	t.Helper()
	log := zaptest.NewLogger(t)
	gate, err := proxy.NewFence(proxy.FenceConfig{Primary: cluster.Primary.DSN("postgres")}, log.Named("gate"))
	if err != nil {
		t.Fatal(err)
	}
	srv, err := proxy.New(proxy.Config{Primary: cluster.Primary.DSN("postgres"), Auth: proxy.AuthTrust, Interceptor: gate}, log.Named("proxy"))
	if err != nil {
		gate.Close()
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		gate.Close()
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(context.Background(), ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Logf("proxy shutdown: %v", err)
		}
		if err := <-served; !errors.Is(err, proxy.ErrServerClosed) {
			t.Errorf("proxy Serve returned %v, want ErrServerClosed", err)
		}
		gate.Close()
	})
	return ln.Addr(), gate
}

func testZombieTakeover(t *testing.T, throughProxy bool) {
	f := newFixture(t)
	const job = "nightly-report"
	outA := filepath.Join(f.out, "a")
	outB := filepath.Join(f.out, "b")
	for _, d := range []string{outA, outB} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// The wrappers' own connection (--database) is always the primary;
	// the commands' psql uses DATABASE_URL, the proxy when throughProxy.
	var gate *proxy.Fence
	var childEnv []string
	if throughProxy {
		var addr net.Addr
		addr, gate = startGatedProxy(t)
		childEnv = []string{fmt.Sprintf("DATABASE_URL=postgres://postgres@%s/%s?sslmode=disable", addr, mustDatabase(t, f.dsn))}
	}
	a, aOut := f.startHelper(helperConfig{
		JobKey: job, TTL: 2 * time.Second, Grace: 10 * time.Second, DSN: f.dsn,
		Command: []string{"sh", script(t, "zombie.sh")},
	}, append([]string{"OUT=" + outA}, childEnv...)...)
	eventually(t, 30*time.Second, "the first worker to write and report ready", func() bool {
		_, err := os.Stat(filepath.Join(outA, "ready"))
		return err == nil
	})
	first, ok := f.result(job)
	if !ok || first.payload != "first" {
		t.Fatalf("first worker's write: got %+v (present %v), want payload first", first, ok)
	}
	leaseA, ok := f.lease(job)
	if !ok || leaseA.token != first.token {
		t.Fatalf("lease: got %+v (present %v), want token %d", leaseA, ok, first.token)
	}
	if gate != nil {
		if n := gate.Stats.Committed.Load(); n != 1 {
			t.Fatalf("gate: %d gated commits after the first worker's write, want 1 (did it go through the proxy?)", n)
		}
	}

	// Pause the first wrapper and its command together.
	if err := syscall.Kill(-a.Process.Pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	continued := false
	defer func() {
		if !continued {
			syscall.Kill(-a.Process.Pid, syscall.SIGCONT)
		}
	}()
	eventually(t, 30*time.Second, "the paused worker's lease to expire", func() bool {
		l, ok := f.lease(job)
		return ok && l.token == leaseA.token && l.expired
	})

	b, bOut := f.startHelper(helperConfig{
		JobKey: job, TTL: 30 * time.Second, DSN: f.dsn,
		Command: []string{"sh", script(t, "write.sh"), "second"},
	}, append([]string{"OUT=" + outB}, childEnv...)...)
	if code := waitExit(t, b, bOut, "second run"); code != 0 {
		t.Fatalf("second run: got exit code %d, want 0", code)
	}
	second, ok := f.result(job)
	if !ok || second.payload != "second" || second.token <= leaseA.token {
		t.Fatalf("second run's write: got %+v (present %v), want payload second with a token above %d", second, ok, leaseA.token)
	}
	if gate != nil {
		if n := gate.Stats.Committed.Load(); n != 2 {
			t.Fatalf("gate: %d gated commits after the second run's write, want 2", n)
		}
	}

	continued = true
	if err := syscall.Kill(-a.Process.Pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if code := waitExit(t, a, aOut, "first run"); code != ExitLeaseLost {
		t.Fatalf("first run: got exit code %d, want %d (lease lost)", code, ExitLeaseLost)
	}
	termOut, err := os.ReadFile(filepath.Join(outA, "term.out"))
	if err != nil {
		t.Fatalf("the first worker was not told to stop (no SIGTERM handled): %v", err)
	}
	termRC, _ := os.ReadFile(filepath.Join(outA, "term.rc"))
	t.Logf("the zombie's last write (psql status %s):\n%s", bytes.TrimSpace(termRC), termOut)
	if strings.TrimSpace(string(termRC)) == "0" || !strings.Contains(string(termOut), "FN001") {
		t.Errorf("the zombie's last write: got psql status %q, output %q; want a failure with FN001", termRC, termOut)
	}
	if gate == nil {
		// The backstop trigger refused it: its PL/pgSQL context is the
		// client's error's.
		if !strings.Contains(string(termOut), "CONTEXT:") {
			t.Errorf("the zombie's last write: output %q has no CONTEXT from the backstop trigger", termOut)
		}
	} else {
		// The gate refused it, before the INSERT reached the backstop
		// trigger: the proxy counted the refusal, and the error has no
		// CONTEXT, which the proxy drops from its own steps' errors only
		// (a trigger's refusal of the client's statement keeps it).
		if n := gate.Stats.Codes.Get("FN001"); n != 1 {
			t.Errorf("gate: %d FN001 refusals, want 1 (the zombie's write)", n)
		}
		if strings.Contains(string(termOut), "CONTEXT:") {
			t.Errorf("the zombie's last write: output %q carries a PL/pgSQL context: refused by the backstop trigger, not the proxy's gate", termOut)
		}
	}
	if final, _ := f.result(job); final != second {
		t.Errorf("final result: got %+v, want the second run's %+v", final, second)
	}
}

// TestPgfenceRunCronLine runs the real binary the way a legacy cron job
// would: only DATABASE_URL in the environment, no flags but --job.
func TestPgfenceRunCronLine(t *testing.T) {
	f := newFixture(t)
	bin := testbin.Pgfence(t)
	pgfence := func(args ...string) (int, string) {
		cmd := exec.Command(bin, args...)
		cmd.Env = f.env() // DATABASE_URL, OUT; no PG* variables
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatalf("pgfence %q: %v", args, err)
		}
		t.Logf("pgfence %q:\n%s", args, out)
		return cmd.ProcessState.ExitCode(), string(out)
	}

	code, _ := pgfence("run", "--job", "nightly-report", "--", "sh", script(t, "write.sh"), "cron", "7")
	if code != 7 {
		t.Fatalf("exit code: got %d, want 7 (the command's own)", code)
	}
	r, ok := f.result("nightly-report")
	if !ok || r.payload != "cron" {
		t.Fatalf("result: got %+v (present %v), want payload cron", r, ok)
	}
	if l, ok := f.lease("nightly-report"); ok {
		t.Errorf("lease still held after the run: %+v", l)
	}

	other := f.acquireAs("nightly-report", "other-host:1", time.Minute)
	code, out := pgfence("run", "--job", "nightly-report", "--", "sh", script(t, "write.sh"), "again")
	if code != ExitLeaseHeld {
		t.Fatalf("exit code while held: got %d, want %d", code, ExitLeaseHeld)
	}
	if !strings.Contains(out, "other-host:1") {
		t.Errorf("output does not name the holder:\n%s", out)
	}
	if r, _ := f.result("nightly-report"); r.payload != "cron" {
		t.Errorf("result changed while the lease was held by %d: %+v", other, r)
	}
}
