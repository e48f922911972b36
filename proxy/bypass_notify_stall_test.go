package proxy

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("notify_stall", bypassNotifyStall) }

// bypassNotifyStall: what the watcher hears of takeovers may come late —
// any login may queue a flood of notifications ahead of a real takeover
// (NOTIFY needs no privilege), and a listener stops at a notifying
// transaction that has not finished committing — but no read through the
// proxy may then be answered by a lagging replica with the old
// generation, whether the reader carries no metadata, the old generation
// (a zombie) or another job's (round 14, attacker AA's break 1). The
// tracker is trusted only as fresh as its last marker (freshWithin):
// while notifications are held up, protected reads go to the primary, or
// get FN007 under policy pending. Here the takeover and the new result
// go through the proxy, as in the attack.
func bypassNotifyStall(t *testing.T) {
	e := newNotifyEnv(t)

	// setup: A holds job and its result is on the replica; another job
	// is held (its holder reads too); the proxy knows both generations;
	// replay then pauses. It returns A's lease and the other one.
	setup := func(t *testing.T, job string) (a, o fence.Lease) {
		t.Helper()
		a = e.scenarioBefore(t, job)
		o = e.acquire(t, "other-"+job, "o", time.Minute)
		e.waitTakeover(t, e.gate, a.JobKey, a.Token)
		e.waitTakeover(t, e.gate, o.JobKey, o.Token)
		e.mark(t)
		if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		waitProxyReplay(t, e.proxy)
		pauseReplay(t)
		return a, o
	}
	// takeover: B takes job over and writes its result, both through the
	// proxy.
	takeover := func(t *testing.T, job string, a fence.Lease) fence.Lease {
		t.Helper()
		c := e.worker(t, nil)
		if err := fence.Release(ctxT(t), c, job, a.Token); err != nil {
			t.Fatalf("release through the proxy: %v", err)
		}
		b, err := fence.Acquire(ctxT(t), c, job, "b", time.Minute)
		if err != nil {
			t.Fatalf("acquire through the proxy: %v", err)
		}
		execOK(t, e.worker(t, &b), upsert, job, "B", b.Token)
		return b
	}
	// readers: without metadata, the zombie A, the other job's holder;
	// opened before the stall (a session's start waits for nothing of
	// the watcher's, but keep the reads the only thing measured).
	type reader struct {
		name string
		conn *pgconn.PgConn
	}
	readers := func(t *testing.T, a, o fence.Lease) []reader {
		return []reader{
			{"no_metadata", e.reader(t, nil)},
			{"zombie", e.reader(t, nil, opts(a.JobKey, a.Token)...)},
			{"other_job", e.reader(t, nil, opts(o.JobKey, o.Token)...)},
			{"no_metadata_pending", e.reader(t, nil, "-c fence.read_policy=pending")},
			{"zombie_pending", e.reader(t, nil, opts(a.JobKey, a.Token, "-c fence.read_policy=pending")...)},
			{"no_metadata_wait", e.reader(t, nil, "-c fence.read_policy=wait", "-c fence.read_wait=100ms")},
		}
	}
	// neverA: no reader gets A's result from the replica: B's from the
	// primary, or FN007 under policy pending.
	neverA := func(t *testing.T, job string, rs []reader) {
		t.Helper()
		q := e.readQuery(job)
		for _, r := range rs {
			vals, onRep, err := where(t, r.conn, q)
			if err != nil {
				if pgtest.SQLState(err) == fence.CodePending && (r.name == "no_metadata_pending" || r.name == "zombie_pending") {
					continue
				}
				t.Fatalf("%s: %v", r.name, err)
			}
			if vals[0] != "B" || onRep {
				t.Fatalf("%s: read %v from replica=%v, want B's result from the primary", r.name, vals, onRep)
			}
		}
	}
	// onReplicaAgain: after replay resumes and the watcher has caught up,
	// the replica serves the readers again (B's result).
	onReplicaAgain := func(t *testing.T, job string, rs []reader) {
		t.Helper()
		resumeAndCatchUp(t)
		waitProxyReplay(t, e.proxy)
		q := e.readQuery(job)
		for _, r := range rs[:3] {
			if err := pgtest.Poll(ctxT(t), func() (bool, error) {
				vals, onRep, err := where(t, r.conn, q)
				if err != nil {
					return false, err
				}
				if vals[0] != "B" {
					return false, fmt.Errorf("%s read %v, want B's result", r.name, vals)
				}
				return onRep, nil
			}); err != nil {
				t.Fatalf("%s: never read from the replica again: %v", r.name, err)
			}
		}
	}

	t.Run("watcher_stalled", func(t *testing.T) {
		// Deterministic: the watcher is stopped inside its notification
		// handler (the test holds the lock the handler takes) before the
		// takeover, as a flood or a stalled commit would hold it.
		job := e.nextJob()
		a, o := setup(t, job)
		rs := readers(t, a, o)
		cat := catalogOf(t, e.gate, e.db)
		heard := cat.tk.heard.Load()
		cat.tk.pmu.Lock()
		locked := true
		unlock := func() {
			if locked {
				locked = false
				cat.tk.pmu.Unlock()
			}
		}
		t.Cleanup(unlock)
		e.asForger(t, "direct", "select pg_notify('pgfence_takeover', '{\"job_key\": \"stall\"}')")
		if err := pgtest.Poll(ctxT(t), func() (bool, error) { return cat.tk.heard.Load() > heard, nil }); err != nil {
			t.Fatalf("the watcher never took the notification: %v", err)
		}
		// The watcher is blocked in its handler now: nothing it hears
		// from here on is in the tracker, and no marker can come back.
		b := takeover(t, job, a)
		// Past the documented window: the tracker was last proven fresh
		// before the stall, more than freshWithin ago.
		if err := pgtest.Poll(ctxT(t), func() (bool, error) { return !cat.tk.current(time.Now()), nil }); err != nil {
			t.Fatalf("the tracker stayed current with its watcher stalled: %v", err)
		}
		stale := e.proxy.srv.rs.stats.Stale.Load()
		neverA(t, job, rs)
		if e.proxy.srv.rs.stats.Stale.Load() == stale {
			t.Fatal("no read was counted as judged by a stale tracker")
		}
		if _, ok := cat.tk.lookup(job); ok {
			if tk, _ := cat.tk.lookup(job); tk.token >= b.Token {
				t.Fatal("the stalled watcher has recorded the takeover: the test did not stall it")
			}
		}
		unlock()
		onReplicaAgain(t, job, rs)
	})

	t.Run("after_idle", func(t *testing.T) {
		// The barrier costs nothing but a marker's round trip after a
		// pause in reads: the replica still serves autocommit reads, and
		// requests in a read-only transaction open there (simple and
		// extended protocol) wait for the marker rather than fail.
		job := e.nextJob()
		e.scenarioBefore(t, job)
		e.mark(t)
		if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		waitProxyReplay(t, e.proxy)
		cat := catalogOf(t, e.gate, e.db)
		idle := func(t *testing.T) {
			t.Helper()
			// Stale without asking for a marker (current would ask).
			if err := pgtest.Poll(ctxT(t), func() (bool, error) {
				return time.Now().UnixNano()-cat.tk.fresh.Load() > int64(freshWithin), nil
			}); err != nil {
				t.Fatal(err)
			}
		}
		q := e.readQuery(job)
		r := e.reader(t, nil)
		waitReplicaRead(t, r, q)
		stale := e.proxy.srv.rs.stats.Stale.Load()
		for i := range 3 {
			idle(t)
			marks := cat.tk.marks.Load()
			if vals := mustWhere(t, r, q, true); vals[0] != "A" {
				t.Fatalf("read %v, want A's result", vals)
			}
			if cat.tk.marks.Load() == marks {
				t.Fatalf("read %d after a pause sent no marker", i)
			}
		}
		mustWhere(t, r, "BEGIN READ ONLY; "+q, true)
		idle(t)
		marks := cat.tk.marks.Load()
		mustWhere(t, r, q, true) // simple protocol, in the transaction
		idle(t)
		if cat.tk.marks.Load() == marks {
			t.Fatal("a read in the transaction after a pause sent no marker")
		}
		marks = cat.tk.marks.Load()
		rr := r.ExecParams(ctxT(t), q, nil, nil, nil, nil) // extended protocol, in the transaction
		var rows [][]string
		for rr.NextRow() {
			var row []string
			for _, v := range rr.Values() {
				row = append(row, string(v))
			}
			rows = append(rows, row)
		}
		if _, err := rr.Close(); err != nil {
			t.Fatalf("extended-protocol read in the transaction after a pause: %v", err)
		}
		if len(rows) != 1 || rows[0][0] != "A" || rows[0][2] != "t" {
			t.Fatalf("extended-protocol read in the transaction: %v, want A's result from the replica", rows)
		}
		if cat.tk.marks.Load() == marks {
			t.Fatal("an extended-protocol read in the transaction after a pause sent no marker")
		}
		mustWhere(t, r, "COMMIT; SELECT 1", false)
		if n := e.proxy.srv.rs.stats.Stale.Load() - stale; n != 0 {
			t.Fatalf("%d reads judged stale with the watcher idle and prompt, want 0", n)
		}
	})

	t.Run("flood_before_takeover", func(t *testing.T) {
		// The attack: 200,000 notifications from a login with no fence
		// role, committed just before the takeover.
		job := e.nextJob()
		a, o := setup(t, job)
		rs := readers(t, a, o)
		e.asForger(t, "direct", "select count(pg_notify('pgfence_takeover', json_build_object('job_key', 'f' || g, 'epoch', 1)::text)) from generate_series(1, 200000) g")
		takeover(t, job, a)
		neverA(t, job, rs)
		onReplicaAgain(t, job, rs)
	})
}
