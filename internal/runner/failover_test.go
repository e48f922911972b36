package runner

// Runs across a real failover (issue 31): a cluster of their own (a
// failover ends it), the primary killed after the replica was detached, the
// replica promoted. The run and its command reach the database through a
// forwarder that moves to the promoted primary, as a virtual IP or a
// multi-host DSN does. In async failover mode every generation issued
// before the promotion is void (FN015), so the run acquires again and
// reruns its command.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// vip forwards TCP connections to the address it points at, read at each
// connection: a virtual IP that a failover moves. Connections already open
// end when the server behind them dies.
type vip struct {
	ln     net.Listener
	mu     sync.Mutex
	target string
}

func newVIP(t *testing.T, target string) *vip {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	v := &vip{ln: ln, target: target}
	go func() {
		for {
			down, err := ln.Accept()
			if err != nil {
				return
			}
			v.mu.Lock()
			target := v.target
			v.mu.Unlock()
			up, err := net.Dial("tcp", target)
			if err != nil {
				down.Close()
				continue
			}
			go func() { io.Copy(up, down); up.Close() }()
			go func() { io.Copy(down, up); down.Close() }()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return v
}

func (v *vip) moveTo(target string) {
	v.mu.Lock()
	v.target = target
	v.mu.Unlock()
}

// failoverFixture is a cluster with a replica, a migrated database with
// the protected table "results", a vip in front of the primary, and an
// output directory for failover.sh.
type failoverFixture struct {
	t   *testing.T
	c   *pgtest.Cluster
	db  string
	vip *vip
	dsn string // through the vip
	out string
}

func newFailoverFixture(t *testing.T) *failoverFixture {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := pgtest.Start(ctx, pgtest.Options{Replica: true})
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	db, err := c.CreateDatabase(ctx, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	f := &failoverFixture{t: t, c: c, db: db, out: t.TempDir()}
	f.vip = newVIP(t, c.Primary.Addr())
	f.dsn = fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&connect_timeout=5", f.vip.ln.Addr(), db)
	admin := f.connect()
	defer admin.Close(ctx)
	if err := migrations.Apply(ctx, admin); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if _, err := admin.Exec(ctx, `CREATE TABLE results (job_key text PRIMARY KEY, payload text NOT NULL, token bigint NOT NULL);
SELECT fence.protect('results');`); err != nil {
		t.Fatal(err)
	}
	return f
}

// connect connects to the current primary directly.
func (f *failoverFixture) connect() *pgx.Conn {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, f.c.Primary.DSN(f.db))
	if err != nil {
		f.t.Fatal(err)
	}
	return conn
}

// config runs failover.sh as job "sync" through the vip, renewing every
// renewEvery, with up to restarts failover restarts; env adds LAST, EXIT.
func (f *failoverFixture) config(renewEvery time.Duration, restarts int, env ...string) Config {
	var base []string
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "PG") || k == "DATABASE_URL" || k == "OUT" {
			continue
		}
		base = append(base, kv)
	}
	return Config{
		JobKey: "sync", TTL: 30 * time.Second, RenewEvery: renewEvery, Grace: 10 * time.Second,
		FailoverRestarts: restarts,
		DSN:              f.dsn,
		Command:          []string{"sh", script(f.t, "failover.sh")},
		Env:              append(append(base, "DATABASE_URL="+f.dsn, "OUT="+f.out), env...),
		Stdin:            strings.NewReader(""),
		Stdout:           testWriter{f.t, "child stdout"},
		Stderr:           testWriter{f.t, "child stderr"},
	}
}

// failover detaches the replica (what the primary commits from now on is
// lost), kills the primary, promotes the replica and moves the vip to it.
func (f *failoverFixture) failover() {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := f.c.WaitReplicaCaughtUp(ctx); err != nil {
		f.t.Fatal(err)
	}
	if err := f.c.DetachReplica(ctx); err != nil {
		f.t.Fatal(err)
	}
	if err := f.c.Failover(ctx); err != nil {
		f.t.Fatal(err)
	}
	f.vip.moveTo(f.c.Primary.Addr())
}

func (f *failoverFixture) waitFile(name string) {
	f.t.Helper()
	eventually(f.t, time.Minute, name, func() bool {
		_, err := os.Stat(filepath.Join(f.out, name))
		return err == nil
	})
}

func (f *failoverFixture) touch(name string) {
	f.t.Helper()
	if err := os.WriteFile(filepath.Join(f.out, name), nil, 0o644); err != nil {
		f.t.Fatal(err)
	}
}

// tokens are the tokens failover.sh's starts ran under, in order.
func (f *failoverFixture) tokens() []int64 {
	f.t.Helper()
	b, err := os.ReadFile(filepath.Join(f.out, "tokens"))
	if err != nil {
		f.t.Fatal(err)
	}
	var out []int64
	for _, s := range strings.Fields(string(b)) {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			f.t.Fatal(err)
		}
		out = append(out, n)
	}
	return out
}

// result is job sync's row of results, and whether a lease row is left.
func (f *failoverFixture) result() (r result, leased bool) {
	f.t.Helper()
	ctx := context.Background()
	conn := f.connect()
	defer conn.Close(ctx)
	if err := conn.QueryRow(ctx, `SELECT payload, token FROM results WHERE job_key = 'sync'`).Scan(&r.payload, &r.token); err != nil {
		f.t.Fatal(err)
	}
	if err := conn.QueryRow(ctx, `SELECT count(*) > 0 FROM fence.leases WHERE job_key = 'sync'`).Scan(&leased); err != nil {
		f.t.Fatal(err)
	}
	return r, leased
}

const restartLog = "failover: the lease's generation is void (FN015) and the job is free; acquiring the lease again and running the command again under a new generation"

// checkRestartLogged checks that n restarts were logged, each with the
// era the server is in.
func checkRestartLogged(t *testing.T, logs *observer.ObservedLogs, n int) {
	t.Helper()
	entries := logs.FilterMessage(restartLog).All()
	if len(entries) != n {
		t.Fatalf("%d restarts logged, want %d", len(entries), n)
	}
	for _, e := range entries {
		m := e.ContextMap()
		if era, ok := m["era"].(int32); !ok || era < 2 {
			t.Errorf("restart logged without a new era: %v", m)
		}
		if !strings.Contains(fmt.Sprint(m["error"]), "FN015") {
			t.Errorf("restart logged without the FN015 that caused it: %v", m)
		}
	}
}

// TestRunRestartsAfterFailover (issue 31): a run whose generation a
// failover made void acquires again and reruns its command under a new,
// larger token, and finishes with the command's exit code. The void
// generation is found by a renewal while the command runs (the command is
// stopped with the kill signal), or, when the command's own write is
// refused with FN015 first and it exits non-zero, by a renewal tried right
// after it exited.
func TestRunRestartsAfterFailover(t *testing.T) {
	t.Run("renewal", func(t *testing.T) {
		t.Parallel()
		f := newFailoverFixture(t)
		log, logs := observed(t)
		done := runAsync(f.config(200*time.Millisecond, 3, "LAST=2", "EXIT=5"), log)
		f.waitFile("ready.1")
		f.failover()
		r := await(t, done)
		if r.code != 5 || r.err != nil {
			t.Fatalf("got code %d, err %v; want the rerun command's 5 and no error", r.code, r.err)
		}
		checkRerun(t, f, logs)
		if logs.FilterMessage("stopping command").Len() != 1 {
			t.Error("the first command was not stopped once (with the kill signal) when the renewal found its generation void")
		}
	})
	t.Run("command_failed_first", func(t *testing.T) {
		t.Parallel()
		f := newFailoverFixture(t)
		log, logs := observed(t)
		// No renewal before the command's own write finds the generation void.
		done := runAsync(f.config(25*time.Second, 3, "LAST=2", "EXIT=0"), log)
		f.waitFile("ready.1")
		f.failover()
		f.touch("go.1")
		r := await(t, done)
		if r.code != 0 || r.err != nil {
			t.Fatalf("got code %d, err %v; want the rerun command's 0 and no error", r.code, r.err)
		}
		if late := f.file("late.1.out"); !strings.Contains(late, "FN015") {
			t.Errorf("the first command's write after the failover: %q, want a refusal with FN015", late)
		}
		checkRerun(t, f, logs)
		if logs.FilterMessage("stopping command").Len() != 0 {
			t.Error("a command that had exited was told to stop")
		}
	})
}

// checkRerun checks what both ways of TestRunRestartsAfterFailover leave:
// two starts, the second under a larger token, whose write stands, one
// restart logged, and the lease released.
func checkRerun(t *testing.T, f *failoverFixture, logs *observer.ObservedLogs) {
	t.Helper()
	tokens := f.tokens()
	if len(tokens) != 2 || tokens[1] <= tokens[0] {
		t.Fatalf("the command ran under tokens %v, want two, the second larger", tokens)
	}
	res, leased := f.result()
	if res.payload != "run-2" || res.token != tokens[1] {
		t.Errorf("result %+v, want the rerun's run-2 under token %d", res, tokens[1])
	}
	if leased {
		t.Error("the rerun's lease was not released")
	}
	checkRestartLogged(t, logs, 1)
}

func (f *failoverFixture) file(name string) string {
	f.t.Helper()
	b, err := os.ReadFile(filepath.Join(f.out, name))
	if err != nil {
		f.t.Fatal(err)
	}
	return string(b)
}

// TestRunFailoverRestartLimit (issue 31): a run restarts at most
// FailoverRestarts times; the failover after that ends it with
// ExitLeaseLost, as every failover did before restarts existed. With none
// allowed, the first does; with one, the second (two failovers: pgtest's
// AddReplica makes a replica of the promoted primary).
func TestRunFailoverRestartLimit(t *testing.T) {
	t.Run("none", func(t *testing.T) {
		t.Parallel()
		f := newFailoverFixture(t)
		log, logs := observed(t)
		done := runAsync(f.config(200*time.Millisecond, 0), log)
		f.waitFile("ready.1")
		f.failover()
		checkRestartsUsedUp(t, f, logs, await(t, done), 0)
		if logs.FilterMessage("stopping command").Len() != 1 {
			t.Error("the command was not stopped when the renewal found its generation void")
		}
	})
	t.Run("one", func(t *testing.T) {
		t.Parallel()
		f := newFailoverFixture(t)
		log, logs := observed(t)
		done := runAsync(f.config(200*time.Millisecond, 1), log)
		f.waitFile("ready.1")
		f.failover()
		f.waitFile("ready.2")
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := f.c.AddReplica(ctx, pgtest.Options{}); err != nil {
			t.Fatal(err)
		}
		f.failover()
		checkRestartsUsedUp(t, f, logs, await(t, done), 1)
	})
}

// checkRestartsUsedUp checks a run that ended with ExitLeaseLost after n
// failover restarts, the last failover finding none left.
func checkRestartsUsedUp(t *testing.T, f *failoverFixture, logs *observer.ObservedLogs, r runResult, n int) {
	t.Helper()
	if r.code != ExitLeaseLost || !errors.Is(r.err, ErrLeaseLost) || !fence.IsFailover(r.err) {
		t.Fatalf("got code %d, err %v; want %d, ErrLeaseLost with FN015", r.code, r.err, ExitLeaseLost)
	}
	if !strings.Contains(r.err.Error(), "no failover restarts are left") {
		t.Errorf("error %q does not say the restarts ran out", r.err)
	}
	if tokens := f.tokens(); len(tokens) != n+1 {
		t.Errorf("the command ran under tokens %v, want %d", tokens, n+1)
	}
	checkRestartLogged(t, logs, n)
}

// TestRunTakeoverIsNotRestarted: FN001 (another holder took the job over)
// still ends the run with ExitLeaseLost whatever FailoverRestarts allows,
// whether a renewal finds it or the command's write is refused first.
func TestRunTakeoverIsNotRestarted(t *testing.T) {
	for _, tc := range []struct {
		name       string
		renewEvery time.Duration
	}{{"renewal", 100 * time.Millisecond}, {"command_failed_first", 25 * time.Second}} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			cfg := f.config("sync", "sh", script(t, "failover.sh"))
			cfg.RenewEvery, cfg.FailoverRestarts = tc.renewEvery, 3
			log, logs := observed(t)
			done := runAsync(cfg, log)
			eventually(t, time.Minute, "the command to start", func() bool { return f.exists("ready.1") })
			// Expire the lease and take it over in one transaction: the
			// runner renews every 100 ms, and a renewal between the two
			// made the lease live again (FN002).
			ctx := context.Background()
			tx, err := f.db.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			// The fence row first, as fence.renew and fence.acquire lock
			// it: a renewal then waits for this transaction (no deadlock).
			if _, err := tx.Exec(ctx, `SELECT FROM fence.fences WHERE job_key = 'sync' FOR UPDATE`); err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `UPDATE fence.leases SET expires_at = clock_timestamp() - interval '1 second' WHERE job_key = 'sync'`); err != nil {
				t.Fatal(err)
			}
			l, err := fence.Acquire(ctx, tx, "sync", "other-host:1", time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			other := l.Token
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if tc.renewEvery > time.Minute/4 {
				f.touch("go.1") // its write is refused (FN001) and it exits 3
			}
			r := await(t, done)
			if r.code != ExitLeaseLost || !errors.Is(r.err, ErrLeaseLost) {
				t.Fatalf("got code %d, err %v; want %d, ErrLeaseLost", r.code, r.err, ExitLeaseLost)
			}
			if n := strings.Count(f.file("tokens"), "\n"); n != 1 {
				t.Errorf("the command started %d times, want once", n)
			}
			if logs.FilterMessage(restartLog).Len() != 0 {
				t.Error("a takeover was taken for a failover and restarted")
			}
			if l, ok := f.lease("sync"); !ok || l.token != other {
				t.Errorf("lease %+v (present %v), want the other holder's token %d", l, ok, other)
			}
		})
	}
}
