package proxy

import (
	"bytes"
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestBypass/reads and TestBypass/reads_tracked: reads after a takeover
// that try to see the previous generation on a lagging replica, phrased
// every way the classifier might miss: views, views over views,
// materialized views, functions, COPY, CTEs and subqueries, partitions,
// row-security policies, names the proxy has not seen, views redefined
// through the proxy and directly, a shadowing schema, read-only
// transactions, cursors, the extended protocol. The replica has replayed
// A's result and then paused; B took over with synchronous_commit off (the
// takeover's position must cover its unwritten commit record) and wrote
// its own result. Every read either is refused with FN007 (policy
// pending) or returns B's result, never A's.
//
// reads runs against a database without the DDL event trigger (every read
// is protected there), reads_tracked against one with it (the proxy keeps
// the set of relations that reach protected data, and must keep it
// current).
func init() {
	registerBypass("reads", func(t *testing.T) { testBypassReads(t, false) })
	registerBypass("reads_tracked", func(t *testing.T) { testBypassReads(t, true) })
	registerBypass("reads_code", func(t *testing.T) { testBypassReadsCode(t, false) })
	registerBypass("reads_code_tracked", func(t *testing.T) { testBypassReadsCode(t, true) })
}

// ddlTriggerSQL installs the event trigger that makes a database's
// catalog tracked (ddlTrigger), unless the fence schema has it already.
const ddlTriggerSQL = `
CREATE OR REPLACE FUNCTION public.pgfence_test_catalog_changed() RETURNS event_trigger LANGUAGE plpgsql
  AS $$ BEGIN PERFORM pg_notify('pgfence_protected', tg_tag); END $$;
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_event_trigger WHERE evtname = '` + ddlTrigger + `') THEN
    CREATE EVENT TRIGGER ` + ddlTrigger + ` ON ddl_command_end EXECUTE FUNCTION public.pgfence_test_catalog_changed();
  END IF;
END $$;
ALTER EVENT TRIGGER ` + ddlTrigger + ` ENABLE ALWAYS;
`

// noDDLTriggerSQL makes a database untracked, whatever the fence schema
// installs.
const noDDLTriggerSQL = "DROP EVENT TRIGGER IF EXISTS " + ddlTrigger + ";"

// readsSchema is the class's database: the protected results table (of
// fenceSchema), and every way to reach it by another name.
const readsSchema = fenceSchema + `
CREATE VIEW v_results AS SELECT job_key, payload, token FROM results;
CREATE VIEW v_v AS SELECT * FROM v_results;
CREATE MATERIALIZED VIEW mv_results AS SELECT * FROM v_v;
CREATE VIEW later AS SELECT payload FROM results;
CREATE FUNCTION f_results() RETURNS SETOF results LANGUAGE sql STABLE AS 'SELECT * FROM results';
CREATE FUNCTION f_payload(k text) RETURNS text LANGUAGE plpgsql STABLE
  AS $$ BEGIN RETURN (SELECT payload FROM results WHERE job_key = k); END $$;
CREATE VIEW v_func AS SELECT * FROM f_results();
CREATE FUNCTION f_max() RETURNS text LANGUAGE sql STABLE AS 'SELECT max(payload) FROM results';
CREATE VIEW v_scalar AS SELECT f_max() AS payload;
CREATE VIEW v_xml AS SELECT query_to_xml('SELECT payload FROM results', false, false, '')::text AS payload;
CREATE VIEW v_safe AS SELECT note AS payload FROM audit;
CREATE VIEW v_audit AS SELECT note AS payload FROM audit;
CREATE TABLE pres (job_key text, payload text, token bigint) PARTITION BY LIST (job_key);
CREATE TABLE pres_job PARTITION OF pres FOR VALUES IN ('job');
SELECT fence.protect('pres'); -- the whole tree (issue 17): a write naming pres_job is protected too
CREATE TABLE rls (id int);
ALTER TABLE rls ENABLE ROW LEVEL SECURITY;
CREATE POLICY rls_p ON rls USING (EXISTS (SELECT FROM results));
CREATE SCHEMA other;
INSERT INTO audit (note) VALUES ('n');
` + readsSchemaCalls

// readsSchemaCalls: code that reads the protected table where a read does
// not name it (issue 30): an immutable function the planner folds (EXPLAIN
// runs it), functions and an aggregate a read may write as a field
// (n.peekattr is peekattr(n)), and a protected table whose planner
// statistics hold its values (pg_stats). None of it is an operator, a
// cast or a domain: the database's expressions stay free of user code
// (readSet.all), so the tracked class still tells safe relations apart.
const readsSchemaCalls = `
CREATE FUNCTION peek(k text) RETURNS text LANGUAGE plpgsql IMMUTABLE
  AS $$ BEGIN RETURN (SELECT payload FROM results WHERE job_key = k); END $$;
CREATE FUNCTION peekattr(a audit) RETURNS text LANGUAGE sql STABLE
  AS $$ SELECT payload FROM results WHERE job_key = 'job' $$;
CREATE FUNCTION peekany(anyelement) RETURNS text LANGUAGE sql STABLE
  AS $$ SELECT payload FROM results WHERE job_key = 'job' $$;
CREATE FUNCTION peek_sfunc(s text, v text) RETURNS text LANGUAGE plpgsql STABLE
  AS $$ BEGIN RETURN (SELECT payload FROM results WHERE job_key = v); END $$;
CREATE AGGREGATE peek_agg(text) (SFUNC = peek_sfunc, STYPE = text);
CREATE TABLE stats_t (payload text);
CREATE STATISTICS st_mcv (mcv) ON payload, upper(payload) FROM stats_t;
CREATE STATISTICS st_ex ON (upper(payload)) FROM stats_t;
SELECT fence.protect('stats_t');
CREATE VIEW v_stats AS SELECT tablename, most_common_vals::text AS mcv FROM pg_stats;
CREATE VIEW v_statistic AS SELECT s.stavalues1::text AS vals FROM pg_statistic s WHERE s.starelid::regclass::text = 'stats_t';
`

// readsCase is one attempt: a query through a reader, and what must come
// back: FN007 (code), or B's payload as the first column of the first row.
type readsCase struct {
	name   string
	reader func(t *testing.T) *pgconn.PgConn
	sql    string
	code   string // the SQLSTATE expected; "" for B's payload
	copy   bool   // sql is COPY ... TO STDOUT
	// want: a value of the answer must contain it (B's payload as EXPLAIN
	// shows it, 'B'::text), and none may contain it with A's.
	want string
	// primary: the read may run code that changes the session's state,
	// so it runs on the primary (round 12, attacker X's M1): nothing is
	// sent to the replica, and the answer is the primary's (never A's;
	// an error only the current generation's payload=B).
	primary bool
}

// readsScene is the class's scenario: A's generation (and job other's,
// and A's statistics of stats_t) replayed on the replica, then replay
// paused, B's takeover of job with its commit record unwritten, and B's
// result (and statistics) on the primary only.
type readsScene struct {
	e      *routeEnv
	direct *pgx.Conn
	a, b   fence.Lease
	other  fence.Lease // job other, acquired before the pause: its takeover is replayed
}

// newReadsScene sets the scenario up in a new database made of schema;
// afterLoad runs once the proxy has read the catalog, before runs just
// before replay pauses (the replica then has A's generation and every
// takeover but B's).
func newReadsScene(t *testing.T, tracked bool, schema string, afterLoad, before func(sc *readsScene)) *readsScene {
	ctx := ctxT(t)
	e := newRouteEnvMode(t, tracked, schema) // the catalog is loaded now
	sc := &readsScene{e: e, direct: e.direct(t)}
	if cat := catalogOf(t, e.gate, e.db); cat.tracked.Load() != tracked {
		t.Fatalf("catalog tracked=%v, want %v", cat.tracked.Load(), tracked)
	}
	if afterLoad != nil {
		afterLoad(sc)
	}
	// A's generation is on the replica; then replay stops and B takes
	// over with its commit record unwritten.
	sc.a = e.acquire(t, "job", "a", time.Minute)
	wa := e.worker(t, &sc.a)
	if _, err := wa.Exec(ctx, upsert, "job", "A", sc.a.Token); err != nil {
		t.Fatalf("A's commit: %v", err)
	}
	if _, err := e.worker(t, &sc.a, "-c fence.step=stats").Exec(ctx, "INSERT INTO stats_t VALUES ('A'), ('A')"); err != nil {
		t.Fatalf("A's statistics rows: %v", err)
	}
	sc.other = e.acquire(t, "other", "o", time.Minute)
	e.waitTakeover(t, e.gate, "other", sc.other.Token)
	execOK(t, sc.direct, "ANALYZE stats_t")
	execOK(t, sc.direct, "REFRESH MATERIALIZED VIEW mv_results")
	if err := cluster.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	if before != nil {
		before(sc)
	}
	pauseReplay(t)
	sc.b = readsAsyncTakeover(t, sc.direct, sc.a)
	e.waitTakeover(t, e.gate, "job", sc.b.Token)
	wb := e.worker(t, &sc.b)
	if _, err := wb.Exec(ctx, upsert, "job", "B", sc.b.Token); err != nil {
		t.Fatalf("B's commit: %v", err)
	}
	if _, err := e.worker(t, &sc.b, "-c fence.step=stats").Exec(ctx, "UPDATE stats_t SET payload = 'B'"); err != nil {
		t.Fatalf("B's statistics rows: %v", err)
	}
	execOK(t, sc.direct, "ANALYZE stats_t")
	cat := catalogOf(t, e.gate, e.db)
	seen := cat.ddlSeen.Load()
	execOK(t, sc.direct, "REFRESH MATERIALIZED VIEW mv_results")
	if tracked {
		// Every DDL has been heard of and the set read again since (or
		// the cases could pass while it is dropped, all reads protected).
		if err := pgtest.Poll(ctx, func() (bool, error) {
			return cat.ddlSeen.Load() > seen && cat.reads.Load() != nil, nil
		}); err != nil {
			t.Fatalf("the catalog was not read again after the DDL: %v", err)
		}
	}
	// The replica still has A's generation: what a stale read would return.
	rconn, err := cluster.Replica.Connect(ctx, e.db)
	if err != nil {
		t.Fatal(err)
	}
	defer rconn.Close(context.Background())
	var onReplica, stats string
	if err := rconn.QueryRow(ctx, "SELECT payload FROM results WHERE job_key = 'job'").Scan(&onReplica); err != nil || onReplica != "A" {
		t.Fatalf("replica shows %q (%v), want A's result (replay paused)", onReplica, err)
	}
	if err := rconn.QueryRow(ctx, "SELECT most_common_vals::text FROM pg_stats WHERE tablename = 'stats_t'").Scan(&stats); err != nil || stats != "{A}" {
		t.Fatalf("replica's statistics show %q (%v), want A's {A}", stats, err)
	}
	return sc
}

// gen is a reader carrying B's generation, with policy.
func (sc *readsScene) gen(policy string, extra ...string) func(t *testing.T) *pgconn.PgConn {
	return sc.genOf("job", sc.b.Token, policy, extra...)
}

// genOf is a reader carrying job's generation token, with policy.
func (sc *readsScene) genOf(job string, token int64, policy string, extra ...string) func(t *testing.T) *pgconn.PgConn {
	return func(t *testing.T) *pgconn.PgConn {
		return sc.e.reader(t, nil, opts(job, token, append([]string{"-c fence.read_policy=" + policy, "-c fence.read_wait=50ms"}, extra...)...)...)
	}
}

// nometa is a reader without fence metadata, with policy.
func (sc *readsScene) nometa(policy string, extra ...string) func(t *testing.T) *pgconn.PgConn {
	return func(t *testing.T) *pgconn.PgConn {
		return sc.e.reader(t, nil, append([]string{"-c fence.read_policy=" + policy, "-c fence.read_wait=50ms"}, extra...)...)
	}
}

// run runs each case on a new connection of its reader.
func (sc *readsScene) run(t *testing.T, cases []readsCase) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.primary {
				readsCheckPrimary(t, sc.e, c.reader(t), c)
				return
			}
			readsCheck(t, c.reader(t), c)
		})
	}
}

// unchanged asserts that nothing the attempts did changed B's result or
// the fence.
func (sc *readsScene) unchanged(t *testing.T) {
	var payload string
	var token, maxIssued int64
	if err := sc.direct.QueryRow(ctxT(t), "SELECT r.payload, r.token, f.max_issued_token FROM results r, fence.fences f WHERE r.job_key = 'job' AND f.job_key = 'job'").Scan(&payload, &token, &maxIssued); err != nil {
		t.Fatal(err)
	}
	if payload != "B" || token != sc.b.Token || maxIssued != sc.b.Token {
		t.Fatalf("after the attempts: result %q token %d, fence at %d; want B's (%d)", payload, token, maxIssued, sc.b.Token)
	}
}

func testBypassReads(t *testing.T, tracked bool) {
	ctx := ctxT(t)
	var ddl, prepared *pgconn.PgConn
	sc := newReadsScene(t, tracked, readsSchema, func(sc *readsScene) {
		// After the proxy read the catalog: a view it does not know, a
		// schema's view that shadows a safe name, a safe view redefined
		// directly and one through the proxy, to read the protected table.
		for _, q := range []string{
			"CREATE VIEW v_new AS SELECT payload FROM results",
			"CREATE VIEW other.audit AS SELECT payload AS note FROM results",
			"CREATE OR REPLACE VIEW v_audit AS SELECT payload FROM results",
		} {
			execOK(t, sc.direct, q)
		}
		ddl = sc.e.reader(t, nil)
		mustExec(t, ddl, "CREATE OR REPLACE VIEW v_safe AS SELECT payload FROM results")
	}, func(sc *readsScene) {
		// A statement prepared on the primary; preparing it on the
		// replica too, in a read-only transaction, is refused (0A000:
		// it would be the replica session's alone, TestBypass/replstate):
		// EXPLAIN EXECUTE plans the primary's, folding peek.
		prepared = sc.e.reader(t, nil, "-c fence.read_policy=primary")
		mustExec(t, prepared, "PREPARE peekp AS SELECT public.peek('job')")
		mustExec(t, prepared, "BEGIN READ ONLY")
		mustWhere(t, prepared, "SELECT 1, pg_is_in_recovery()", true)
		if _, err := prepared.Exec(ctxT(t), "PREPARE peekp AS SELECT public.peek('job')").ReadAll(); pgtest.SQLState(err) != "0A000" {
			t.Fatalf("PREPARE on the replica: %v, want 0A000", err)
		}
		mustExec(t, prepared, "ROLLBACK")
	})
	e, direct, b := sc.e, sc.direct, sc.b
	var toast string // the protected table's TOAST relation, read directly
	if err := direct.QueryRow(ctx, "SELECT reltoastrelid::regclass::text FROM pg_class WHERE oid = 'results'::regclass").Scan(&toast); err != nil {
		t.Fatal(err)
	}
	gen, nometa := func(policy string) func(t *testing.T) *pgconn.PgConn { return sc.gen(policy) }, sc.nometa
	pending := fence.CodePending
	// inUntracked: the SQLSTATE in a database without a read set, where
	// only what a statement calls itself counts as code that may change
	// the session (round 12): there the read is routed and refused as
	// before; with a read set it runs on the primary: B's result.
	inUntracked := func(code string) string {
		if tracked {
			return ""
		}
		return code
	}
	generic := "" // EXPLAIN (GENERIC_PLAN) is PostgreSQL 16's: a syntax error before
	if major, _ := strconv.Atoi(strings.Split(ddl.ParameterStatus("server_version"), ".")[0]); major < 16 {
		generic = "42601"
	}
	cases := []readsCase{
		{name: "view_pending", reader: gen("pending"), sql: "SELECT payload FROM v_results WHERE job_key = 'job'", code: pending},
		{name: "view_over_view_no_metadata", reader: nometa("primary"), sql: "SELECT payload, pg_is_in_recovery() FROM v_v WHERE job_key = 'job'"},
		{name: "view_over_view_no_metadata_pending", reader: nometa("pending"), sql: "SELECT payload FROM v_v", code: pending},
		{name: "materialized_view_pending", reader: gen("pending"), sql: "SELECT payload FROM mv_results", code: pending},
		{name: "materialized_view_wait", reader: nometa("wait"), sql: "SELECT payload, pg_is_in_recovery() FROM mv_results"},
		{name: "copy_query_over_view_pending", reader: gen("pending"), sql: "COPY (SELECT payload FROM v_v) TO STDOUT", code: pending, copy: true},
		{name: "copy_query_over_view_no_metadata", reader: nometa("primary"), sql: "COPY (SELECT payload FROM v_v) TO STDOUT", copy: true},
		{name: "copy_view_pending", reader: gen("pending"), sql: "COPY v_results TO STDOUT", code: pending, copy: true},
		{name: "copy_view_primary", reader: gen("primary"), sql: "COPY v_results TO STDOUT", code: "42809", copy: true}, // as direct: "cannot copy from view"
		{name: "sql_function", reader: gen("pending"), sql: "SELECT payload, pg_is_in_recovery() FROM f_results()"},
		{name: "plpgsql_function_no_metadata", reader: nometa("pending"), sql: "SELECT f_payload('job'), pg_is_in_recovery()"},
		// A read that may run code changing the session's state (a
		// view's function, a built-in that runs SQL, a name the read set
		// does not know) runs in the client's own session, on the
		// primary, where the proxy keeps a read set, since round 12
		// (attacker X's M1): B's result (before: FN007 from the lagging
		// replica, as still in an untracked database).
		{name: "view_calling_function", reader: gen("pending"), sql: "SELECT payload, pg_is_in_recovery() FROM v_func", code: inUntracked(pending)},
		{name: "view_calling_scalar_function", reader: gen("pending"), sql: "SELECT payload, pg_is_in_recovery() FROM v_scalar", code: inUntracked(pending)},
		{name: "view_running_sql", reader: nometa("pending"), sql: "SELECT payload, pg_is_in_recovery() FROM v_xml", want: "<payload>B</payload>", code: inUntracked(pending)},
		{name: "toast_table", reader: gen("pending"), sql: "SELECT 'B', count(*), pg_is_in_recovery() FROM " + toast, code: inUntracked(pending)},
		{name: "cte_shadowing_table", reader: gen("pending"), sql: "WITH results AS (SELECT * FROM results) SELECT payload FROM results", code: pending},
		{name: "cte_later_sibling", reader: nometa("pending"), sql: "WITH x AS (SELECT payload FROM later), later AS (SELECT 'z'::text AS payload) SELECT payload FROM x", code: pending},
		{name: "deep_subquery", reader: gen("pending"), sql: "SELECT (SELECT payload FROM (SELECT * FROM (SELECT * FROM v_v) a) b LIMIT 1)", code: pending},
		{name: "values_subquery", reader: gen("pending"), sql: "VALUES ((SELECT payload FROM v_results LIMIT 1))", code: pending},
		{name: "table_statement", reader: gen("pending"), sql: "TABLE v_results", code: pending},
		{name: "second_statement", reader: gen("pending"), sql: "SELECT 1; SELECT payload FROM v_results", code: pending},
		{name: "view_created_after_load", reader: nometa("pending"), sql: "SELECT payload FROM v_new", code: pending},
		{name: "view_redefined_directly", reader: gen("pending"), sql: "SELECT payload FROM v_audit", code: pending},
		{name: "unqualified_name_shadowed", reader: nometa("pending", "-c search_path=other,public"), sql: "SELECT note FROM audit", code: pending},
		{name: "partition_parent", reader: gen("pending"), sql: "SELECT payload FROM pres", code: pending},
		{name: "row_security_policy", reader: gen("pending"), sql: "SELECT count(*) FROM rls", code: pending},
		{name: "read_only_transaction", reader: gen("pending"), sql: "BEGIN READ ONLY; SELECT payload FROM v_safe; COMMIT", code: pending},

		// Plain EXPLAIN runs nothing, but the planner folds immutable
		// functions into constants, a user's too: EXPLAIN VERBOSE shows
		// what peek read (issue 30, H4).
		{name: "explain_verbose_folds_function", reader: gen("pending"), sql: "EXPLAIN VERBOSE SELECT public.peek('job')", want: "'B'::text"},
		{name: "explain_costs_off", reader: nometa("pending"), sql: "EXPLAIN (VERBOSE, COSTS OFF) SELECT peek('job')", want: "'B'::text"},
		{name: "explain_analyze_false", reader: gen("pending"), sql: "EXPLAIN (ANALYZE false, VERBOSE true) SELECT peek('job')", want: "'B'::text"},
		{name: "explain_format_json", reader: gen("pending"), sql: "EXPLAIN (VERBOSE, FORMAT JSON, SUMMARY) SELECT peek('job')", want: "'B'::text"},
		{name: "explain_function_in_filter", reader: gen("pending"), sql: "EXPLAIN VERBOSE SELECT note FROM audit WHERE note = peek('job')", want: "'B'::text"},
		{name: "explain_function_in_subquery", reader: nometa("pending"), sql: "EXPLAIN VERBOSE SELECT * FROM (SELECT peek('job') AS p) s", want: "'B'::text"},
		{name: "explain_values", reader: gen("pending"), sql: "EXPLAIN VERBOSE VALUES (peek('job'))", want: "'B'::text"},
		{name: "explain_cte", reader: gen("pending"), sql: "EXPLAIN VERBOSE WITH w AS MATERIALIZED (SELECT peek('job') AS p) SELECT p FROM w", want: "'B'::text"},
		{name: "explain_declare", reader: gen("pending"), sql: "EXPLAIN VERBOSE DECLARE c CURSOR FOR SELECT peek('job')", want: "'B'::text"},
		{name: "explain_create_table_as", reader: nometa("pending"), sql: "EXPLAIN VERBOSE CREATE TABLE never AS SELECT peek('job')", want: "'B'::text"},
		{name: "explain_generic_plan", reader: gen("pending"), sql: "EXPLAIN (GENERIC_PLAN, VERBOSE) SELECT peek('job')", want: "'B'::text", code: generic},

		// A function written as a field: n.f is f(n) when n has no
		// column f, for a table's row, any row, any value (H6).
		// (A user's function: it may change the session's state, so the
		// read runs on the primary since round 12, attacker X's M1.)
		{name: "field_function_alias", reader: gen("pending"), sql: "SELECT a.peekattr, pg_is_in_recovery() FROM audit a LIMIT 1", code: inUntracked(pending)},
		{name: "field_function_parenthesized", reader: gen("pending"), sql: "SELECT (a).peekattr, pg_is_in_recovery() FROM audit a LIMIT 1", code: inUntracked(pending)},
		{name: "field_function_table_name", reader: nometa("pending"), sql: "SELECT audit.peekattr, pg_is_in_recovery() FROM audit LIMIT 1", code: inUntracked(pending)},
		{name: "field_function_qualified_table", reader: gen("pending"), sql: "SELECT public.audit.peekattr, pg_is_in_recovery() FROM public.audit LIMIT 1", code: inUntracked(pending)},
		{name: "field_function_in_where", reader: gen("pending"), sql: "SELECT 'B', count(*), pg_is_in_recovery() FROM audit a WHERE a.peekattr = 'A'", code: inUntracked(pending)},
		{name: "field_function_call_form", reader: gen("pending"), sql: "SELECT peekattr(a), pg_is_in_recovery() FROM audit a LIMIT 1"},
		{name: "field_polymorphic_scalar", reader: nometa("pending"), sql: "SELECT (1).peekany, pg_is_in_recovery()", code: inUntracked(pending)},
		{name: "field_polymorphic_row", reader: gen("pending"), sql: "SELECT (ROW(1)).peekany, pg_is_in_recovery()", code: inUntracked(pending)},
		{name: "field_subquery_alias", reader: gen("pending"), sql: "SELECT x.peekany, pg_is_in_recovery() FROM (SELECT 1 AS v) x", code: inUntracked(pending)},
		{name: "field_cte", reader: gen("pending"), sql: "WITH w AS (SELECT 1 AS v) SELECT w.peekany, pg_is_in_recovery() FROM w", code: inUntracked(pending)},
		{name: "field_values_alias_primary", reader: nometa("primary"), sql: "SELECT t.peekany, pg_is_in_recovery() FROM (VALUES (1)) t(v)"},
		{name: "field_aggregate", reader: gen("pending"), sql: "SELECT (v).peek_agg, pg_is_in_recovery() FROM (VALUES ('job')) t(v)", code: inUntracked(pending)},
		{name: "aggregate_call", reader: gen("pending"), sql: "SELECT peek_agg(v), pg_is_in_recovery() FROM (VALUES ('job')) t(v)"},
		{name: "aggregate_as_window_function", reader: gen("pending"), sql: "SELECT peek_agg(v) OVER (), pg_is_in_recovery() FROM (VALUES ('job')) t(v)"},

		// A reader carrying another job's current generation is no
		// less protected than a reader without metadata: every
		// takeover seen, then its own (H8).
		{name: "other_generation_pending", reader: sc.genOf("other", sc.other.Token, "pending"), sql: "SELECT payload FROM results WHERE job_key = 'job'", code: pending},
		{name: "other_generation_primary", reader: sc.genOf("other", sc.other.Token, "primary"), sql: "SELECT payload, pg_is_in_recovery() FROM results WHERE job_key = 'job'"},
		{name: "other_generation_wait", reader: sc.genOf("other", sc.other.Token, "wait"), sql: "SELECT payload, pg_is_in_recovery() FROM v_v WHERE job_key = 'job'"},
		{name: "other_generation_view", reader: sc.genOf("other", sc.other.Token, "pending"), sql: "SELECT payload FROM v_results", code: pending},
		{name: "other_generation_min_lsn", reader: sc.genOf("other", sc.other.Token, "pending", "-c fence.min_lsn=0/1"), sql: "SELECT payload FROM results", code: pending},
		{name: "zombie_generation", reader: sc.genOf("job", sc.a.Token, "pending"), sql: "SELECT payload FROM results", code: pending},
		{name: "never_acquired_generation", reader: sc.genOf("nojob", sc.b.Token, "pending"), sql: "SELECT payload FROM results", code: pending},

		// The planner's statistics hold column values: a lagging
		// replica's show the previous generation's (L1).
		{name: "pg_stats", reader: gen("pending"), sql: "SELECT unnest(most_common_vals::text::text[]) FROM pg_stats WHERE tablename = 'stats_t'", code: pending},
		{name: "pg_stats_qualified_primary", reader: nometa("primary"), sql: "SELECT unnest(most_common_vals::text::text[]), pg_is_in_recovery() FROM pg_catalog.pg_stats WHERE tablename = 'stats_t'"},
		{name: "pg_statistic", reader: gen("pending"), sql: "SELECT unnest(stavalues1::text::text[]) FROM pg_statistic WHERE starelid = 'stats_t'::regclass", code: pending},
		{name: "pg_stats_ext", reader: gen("pending"), sql: "SELECT unnest(most_common_vals) FROM pg_stats_ext WHERE statistics_name = 'st_mcv'", code: pending},
		{name: "pg_stats_ext_exprs", reader: nometa("pending"), sql: "SELECT unnest(most_common_vals::text::text[]) FROM pg_stats_ext_exprs WHERE statistics_name = 'st_ex'", code: pending},
		{name: "view_over_pg_stats", reader: gen("pending"), sql: "SELECT mcv FROM v_stats WHERE tablename = 'stats_t'", code: pending},
		{name: "view_over_pg_statistic", reader: gen("pending"), sql: "SELECT vals FROM v_statistic", code: pending},
		{name: "pg_largeobject", reader: gen("pending"), sql: "SELECT count(*) FROM pg_largeobject", code: pending},
		// pg_class counts rows and pages as the last ANALYZE left them
		// (round 16, attacker AE's M1).
		{name: "pg_class_reltuples", reader: gen("pending"), sql: "SELECT reltuples FROM pg_class WHERE relname = 'stats_t'", code: pending},
		{name: "pg_class_by_oid_nometa", reader: nometa("pending"), sql: "SELECT relpages, reltuples FROM pg_catalog.pg_class WHERE oid = 'stats_t'::regclass", code: pending},
	}
	sc.run(t, cases)
	t.Run("explain_execute_prepared", func(t *testing.T) {
		// peekp exists on the primary only (its PREPARE on the replica
		// was refused); EXPLAIN EXECUTE plans it, and the planner folds
		// peek.
		readsCheck(t, prepared, readsCase{sql: "EXPLAIN VERBOSE EXECUTE peekp", want: "'B'::text"})
		readsCheck(t, prepared, readsCase{sql: "EXPLAIN (COSTS OFF, VERBOSE) EXECUTE peekp", want: "'B'::text"})
	})

	t.Run("view_redefined_through_proxy", func(t *testing.T) {
		// The session that replaced v_safe reads it next: the proxy
		// re-reads the catalog first, and v_safe now reads results.
		mustExec(t, ddl, "SET fence.read_policy = 'pending'")
		readsCheck(t, ddl, readsCase{sql: "SELECT payload FROM v_safe", code: pending})
	})
	t.Run("declare_with_hold", func(t *testing.T) {
		// A cursor declared outside a transaction lives where FETCH runs.
		r := nometa("primary")(t)
		mustExec(t, r, "DECLARE c CURSOR WITH HOLD FOR SELECT payload FROM v_results WHERE job_key = 'job'")
		readsCheck(t, r, readsCase{sql: "FETCH ALL FROM c"})
	})
	t.Run("extended_protocol", func(t *testing.T) {
		ctx := ctxT(t) // each its own deadline: the class takes over 30 s under load
		for _, policy := range []string{"pending", "primary"} {
			w := readsPgx(t, e, opts("job", b.Token, "-c fence.read_policy="+policy)...)
			var payload string
			var rec bool
			if err := w.QueryRow(ctx, "SELECT payload, pg_is_in_recovery() FROM v_results WHERE job_key = $1", "job").Scan(&payload, &rec); err != nil {
				t.Fatalf("%s: %v", policy, err)
			}
			if payload != "B" || rec {
				t.Fatalf("%s: read %q from replica=%v, want B's result from the primary", policy, payload, rec)
			}
		}
	})
	t.Run("extended_read_only_transaction", func(t *testing.T) {
		ctx := ctxT(t) // each its own deadline: the class takes over 30 s under load
		w := readsPgx(t, e)
		tx, err := w.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		var payload string
		var rec bool
		if err := tx.QueryRow(ctx, "SELECT payload, pg_is_in_recovery() FROM v_v WHERE job_key = $1", "job").Scan(&payload, &rec); err != nil {
			t.Fatal(err)
		}
		if payload != "B" || rec {
			t.Fatalf("read %q from replica=%v, want B's result from the primary", payload, rec)
		}
	})
	t.Run("extended_read_only_transaction_pending", func(t *testing.T) {
		ctx := ctxT(t) // each its own deadline: the class takes over 30 s under load
		w := readsPgx(t, e, opts("job", b.Token, "-c fence.read_policy=pending")...)
		_, err := w.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
		wantCode(t, err, pending)
	})

	sc.unchanged(t)
}

// readsAsyncTakeover ends old's lease and acquires job for b in one
// transaction committed with synchronous_commit off: its commit record may
// be unwritten when the notification arrives.
func readsAsyncTakeover(t *testing.T, direct *pgx.Conn, old fence.Lease) fence.Lease {
	t.Helper()
	ctx := ctxT(t)
	tx := beginOK(t, direct)
	defer tx.Rollback(ctx)
	l := fence.Lease{JobKey: old.JobKey}
	for _, q := range []string{"SET LOCAL synchronous_commit = off", fmt.Sprintf("SELECT fence.release('%s', %d)", old.JobKey, old.Token)} {
		execOK(t, tx, q)
	}
	if err := tx.QueryRow(ctx, "SELECT epoch, token FROM fence.acquire($1, 'b', interval '1 minute')", old.JobKey).Scan(&l.Epoch, &l.Token); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return l
}

// readsCheck runs c.sql on r and asserts its outcome: c.code, or B's
// payload (never A's), from the primary when the query says where it ran.
func readsCheck(t *testing.T, r *pgconn.PgConn, c readsCase) {
	t.Helper()
	ctx := ctxT(t)
	var rows [][]string
	var err error
	if c.copy {
		var buf bytes.Buffer
		_, err = r.CopyTo(ctx, &buf, c.sql)
		for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
			if line != "" {
				rows = append(rows, strings.Split(line, "\t"))
			}
		}
	} else {
		var res []*pgconn.Result
		res, err = r.Exec(ctx, c.sql).ReadAll()
		for _, rr := range res {
			for _, row := range rr.Rows {
				var vals []string
				for _, v := range row {
					vals = append(vals, string(v))
				}
				rows = append(rows, vals)
			}
		}
	}
	stale := strings.ReplaceAll(c.want, "B", "A")
	for _, row := range rows {
		for _, v := range row {
			if v == "A" || c.want != "" && strings.Contains(v, stale) {
				t.Fatalf("%s: returned A's result %v: the previous generation", c.sql, row)
			}
		}
	}
	if err != nil && strings.Contains(err.Error(), "payload=A") {
		t.Fatalf("%s: %v: the previous generation", c.sql, err)
	}
	if c.code == "P0001" && !strings.Contains(fmt.Sprint(err), "payload=B") {
		t.Fatalf("%s: %v, want the current generation's payload=B", c.sql, err)
	}
	if c.code != "" {
		if len(rows) > 0 {
			t.Fatalf("%s: returned %v, want SQLSTATE %s and no rows", c.sql, rows, c.code)
		}
		wantCode(t, err, c.code)
		// The session is usable after the refusal.
		if _, err := r.Exec(ctx, "SELECT 1").ReadAll(); err != nil {
			t.Fatalf("session unusable after %s: %v", c.code, err)
		}
		return
	}
	if err != nil {
		t.Fatalf("%s: %v", c.sql, err)
	}
	if c.want != "" {
		for _, row := range rows {
			for _, v := range row {
				if strings.Contains(v, c.want) {
					return
				}
			}
		}
		t.Fatalf("%s: returned %v, want %s", c.sql, rows, c.want)
	}
	if len(rows) == 0 || rows[0][0] != "B" {
		t.Fatalf("%s: returned %v, want B's result", c.sql, rows)
	}
	if last := rows[0][len(rows[0])-1]; len(rows[0]) > 1 && last != "f" {
		t.Fatalf("%s: answered by the replica (pg_is_in_recovery %s), which has not replayed the takeover", c.sql, last)
	}
}

// readsCheckPrimary checks a readsCase whose read runs on the primary.
func readsCheckPrimary(t *testing.T, e *routeEnv, r *pgconn.PgConn, c readsCase) {
	t.Helper()
	stats := e.proxy.srv.RouteStats()
	before := stats.Replica.Load()
	var vals []string
	var err error
	if c.copy {
		var buf bytes.Buffer
		_, err = r.CopyTo(ctxT(t), &buf, c.sql)
		vals = strings.Fields(buf.String())
	} else {
		var res []*pgconn.Result
		res, err = r.Exec(ctxT(t), c.sql).ReadAll()
		for _, rr := range res {
			for _, row := range rr.Rows {
				for _, v := range row {
					vals = append(vals, string(v))
				}
			}
		}
	}
	if n := stats.Replica.Load() - before; n != 0 {
		t.Fatalf("%s: %d sent to the replica, want the primary", c.sql, n)
	}
	for _, v := range vals {
		if v == "A" || strings.Contains(v, "'A'::text") {
			t.Fatalf("%s: returned A's result %v: the previous generation", c.sql, vals)
		}
	}
	if err != nil && (pgtest.SQLState(err) != "P0001" || !strings.Contains(err.Error(), "payload=B")) {
		t.Fatalf("%s: %v, want the primary's answer", c.sql, err)
	}
}

// readsPgx is a pgx connection (extended protocol) through the proxy.
func readsPgx(t *testing.T, e *routeEnv, opts ...string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(e.proxy.dsn(e.db))
	if err != nil {
		t.Fatal(err)
	}
	if len(opts) > 0 {
		cfg.RuntimeParams["options"] = strings.Join(opts, " ")
	}
	return connectPgx(t, cfg)
}

// readsCodeSchema: code of the database's that a read runs without naming
// a function or a relation for it (issue 30, H5): operators, a domain's
// CHECK, a cast, a type's operator class, types whose input runs a domain's
// CHECK, a built-in that runs SQL behind an operator, a column DEFAULT.
// Every function reads the protected table: it returns B's or A's payload,
// or raises it (payload=...). And the operator a client puts before
// pg_catalog's on its search_path to forge the replica fence-row check
// (H7).
const readsCodeSchema = fenceSchema + `
CREATE MATERIALIZED VIEW mv_results AS SELECT * FROM results;
CREATE TABLE stats_t (payload text);
SELECT fence.protect('stats_t');
INSERT INTO audit (note) VALUES ('n');
CREATE FUNCTION peek_op(k text, x text) RETURNS text LANGUAGE plpgsql IMMUTABLE
  AS $$ BEGIN RETURN (SELECT payload FROM results WHERE job_key = k); END $$;
CREATE OPERATOR @@@ (LEFTARG = text, RIGHTARG = text, FUNCTION = peek_op);
CREATE FUNCTION peek_pre(k text) RETURNS text LANGUAGE plpgsql IMMUTABLE
  AS $$ BEGIN RETURN (SELECT payload FROM results WHERE job_key = k); END $$;
CREATE OPERATOR ### (RIGHTARG = text, FUNCTION = peek_pre);
CREATE OPERATOR @@? (LEFTARG = tsquery, RIGHTARG = text, FUNCTION = ts_rewrite);
CREATE FUNCTION peek_raise(k text) RETURNS boolean LANGUAGE plpgsql STABLE
  AS $$ BEGIN RAISE EXCEPTION 'payload=%', (SELECT payload FROM results WHERE job_key = k); END $$;
CREATE DOMAIN dpeek AS text CHECK (peek_raise(VALUE));
CREATE TYPE jd AS (k dpeek);
CREATE TYPE drange AS RANGE (subtype = dpeek);
CREATE TYPE jobref AS (k text);
CREATE FUNCTION jobref_text(j jobref) RETURNS text LANGUAGE sql STABLE
  AS $$ SELECT payload FROM results WHERE job_key = j.k $$;
CREATE CAST (jobref AS text) WITH FUNCTION jobref_text(jobref);
CREATE FUNCTION jk_cmp(a jobref, b jobref) RETURNS int LANGUAGE plpgsql STABLE
  AS $$ BEGIN RAISE EXCEPTION 'payload=%', (SELECT payload FROM results WHERE job_key = 'job'); END $$;
CREATE FUNCTION jk_lt(a jobref, b jobref) RETURNS boolean LANGUAGE sql STABLE AS 'SELECT jk_cmp(a, b) < 0';
CREATE FUNCTION jk_le(a jobref, b jobref) RETURNS boolean LANGUAGE sql STABLE AS 'SELECT jk_cmp(a, b) <= 0';
CREATE FUNCTION jk_eq(a jobref, b jobref) RETURNS boolean LANGUAGE sql STABLE AS 'SELECT jk_cmp(a, b) = 0';
CREATE FUNCTION jk_ge(a jobref, b jobref) RETURNS boolean LANGUAGE sql STABLE AS 'SELECT jk_cmp(a, b) >= 0';
CREATE FUNCTION jk_gt(a jobref, b jobref) RETURNS boolean LANGUAGE sql STABLE AS 'SELECT jk_cmp(a, b) > 0';
CREATE OPERATOR < (LEFTARG = jobref, RIGHTARG = jobref, FUNCTION = jk_lt);
CREATE OPERATOR <= (LEFTARG = jobref, RIGHTARG = jobref, FUNCTION = jk_le);
CREATE OPERATOR = (LEFTARG = jobref, RIGHTARG = jobref, FUNCTION = jk_eq, MERGES);
CREATE OPERATOR >= (LEFTARG = jobref, RIGHTARG = jobref, FUNCTION = jk_ge);
CREATE OPERATOR > (LEFTARG = jobref, RIGHTARG = jobref, FUNCTION = jk_gt);
CREATE OPERATOR CLASS jobref_ops DEFAULT FOR TYPE jobref USING btree AS
  OPERATOR 1 <, OPERATOR 2 <=, OPERATOR 3 =, OPERATOR 4 >=, OPERATOR 5 >, FUNCTION 1 jk_cmp(jobref, jobref);
CREATE TABLE jtab (j jobref);
INSERT INTO jtab VALUES (ROW('job')), (ROW('x'));
CREATE TABLE dflt (note text DEFAULT peek_pre('job'));
CREATE FUNCTION public.forge(a text, b text) RETURNS text LANGUAGE sql IMMUTABLE
  AS $$ SELECT '900000000000000000 0/1'::pg_catalog.text $$;
CREATE OPERATOR public.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = public.forge);
`

// forgedToken is what public.forge makes a fence-row check say.
const forgedToken = 900000000000000000

func testBypassReadsCode(t *testing.T, tracked bool) {
	ctx := ctxT(t)
	var forgedChecks int64
	sc := newReadsScene(t, tracked, readsCodeSchema, nil, func(sc *readsScene) {
		// The replica is current: a reader whose generation the proxy
		// has not seen is checked on the replica's fence row, in its
		// own session, where its search_path puts public.|| before
		// pg_catalog's (H7). With fence.replica_reached, then with the
		// fence row read directly.
		e := sc.e
		cat := catalogOf(t, e.gate, e.db)
		stats := e.proxy.srv.RouteStats()
		attack := func(job string) {
			checks := stats.FenceChecks.Load()
			r := e.reader(t, nil, opts(job, forgedToken-1, "-c search_path=public,pg_catalog", "-c fence.read_policy=pending")...)
			r.Exec(ctx, "SELECT payload FROM results").ReadAll() // its own answer is its own business
			if stats.FenceChecks.Load() == checks {
				t.Fatalf("%s: no fence-row check ran: the attack tried nothing", job)
			}
			forgedChecks++
			if tk, _ := cat.tk.lookup(job); tk.token >= forgedToken {
				t.Errorf("%s: the takeover tracker took the client's forged check: token %d at %s", job, tk.token, tk.lsn)
			}
		}
		attack("job")
		seen := cat.ddlSeen.Load()
		execOK(t, sc.direct, `ALTER FUNCTION fence.replica_reached(text, bigint, bigint) RENAME TO replica_reached_off;
			SELECT pg_notify('pgfence_protected', 'replica_reached')`)
		// (And the read set read again after the DDL: while it is, every
		// read that names a relation may run code that changes the
		// session, and goes to the primary: round 12.)
		if err := pgtest.Poll(ctx, func() (bool, error) {
			return !cat.reached.Load() && cat.loads.Load() > 0 && (!tracked || cat.ddlSeen.Load() > seen && cat.reads.Load() != nil), nil
		}); err != nil {
			t.Fatal(err)
		}
		attack("other")
		execOK(t, sc.direct, `ALTER FUNCTION fence.replica_reached_off(text, bigint, bigint) RENAME TO replica_reached;
			SELECT pg_notify('pgfence_protected', 'replica_reached')`)
		if err := pgtest.Poll(ctx, func() (bool, error) { return cat.reached.Load(), nil }); err != nil {
			t.Fatal(err)
		}
		if err := cluster.WaitReplicaCaughtUp(ctx); err != nil {
			t.Fatal(err)
		}
	})
	if forgedChecks != 2 {
		t.Fatalf("%d forged checks, want 2", forgedChecks)
	}
	pending := fence.CodePending
	gen, nometa := func(policy string) func(t *testing.T) *pgconn.PgConn { return sc.gen(policy) }, sc.nometa
	jk := func(k string) string { return "ROW('" + k + "')::jobref" }
	one := "(VALUES (" + jk("job") + ")) v(j)"
	two := "(VALUES (" + jk("job") + "), (" + jk("x") + ")) v(j)"
	cases := []readsCase{
		// The forged checks taught nobody: readers of job and other
		// wait for what the watcher saw (H7).
		{name: "after_forged_check_reached", reader: gen("pending"), sql: "SELECT payload FROM results WHERE job_key = 'job'", code: pending},
		{name: "after_forged_check_no_metadata", reader: nometa("pending"), sql: "SELECT payload FROM results WHERE job_key = 'job'", code: pending},
		{name: "after_forged_check_fence_row", reader: sc.genOf("other", sc.other.Token, "pending"), sql: "SELECT payload FROM results", code: pending},

		// Operators (H5).
		{name: "operator", reader: gen("pending"), sql: "SELECT 'job' @@@ ''", code: pending},
		{name: "operator_primary", reader: nometa("primary"), sql: "SELECT 'job' @@@ '', pg_is_in_recovery()"},
		{name: "operator_prefix", reader: gen("pending"), sql: "SELECT ### 'job'", code: pending},
		{name: "operator_qualified", reader: nometa("pending"), sql: "SELECT 'job' OPERATOR(public.@@@) ''", code: pending},
		{name: "operator_over_values", reader: gen("pending"), sql: "SELECT v @@@ '' FROM (VALUES ('job')) t(v)", code: pending},
		{name: "operator_with_collation", reader: gen("pending"), sql: "SELECT ('job' COLLATE \"C\") @@@ ''", code: pending},
		{name: "operator_running_sql", reader: gen("pending"), sql: "SELECT ('x'::tsquery @@? 'SELECT ''x''::tsquery, payload::tsquery FROM results')::text", code: pending},
		{name: "operator_on_safe_table", reader: gen("pending"), sql: "SELECT note @@@ '' FROM audit", code: pending},
		{name: "operator_in_copy", reader: gen("pending"), sql: "COPY (SELECT 'job' @@@ '') TO STDOUT", code: pending, copy: true},
		{name: "operator_in_second_statement", reader: gen("pending"), sql: "SELECT 1; SELECT 'job' @@@ ''", code: pending},
		{name: "operator_in_cte", reader: nometa("pending"), sql: "WITH w AS (SELECT 'job' @@@ '' AS p) SELECT p FROM w", code: pending},
		{name: "operator_in_values", reader: gen("pending"), sql: "VALUES ('job' @@@ '')", code: pending},
		{name: "operator_in_subquery", reader: gen("pending"), sql: "SELECT * FROM (SELECT 'job' @@@ '') s", code: pending},
		{name: "explain_operator", reader: gen("pending"), sql: "EXPLAIN VERBOSE SELECT 'job' @@@ ''", code: pending},
		{name: "explain_operator_primary", reader: nometa("primary"), sql: "EXPLAIN VERBOSE SELECT 'job' @@@ ''", want: "'B'::text"},

		// Casts, domains, types whose input runs a domain's check.
		{name: "cast_to_domain", reader: gen("pending"), sql: "SELECT 'job'::dpeek", code: pending},
		{name: "cast_to_domain_primary", reader: nometa("primary"), sql: "SELECT 'job'::dpeek", code: "P0001"},
		{name: "cast_to_domain_qualified", reader: gen("pending"), sql: "SELECT CAST('job' AS public.dpeek)", code: pending},
		{name: "user_cast", reader: gen("pending"), sql: "SELECT " + jk("job") + "::text", code: pending},
		{name: "user_cast_primary", reader: nometa("primary"), sql: "SELECT " + jk("job") + "::text, pg_is_in_recovery()"},
		{name: "composite_of_domain", reader: gen("pending"), sql: "SELECT '(job)'::jd", code: pending},
		{name: "range_of_domain", reader: gen("pending"), sql: "SELECT '[job,job]'::drange", code: pending},
		{name: "multirange_of_domain", reader: nometa("pending"), sql: "SELECT '{[job,job]}'::dmultirange", code: pending},
		{name: "range_constructor", reader: gen("pending"), sql: "SELECT drange('job', 'job')", code: "P0001"},
		{name: "domain_on_safe_table", reader: gen("pending"), sql: "SELECT count(*) FROM audit WHERE (CASE WHEN note = 'n' THEN 'job' END)::dpeek IS NOT NULL", code: pending},

		// A user type's comparisons, wherever PostgreSQL makes them.
		// (ROW(...)::jobref = ROW(...)::jobref compares two row
		// constructors field by field, with text's =: j is a value.)
		{name: "equality", reader: gen("pending"), sql: "SELECT j = " + jk("x") + " FROM " + one, code: pending},
		{name: "in_list", reader: gen("pending"), sql: "SELECT j IN (" + jk("x") + ", " + jk("y") + ") FROM " + one, code: pending},
		{name: "in_list_primary", reader: nometa("primary"), sql: "SELECT j IN (" + jk("x") + ") FROM " + one, code: "P0001"},
		{name: "any_array", reader: nometa("pending"), sql: "SELECT " + jk("job") + " = ANY (ARRAY[" + jk("x") + "])", code: pending},
		{name: "row_comparison", reader: gen("pending"), sql: "SELECT ROW(" + jk("job") + ", 1) < ROW(" + jk("x") + ", 2)", code: pending},
		{name: "order_by_operator_class", reader: gen("pending"), sql: "SELECT j FROM " + two + " ORDER BY j", code: pending},
		{name: "order_by_using", reader: gen("pending"), sql: "SELECT j FROM " + two + " ORDER BY j USING <", code: pending},
		{name: "distinct", reader: gen("pending"), sql: "SELECT DISTINCT j FROM " + two, code: pending},
		{name: "count_distinct", reader: gen("pending"), sql: "SELECT count(DISTINCT j) FROM " + two, code: pending},
		{name: "greatest", reader: gen("pending"), sql: "SELECT greatest(" + jk("job") + ", " + jk("x") + ")", code: pending},
		{name: "case_operand", reader: gen("pending"), sql: "SELECT CASE " + jk("job") + " WHEN " + jk("x") + " THEN 1 END", code: pending},
		{name: "nullif", reader: gen("pending"), sql: "SELECT nullif(" + jk("job") + ", " + jk("x") + ")", code: pending},
		{name: "window_order", reader: gen("pending"), sql: "SELECT rank() OVER (ORDER BY j) FROM " + two, code: pending},
		{name: "join_using", reader: gen("pending"), sql: "SELECT * FROM (VALUES (" + jk("job") + ")) a(j) JOIN (VALUES (" + jk("job") + ")) b(j) USING (j)", code: pending},
		{name: "order_by_on_safe_table", reader: gen("pending"), sql: "SELECT j FROM jtab ORDER BY j", code: pending},
		{name: "order_by_on_safe_table_primary", reader: nometa("primary"), sql: "SELECT j FROM jtab ORDER BY j", code: "P0001"},

		// Defaults run only in writes, which never leave the primary.
		{name: "default_in_insert", reader: nometa("pending"), sql: "INSERT INTO dflt DEFAULT VALUES RETURNING note"},
		{name: "default_in_values", reader: nometa("primary"), sql: "VALUES (DEFAULT)", code: "42601"},
	}
	if tracked {
		// With a read set, a read whose expressions may run the
		// database's code (an operator, a cast, a domain, a comparison
		// of a user's type: readSet.runsCode, setsRelCode) may change the
		// session's state: it runs on the primary since round 12
		// (attacker X's M1), where it answers B's result (before: FN007
		// from the lagging replica). A read that runs none (a plain read
		// of results) still goes to the replica and is refused.
		for i, c := range cases {
			if c.code == pending && c.name != "after_forged_check_fence_row" {
				cases[i].code, cases[i].primary = "", true
			}
		}
	}
	sc.run(t, cases)
	sc.unchanged(t)
}
