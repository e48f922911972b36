package proxy

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The classifier reads text with PostgreSQL 17's grammar (pg_query_go
// v6); the server may be older (the tests run PostgreSQL 15). Where the
// two grammars read the same text differently, the server's reading is
// the one that runs (issue 30, attacker C's H2). PostgreSQL 16 and 17
// made SQL/JSON syntax of names that were plain function calls before:
// json_scalar('k') is a JsonScalarExpr to the classifier (no call, no
// relation) and a call of public.json_scalar(text) to a 15 server, which
// read a protected table on a lagging replica. And 16 made json a
// keyword that the grammar names pg_catalog.json itself, where 15 looks
// the type up on the search path (a domain whose check runs SQL).
//
// The class's rule: a construct whose reading depends on the grammar's
// version is read as the server's version reads it; for every construct
// 16 and 17 added, that is a call of a function the database may define
// (opaque: the primary; in a fenced session commit_if_written) or a type
// looked up on the search path (an expression resolved through the
// catalog).
//
// grammar runs in a database without the DDL event trigger, grammar_tracked
// in one with it, as builtins does; grammar_gate is the write gate's side.
func init() {
	registerBypass("grammar", func(t *testing.T) { testBypassGrammar(t, false) })
	registerBypass("grammar_tracked", func(t *testing.T) { testBypassGrammar(t, true) })
	registerBypass("grammar_gate", bypassGrammarGate)
}

// grammarSchema: functions named like what 16 and 17 turned into syntax,
// each reading the protected results table; and attacker C's H1, a
// length(name) that PostgreSQL prefers to pg_catalog.length(text) for a
// name argument whatever the search path.
const grammarSchema = fenceSchema + `
CREATE FUNCTION public.length(name) RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM public.results WHERE job_key = 'job'$$;
CREATE FUNCTION public.json_scalar(k text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.json_serialize(k text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.json(k text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.json_array(k text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.json_arrayagg(k text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.json_object() RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM public.results WHERE job_key = 'job'$$;
CREATE FUNCTION public.json_object(k text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.json_query(k text, p text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.json_value(k text, p text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.json_exists(k text, p text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.merge_action() RETURNS text LANGUAGE sql STABLE AS $$SELECT payload FROM public.results WHERE job_key = 'job'$$;
`

func testBypassGrammar(t *testing.T, tracked bool) {
	ctx := ctxT(t)
	e := newRouteEnvMode(t, tracked, grammarSchema)
	direct := e.direct(t)
	cat := catalogOf(t, e.gate, e.db)

	a := e.acquire(t, "job", "a", time.Minute)
	if _, err := e.worker(t, &a).Exec(ctx, upsert, "job", "A", a.Token); err != nil {
		t.Fatalf("A's commit: %v", err)
	}
	if err := cluster.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	pauseReplay(t)
	b := readsAsyncTakeover(t, direct, a)
	e.waitTakeover(t, e.gate, "job", b.Token)
	if _, err := e.worker(t, &b).Exec(ctx, upsert, "job", "B", b.Token); err != nil {
		t.Fatalf("B's commit: %v", err)
	}
	reader := func(policy string, meta bool, extra ...string) func(t *testing.T) *pgconn.PgConn {
		return func(t *testing.T) *pgconn.PgConn {
			o := append([]string{"-c fence.read_policy=" + policy, "-c fence.read_wait=50ms"}, extra...)
			if meta {
				o = opts("job", b.Token, o...)
			}
			return e.reader(t, nil, o...)
		}
	}
	// The control: a read of no relation calling true built-ins is still
	// served by the lagging replica.
	t.Run("true_builtins_on_replica", func(t *testing.T) {
		// The built-in names the database shadows are kept across a DDL
		// notification (fence_catalog.go), so a temporary table's DDL no
		// longer sends this read to the primary.
		waitLoad(t, cat, -1)
		mustWhere(t, reader("pending", false)(t), "SELECT upper('x'), pg_is_in_recovery()", true)
	})
	cases := []readsCase{
		// Attacker C's H1: closed by the shadowed-built-in check (length
		// is trusted by name only where no length exists outside
		// pg_catalog).
		{name: "length_name_overload", sql: "SELECT length(current_user), pg_is_in_recovery()"},
		{name: "json_scalar", sql: "SELECT json_scalar('job'), pg_is_in_recovery()"},
		{name: "json_scalar_in_subquery", sql: "SELECT (SELECT json_scalar('job')), pg_is_in_recovery()"},
		{name: "json_scalar_in_values", sql: "VALUES (json_scalar('job'))"},
		{name: "json_scalar_in_copy", sql: "COPY (SELECT json_scalar('job')) TO STDOUT", copy: true},
		{name: "json_serialize", sql: "SELECT json_serialize('job'), pg_is_in_recovery()"},
		// json('job') with an unknown literal is a cast to json to 15; with
		// a text, a call of public.json(text).
		{name: "json_parse", sql: "SELECT json('job'::text), pg_is_in_recovery()"},
		{name: "json_array", sql: "SELECT json_array('job'), pg_is_in_recovery()"},
		{name: "json_arrayagg", sql: "SELECT json_arrayagg('job'), pg_is_in_recovery()"},
		{name: "json_object_empty", sql: "SELECT json_object(), pg_is_in_recovery()"},
		// 17 reads this one as pg_catalog.json_object(...) itself, 15 on
		// the search path: a call the classifier never trusted.
		{name: "json_object_legacy_call", sql: "SELECT json_object('job'), pg_is_in_recovery()"},
		{name: "json_query", sql: "SELECT json_query('job', 'p'), pg_is_in_recovery()"},
		{name: "json_value", sql: "SELECT json_value('job', 'p'), pg_is_in_recovery()"},
		{name: "json_exists", sql: "SELECT json_exists('job', 'p'), pg_is_in_recovery()"},
		{name: "merge_action", sql: "SELECT merge_action(), pg_is_in_recovery()"},
		{name: "upper_case_keyword", sql: "SELECT JSON_SCALAR('job'), pg_is_in_recovery()"},
		{name: "beside_true_builtin", sql: "SELECT json_scalar('job'), now() IS NOT NULL, pg_is_in_recovery()"},
	}
	for _, c := range cases {
		for _, r := range []struct {
			name string
			conn func(t *testing.T) *pgconn.PgConn
		}{{"no_metadata", reader("pending", false)}, {"generation", reader("pending", true)}} {
			c := c
			t.Run(c.name+"/"+r.name, func(t *testing.T) { readsCheck(t, r.conn(t), c) })
		}
	}

	// 16 made json a keyword the grammar names pg_catalog.json; 15 looks
	// json up on the search path, here a domain whose check reads the
	// protected table (and raises with what it read). Created last: a
	// domain check of the database's own makes every read that resolves
	// something through the catalog protected, which would hide the cases
	// above.
	t.Run("json_type_on_search_path", func(t *testing.T) {
		// The replica must have the domain: it is replayed with B's
		// result, then replay is paused again and C takes over and
		// writes C. The check raises what it read, B's result as "A"
		// (the previous generation now) and C's as "B" (the current).
		loads := cat.loads.Load()
		execOK(t, direct, `CREATE FUNCTION public.leak(v text) RETURNS boolean LANGUAGE plpgsql STABLE AS $$
BEGIN RAISE EXCEPTION 'payload=%', CASE (SELECT payload FROM public.results WHERE job_key = 'job') WHEN 'C' THEN 'B' ELSE 'A' END; END $$;
CREATE DOMAIN public.json AS text CHECK (public.leak(VALUE));`)
		waitLoad(t, cat, loads)
		resumeAndCatchUp(t)
		pauseReplay(t)
		c := readsAsyncTakeover(t, direct, b)
		e.waitTakeover(t, e.gate, "job", c.Token)
		if _, err := e.worker(t, &c).Exec(ctx, upsert, "job", "C", c.Token); err != nil {
			t.Fatalf("C's commit: %v", err)
		}
		path := "-c search_path=public,pg_catalog"
		for _, sql := range []string{"SELECT 'x'::json", "SELECT CAST('x' AS json)", "SELECT 'x'::json, pg_is_in_recovery()"} {
			readsCheck(t, e.reader(t, nil, "-c fence.read_policy=primary", path), readsCase{sql: sql, code: "P0001"})
			readsCheck(t, e.reader(t, nil, opts("job", c.Token, "-c fence.read_policy=primary", path)...), readsCase{sql: sql, code: "P0001"})
		}
	})
}

// bypassGrammarGate: on the gate's side, a function that 17 reads as
// SQL/JSON syntax and 15 calls runs code the gate cannot see into, so
// its transaction ends with commit_if_written (the proxy's digest in the
// receipt) like any function call's.
func bypassGrammarGate(t *testing.T) {
	const schema = `
CREATE FUNCTION public.json_scalar(n int) RETURNS int LANGUAGE plpgsql AS $$
BEGIN UPDATE results SET payload = 'by json_scalar' WHERE job_key = 'r'; RETURN n; END $$;
CREATE FUNCTION public.merge_action() RETURNS int LANGUAGE plpgsql AS $$
BEGIN UPDATE results SET payload = 'by merge_action' WHERE job_key = 'r'; RETURN 1; END $$;
`
	for _, m := range []struct {
		name string
		mode pgx.QueryExecMode
	}{{"simple", pgx.QueryExecModeSimpleProtocol}, {"extended", pgx.QueryExecModeDescribeExec}} {
		for _, f := range []struct{ name, sql string }{{"json_scalar", "SELECT json_scalar(1)"}, {"merge_action", "SELECT merge_action()"}} {
			t.Run(f.name+"_writes_"+m.name, func(t *testing.T) {
				t.Parallel()
				e := newReservedEnv(t)
				execOK(t, e.direct(t), schema)
				c := e.mustConnect(t, client{lease: &e.lease, mode: m.mode})
				execOK(t, c, fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'seed', %d)", e.lease.Token))
				execOK(t, c, "SET fence.step = 'grammar'")
				var n int
				if err := c.QueryRow(ctxT(t), f.sql).Scan(&n); err != nil || n != 1 {
					t.Fatalf("%s: %d, %v", f.sql, n, err)
				}
				e.wantResult(t, "r", "by "+f.name, e.lease.Token)
				e.wantReceipt(t, "grammar") // the proxy's digest (v1), not the backstop's
			})
		}
	}
}
