package proxy

import (
	"context"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/rewrite"
)

// readsWALWriterDelay keeps asynchronous commits unwritten for up to 10s
// (the walwriter is what writes them) until the end of t.
func readsWALWriterDelay(t *testing.T) {
	t.Helper()
	ctx := ctxT(t)
	c, err := cluster.Primary.Connect(ctx, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	for _, q := range []string{"ALTER SYSTEM SET wal_writer_delay = '10s'", "SELECT pg_reload_conf()"} {
		execOK(t, c, q)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		c, err := cluster.Primary.Connect(ctx, "postgres")
		if err != nil {
			t.Error(err)
			return
		}
		defer c.Close(ctx)
		for _, q := range []string{"ALTER SYSTEM RESET wal_writer_delay", "SELECT pg_reload_conf()"} {
			if _, err := c.Exec(ctx, q); err != nil {
				t.Error(err)
			}
		}
	})
}

// commitEnd is the end of transaction xid's commit record, read from the
// WAL from start on (pg_walinspect); it first flushes the WAL with a
// synchronous commit of its own that writes.
func commitEnd(t *testing.T, c *pgx.Conn, start, xid string) LSN {
	t.Helper()
	ctx := ctxT(t)
	for _, q := range []string{"CREATE EXTENSION IF NOT EXISTS pg_walinspect", "INSERT INTO audit (note) VALUES ('flush')"} {
		execOK(t, c, q)
	}
	var end string
	if err := c.QueryRow(ctx, `SELECT end_lsn::text FROM pg_get_wal_records_info($1::pg_lsn, pg_current_wal_flush_lsn())
		WHERE resource_manager = 'Transaction' AND record_type = 'COMMIT' AND xid::text = $2`, start, xid).Scan(&end); err != nil {
		t.Fatalf("commit record of %s: %v", xid, err)
	}
	l, err := parseLSN(end)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestReadRoutingAsyncTakeover: a takeover committed with
// synchronous_commit off (any user may) has its commit record inserted but
// not written when its notification arrives. The position the proxy
// records must still cover that record, or a replica paused before it
// looks current and serves the previous generation. The same for the
// fence.commit_lsn a client is handed.
func TestReadRoutingAsyncTakeover(t *testing.T) {
	e := newRouteEnv(t)
	ctx := ctxT(t)
	a := e.acquire(t, "job", "a", time.Minute)
	execOK(t, e.worker(t, &a), upsert, "job", "A", a.Token)
	if err := cluster.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	readsWALWriterDelay(t)
	pauseReplay(t)

	direct := e.direct(t)
	var start, xid string
	if err := direct.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&start); err != nil {
		t.Fatal(err)
	}
	tx := beginOK(t, direct)
	b := fence.Lease{JobKey: "job"}
	execOK(t, tx, "SET LOCAL synchronous_commit = off")
	execOK(t, tx, "SELECT fence.release('job', $1)", a.Token)
	if err := tx.QueryRow(ctx, "SELECT epoch, token, pg_current_xact_id()::text FROM fence.acquire('job', 'b', interval '1 minute')").Scan(&b.Epoch, &b.Token, &xid); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	e.waitTakeover(t, e.gate, "job", b.Token)
	tk, _ := catalogOf(t, e.gate, e.db).tk.lookup("job")

	// Readers of B's generation, and readers without any, never get
	// A's result from the paused replica.
	rg := e.reader(t, nil, opts("job", b.Token)...)
	if got := mustWhere(t, rg, readResult, false); got[0] != "A" {
		t.Fatalf("read %v from the primary, want A's result (B has not written)", got)
	}
	rp := e.reader(t, nil, opts("job", b.Token, "-c fence.read_policy=pending")...)
	_, _, err := where(t, rp, readResult)
	wantCode(t, err, fence.CodePending)
	mustWhere(t, e.reader(t, nil), readResult, false)

	// The recorded position is at or past the end of the commit record.
	if end := commitEnd(t, direct, start, xid); tk.lsn < end {
		t.Fatalf("the proxy recorded the takeover at %s, before the end of its commit record %s", tk.lsn, end)
	}

	// fence.commit_lsn of an asynchronous acquire through the proxy.
	c := e.reader(t, nil)
	rs, err := c.Exec(ctx, "SELECT pg_current_wal_insert_lsn()::text; BEGIN; SET LOCAL synchronous_commit = off; "+
		"SELECT pg_current_xact_id()::text FROM fence.acquire('job2', 'c', interval '1 minute'); COMMIT").ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	start2, xid2 := string(rs[0].Rows[0][0]), string(rs[3].Rows[0][0])
	reported, err := parseLSN(c.ParameterStatus(ParamCommitLSN))
	if err != nil {
		t.Fatal(err)
	}
	if end := commitEnd(t, direct, start2, xid2); reported < end {
		t.Fatalf("fence.commit_lsn %s is before the end of the acquire's commit record %s", reported, end)
	}
}

// TestReadRoutingTrackedCatalog: in a database that notifies DDL, reads of
// unprotected relations use a lagging replica, and the proxy follows the
// catalog: a view it had as safe that now reads a protected table, or a
// user-defined operator written in SQL (it runs inside any expression),
// makes those reads protected.
func TestReadRoutingTrackedCatalog(t *testing.T) {
	e := newRouteEnv(t)
	ctx := ctxT(t)
	direct := e.direct(t)
	execOK(t, direct, "CREATE VIEW v_audit AS SELECT id, note FROM audit")
	b := e.scenario(t)
	e.waitTakeover(t, e.gate, "job", b.Token)
	cat := catalogOf(t, e.gate, e.db)
	waitSet := func(what string) {
		t.Helper()
		// A read set older than a takeover the proxy knows cannot vouch
		// for the relations (route.go): wait for one read after it.
		if err := pgtest.Poll(ctx, func() (bool, error) {
			rd := cat.reads.Load()
			seen, ok := cat.tk.lookup("job")
			return rd != nil && (!ok || rd.vouched() >= seen.lsn), nil
		}); err != nil {
			t.Fatalf("%s: the catalog was not read again: %v", what, err)
		}
	}
	waitSet("after the scenario")
	r := e.reader(t, nil, "-c fence.read_policy=pending")
	for _, q := range []string{
		"SELECT count(*), pg_is_in_recovery() FROM audit",
		"SELECT count(*), pg_is_in_recovery() FROM public.v_audit",
		"SELECT count(*), pg_is_in_recovery() FROM pg_namespace",
		"SELECT count(*), pg_is_in_recovery() FROM information_schema.tables",
	} {
		mustWhere(t, r, q, true)
	}
	_, _, err := where(t, r, readResult)
	wantCode(t, err, fence.CodePending)

	// The replica has replayed up to the pause; DDL since is not there.
	// A view redefined on the replica too (before the pause) is tested
	// in TestBypass/reads_tracked; here: what the proxy knows changes.
	seen := cat.ddlSeen.Load()
	if _, err := direct.Exec(ctx, "CREATE FUNCTION same(int, int) RETURNS bool LANGUAGE sql IMMUTABLE AS 'SELECT $1 = $2'; "+
		"CREATE OPERATOR === (leftarg = int, rightarg = int, function = same)"); err != nil {
		t.Fatal(err)
	}
	if err := pgtest.Poll(ctx, func() (bool, error) { return cat.ddlSeen.Load() > seen && cat.reads.Load() != nil, nil }); err != nil {
		t.Fatal(err)
	}
	if !cat.reads.Load().all {
		t.Fatal("a SQL operator does not make every read protected")
	}
	_, _, err = where(t, r, "SELECT count(*), pg_is_in_recovery() FROM audit")
	wantCode(t, err, fence.CodePending)
	execOK(t, direct, "DROP OPERATOR === (int, int)")
	if err := pgtest.Poll(ctx, func() (bool, error) { rd := cat.reads.Load(); return rd != nil && !rd.all, nil }); err != nil {
		t.Fatal(err)
	}
	// A new set has a new position, which the paused replica has not
	// replayed: the catalog there may differ, so even safe reads wait.
	mustWhere(t, e.reader(t, nil), "SELECT count(*), pg_is_in_recovery() FROM audit", false)
	resumeAndCatchUp(t)
	waitReplicaRead(t, r, "SELECT count(*), pg_is_in_recovery() FROM audit")
}

// TestReadRoutingUntrackedCatalog: without the DDL event trigger the proxy
// cannot know when a view is redefined, so in a database with protected
// tables every read is protected: a read of an unprotected table needs
// the takeovers too (here: it is answered by the primary, or FN007).
func TestReadRoutingUntrackedCatalog(t *testing.T) {
	e := newRouteEnvMode(t, false, fenceSchema)
	b := e.scenario(t)
	e.waitTakeover(t, e.gate, "job", b.Token)
	if cat := catalogOf(t, e.gate, e.db); cat.tracked.Load() || cat.reads.Load() != nil {
		t.Fatal("an untracked database has a read set")
	}
	mustWhere(t, e.reader(t, nil), "SELECT count(*), pg_is_in_recovery() FROM audit", false)
	_, _, err := where(t, e.reader(t, nil, opts("job", b.Token, "-c fence.read_policy=pending")...), "SELECT count(*), pg_is_in_recovery() FROM audit")
	wantCode(t, err, fence.CodePending)
	// Reads that name no relation still use the replica.
	mustWhere(t, e.reader(t, nil), "SELECT 1, pg_is_in_recovery()", true)
	resumeAndCatchUp(t)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		_, rep, err := where(t, e.reader(t, nil), "SELECT count(*), pg_is_in_recovery() FROM audit")
		return rep, err
	}); err != nil {
		t.Fatal(err)
	}
}

// TestReadRoutingCursorsAndTemp: a cursor declared WITH HOLD outside a
// transaction, and temporary tables, live on the primary session: the
// replica connection does not have them.
func TestReadRoutingCursorsAndTemp(t *testing.T) {
	e := newRouteEnv(t)
	ctx := ctxT(t)
	r := e.reader(t, nil)
	mustWhere(t, r, "SELECT count(*), pg_is_in_recovery() FROM audit", true)
	mustExec(t, r, "DECLARE c CURSOR WITH HOLD FOR SELECT count(*), pg_is_in_recovery() FROM audit")
	mustWhere(t, r, "FETCH ALL FROM c", false)
	for _, q := range []string{"CLOSE c", "CREATE TEMP TABLE tt AS SELECT * FROM audit"} {
		if _, err := r.Exec(ctx, q).ReadAll(); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	mustWhere(t, r, "SELECT count(*), pg_is_in_recovery() FROM tt", false)
	mustWhere(t, r, "SELECT count(*), pg_is_in_recovery() FROM audit", false) // pinned
	mustExec(t, r, "DISCARD ALL")
	// Unpinned. The read of tt, a relation the read set does not know,
	// counted as code that may have set a custom setting (sessionCode,
	// route.go), so a read that may run code stays on the primary: audit's
	// does while the catalog is read again after CREATE TEMP TABLE's DDL
	// notification, then the replica answers.
	waitReplicaRead(t, r, "SELECT count(*), pg_is_in_recovery() FROM audit")
}

// TestReadRoutingReplicaReached: the replica fence-row check runs on the
// session's replica connection as the client's role. A role that may not
// read fence.fences fails closed (the primary answers); with
// fence.replica_reached, a SECURITY DEFINER function that reveals no
// token, the replica serves the read once it has replayed the generation.
func TestReadRoutingReplicaReached(t *testing.T) {
	e := newRouteEnv(t)
	ctx := ctxT(t)
	direct := e.direct(t)
	for _, q := range []string{
		"DO $$ BEGIN CREATE ROLE reads_worker LOGIN IN ROLE pgfence_worker; EXCEPTION WHEN duplicate_object THEN NULL; END $$",
		"GRANT SELECT ON results, audit TO reads_worker",
		"REVOKE SELECT ON fence.fences FROM pgfence_worker",
	} {
		execOK(t, direct, q)
	}
	b := e.scenario(t)
	e.waitTakeover(t, e.gate, "job", b.Token)
	cat := catalogOf(t, e.gate, e.db)
	forget := func() {
		cat.tk.mu.Lock()
		delete(cat.tk.jobs, "job")
		cat.tk.mu.Unlock()
	}
	worker := func() *pgconn.PgConn {
		cfg, err := pgconn.ParseConfig(strings.Replace(e.proxy.dsn(e.db), "postgres@", "reads_worker@", 1))
		if err != nil {
			t.Fatal(err)
		}
		cfg.RuntimeParams["options"] = strings.Join(opts("job", b.Token), " ")
		return connectConfig(t, cfg)
	}
	// The migrated fence.replica_reached, out of the way for the first
	// part.
	if _, err := direct.Exec(ctx, `ALTER FUNCTION fence.replica_reached(text, bigint, bigint) RENAME TO replica_reached_off;
		SELECT pg_notify('pgfence_protected', 'replica_reached')`); err != nil {
		t.Fatal(err)
	}
	if err := pgtest.Poll(ctx, func() (bool, error) { return !cat.reached.Load(), nil }); err != nil {
		t.Fatal(err)
	}
	resumeAndCatchUp(t)
	stats := e.proxy.srv.RouteStats()

	// Without the function: the check cannot read the fence row.
	holdCurrent(cat)
	forget()
	checks := stats.FenceChecks.Load()
	if got := mustWhere(t, worker(), readResult, false); got[0] != "B" {
		t.Fatalf("read %v, want B's result", got)
	}
	if stats.FenceChecks.Load() == checks {
		t.Fatal("no fence-row check was made")
	}

	// With it (and the proxy told of it): the replica answers.
	if _, err := direct.Exec(ctx, `ALTER FUNCTION fence.replica_reached_off(text, bigint, bigint) RENAME TO replica_reached;
		SELECT pg_notify('pgfence_protected', 'replica_reached')`); err != nil {
		t.Fatal(err)
	}
	if err := pgtest.Poll(ctx, func() (bool, error) { return cat.reached.Load(), nil }); err != nil {
		t.Fatal(err)
	}
	if err := cluster.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	w := worker()
	if err := pgtest.Poll(ctx, func() (bool, error) {
		forget()
		_, rep, err := where(t, w, readResult)
		return rep, err
	}); err != nil {
		t.Fatalf("the replica never served the worker: %v", err)
	}
	// And a generation the replica has not replayed is refused there.
	pauseReplay(t)
	forget()
	future := e.reader(t, nil, opts("job", b.Token+1000, "-c fence.read_policy=pending")...)
	_, _, err := where(t, future, readResult)
	wantCode(t, err, fence.CodePending)
}

// TestReadSetCode: what the read set says about code a read runs without
// naming it (issue 30): a database with an operator, cast, domain check or
// range difference of a user's, or of a built-in that runs SQL, has every
// read that resolves one through the catalog protected (readSet.all); a
// function or aggregate callable as a field is listed by name
// (readSet.colFuncs); the planner's statistics, and views over them
// (pinned catalogs have no pg_depend row), expose protected data.
func TestReadSetCode(t *testing.T) {
	e := newRouteEnv(t)
	ctx := ctxT(t)
	direct := e.direct(t)
	cat := catalogOf(t, e.gate, e.db)
	reload := func(sql string) *readSet {
		t.Helper()
		seen := cat.ddlSeen.Load()
		execOK(t, direct, sql)
		var rd *readSet
		if err := pgtest.Poll(ctx, func() (bool, error) {
			rd = cat.reads.Load()
			return cat.ddlSeen.Load() > seen && rd != nil, nil
		}); err != nil {
			t.Fatalf("%s: the catalog was not read again: %v", sql, err)
		}
		return rd
	}
	// reloadAll runs sql and waits for a set whose all is want: a
	// notification of the previous step may still arrive and be the
	// reload reload waits for, read before sql committed.
	reloadAll := func(sql string, want bool) bool {
		t.Helper()
		seen := cat.ddlSeen.Load()
		execOK(t, direct, sql)
		err := pgtest.Poll(ctx, func() (bool, error) {
			rd := cat.reads.Load()
			return cat.ddlSeen.Load() > seen && rd != nil && rd.all == want, nil
		})
		return err == nil
	}
	rd := reload("CREATE TABLE quiet (n int)")
	if rd.all || rd.colFuncs["peekattr"] || !rd.colFuncs["ts_stat"] {
		t.Fatalf("a database without user code: all=%v colFuncs=%v", rd.all, rd.colFuncs)
	}
	for _, rel := range []rewrite.RelName{{Name: "pg_stats"}, {Schema: "pg_catalog", Name: "pg_statistic"},
		{Name: "pg_stats_ext"}, {Name: "pg_stats_ext_exprs"}, {Name: "pg_statistic_ext_data"}, {Name: "pg_largeobject"},
		{Name: "pg_class"}, {Schema: "pg_catalog", Name: "pg_class"}} {
		if !rd.exposes(rel) {
			t.Errorf("%s is not exposed: the replica's statistics show the previous generation's values", rel)
		}
	}
	for _, rel := range []rewrite.RelName{{Name: "pg_namespace"}, {Name: "pg_stat_activity"}, {Name: "quiet"}} {
		if rd.exposes(rel) {
			t.Errorf("%s is exposed", rel)
		}
	}
	for _, c := range []struct{ name, create, drop string }{
		{"operator running SQL", "CREATE OPERATOR @@? (LEFTARG = tsquery, RIGHTARG = text, FUNCTION = ts_rewrite)", "DROP OPERATOR @@? (tsquery, text)"},
		{"operator in SQL", "CREATE FUNCTION same(int, int) RETURNS bool LANGUAGE sql IMMUTABLE AS 'SELECT $1 = $2'; CREATE OPERATOR === (LEFTARG = int, RIGHTARG = int, FUNCTION = same)",
			"DROP OPERATOR === (int, int); DROP FUNCTION same(int, int)"},
		{"domain check running SQL", "CREATE DOMAIN dx AS text CHECK (query_to_xml('SELECT payload FROM results', false, false, '')::text <> VALUE)", "DROP DOMAIN dx"},
		{"domain check in plpgsql", "CREATE FUNCTION chk(text) RETURNS bool LANGUAGE plpgsql AS 'BEGIN RETURN true; END'; CREATE DOMAIN dp AS text CHECK (chk(VALUE))",
			"DROP DOMAIN dp; DROP FUNCTION chk(text)"},
		{"cast in SQL", "CREATE TYPE jr AS (k text); CREATE FUNCTION jr_text(jr) RETURNS text LANGUAGE sql AS 'SELECT $1.k'; CREATE CAST (jr AS text) WITH FUNCTION jr_text(jr)",
			"DROP CAST (jr AS text); DROP FUNCTION jr_text(jr); DROP TYPE jr"},
		{"range difference in plpgsql", "CREATE FUNCTION tdiff(a text, b text) RETURNS float8 LANGUAGE plpgsql IMMUTABLE AS 'BEGIN RETURN 0; END'; CREATE TYPE trange AS RANGE (subtype = text, subtype_diff = tdiff)",
			"DROP TYPE trange; DROP FUNCTION tdiff(text, text)"},
	} {
		if !reloadAll(c.create, true) {
			t.Errorf("%s: all is false", c.name)
		}
		if !reloadAll(c.drop, false) {
			t.Errorf("after dropping the %s: all is still true", c.name)
		}
	}
	rd = reload(`CREATE FUNCTION peekattr(a audit) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM results LIMIT 1';
		CREATE FUNCTION twoargs(a audit, b int) RETURNS text LANGUAGE sql AS 'SELECT 1::text';
		CREATE FUNCTION onedefault(a audit, b int DEFAULT 0) RETURNS text LANGUAGE sql AS 'SELECT 1::text';
		CREATE AGGREGATE agg_any(anycompatible) (SFUNC = array_append, STYPE = anycompatiblearray);
		CREATE PROCEDURE proc(a int) LANGUAGE sql AS 'SELECT 1';
		CREATE VIEW v_statistic AS SELECT s.stavalues1::text AS vals FROM pg_statistic s;
		CREATE VIEW v_stats AS SELECT most_common_vals::text AS mcv FROM pg_stats`)
	for name, want := range map[string]bool{"peekattr": true, "onedefault": true, "agg_any": true, "ts_stat": true,
		"twoargs": false, "proc": false, "lower": false, "query_to_xml": false} {
		if rd.colFuncs[name] != want {
			t.Errorf("colFuncs[%s] = %v, want %v", name, rd.colFuncs[name], want)
		}
	}
	for _, v := range []string{"v_statistic", "v_stats"} {
		if !rd.exposes(rewrite.RelName{Schema: "public", Name: v}) {
			t.Errorf("%s, a view over the statistics, is not exposed", v)
		}
	}
	if rd.all {
		t.Error("functions callable as fields made every read protected")
	}
	for _, c := range []struct {
		sql  string
		runs bool
	}{
		{"SELECT a.peekattr FROM audit a", true},
		{"SELECT (1).ts_stat", true},
		{"SELECT a.note FROM audit a", false},
		{"SELECT 1 + 1", false},
		{"SELECT 1", false},
	} {
		res, err := rewrite.Classify(c.sql)
		if err != nil {
			t.Fatal(err)
		}
		if got := rd.runsCode(res.Stmts[0]); got != c.runs {
			t.Errorf("%s: runsCode %v, want %v", c.sql, got, c.runs)
		}
		if !(*readSet)(nil).runsCode(res.Stmts[0]) && res.Stmts[0].CatalogExprs {
			t.Errorf("%s: a set not loaded says no", c.sql)
		}
	}
}

// TestReadRoutingCounted: the routing counters an operator reads, in
// /metrics and in the console's SHOW FENCE_STATS, count the reads routed
// (round 12, attacker X's L1: both read counters the router never
// incremented, so they stayed 0 while reads went to the replica).
func TestReadRoutingCounted(t *testing.T) {
	e := newRouteEnv(t)
	r := e.reader(t, nil)
	waitReplicaRead(t, r, "SELECT 1, pg_is_in_recovery()")
	// A read inside a transaction open on the primary: counted there.
	for _, q := range []string{"BEGIN", "SELECT 1", "COMMIT"} {
		if _, err := r.Exec(ctxT(t), q).ReadAll(); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	hs := httptest.NewServer(e.proxy.srv.MetricsHandler())
	defer hs.Close()
	_, body := scrape(t, hs.URL+"/metrics")
	for _, route := range []string{"replica", "primary"} {
		if got := metric(t, body, `pgfence_read_routes_total{route="`+route+`"}`); got < 1 {
			t.Errorf("pgfence_read_routes_total{route=%q} = %v after reads routed there", route, got)
		}
	}
	stats := map[string]any{}
	for _, row := range e.proxy.srv.showFenceStats().rows {
		stats[row[0].(string)] = row[1]
	}
	for _, k := range []string{"reads_replica", "reads_primary"} {
		if v, _ := stats[k].(string); v == "" || v == "0" {
			t.Errorf("SHOW FENCE_STATS %s = %v after reads routed", k, stats[k])
		}
	}
}
