package fence_test

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/audit"
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// failoverEnv is a cluster of its own (a primary and a streaming replica)
// with a migrated database, a protected table and two worker roles: a
// failover ends the cluster, so no test shares it.
type failoverEnv struct {
	t  *testing.T
	c  *pgtest.Cluster
	db string
}

func newFailoverEnv(t *testing.T, settings map[string]string) *failoverEnv {
	t.Helper()
	ctx := ctxT(t)
	c, err := pgtest.Start(ctx, pgtest.Options{Replica: true, Settings: settings})
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	db, err := c.CreateDatabase(ctx, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	e := &failoverEnv{t: t, c: c, db: db}
	admin := e.connect("", nil)
	if err := migrations.Apply(ctx, admin); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if _, err := admin.Exec(ctx, `
create role wa login; create role wb login;
grant pgfence_worker to wa, wb;
create table results (job_key text primary key, payload text not null, token bigint not null);
grant select, insert, update on results to wa, wb;
select fence.protect('results');`); err != nil {
		t.Fatal(err)
	}
	return e
}

// connect connects to the current primary as user ("": the superuser),
// with the generation g in its settings when g is not nil.
func (e *failoverEnv) connect(user string, g *fence.Lease) *pgx.Conn {
	return e.connectStep(user, g, "s")
}

// connectStep is connect with step as fence.step.
func (e *failoverEnv) connectStep(user string, g *fence.Lease, step string) *pgx.Conn {
	e.t.Helper()
	cfg, err := pgx.ParseConfig(e.c.Primary.DSN(e.db))
	if err != nil {
		e.t.Fatal(err)
	}
	if user != "" {
		cfg.User = user
	}
	if g != nil {
		cfg.RuntimeParams["options"] = fmt.Sprintf("-c fence.job_key=%s -c fence.epoch=%d -c fence.token=%d -c fence.step=%s", g.JobKey, g.Epoch, g.Token, step)
	}
	conn, err := pgx.ConnectConfig(ctxT(e.t), cfg)
	if err != nil {
		e.t.Fatalf("connect as %q: %v", user, err)
	}
	e.t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func (e *failoverEnv) acquire(user, job string) fence.Lease {
	e.t.Helper()
	l, err := fence.Acquire(ctxT(e.t), e.connect(user, nil), job, user, time.Minute)
	if err != nil {
		e.t.Fatalf("acquire %s as %s: %v", job, user, err)
	}
	return l
}

// write upserts job's result under generation g, directly (the backstop),
// with payload as the step (each write a step of its own).
func (e *failoverEnv) write(user string, g fence.Lease, payload string) error {
	_, err := e.connectStep(user, &g, strings.ReplaceAll(payload, " ", "_")).Exec(ctxT(e.t),
		"insert into results values ($1, $2, $3) on conflict (job_key) do update set payload = excluded.payload, token = excluded.token",
		g.JobKey, payload, g.Token)
	return err
}

// expire makes job's lease expired without waiting for it.
func (e *failoverEnv) expire(job string) {
	e.t.Helper()
	if _, err := e.connect("", nil).Exec(ctxT(e.t), "update fence.leases set expires_at = clock_timestamp() - interval '1 second' where job_key = $1", job); err != nil {
		e.t.Fatal(err)
	}
}

func (e *failoverEnv) payload(job string) string {
	e.t.Helper()
	var p string
	if err := e.connect("", nil).QueryRow(ctxT(e.t), "select payload from results where job_key = $1", job).Scan(&p); err != nil {
		e.t.Fatal(err)
	}
	return p
}

// TestFailoverAsync (issue 31): an asynchronous failover loses a takeover
// and the tokens issued with it. On the promoted primary no generation
// issued before the failover commits — the zombie the lost takeover had
// fenced out, the holder whose takeover was lost — with FN015; a new
// acquire draws a number above every number issued before (L5), and the
// void lease does not keep the job from being taken at once.
func TestFailoverAsync(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, nil)
	ctx := ctxT(t)
	a := e.acquire("wa", "j")
	if err := e.write("wa", a, "a"); err != nil {
		t.Fatalf("A's write: %v", err)
	}
	other := e.acquire("wa", "k") // a job nobody takes over: its holder loses it too
	if err := e.c.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.c.DetachReplica(ctx); err != nil {
		t.Fatal(err)
	}
	// The takeover and B's write reach only the old primary.
	e.expire("j")
	b := e.acquire("wb", "j")
	if err := e.write("wb", b, "b"); err != nil {
		t.Fatalf("B's write: %v", err)
	}
	if err := e.write("wa", a, "zombie before"); fence.Code(err) != fence.CodeStale {
		t.Fatalf("A's write after the takeover, before the failover: %v, want FN001", err)
	}
	if err := e.c.Failover(ctx); err != nil {
		t.Fatal(err)
	}
	if got := e.payload("j"); got != "a" {
		t.Fatalf("after the failover the result is %q, want A's (B's write was lost)", got)
	}
	for _, w := range []struct {
		name string
		user string
		g    fence.Lease
	}{{"zombie A", "wa", a}, {"B, whose takeover was lost", "wb", b}, {"the holder of another job", "wa", other}} {
		err := e.write(w.user, w.g, "after failover")
		if fence.Code(err) != fence.CodeFailover {
			t.Fatalf("%s writes after the failover: %v, want FN015", w.name, err)
		}
	}
	// Retries learn what happened: A's commit reached the new primary
	// (its receipt is there): a replay. B's did not: FN015, not a first
	// commit.
	if err := e.write("wa", a, "a"); fence.Code(err) != fence.CodeReplay {
		t.Fatalf("A retries its commit from before the failover: %v, want FN00R (it survived)", err)
	}
	if err := e.write("wb", b, "b"); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("B retries its commit lost in the failover: %v, want FN015", err)
	}
	if got := e.payload("j"); got != "a" {
		t.Fatalf("after the refused writes the result is %q, want A's", got)
	}
	if _, err := fence.Renew(ctx, e.connect("wa", nil), "k", other.Token, time.Minute); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("renewal of a lease from before the failover: %v, want FN015", err)
	}
	// (round 9) B, whose takeover was lost, renews: FN015 (the job is
	// free: pgfence run acquires again), not FN001 for the role the fence
	// row names; release and retire refuse a void generation as renew does.
	if _, err := fence.Renew(ctx, e.connect("wb", nil), "j", b.Token, time.Minute); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("B renews the lease whose takeover was lost: %v, want FN015", err)
	}
	if err := fence.Release(ctx, e.connect("wa", nil), "k", other.Token); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("release of a lease from before the failover: %v, want FN015", err)
	}
	if err := fence.Retire(ctx, e.connect("wa", nil), "k", fence.RetireOptions{Token: other.Token}); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("retire under a generation from before the failover: %v, want FN015", err)
	}
	// The void lease does not hold the job: another role takes it now,
	// under a token above every token issued before the failover.
	c := e.acquire("wb", "k")
	for _, old := range []fence.Lease{a, b, other} {
		if c.Token <= old.Token {
			t.Fatalf("token %d issued after the failover is not above %d, issued before", c.Token, old.Token)
		}
	}
	if err := e.write("wb", c, "c"); err != nil {
		t.Fatalf("a write under the new generation: %v", err)
	}
	var era int
	var lossless bool
	if err := e.connect("", nil).QueryRow(ctx, "select era, lossless from fence.current_era()").Scan(&era, &lossless); err != nil {
		t.Fatal(err)
	}
	if era < 2 || lossless {
		t.Fatalf("current era %d (lossless %v), want a new, lossy era", era, lossless)
	}
	// The audit of the new primary's history: clean (every refused write
	// left nothing), with the failover in its eras and a note on what an
	// asynchronous promotion may have lost.
	rep, err := audit.Run(ctx, e.connect("", nil), audit.Options{})
	if err != nil {
		t.Fatal(err)
	}
	var text strings.Builder
	rep.WriteText(&text)
	if !rep.OK() || len(rep.Eras) != 2 || rep.Eras[1].Lossless || !strings.Contains(text.String(), "may have been lost") {
		t.Fatalf("audit after the failover: ok=%v eras %+v, want clean, 2 eras, the second lossy and noted:\n%s", rep.OK(), rep.Eras, text.String())
	}
}

// TestFailoverSync (issue 31): with a synchronous standby and
// failover_mode sync, a takeover is acknowledged only once the standby has
// it, and a failover to that standby disturbs nobody: the live holder
// keeps its lease and writes; only the zombie is refused, as before.
func TestFailoverSync(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, map[string]string{"synchronous_standby_names": "'*'"})
	ctx := ctxT(t)
	if _, err := e.connect("", nil).Exec(ctx, "select fence.set_failover_mode('sync')"); err != nil {
		t.Fatal(err)
	}
	a := e.acquire("wa", "j")
	if err := e.write("wa", a, "a"); err != nil {
		t.Fatalf("A's write: %v", err)
	}
	e.expire("j")
	b := e.acquire("wb", "j") // its commit waits for the standby
	if err := e.c.Failover(ctx); err != nil {
		t.Fatal(err)
	}
	// The new primary has no standby: as Patroni does, it stops waiting
	// for one (else every commit would wait for ever).
	admin := e.connect("", nil)
	for _, sql := range []string{"alter system set synchronous_standby_names = ''", "select pg_reload_conf()"} {
		if _, err := admin.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.write("wa", a, "zombie"); fence.Code(err) != fence.CodeStale {
		t.Fatalf("zombie A writes after the failover: %v, want FN001", err)
	}
	if err := e.write("wb", b, "b"); err != nil {
		t.Fatalf("B, the live holder, writes after the failover: %v", err)
	}
	if err := e.write("wb", b, "b"); fence.Code(err) != fence.CodeReplay {
		t.Fatalf("B retries its write: %v, want FN00R", err)
	}
	// Without a synchronous standby a takeover could be lost again: an
	// acquire fails closed until one is back (or the mode is async).
	if _, err := fence.Acquire(ctx, e.connect("wa", nil), "j", "wa", time.Minute); pgtest.SQLState(err) != "55000" {
		t.Fatalf("acquire in sync mode without a standby: %v, want 55000", err)
	}
	var lossless bool
	if err := e.connect("", nil).QueryRow(ctx, "select lossless from fence.current_era()").Scan(&lossless); err != nil {
		t.Fatal(err)
	}
	if !lossless {
		t.Fatal("the era after a failover in sync mode is not lossless")
	}
}

// TestFailoverModeNeedsStandby: failover_mode sync is refused without a
// synchronous standby, and an acquire under it fails closed when the
// standby setting is gone (a takeover then could be lost).
func TestFailoverModeNeedsStandby(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	ctx := ctxT(t)
	_, err := e.admin.Exec(ctx, "select fence.set_failover_mode('sync')")
	wantCode(t, err, "55000")
	e.exec("insert into fence.settings (name, value) values ('failover_mode', 'sync')")
	_, err = fence.Acquire(ctx, e.admin, "j", "h", time.Minute)
	wantCode(t, err, "55000")
	e.exec("select fence.set_failover_mode('async')")
	if _, err := fence.Acquire(ctx, e.admin, "j", "h", time.Minute); err != nil {
		t.Fatalf("acquire in async mode: %v", err)
	}
}

// replayedTo waits until standby n has replayed the primary's WAL as it
// is now.
func (e *failoverEnv) replayedTo(n *pgtest.Node) {
	e.t.Helper()
	ctx := ctxT(e.t)
	lsn, err := e.c.CurrentLSN(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	conn, err := n.Connect(ctx, "postgres")
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close(ctx)
	if err := pgtest.Poll(ctx, func() (bool, error) {
		var ok bool
		err := conn.QueryRow(ctx, "select coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)", lsn).Scan(&ok)
		return ok, err
	}); err != nil {
		e.t.Fatal(err)
	}
}

// TestFailoverSameTimeline (round 9, Q-H1): two promotions from one
// history onto the same timeline number. Primary A has two asynchronous
// standbys, B and C. A dies, B is promoted (timeline 2) and a takeover
// commits there; B dies, and C, which never received B's WAL, is
// promoted: timeline 2 as well. C must not issue the generation B issued
// (the same era number on both branches once gave the same token floor),
// and B's holder, whose takeover C lost, must not commit on C.
func TestFailoverSameTimeline(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, nil)
	ctx := ctxT(t)
	standbyC, err := e.c.AddNode(ctx, "standbyC", pgtest.Options{}, true, true)
	if err != nil {
		t.Fatal(err)
	}
	a := e.acquire("wa", "j")
	if err := e.write("wa", a, "a"); err != nil {
		t.Fatalf("A's write: %v", err)
	}
	e.replayedTo(e.c.Replica)
	e.replayedTo(standbyC)
	if err := e.c.Failover(ctx); err != nil { // B
		t.Fatal(err)
	}
	b := e.acquire("wb", "j") // a's lease is void on B: free at once
	if err := e.write("wb", b, "b"); err != nil {
		t.Fatalf("B's holder writes on B: %v", err)
	}
	if err := e.c.FailoverTo(ctx, standbyC); err != nil {
		t.Fatal(err)
	}
	var tl int
	if err := e.connect("", nil).QueryRow(ctx, "select timeline from fence.current_era()").Scan(&tl); err != nil {
		t.Fatal(err)
	}
	if tl != 2 {
		t.Fatalf("C is on timeline %d, want 2 (the test needs both promotions on one timeline number)", tl)
	}
	c := e.acquire("wb", "j") // the same role, as the same program on another host
	if c.Token == b.Token || c.Epoch == b.Epoch && c.Token == b.Token {
		t.Fatalf("C issued generation (%d, %d) again, which B issued", c.Epoch, c.Token)
	}
	if c.Token <= a.Token {
		t.Fatalf("C issued token %d, not above %d issued before both failovers", c.Token, a.Token)
	}
	if err := e.write("wb", c, "c"); err != nil {
		t.Fatalf("C's holder writes: %v", err)
	}
	// B's holder (a zombie whose takeover C lost): its retry of the commit
	// C lost and new work are refused, whatever the number.
	for _, payload := range []string{"b", "zombie"} {
		err := e.write("wb", b, payload)
		if code := fence.Code(err); code != fence.CodeFailover && code != fence.CodeNotOwner {
			t.Fatalf("B's holder writes %q on C: %v, want FN015 or FN011", payload, err)
		}
	}
	if got := e.payload("j"); got != "c" {
		t.Fatalf("the result on C is %q, want C's holder's", got)
	}
}

// TestCrashRestartKeepsTakeover (round 9, Q-H3): a takeover acknowledged
// with synchronous_commit off survives a crash-restart (kill -9 of any
// backend: the postmaster reinitialises, its start time unchanged), so
// the previous holder does not commit after it. wal_writer_delay is long
// and autovacuum off, so nothing but the acquire's own commit flushes its
// WAL before the crash (the WAL writer's next round is up to 10 s away):
// without that flush the takeover is lost.
func TestCrashRestartKeepsTakeover(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, map[string]string{"wal_writer_delay": "'10s'", "autovacuum": "off"})
	ctx := ctxT(t)
	a := e.acquire("wa", "j")
	if err := e.write("wa", a, "a"); err != nil {
		t.Fatalf("A's write: %v", err)
	}
	e.expire("j")
	wb := e.connect("wb", nil)
	if _, err := wb.Exec(ctx, "set synchronous_commit = off"); err != nil {
		t.Fatal(err)
	}
	b, err := fence.Acquire(ctx, wb, "j", "wb", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	var pid int
	if err := e.connect("", nil).QueryRow(ctx, "select pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := pgtest.Poll(ctx, func() (bool, error) {
		conn, err := e.c.Primary.Connect(ctx, e.db)
		if err != nil {
			return false, nil // the postmaster is reinitialising
		}
		defer conn.Close(ctx)
		var rec bool
		return conn.QueryRow(ctx, "select not pg_is_in_recovery()").Scan(&rec) == nil && rec, nil
	}); err != nil {
		t.Fatal(err)
	}
	var tok int64
	if err := e.connect("", nil).QueryRow(ctx, "select max_issued_token from fence.fences where job_key = 'j'").Scan(&tok); err != nil {
		t.Fatal(err)
	}
	if tok != b.Token {
		t.Fatalf("after the crash-restart the fence's token is %d, want %d (the acknowledged takeover)", tok, b.Token)
	}
	if err := e.write("wa", a, "zombie"); fence.Code(err) != fence.CodeStale {
		t.Fatalf("A writes after the crash-restart: %v, want FN001 (the takeover stands)", err)
	}
	if err := e.write("wb", b, "b"); err != nil {
		t.Fatalf("B writes after the crash-restart: %v", err)
	}
}

// TestRestoredBackupNewEra (round 9, Q-H2): a physical backup restored as
// the primary on the same timeline (crash recovery, the same system
// identifier) looks like a crash restart to the database; the runbook's
// fence.new_era after the restore voids every generation the copy knew
// and moves the numbers past everything issued before.
func TestRestoredBackupNewEra(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, nil)
	ctx := ctxT(t)
	a := e.acquire("wa", "j")
	if err := e.write("wa", a, "a"); err != nil {
		t.Fatalf("A's write: %v", err)
	}
	backup, err := e.c.AddNode(ctx, "backup", pgtest.Options{}, false, false)
	if err != nil {
		t.Fatal(err)
	}
	e.expire("j")
	b := e.acquire("wb", "j") // a takeover after the backup: lost with the old primary
	if err := e.c.Primary.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := backup.Start(ctx); err != nil {
		t.Fatal(err)
	}
	e.c.UsePrimary(backup)
	if _, err := e.connect("wa", nil).Exec(ctx, "select fence.new_era('restored')"); pgtest.SQLState(err) != "42501" {
		t.Fatalf("a worker starts a new era: %v, want 42501", err)
	}
	if _, err := e.connect("", nil).Exec(ctx, "select fence.new_era('restored from last night''s backup')"); err != nil {
		t.Fatalf("new_era: %v", err)
	}
	if err := e.write("wa", a, "zombie"); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("A (superseded before the loss) writes on the restored copy: %v, want FN015", err)
	}
	c := e.acquire("wb", "j")
	if c.Token <= b.Token {
		t.Fatalf("token %d issued on the restored copy is not above %d, issued before the restore", c.Token, b.Token)
	}
	var reason string
	if err := e.connect("", nil).QueryRow(ctx, "select reason from fence.current_era()").Scan(&reason); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(reason, "last night") {
		t.Fatalf("current era's reason %q does not give the administrator's", reason)
	}
}
