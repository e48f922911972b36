package runner

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/proxy"
)

var cluster *pgtest.Cluster

// helperEnv carries a helperConfig to a re-executed test binary that acts
// as a separate `pgfence run` process (so a test can SIGSTOP it).
const helperEnv = "PGFENCE_RUNNER_TEST_HELPER"

type helperConfig struct {
	JobKey     string
	TTL        time.Duration
	RenewEvery time.Duration
	Grace      time.Duration
	DSN        string
	Command    []string
}

func TestMain(m *testing.M) {
	if v := os.Getenv(helperEnv); v != "" {
		os.Exit(helperMain(v))
	}
	os.Exit(pgtest.Run(m, pgtest.Options{}, migrations.Prepare, &cluster))
}

// helperMain is what cmd/pgfence's run command does, minus flag parsing.
func helperMain(v string) int {
	var hc helperConfig
	if err := json.Unmarshal([]byte(v), &hc); err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		return 2
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	log, _ := zap.NewDevelopment()
	code, err := Run(context.Background(), Config{
		JobKey: hc.JobKey, TTL: hc.TTL, RenewEvery: hc.RenewEvery, Grace: hc.Grace,
		DSN: hc.DSN, Command: hc.Command, Signals: sigs,
	}, log)
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper: run:", err)
	}
	return code
}

// fixture is one test's database with the protected table "results", and
// an output directory for the child scripts.
type fixture struct {
	t   *testing.T
	dsn string
	out string
	db  *pgx.Conn
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	ctx := context.Background()
	dsn := cluster.Primary.DSN(cluster.NewDatabase(t))
	db, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close(context.Background()) })
	if _, err := db.Exec(ctx, `CREATE TABLE results (job_key text PRIMARY KEY, payload text NOT NULL, token bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `SELECT fence.protect('results')`); err != nil {
		t.Fatal(err)
	}
	return &fixture{t: t, dsn: dsn, out: t.TempDir(), db: db}
}

// script returns the path of a test script in testdata/run.
func script(t *testing.T, name string) string {
	t.Helper()
	p, err := filepath.Abs(filepath.Join("..", "..", "testdata", "run", name))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// env is the child environment: the database for psql and the output dir.
func (f *fixture) env(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "PG") || k == "DATABASE_URL" || k == "OUT" {
			continue
		}
		env = append(env, kv)
	}
	return append(append(env, "DATABASE_URL="+f.dsn, "OUT="+f.out), extra...)
}

func (f *fixture) config(job string, command ...string) Config {
	return Config{
		JobKey:  job,
		TTL:     30 * time.Second,
		DSN:     f.dsn,
		Command: command,
		Env:     f.env(),
		Stdin:   strings.NewReader(""),
		Stdout:  testWriter{f.t, "child stdout"},
		Stderr:  testWriter{f.t, "child stderr"},
	}
}

type testWriter struct {
	t      *testing.T
	prefix string
}

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Logf("%s: %s", w.prefix, bytes.TrimRight(p, "\n"))
	return len(p), nil
}

type result struct {
	payload string
	token   int64
}

func (f *fixture) result(job string) (result, bool) {
	f.t.Helper()
	var r result
	err := f.db.QueryRow(context.Background(), `SELECT payload, token FROM results WHERE job_key = $1`, job).Scan(&r.payload, &r.token)
	if errors.Is(err, pgx.ErrNoRows) {
		return r, false
	}
	if err != nil {
		f.t.Fatal(err)
	}
	return r, true
}

type leaseRow struct {
	holder    string
	token     int64
	expiresAt time.Time
	expired   bool
}

func (f *fixture) lease(job string) (leaseRow, bool) {
	f.t.Helper()
	var l leaseRow
	err := f.db.QueryRow(context.Background(),
		`SELECT holder, token, expires_at, expires_at <= clock_timestamp() FROM fence.leases WHERE job_key = $1`, job).
		Scan(&l.holder, &l.token, &l.expiresAt, &l.expired)
	if errors.Is(err, pgx.ErrNoRows) {
		return l, false
	}
	if err != nil {
		f.t.Fatal(err)
	}
	return l, true
}

// acquireAs takes the lease as another holder, directly in SQL.
func (f *fixture) acquireAs(job, holder string, ttl time.Duration) int64 {
	f.t.Helper()
	l, err := fence.Acquire(context.Background(), f.db, job, holder, ttl)
	if err != nil {
		f.t.Fatal(err)
	}
	return l.Token
}

func (f *fixture) file(name string) string {
	f.t.Helper()
	b, err := os.ReadFile(filepath.Join(f.out, name))
	if err != nil {
		f.t.Fatal(err)
	}
	return string(b)
}

func (f *fixture) exists(name string) bool {
	_, err := os.Stat(filepath.Join(f.out, name))
	return err == nil
}

func (f *fixture) touch(name string) {
	f.t.Helper()
	if err := os.WriteFile(filepath.Join(f.out, name), nil, 0o644); err != nil {
		f.t.Fatal(err)
	}
}

// eventually polls cond (an observation, not a delay) until it holds.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

type runResult struct {
	code int
	err  error
}

func runAsync(cfg Config, log *zap.Logger) <-chan runResult {
	ch := make(chan runResult, 1)
	go func() {
		code, err := Run(context.Background(), cfg, log)
		ch <- runResult{code, err}
	}()
	return ch
}

func await(t *testing.T, ch <-chan runResult) runResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(time.Minute):
		t.Fatal("run did not return within a minute")
		return runResult{}
	}
}

// observed returns a logger writing to the test log and an observer of
// its entries.
func observed(t *testing.T) (*zap.Logger, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.DebugLevel)
	return zap.New(zapcore.NewTee(zaptest.NewLogger(t).Core(), core)), logs
}

func TestEscapeOption(t *testing.T) {
	tests := []struct{ in, want string }{
		{"nightly-report", "nightly-report"},
		{"nightly report", `nightly\ report`},
		{`a\b`, `a\\b`},
		{"tab\there", "tab\\\there"},
		{"", ""},
	}
	for _, tt := range tests {
		if got := escapeOption(tt.in); got != tt.want {
			t.Errorf("escapeOption(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestAppendPGOptions(t *testing.T) {
	l := held{Lease: fence.Lease{JobKey: "nightly report", Epoch: 3, Token: 17}}
	ours := `-c fence.job_key=nightly\ report -c fence.epoch=3 -c fence.token=17`
	tests := []struct{ existing, want string }{
		{"", ours},
		{"  ", ours},
		{"-c statement_timeout=5s", "-c statement_timeout=5s " + ours},
		{`-c application_name=legacy\ job`, `-c application_name=legacy\ job ` + ours},
	}
	for _, tt := range tests {
		if got := appendPGOptions(tt.existing, l); got != tt.want {
			t.Errorf("appendPGOptions(%q) = %q, want %q", tt.existing, got, tt.want)
		}
	}
}

func TestChildEnvReplacesFenceVariables(t *testing.T) {
	l := held{Lease: fence.Lease{JobKey: "j", Epoch: 1, Token: 2, ExpiresAt: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)}}
	env := childEnv([]string{"A=1", "PGFENCE_TOKEN=99", "PGOPTIONS=-c x.y=1"}, l)
	want := []string{"A=1", "PGOPTIONS=-c x.y=1 -c fence.job_key=j -c fence.epoch=1 -c fence.token=2",
		"PGFENCE_JOB_KEY=j", "PGFENCE_EPOCH=1", "PGFENCE_TOKEN=2", "PGFENCE_LEASE_EXPIRES_AT=2030-01-02T03:04:05Z"}
	if strings.Join(env, "\n") != strings.Join(want, "\n") {
		t.Errorf("childEnv:\ngot  %q\nwant %q", env, want)
	}
}

func TestRunWritesAndPassesExitCode(t *testing.T) {
	for _, code := range []int{0, 7} {
		t.Run(strconv.Itoa(code), func(t *testing.T) {
			f := newFixture(t)
			cfg := f.config("nightly-report", "sh", script(t, "write.sh"), "done", strconv.Itoa(code))
			got, err := Run(context.Background(), cfg, zaptest.NewLogger(t))
			if err != nil {
				t.Fatalf("run: %v", err)
			}
			if got != code {
				t.Fatalf("exit code: got %d, want %d", got, code)
			}
			var job string
			var epoch, token int64
			var expires string
			if _, err := fmt.Sscanf(f.file("env"), "%s %d %d %s", &job, &epoch, &token, &expires); err != nil {
				t.Fatalf("parse child env %q: %v", f.file("env"), err)
			}
			if job != "nightly-report" || token <= 0 || epoch <= 0 {
				t.Errorf("child env: got job %q epoch %d token %d", job, epoch, token)
			}
			if _, err := time.Parse(time.RFC3339Nano, expires); err != nil {
				t.Errorf("PGFENCE_LEASE_EXPIRES_AT %q: %v", expires, err)
			}
			r, ok := f.result("nightly-report")
			if !ok || r.payload != "done" || r.token != token {
				t.Errorf("result row: got %+v (present %v), want payload done with token %d", r, ok, token)
			}
			if l, ok := f.lease("nightly-report"); ok {
				t.Errorf("lease still held after the run: %+v", l)
			}
		})
	}
}

func TestRunAppendsToExistingPGOPTIONS(t *testing.T) {
	f := newFixture(t)
	job := "nightly report" // a space: escaped in PGOPTIONS
	cfg := f.config(job, "sh", script(t, "write.sh"), "done")
	cfg.Env = f.env(`PGOPTIONS=-c legacy.note=legacy\ job`)
	code, err := Run(context.Background(), cfg, zaptest.NewLogger(t))
	if err != nil || code != 0 {
		t.Fatalf("run: got code %d, err %v; want 0, nil", code, err)
	}
	r, ok := f.result(job)
	if !ok {
		t.Fatal("no result written")
	}
	var epoch int64
	if err := f.db.QueryRow(context.Background(), `SELECT epoch FROM fence.fences WHERE job_key = $1`, job).Scan(&epoch); err != nil {
		t.Fatal(err)
	}
	wantOpts := fmt.Sprintf(`-c legacy.note=legacy\ job -c fence.job_key=nightly\ report -c fence.epoch=%d -c fence.token=%d`, epoch, r.token)
	if got := f.file("pgoptions"); got != wantOpts {
		t.Errorf("PGOPTIONS: got %q, want %q", got, wantOpts)
	}
	// What the server saw: both the caller's option and ours.
	wantSettings := fmt.Sprintf("nightly report|%d|%d|legacy job", epoch, r.token)
	if got := strings.TrimSpace(f.file("settings")); got != wantSettings {
		t.Errorf("session settings: got %q, want %q", got, wantSettings)
	}
}

func TestRunLeaseHeldByAnother(t *testing.T) {
	f := newFixture(t)
	other := f.acquireAs("nightly-report", "other-host:1", time.Minute)
	cfg := f.config("nightly-report", "sh", script(t, "write.sh"), "mine")
	code, err := Run(context.Background(), cfg, zaptest.NewLogger(t))
	if code != ExitLeaseHeld || !errors.Is(err, ErrLeaseHeld) {
		t.Fatalf("got code %d, err %v; want %d, ErrLeaseHeld", code, err, ExitLeaseHeld)
	}
	if f.exists("env") {
		t.Error("the command ran although the lease was held")
	}
	if l, ok := f.lease("nightly-report"); !ok || l.token != other || l.holder != "other-host:1" {
		t.Errorf("the other holder's lease changed: got %+v (present %v), want token %d", l, ok, other)
	}
}

func TestRunWaitsForRelease(t *testing.T) {
	f := newFixture(t)
	other := f.acquireAs("nightly-report", "other-host:1", time.Minute)
	cfg := f.config("nightly-report", "sh", script(t, "write.sh"), "mine")
	cfg.Wait = true
	cfg.WaitPoll = 50 * time.Millisecond
	log, logs := observed(t)
	done := runAsync(cfg, log)
	eventually(t, 30*time.Second, "the run to report it is waiting", func() bool {
		return logs.FilterMessage("lease held by another holder; waiting").Len() > 0
	})
	if f.exists("env") {
		t.Fatal("the command started while the lease was held")
	}
	if err := fence.Release(context.Background(), f.db, "nightly-report", other); err != nil {
		t.Fatal(err)
	}
	r := await(t, done)
	if r.err != nil || r.code != 0 {
		t.Fatalf("run: got code %d, err %v; want 0, nil", r.code, r.err)
	}
	if res, ok := f.result("nightly-report"); !ok || res.payload != "mine" || res.token <= other {
		t.Errorf("result: got %+v (present %v), want payload mine with a token above %d", res, ok, other)
	}
}

func TestRunWaitTimeout(t *testing.T) {
	f := newFixture(t)
	f.acquireAs("nightly-report", "other-host:1", time.Minute)
	cfg := f.config("nightly-report", "sh", script(t, "write.sh"), "mine")
	cfg.Wait = true
	cfg.WaitTimeout = 300 * time.Millisecond
	cfg.WaitPoll = 50 * time.Millisecond
	code, err := Run(context.Background(), cfg, zaptest.NewLogger(t))
	if code != ExitLeaseHeld || !errors.Is(err, ErrLeaseHeld) {
		t.Fatalf("got code %d, err %v; want %d, ErrLeaseHeld", code, err, ExitLeaseHeld)
	}
	if f.exists("env") {
		t.Error("the command ran although the lease was held")
	}
}

func TestRunInterruptedWhileWaiting(t *testing.T) {
	f := newFixture(t)
	f.acquireAs("nightly-report", "other-host:1", time.Minute)
	cfg := f.config("nightly-report", "sh", script(t, "write.sh"), "mine")
	cfg.Wait = true
	cfg.WaitPoll = 50 * time.Millisecond
	sigs := make(chan os.Signal, 1)
	cfg.Signals = sigs
	log, logs := observed(t)
	done := runAsync(cfg, log)
	eventually(t, 30*time.Second, "the run to report it is waiting", func() bool {
		return logs.FilterMessage("lease held by another holder; waiting").Len() > 0
	})
	sigs <- syscall.SIGINT
	r := await(t, done)
	if r.code != ExitSignalBase+int(syscall.SIGINT) || !errors.Is(r.err, ErrInterrupted) {
		t.Fatalf("got code %d, err %v; want %d, ErrInterrupted", r.code, r.err, ExitSignalBase+int(syscall.SIGINT))
	}
}

func TestRunCommandNotFound(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("nightly-report", filepath.Join(f.out, "no-such-program"))
	code, err := Run(context.Background(), cfg, zaptest.NewLogger(t))
	if code != ExitNotFound || err == nil {
		t.Fatalf("got code %d, err %v; want %d and an error", code, err, ExitNotFound)
	}
	if l, ok := f.lease("nightly-report"); ok {
		t.Errorf("lease still held: %+v", l)
	}
}

func TestRunForwardsSignals(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("nightly-report", "sh", script(t, "signals.sh"))
	sigs := make(chan os.Signal, 1)
	cfg.Signals = sigs
	done := runAsync(cfg, zaptest.NewLogger(t))
	eventually(t, 30*time.Second, "the command to start", func() bool { return f.exists("ready") })
	sigs <- syscall.SIGHUP
	eventually(t, 30*time.Second, "the command to receive SIGHUP", func() bool { return f.exists("hup") })
	sigs <- syscall.SIGTERM
	r := await(t, done)
	if r.err != nil || r.code != 42 {
		t.Fatalf("got code %d, err %v; want 42 (the command's own), nil", r.code, r.err)
	}
}

func TestRunRenewsLease(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("nightly-report", "sh", script(t, "wait_go.sh"))
	cfg.TTL = 2 * time.Second // short, with slack for a loaded machine
	done := runAsync(cfg, zaptest.NewLogger(t))
	eventually(t, 30*time.Second, "the command to start", func() bool { return f.exists("ready") })
	first, ok := f.lease("nightly-report")
	if !ok {
		t.Fatal("no lease while the command runs")
	}
	// Observe the database clock pass the first expiry while the lease,
	// still ours, stays live: only renewals can do that.
	eventually(t, 30*time.Second, "the database clock to pass the first expiry", func() bool {
		var passed bool
		if err := f.db.QueryRow(context.Background(), `SELECT clock_timestamp() > $1`, first.expiresAt).Scan(&passed); err != nil {
			t.Fatal(err)
		}
		return passed
	})
	now, ok := f.lease("nightly-report")
	if !ok || now.token != first.token || now.expired || !now.expiresAt.After(first.expiresAt) {
		t.Fatalf("lease after its first ttl: got %+v (present %v), want token %d, live, renewed past %s", now, ok, first.token, first.expiresAt)
	}
	f.touch("go")
	if r := await(t, done); r.err != nil || r.code != 0 {
		t.Fatalf("got code %d, err %v; want 0, nil", r.code, r.err)
	}
}

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

func mustDatabase(t *testing.T, dsn string) string {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Database
}

// startHelper starts a separate `pgfence run` process in its own process
// group, so the test can stop and continue it together with its command.
func (f *fixture) startHelper(hc helperConfig, extraEnv ...string) (*exec.Cmd, *bytes.Buffer) {
	f.t.Helper()
	b, err := json.Marshal(hc)
	if err != nil {
		f.t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(f.env(extraEnv...), helperEnv+"="+string(b))
	var stderr bytes.Buffer
	cmd.Stdout = &stderr
	cmd.Stderr = &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() {
		if cmd.ProcessState == nil {
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			syscall.Kill(-cmd.Process.Pid, syscall.SIGCONT)
			cmd.Wait()
		}
	})
	return cmd, &stderr
}

func waitExit(t *testing.T, cmd *exec.Cmd, out *bytes.Buffer, name string) int {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatalf("%s: %v", name, err)
		}
		t.Logf("%s output:\n%s", name, out)
		return cmd.ProcessState.ExitCode()
	case <-time.After(time.Minute):
		t.Fatalf("%s did not exit within a minute; output:\n%s", name, out)
		return -1
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

func TestParseSignal(t *testing.T) {
	tests := []struct {
		in   string
		want syscall.Signal
		ok   bool
	}{
		{"TERM", syscall.SIGTERM, true},
		{"sigint", syscall.SIGINT, true},
		{"SIGUSR1", syscall.SIGUSR1, true},
		{"9", syscall.SIGKILL, true},
		{"NOPE", 0, false},
		{"0", 0, false},
	}
	for _, tt := range tests {
		got, err := ParseSignal(tt.in)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("ParseSignal(%q) = %v, %v; want %v, ok=%v", tt.in, got, err, tt.want, tt.ok)
		}
	}
}

// buildPgfence builds the pgfence binary for end-to-end tests.
func buildPgfence(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "pgfence")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/pgfence/pgfence/cmd/pgfence")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build pgfence: %v\n%s", err, out)
	}
	return bin
}

// TestPgfenceRunCronLine runs the real binary the way a legacy cron job
// would: only DATABASE_URL in the environment, no flags but --job.
func TestPgfenceRunCronLine(t *testing.T) {
	f := newFixture(t)
	bin := buildPgfence(t)
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

// A command that runs past MaxRuntime is stopped like one that lost its
// lease, run exits 124, and the lease is released.
func TestRunMaxRuntime(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("nightly-report", "sh", script(t, "wait_go.sh")) // waits for $OUT/go, which never comes
	cfg.MaxRuntime = 300 * time.Millisecond
	start := time.Now()
	code, err := Run(context.Background(), cfg, zaptest.NewLogger(t))
	if code != ExitMaxRuntime || !errors.Is(err, ErrMaxRuntime) {
		t.Fatalf("got code %d, err %v; want %d, ErrMaxRuntime", code, err, ExitMaxRuntime)
	}
	if d := time.Since(start); d < cfg.MaxRuntime {
		t.Errorf("stopped after %s, before the maximum runtime %s", d, cfg.MaxRuntime)
	}
	if !f.exists("ready") {
		t.Error("the command never started")
	}
	if l, ok := f.lease("nightly-report"); ok {
		t.Errorf("lease still held after the run: %+v", l)
	}
}

// A takeover after the last renewal is found when the run releases the
// lease: run exits 76 (lease lost) although the command exited 0, since
// the command's last writes may have been refused.
func TestRunReleaseFindsTheLeaseTakenOver(t *testing.T) {
	f := newFixture(t)
	cfg := f.config("nightly-report", "sh", script(t, "wait_go.sh"))
	cfg.TTL = time.Hour
	cfg.RenewEvery = 59 * time.Minute // no renewal during the test: only the release can notice
	done := runAsync(cfg, zaptest.NewLogger(t))
	eventually(t, 30*time.Second, "the command to start", func() bool { return f.exists("ready") })
	if _, err := f.db.Exec(context.Background(), "UPDATE fence.leases SET expires_at = now() - interval '1s' WHERE job_key = 'nightly-report'"); err != nil {
		t.Fatal(err)
	}
	bob := f.acquireAs("nightly-report", "bob", time.Minute)
	f.touch("go")
	r := await(t, done)
	if r.code != ExitLeaseLost || !errors.Is(r.err, ErrLeaseLost) || !strings.Contains(r.err.Error(), "release found it taken over") {
		t.Fatalf("got code %d, err %v; want %d, ErrLeaseLost found at release", r.code, r.err, ExitLeaseLost)
	}
	if l, ok := f.lease("nightly-report"); !ok || l.holder != "bob" || l.token != bob {
		t.Errorf("bob's lease: got %+v (present %v), want token %d", l, ok, bob)
	}
}
