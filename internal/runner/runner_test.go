package runner

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/fence"
)

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
	other, done := f.runBehindOther(f.config("nightly-report", "sh", script(t, "write.sh"), "mine"))
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
	// Long enough for the first attempt to be answered on a loaded
	// machine (an attempt cut off by the deadline before any answer does
	// not know the lease is held, and exits 70).
	cfg.WaitTimeout = 2 * time.Second
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
	cfg := f.config("nightly-report", "sh", script(t, "write.sh"), "mine")
	sigs := make(chan os.Signal, 1)
	cfg.Signals = sigs
	_, done := f.runBehindOther(cfg)
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
