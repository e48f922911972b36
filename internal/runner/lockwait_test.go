package runner

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pgfence/pgfence/fence"
)

// holdFenceRow opens a transaction on its own connection that locks job's
// fence row, as a gated write that has not committed does, and returns
// the connection (in the open transaction) and its backend pid.
func (f *fixture) holdFenceRow(job string) (*pgx.Conn, uint32) {
	f.t.Helper()
	ctx := context.Background()
	token := f.acquireAs(job, "earlier-holder", time.Minute)
	if err := fence.Release(ctx, f.db, job, token); err != nil {
		f.t.Fatal(err)
	}
	c, err := pgx.Connect(ctx, f.dsn+"&application_name=stalled-worker")
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { c.Close(context.Background()) })
	if _, err := c.Exec(ctx, "BEGIN"); err != nil {
		f.t.Fatal(err)
	}
	if _, err := c.Exec(ctx, "SELECT 1 FROM fence.fences WHERE job_key = $1 FOR UPDATE", job); err != nil {
		f.t.Fatal(err)
	}
	return c, c.PgConn().PID()
}

// bobsAcquire is the configuration of bob's acquire of job, and the logger
// it logs to with an observer of its entries.
func (f *fixture) bobsAcquire(job string) (Config, *zap.Logger, *observer.ObservedLogs) {
	cfg := f.config(job)
	cfg.Holder = "bob"
	log, logs := observed(f.t)
	return cfg, log, logs
}

// An acquire blocked by an open transaction on the job's fence row says
// so, naming the blocking session, and gives up after LockTimeout naming
// it again; nothing was acquired.
func TestAcquireNamesTheBlockingSession(t *testing.T) {
	f := newFixture(t)
	_, pid := f.holdFenceRow("nightly-report")
	cfg, log, logs := f.bobsAcquire("nightly-report")
	cfg.LockTimeout = 3 * time.Second
	start := time.Now()
	_, code, err := Acquire(context.Background(), cfg, log)
	if code != ExitLeaseHeld || !errors.Is(err, ErrLockTimeout) {
		t.Fatalf("got code %d, err %v; want %d, ErrLockTimeout", code, err, ExitLeaseHeld)
	}
	if d := time.Since(start); d < cfg.LockTimeout {
		t.Errorf("gave up after %s, before the lock timeout %s", d, cfg.LockTimeout)
	}
	for _, want := range []string{fmt.Sprintf("pid %d", pid), "idle in transaction", `application "stalled-worker"`, fmt.Sprintf("pg_terminate_backend(%d)", pid)} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	warned := logs.FilterMessageSnippet("locked by an open transaction").All()
	if len(warned) != 1 {
		t.Fatalf("got %d warnings that the fence row is locked, want 1 (logs: %v)", len(warned), logs.All())
	}
	if got := warned[0].ContextMap()["blocking_pids"]; fmt.Sprint(got) != fmt.Sprintf("[%d]", pid) {
		t.Errorf("blocking_pids: got %v, want [%d]", got, pid)
	}
	if l, ok := f.lease("nightly-report"); ok {
		t.Errorf("a lease was taken although the acquire gave up: %+v", l)
	}
}

// Once the blocking transaction ends, the waiting acquire goes through.
func TestAcquireWaitsForTheBlockingTransaction(t *testing.T) {
	f := newFixture(t)
	blocker, pid := f.holdFenceRow("nightly-report")
	cfg, log, logs := f.bobsAcquire("nightly-report")
	type res struct {
		l    fence.Lease
		code int
		err  error
	}
	done := make(chan res, 1)
	go func() {
		l, code, err := Acquire(context.Background(), cfg, log)
		done <- res{l, code, err}
	}()
	eventually(t, 30*time.Second, "the warning that the fence row is locked", func() bool {
		return logs.FilterMessageSnippet("locked by an open transaction").FilterField(zap.Ints("blocking_pids", []int{int(pid)})).Len() == 1
	})
	if _, err := blocker.Exec(context.Background(), "COMMIT"); err != nil {
		t.Fatal(err)
	}
	var r res
	select {
	case r = <-done:
	case <-time.After(time.Minute):
		t.Fatal("the acquire did not return after the blocking transaction ended")
	}
	if r.err != nil || r.code != 0 || r.l.Holder != "bob" {
		t.Fatalf("acquire: got %+v, want bob's lease", r)
	}
	if l, ok := f.lease("nightly-report"); !ok || l.holder != "bob" || l.token != r.l.Token {
		t.Errorf("lease row: got %+v (present %v), want bob with token %d", l, ok, r.l.Token)
	}
}
