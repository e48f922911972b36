package runner

// The package's test harness: its PostgreSQL, a fixture per test (a
// database with a protected table, a directory for the child scripts), a
// run in the background, and a separate `pgfence run` process.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
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
	"github.com/pgfence/pgfence/internal/testbin"
	"github.com/pgfence/pgfence/migrations"
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
	code := pgtest.Run(m, pgtest.Options{}, migrations.Prepare, &cluster)
	testbin.Remove() // built once for TestPgfenceRunCronLine
	os.Exit(code)
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

// runBehindOther has another holder take the lease of cfg's job, starts
// cfg's run waiting for it (polling every 50 ms), and returns once the run
// has logged that it waits: the other holder's token and the run's result.
func (f *fixture) runBehindOther(cfg Config) (int64, <-chan runResult) {
	f.t.Helper()
	other := f.acquireAs(cfg.JobKey, "other-host:1", time.Minute)
	cfg.Wait = true
	cfg.WaitPoll = 50 * time.Millisecond
	log, logs := observed(f.t)
	done := runAsync(cfg, log)
	eventually(f.t, 30*time.Second, "the run to report it is waiting", func() bool {
		return logs.FilterMessage("lease held by another holder; waiting").Len() > 0
	})
	return other, done
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
