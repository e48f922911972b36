package proxy

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
)

// routeEnv is a fenceEnv whose proxy routes reads to the test cluster's
// streaming replica. Its database notifies DDL (ddlTriggerSQL), so reads
// of unprotected tables may use a lagging replica.
type routeEnv struct {
	*fenceEnv
}

func newRouteEnv(t *testing.T) *routeEnv { return newRouteEnvMode(t, true, fenceSchema) }

// newRouteEnvMode is newRouteEnv with a database that notifies DDL
// (tracked) or does not, and schema instead of fenceSchema.
func newRouteEnvMode(t *testing.T, tracked bool, schema string) *routeEnv {
	t.Helper()
	mode := noDDLTriggerSQL
	if tracked {
		mode = ddlTriggerSQL
	}
	db := cluster.NewDatabaseWith(t, mode+schema)
	if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	e := &routeEnv{&fenceEnv{db: db}}
	e.proxy, e.gate = startRouteProxy(t, db)
	return e
}

// startRouteProxy starts a gated proxy with the replica configured, and
// holds a session in db until the end of t: the proxy's pollers and the
// database's catalog watcher live while it has sessions.
func startRouteProxy(t *testing.T, db string) (*testProxy, *Fence) {
	t.Helper()
	gate := newGate(t)
	p := startProxy(t, Config{Interceptor: gate, Replicas: []string{cluster.Replica.DSN("postgres")},
		ReplicaPoll: 10 * time.Millisecond, ReplicaMaxLag: time.Minute})
	connect(t, p.dsn(db))
	waitHealthy(t, p)
	waitCatalogReplayed(t, p, gate, db)
	return p, gate
}

// waitCatalogReplayed waits until the gate has loaded the catalog of db
// (in a tracked database) and the replica has replayed its position: before it, even a read of an
// unprotected table goes to the primary (the replica's catalog could be
// older than the one the gate judged it by). It waits for the replica to
// have shown the primary's era too (era.go): before that, every read of a
// database with protected tables goes to the primary.
func waitCatalogReplayed(t *testing.T, p *testProxy, g *Fence, db string) {
	t.Helper()
	c := catalogOf(t, g, db)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		// In a tracked database, a set loaded: while it is read (again),
		// every read that names a relation goes to the primary (round 12).
		rd := c.reads.Load()
		return (rd != nil || !c.tracked.Load()) && LSN(p.srv.rs.list[0].replay.Load()) >= rd.position(), nil
	}); err != nil {
		t.Fatalf("the replica never replayed the catalog's position: %v", err)
	}
	waitEraShown(t, p, c)
}

// waitReadSetKnows waits until the read set of db's catalog (g's
// watcher) knows every one of rels: a relation created since the last
// load is a name the proxy does not know until the set is read again
// after the DDL, and a read that names one is judged as if it could run
// anything (it goes to the primary, and marks the session's primary as
// having run code: route.go runsSessionCode, rt.primaryCodeRan).
func waitReadSetKnows(t *testing.T, g *Fence, db string, rels ...rewrite.RelName) {
	t.Helper()
	c := catalogOf(t, g, db)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		rd := c.reads.Load()
		if rd == nil {
			return false, nil
		}
		for _, rel := range rels {
			if _, ok := rd.rels[rel]; !ok {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Fatalf("the catalog's read set never knew %v: %v", rels, err)
	}
}

// waitEraShown waits until the first replica has shown the primary's era
// of c's database (nothing to wait for in a database without eras).
func waitEraShown(t *testing.T, p *testProxy, c *catalog) {
	t.Helper()
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		e := c.era.Load()
		return e == nil || e.known && p.srv.rs.list[0].hasEra(eraKey{c.db, *e}), nil
	}); err != nil {
		t.Fatalf("the replica never showed the primary's era: %v", err)
	}
}

func waitHealthy(t *testing.T, p *testProxy) {
	t.Helper()
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return p.srv.rs.list[0].healthy.Load(), nil }); err != nil {
		t.Fatalf("replica never healthy: %v", err)
	}
}

// catalogOf is the catalog g's watcher keeps for db (a session must hold it).
func catalogOf(t *testing.T, g *Fence, db string) *catalog {
	t.Helper()
	c := g.cats.lookup(db)
	if c == nil {
		t.Fatalf("no catalog watcher for %s: no session holds it", db)
	}
	return c
}

// reader connects through the proxy with startup options.
func (e *routeEnv) reader(t *testing.T, p *testProxy, opts ...string) *pgconn.PgConn {
	t.Helper()
	if p == nil {
		p = e.proxy
	}
	cfg, err := pgconn.ParseConfig(p.dsn(e.db))
	if err != nil {
		t.Fatal(err)
	}
	if len(opts) > 0 {
		cfg.RuntimeParams["options"] = strings.Join(opts, " ")
	}
	return connectConfig(t, cfg)
}

// where runs a simple query whose last column is pg_is_in_recovery() and
// reports the first row's other columns and whether a replica answered.
func where(t *testing.T, c *pgconn.PgConn, sql string) ([]string, bool, error) {
	t.Helper()
	rs, err := c.Exec(ctxT(t), sql).ReadAll()
	if err != nil {
		return nil, false, err
	}
	for _, r := range rs {
		if len(r.Rows) == 0 {
			continue
		}
		row := r.Rows[0]
		var vals []string
		for _, v := range row[:len(row)-1] {
			vals = append(vals, string(v))
		}
		return vals, string(row[len(row)-1]) == "t", nil
	}
	return nil, false, fmt.Errorf("%s: no rows", sql)
}

func mustWhere(t *testing.T, c *pgconn.PgConn, sql string, replica bool) []string {
	t.Helper()
	vals, onReplica, err := where(t, c, sql)
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	if onReplica != replica {
		t.Fatalf("%s: answered by replica=%v, want replica=%v", sql, onReplica, replica)
	}
	return vals
}

// waitReplayWait waits until a read waits for replay (stats.Waiting),
// failing if its answer arrives on res first.
func waitReplayWait[A any](t *testing.T, stats *RouteStats, res <-chan A) {
	t.Helper()
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		select {
		case a := <-res:
			return false, fmt.Errorf("answered before replay resumed: %+v", a)
		default:
		}
		return stats.Waiting.Load() == 1, nil
	}); err != nil {
		t.Fatal(err)
	}
}

// waitReplicaRead waits until sql on c (a read of where's form) is answered
// by the replica.
func waitReplicaRead(t *testing.T, c *pgconn.PgConn, sql string) {
	t.Helper()
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		_, rep, err := where(t, c, sql)
		return rep, err
	}); err != nil {
		t.Fatalf("%s never answered by the replica: %v", sql, err)
	}
}

func opts(job string, token int64, extra ...string) []string {
	return append([]string{fmt.Sprintf("-c fence.job_key=%s -c fence.token=%d", job, token)}, extra...)
}

// waitTakeover waits until the proxy's watcher has recorded job's token.
func (e *routeEnv) waitTakeover(t *testing.T, g *Fence, job string, token int64) {
	t.Helper()
	cat := catalogOf(t, g, e.db)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		tk, ok := cat.tk.lookup(job)
		return ok && tk.token >= token, nil
	}); err != nil {
		t.Fatalf("the proxy never saw token %d of %s: %v", token, job, err)
	}
}

// holdCurrent makes c's takeover tracker current for the rest of the
// test (as if a freshness marker kept coming back at once): a read is
// judged as it comes. A read that found it stale would wait for a marker
// first, and meanwhile the watcher would read the fence row its reader's
// unknown generation hinted: the reader would not need the replica's
// fence-row check such a test is about.
func holdCurrent(c *catalog) { c.tk.fresh.Store(math.MaxInt64) }

func pauseReplay(t *testing.T) {
	t.Helper()
	if err := cluster.PauseReplay(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cluster.ResumeReplay(context.Background()) })
}

func resumeAndCatchUp(t *testing.T) {
	t.Helper()
	ctx := ctxT(t)
	if err := cluster.ResumeReplay(ctx); err != nil {
		t.Fatal(err)
	}
	if err := cluster.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
}

// waitProxyReplay waits until p has seen its first replica replay the
// primary's WAL as it is now (insertLSN, as the proxy reads positions),
// and returns that position:
// the replay position routing compares with what a read needs is the one
// p's poller last read (replica.replay), not the replica's own, so a
// replica caught up (resumeAndCatchUp) can still be behind for p for a
// poll, and a read then goes to the primary.
func waitProxyReplay(t *testing.T, p *testProxy) LSN {
	t.Helper()
	ctx := ctxT(t)
	conn, err := cluster.Primary.Connect(ctx, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	want, err := insertLSN(ctx, conn.PgConn())
	if err != nil {
		t.Fatal(err)
	}
	if err := pgtest.Poll(ctx, func() (bool, error) {
		return LSN(p.srv.rs.list[0].replay.Load()) >= want, nil
	}); err != nil {
		t.Fatalf("the proxy never saw the replica replay %s: %v", want, err)
	}
	return want
}

// scenario: A (token 17's holder) commits its result and the replica has
// it; then replay pauses, B takes over and commits its own result on the
// primary. It returns B's lease.
func (e *routeEnv) scenario(t *testing.T) fence.Lease {
	t.Helper()
	ctx := ctxT(t)
	a := e.acquire(t, "job", "a", time.Minute)
	wa := e.worker(t, &a)
	if _, err := wa.Exec(ctx, upsert, "job", "A", a.Token); err != nil {
		t.Fatalf("A's commit: %v", err)
	}
	// The read set the proxy judges reads by must be one the paused
	// replica has replayed: a set first read after the pause is newer
	// than the replica (route.go catalogAt), and every read then waits.
	cat := catalogOf(t, e.gate, e.db)
	if err := pgtest.Poll(ctx, func() (bool, error) {
		return cat.loads.Load() > 0 && (!cat.tracked.Load() || cat.reads.Load() != nil), nil
	}); err != nil {
		t.Fatalf("the catalog watcher has not read the catalog: %v", err)
	}
	if err := cluster.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	pauseReplay(t)
	b := e.takeover(t, "job", "b", a)
	wb := e.worker(t, &b)
	if _, err := wb.Exec(ctx, upsert, "job", "B", b.Token); err != nil {
		t.Fatalf("B's commit: %v", err)
	}
	return b
}

const readResult = "SELECT payload, token, pg_is_in_recovery() FROM results WHERE job_key = 'job'"

func TestAcceptanceReads(t *testing.T) {
	t.Run("A08_reader_with_new_generation", func(t *testing.T) {
		e := newRouteEnv(t)
		b := e.scenario(t)
		e.waitTakeover(t, e.gate, "job", b.Token)
		want := []string{"B", fmt.Sprint(b.Token)}
		check := func(got []string) {
			t.Helper()
			if strings.Join(got, " ") != strings.Join(want, " ") {
				t.Fatalf("read %v, want %v (never the previous generation)", got, want)
			}
		}

		// primary (the default): answered by the primary.
		rp := e.reader(t, nil, opts("job", b.Token)...)
		check(mustWhere(t, rp, readResult, false))

		// pending: FN007 naming the generation.
		rpend := e.reader(t, nil, opts("job", b.Token, "-c fence.read_policy=pending")...)
		_, _, err := where(t, rpend, readResult)
		wantCode(t, err, fence.CodePending)
		if !strings.Contains(err.Error(), fmt.Sprintf("token %d", b.Token)) {
			t.Fatalf("FN007 message does not name the generation: %v", err)
		}
		// The session is usable after FN007.
		mustWhere(t, rpend, "SELECT 1, pg_is_in_recovery()", true)

		// wait: blocks until replay resumes, then the replica answers.
		rw := e.reader(t, nil, opts("job", b.Token, "-c fence.read_policy=wait", "-c fence.read_wait=30s")...)
		type answer struct {
			vals    []string
			replica bool
			err     error
		}
		done := make(chan answer, 1)
		go func() {
			v, r, err := where(t, rw, readResult)
			done <- answer{v, r, err}
		}()
		waitReplayWait(t, e.proxy.srv.RouteStats(), done)
		if err := cluster.ResumeReplay(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		a := <-done
		if a.err != nil {
			t.Fatalf("wait policy: %v", a.err)
		}
		check(a.vals)
		if !a.replica {
			t.Fatalf("wait policy answered from the primary, want the replica after replay resumed")
		}

		// After resume the replica serves every policy again.
		if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		if err := pgtest.Poll(ctxT(t), func() (bool, error) {
			_, r, err := where(t, rp, readResult)
			return r, err
		}); err != nil {
			t.Fatalf("the replica never served the primary-policy reader again: %v", err)
		}
		check(mustWhere(t, rp, readResult, true))
		check(mustWhere(t, rpend, readResult, true))
	})

	t.Run("A08_unknown_token_checks_replica_fence_row", func(t *testing.T) {
		// The proxy has not been told of the takeover (another proxy made
		// it, or the notification is still on its way): the replica's own
		// fence row decides, never the result's token column.
		e := newRouteEnv(t)
		b := e.scenario(t)
		e.waitTakeover(t, e.gate, "job", b.Token)
		cat := catalogOf(t, e.gate, e.db)
		cat.tk.mu.Lock()
		delete(cat.tk.jobs, "job")
		cat.tk.mu.Unlock()
		// Not told means not seen at all: every protected read needs
		// every takeover the proxy has seen (tk.all), which then does
		// not include this one either; the floor (the watcher's start)
		// is before A's.
		cat.tk.max.Store(0)
		holdCurrent(cat)
		stats := e.proxy.srv.RouteStats()
		checks := stats.FenceChecks.Load()

		rpend := e.reader(t, nil, opts("job", b.Token, "-c fence.read_policy=pending")...)
		_, _, err := where(t, rpend, readResult)
		wantCode(t, err, fence.CodePending)
		rp := e.reader(t, nil, opts("job", b.Token)...)
		if got := mustWhere(t, rp, readResult, false); got[0] != "B" {
			t.Fatalf("read %v, want B's result", got)
		}
		if stats.FenceChecks.Load() == checks {
			t.Fatal("no fence-row check was made on the replica")
		}
		resumeAndCatchUp(t)
		// What rp needs now (B's takeover, once the watcher has read
		// the job's row at rpend's hint, else the replica's row and
		// every takeover seen) is checked against the replay position
		// the proxy last polled: wait for it to pass the primary's.
		waitProxyReplay(t, e.proxy)
		if got := mustWhere(t, rp, readResult, true); got[0] != "B" {
			t.Fatalf("read %v after replay, want B's result from the replica", got)
		}
	})

	t.Run("A09_reader_without_metadata", func(t *testing.T) {
		e := newRouteEnv(t)
		b := e.scenario(t)
		e.waitTakeover(t, e.gate, "job", b.Token)
		r := e.reader(t, nil)
		if got := mustWhere(t, r, readResult, false); got[0] != "B" {
			t.Fatalf("read %v, want B's result from the primary", got)
		}
		// Unprotected tables are still read from the (lagging) replica,
		// once the catalog's read set is vouched for past the takeover
		// (until then every read may be protected: under load its reload
		// came after the first read, which went to the primary).
		if err := pgtest.Poll(ctxT(t), func() (bool, error) {
			_, rep, err := where(t, r, "SELECT count(*), pg_is_in_recovery() FROM audit")
			return rep, err
		}); err != nil {
			t.Fatalf("the lagging replica never served a read of an unprotected table: %v", err)
		}
		resumeAndCatchUp(t)
		if err := pgtest.Poll(ctxT(t), func() (bool, error) {
			_, rep, err := where(t, r, readResult)
			return rep, err
		}); err != nil {
			t.Fatalf("the replica never served the protected read after replay: %v", err)
		}
		if got := mustWhere(t, r, readResult, true); got[0] != "B" {
			t.Fatalf("read %v, want B's result", got)
		}
	})
}

func TestReadRouting(t *testing.T) {
	e := newRouteEnv(t)
	ctx := ctxT(t)

	t.Run("autocommit_read_on_replica", func(t *testing.T) {
		r := e.reader(t, nil)
		mustWhere(t, r, "SELECT 1, pg_is_in_recovery()", true)
		mustWhere(t, r, "SELECT count(*), pg_is_in_recovery() FROM audit", true)
		// Writes and primary-only functions go to the primary.
		mustExec(t, r, "INSERT INTO audit (note) VALUES ('w')")
		mustWhere(t, r, "SELECT nextval('audit_id_seq'), pg_is_in_recovery()", false)
		mustWhere(t, r, "SELECT 1 FROM audit FOR UPDATE", false)
		mustWhere(t, r, "SELECT 1, pg_is_in_recovery()", true)
	})
	t.Run("read_then_write_transaction_stays_on_primary", func(t *testing.T) {
		r := e.reader(t, nil)
		mustExec(t, r, "BEGIN")
		mustWhere(t, r, "SELECT 1, pg_is_in_recovery()", false)
		mustExec(t, r, "INSERT INTO audit (note) VALUES ('tx')")
		mustWhere(t, r, "SELECT count(*), pg_is_in_recovery() FROM audit WHERE note = 'tx'", false)
		mustExec(t, r, "COMMIT")
	})
	t.Run("begin_read_only_on_replica", func(t *testing.T) {
		r := e.reader(t, nil)
		mustExec(t, r, "BEGIN READ ONLY")
		mustWhere(t, r, "SELECT 1, pg_is_in_recovery()", true)
		mustWhere(t, r, "SELECT 2, pg_is_in_recovery()", true)
		mustExec(t, r, "COMMIT")
		// Back on the primary for a write, then reads go to the replica.
		mustExec(t, r, "INSERT INTO audit (note) VALUES ('after ro')")
		mustWhere(t, r, "BEGIN READ ONLY; SELECT 3, pg_is_in_recovery(); COMMIT", true)
	})
	t.Run("extended_protocol_on_primary", func(t *testing.T) {
		c, err := pgx.Connect(ctx, e.proxy.dsn(e.db))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(ctx)
		var rec bool
		if err := c.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&rec); err != nil || rec {
			t.Fatalf("extended read: recovery=%v, %v; want the primary", rec, err)
		}
		if err := c.QueryRow(ctx, "SELECT pg_is_in_recovery()", pgx.QueryExecModeSimpleProtocol).Scan(&rec); err != nil || !rec {
			t.Fatalf("simple read: recovery=%v, %v; want the replica", rec, err)
		}
		if err := c.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&rec); err != nil || rec {
			t.Fatalf("extended read after a replica read: recovery=%v, %v; want the primary", rec, err)
		}
		// A read-only transaction through pgx: its simple BEGIN goes to
		// the replica, and its extended statements follow it there.
		tx, err := c.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.QueryRow(ctx, "SELECT pg_is_in_recovery()", pgx.QueryExecModeSimpleProtocol).Scan(&rec); err != nil || !rec {
			t.Fatalf("read-only tx: recovery=%v, %v; want the replica", rec, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("session_set_pins_to_primary", func(t *testing.T) {
		r := e.reader(t, nil)
		mustExec(t, r, "SET statement_timeout = '5min'")
		mustWhere(t, r, "SELECT current_setting('statement_timeout'), pg_is_in_recovery()", false)
		mustExec(t, r, "DISCARD ALL")
		mustWhere(t, r, "SELECT 1, pg_is_in_recovery()", true)
		// fence.* parameters do not pin.
		mustExec(t, r, "SET fence.read_policy = 'wait'")
		mustWhere(t, r, "SELECT 1, pg_is_in_recovery()", true)
		mustExec(t, r, "SET fence.read_replicas = off")
		mustWhere(t, r, "SELECT 1, pg_is_in_recovery()", false)
	})
	t.Run("commit_lsn_after_acquire", func(t *testing.T) {
		r := e.reader(t, nil)
		mustExec(t, r, "SELECT * FROM fence.acquire('lsnjob', 'w', interval '1 minute')")
		v := r.ParameterStatus(ParamCommitLSN)
		if v == "" {
			t.Fatal("no fence.commit_lsn after fence.acquire")
		}
		got, err := parseLSN(v)
		if err != nil {
			t.Fatal(err)
		}
		cur, _ := cluster.CurrentLSN(ctx)
		now, _ := parseLSN(cur)
		if got == 0 || got > now {
			t.Fatalf("fence.commit_lsn %s, want a position up to the current %s", got, now)
		}
		// In an explicit transaction it comes with the COMMIT.
		for _, q := range []string{"BEGIN", "SELECT * FROM fence.acquire('lsnjob2', 'w', interval '1 minute')"} {
			mustExec(t, r, q)
		}
		if r.ParameterStatus(ParamCommitLSN) != v {
			t.Fatalf("fence.commit_lsn changed before COMMIT")
		}
		mustExec(t, r, "COMMIT")
		v2, _ := parseLSN(r.ParameterStatus(ParamCommitLSN))
		if v2 <= got {
			t.Fatalf("fence.commit_lsn after COMMIT %s, want past %s", v2, got)
		}
		// A reader demanding that position is pinned until the replica has it.
		pauseReplay(t)
		execOK(t, e.direct(t), "SELECT * FROM fence.acquire('lsnjob3', 'w', interval '1 minute')")
		cur, _ = cluster.CurrentLSN(ctx)
		rm := e.reader(t, nil, "-c fence.min_lsn="+cur)
		mustWhere(t, rm, readResult+" UNION ALL SELECT 'x', 0, pg_is_in_recovery()", false)
		resumeAndCatchUp(t)
		waitReplicaRead(t, rm, readResult+" UNION ALL SELECT 'x', 0, pg_is_in_recovery()")
	})
	t.Run("refused_parse_reserved_name_not_copied", func(t *testing.T) {
		// The attack on read routing's copies of named Parses: a Parse
		// the gate refuses (FN013: the name of its receipt statement)
		// on the primary and again in a read-only transaction on the
		// replica, then a Bind of that name back on the primary. Had
		// routing kept the refused Parse, it would close the gate's
		// statement there (a version of that name is "left behind") and
		// parse the client's stand-in in its place, hidden, before the
		// gate refused the Bind: the next gated commit would then run
		// the stand-in and leave no receipt.
		l := e.acquire(t, "parse", "w", time.Minute)
		c := e.mustConnect(t, client{lease: &l, extra: []string{"-c fence.step=one"}})
		pc := c.PgConn()
		receipts := "SELECT count(*) FROM fence.receipts WHERE job_key = 'parse' AND token = $1 AND step = $2 AND digest_version = 'v1'"
		// A first gated commit prepares the gate's statements on the primary.
		routeGatedCommit(t, c, l, "first")
		e.wantCount(t, 1, receipts, l.Token, "one")

		// pgfence_commit's parameters, and a body that does nothing.
		standIn := &pgproto3.Parse{Name: plan.CommitStatement, Query: "SELECT 'committed'::text",
			ParameterOIDs: []uint32{25, 20, 20, 25, 17, 25}}
		rawWantCodes(t, pc, []string{fence.CodeReserved}, standIn)
		routeReadOnlyOnReplica(t, pc)
		rawWantCodes(t, pc, []string{fence.CodeReserved}, standIn)
		mustExec(t, pc, "ROLLBACK")
		// Back on the primary: the refused name parsed again (a version
		// of it is "left behind" there, had routing followed it) ...
		rawWantCodes(t, pc, []string{fence.CodeReserved}, standIn)
		// ... then bound and executed.
		args := plan.CommitArgs(fence.Generation{JobKey: "parse", Epoch: l.Epoch, Token: l.Token, Step: "one"}, []byte{0}, "v1")
		rawWantCodes(t, pc, []string{fence.CodeReserved},
			&pgproto3.Bind{PreparedStatement: plan.CommitStatement, Parameters: args}, &pgproto3.Execute{})

		// The primary's pgfence_commit is still the gate's, and the next
		// gated commit leaves its receipt (seen on another connection).
		mustExec(t, pc, "BEGIN")
		got := mustWhere(t, pc, "SELECT statement, pg_is_in_recovery() FROM pg_prepared_statements WHERE name = '"+plan.CommitStatement+"'", false)
		mustExec(t, pc, "ROLLBACK")
		if !strings.Contains(got[0], "fence.commit(") {
			t.Errorf("the primary's %s is %q: the client's stand-in replaced the gate's", plan.CommitStatement, got[0])
		}
		mustExec(t, pc, "SET fence.step = 'two'")
		routeGatedCommit(t, c, l, "second")
		e.wantResult(t, "parse", "first", l.Token) // the same token: the upsert keeps the first
		e.wantCount(t, 1, receipts, l.Token, "two")
	})
	t.Run("refused_parse_invalid_text_not_copied", func(t *testing.T) {
		// Text the gate cannot read on a fenced session (invalid UTF-8,
		// 22021), a protected write, refused in a read-only transaction
		// on the replica; bound and executed back on the primary, the
		// name is the server's to refuse: no such statement there.
		l := e.acquire(t, "parse_enc", "w", time.Minute)
		c := e.mustConnect(t, client{lease: &l})
		routeGatedCommit(t, c, l, "first")
		pc := c.PgConn()
		enc := &pgproto3.Parse{Name: "route_enc", Query: "UPDATE results SET payload = 'enc' WHERE job_key = 'parse_enc' -- \xff"}
		routeReadOnlyOnReplica(t, pc)
		rawWantCodes(t, pc, []string{"22021"}, enc)
		mustExec(t, pc, "ROLLBACK")
		rawWantCodes(t, pc, []string{"26000"}, &pgproto3.Bind{PreparedStatement: "route_enc"}, &pgproto3.Execute{})
		e.wantResult(t, "parse_enc", "first", l.Token)
	})
	t.Run("replica_down_reads_from_primary", func(t *testing.T) {
		r := e.reader(t, nil)
		mustWhere(t, r, "SELECT 1, pg_is_in_recovery()", true)
		if err := cluster.Replica.Stop(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if !cluster.Replica.Running() {
				cluster.Replica.Start(context.Background())
			}
		})
		for i := range 5 {
			mustWhere(t, r, fmt.Sprintf("SELECT %d, pg_is_in_recovery()", i), false)
		}
		r2 := e.reader(t, nil)
		mustWhere(t, r2, "SELECT 1, pg_is_in_recovery()", false)
		if err := cluster.Replica.Start(ctx); err != nil {
			t.Fatal(err)
		}
		waitHealthy(t, e.proxy)
		mustWhere(t, r, "SELECT 1, pg_is_in_recovery()", true)
		mustWhere(t, r2, "SELECT 1, pg_is_in_recovery()", true)
	})
}

func TestReadRoutingTwoProxies(t *testing.T) {
	e := newRouteEnv(t)
	ctx := ctxT(t)
	p2, g2 := startRouteProxy(t, e.db)
	// Both proxies watch the database before the takeover.
	e.reader(t, p2)

	a := e.acquire(t, "job", "a", time.Minute)
	execOK(t, e.worker(t, &a), upsert, "job", "A", a.Token)
	if err := cluster.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	pauseReplay(t)
	// The takeover goes through proxy 1.
	c1 := e.reader(t, nil)
	if _, err := c1.Exec(ctx, fmt.Sprintf("SELECT fence.release('job', %d)", a.Token)).ReadAll(); err != nil {
		t.Fatal(err)
	}
	rs, err := c1.Exec(ctx, "SELECT token FROM fence.acquire('job', 'b', interval '1 minute')").ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	token := string(rs[0].Rows[0][0])
	if c1.ParameterStatus(ParamCommitLSN) == "" {
		t.Fatal("no fence.commit_lsn after the takeover")
	}
	// Readers of the new generation on proxy 2 never see A's result as current.
	r2 := e.reader(t, p2, "-c fence.job_key=job -c fence.token="+token)
	if got := mustWhere(t, r2, readResult, false); got[0] != "A" || got[1] != fmt.Sprint(a.Token) {
		// B has not written: the primary still holds A's result, and
		// says so with A's token, but the read came from the primary.
		t.Logf("read %v", got)
	}
	rp := e.reader(t, p2, "-c fence.job_key=job -c fence.token="+token+" -c fence.read_policy=pending")
	_, _, err = where(t, rp, readResult)
	wantCode(t, err, fence.CodePending)
	// Proxy 2 learns the takeover from its own LISTEN.
	var tok int64
	fmt.Sscan(token, &tok)
	e.waitTakeover(t, g2, "job", tok)
	noMeta := e.reader(t, p2)
	mustWhere(t, noMeta, readResult, false)
	resumeAndCatchUp(t)
	waitReplicaRead(t, r2, readResult)
	mustWhere(t, noMeta, readResult, true)
}

// TestReadRoutingPreparedStatements: pgx's statement cache prepares named
// statements wherever the session is; they must work on both upstreams.
func TestReadRoutingPreparedStatements(t *testing.T) {
	e := newRouteEnv(t)
	ctx := ctxT(t)
	c, err := pgx.Connect(ctx, e.proxy.dsn(e.db))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	const q = "SELECT pg_is_in_recovery(), count(*) FROM audit WHERE id > $1"
	run := func(want bool, what string, tx pgx.Tx) {
		t.Helper()
		var rec bool
		var n int
		var err error
		if tx != nil {
			err = tx.QueryRow(ctx, q, 0).Scan(&rec, &n)
		} else {
			err = c.QueryRow(ctx, q, 0).Scan(&rec, &n)
		}
		if err != nil || rec != want {
			t.Fatalf("%s: recovery=%v, %v; want recovery=%v", what, rec, err, want)
		}
	}
	// Prepared inside a read-only transaction on the replica first.
	tx, err := c.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		t.Fatal(err)
	}
	run(true, "in read-only tx", tx)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	run(false, "after the tx, on the primary", nil)
	tx, err = c.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		t.Fatal(err)
	}
	run(true, "in a second read-only tx", tx)
	const q2 = "SELECT pg_is_in_recovery(), $1::int"
	var rec bool
	var n int
	if err := tx.QueryRow(ctx, q2, 7).Scan(&rec, &n); err != nil || !rec || n != 7 {
		t.Fatalf("new statement in tx: %v %d %v", rec, n, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.QueryRow(ctx, q2, 8).Scan(&rec, &n); err != nil || rec || n != 8 {
		t.Fatalf("statement from the replica tx on the primary: %v %d %v", rec, n, err)
	}
	// DEALLOCATE of a cached statement (pgx's own cleanup) and a new
	// Parse of the same name where the old version lives on the replica.
	if err := c.Deallocate(ctx, q2); err != nil {
		t.Fatal(err)
	}
	tx, err = c.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(ctx, q2, 9).Scan(&rec, &n); err != nil || !rec || n != 9 {
		t.Fatalf("re-prepared statement in a read-only tx: %v %d %v", rec, n, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	run(false, "the first statement again on the primary", nil)
}

// rawWantCodes sends msgs and a Sync on c and wants exactly the errors
// codes (their SQLSTATEs, in order) before ReadyForQuery. A mismatch
// does not stop the test: what the attempt changed is checked next.
func rawWantCodes(t *testing.T, c *pgconn.PgConn, codes []string, msgs ...pgproto3.FrontendMessage) {
	t.Helper()
	fe := c.Frontend()
	for _, m := range msgs {
		fe.Send(m)
	}
	fe.Send(&pgproto3.Sync{})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	var got []string
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		if er, ok := m.(*pgproto3.ErrorResponse); ok {
			got = append(got, er.Code)
		}
		if _, ok := m.(*pgproto3.ReadyForQuery); ok {
			break
		}
	}
	if strings.Join(got, " ") != strings.Join(codes, " ") {
		t.Errorf("got errors %v, want exactly %v", got, codes)
	}
}

// routeGatedCommit writes l's job's result through c in an explicit
// transaction (extended protocol: the gate's named statements run it).
func routeGatedCommit(t *testing.T, c *pgx.Conn, l fence.Lease, payload string) {
	t.Helper()
	ctx := ctxT(t)
	tx := beginOK(t, c)
	defer tx.Rollback(ctx)
	execOK(t, tx, upsert, l.JobKey, payload, l.Token)
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit: %v", err)
	}
}

// routeReadOnlyOnReplica opens a read-only transaction on c and waits
// until one runs on the replica (it has replayed the session's
// generation), leaving it open.
func routeReadOnlyOnReplica(t *testing.T, c *pgconn.PgConn) {
	t.Helper()
	if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		mustExec(t, c, "BEGIN READ ONLY")
		_, rep, err := where(t, c, "SELECT 1, pg_is_in_recovery()")
		if !rep || err != nil {
			mustExec(t, c, "ROLLBACK")
		}
		return rep, err
	}); err != nil {
		t.Fatalf("no read-only transaction ran on the replica: %v", err)
	}
}
