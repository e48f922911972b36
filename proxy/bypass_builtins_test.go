package proxy

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// Built-in functions are not trusted by their name alone (issue 30,
// MEDIUM): a user's public.version(text) overload, or a public.lower(text)
// that a startup search_path puts before pg_catalog, is the function
// PostgreSQL calls, and taking it for the built-in routed a read of a
// protected table to a lagging replica (and let it run unseen, the view
// route of HIGH 3). The proxy asks each database which of the names it
// trusts exist outside pg_catalog, and whether operators, casts and domain
// checks of its own run client code; a call of such a name runs on the
// primary like any user function, and a read there that calls an operator
// is a protected read.
//
// builtins runs against a database without the DDL event trigger, and
// builtins_tracked against one with it, as reads does.
func init() {
	registerBypass("builtins", func(t *testing.T) { testBypassBuiltins(t, false) })
	registerBypass("builtins_tracked", func(t *testing.T) { testBypassBuiltins(t, true) })
	registerBypass("builtins_gate", bypassBuiltinsGate)
}

// builtinsSchema: functions named like built-ins that read the protected
// results table (reading its payload where the built-in would return
// something harmless).
const builtinsSchema = fenceSchema + `
CREATE FUNCTION public.version(k text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.lower(k text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.to_char(k text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.string_agg(k text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.peek(n int, k text) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k';
CREATE FUNCTION public.folded(k text) RETURNS text LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN RETURN (SELECT payload FROM public.results WHERE job_key = k); END $$;
`

func testBypassBuiltins(t *testing.T, tracked bool) {
	ctx := ctxT(t)
	e := newRouteEnvMode(t, tracked, builtinsSchema)
	direct := e.direct(t)
	cat := catalogOf(t, e.gate, e.db)

	// A's generation is on the replica; replay stops; B takes over and
	// writes (as TestBypass/reads sets it up).
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
	gen := func(policy string, extra ...string) func(t *testing.T) *pgconn.PgConn {
		return func(t *testing.T) *pgconn.PgConn {
			return e.reader(t, nil, opts("job", b.Token, append([]string{"-c fence.read_policy=" + policy}, extra...)...)...)
		}
	}
	nometa := func(policy string, extra ...string) func(t *testing.T) *pgconn.PgConn {
		return func(t *testing.T) *pgconn.PgConn {
			return e.reader(t, nil, append([]string{"-c fence.read_policy=" + policy, "-c fence.read_wait=50ms"}, extra...)...)
		}
	}
	// The control: a read of no relation that calls true built-ins is
	// still served by the (lagging) replica.
	t.Run("true_builtins_on_replica", func(t *testing.T) {
		mustWhere(t, nometa("pending")(t), "SELECT upper('x'), now() IS NOT NULL, pg_is_in_recovery()", true)
	})
	path := "-c search_path=public,pg_catalog"
	cases := []readsCase{
		{name: "overload_no_metadata", reader: nometa("pending"), sql: "SELECT version('job'), pg_is_in_recovery()"},
		{name: "overload_generation", reader: gen("pending"), sql: "SELECT version('job'), pg_is_in_recovery()"},
		{name: "overload_in_subquery", reader: nometa("pending"), sql: "SELECT (SELECT version('job')), pg_is_in_recovery()"},
		{name: "overload_in_values", reader: nometa("pending"), sql: "VALUES (version('job'))"},
		{name: "overload_in_copy", reader: nometa("pending"), sql: "COPY (SELECT version('job')) TO STDOUT", copy: true},
		{name: "overload_beside_true_builtin", reader: nometa("pending"), sql: "SELECT version('job'), now() IS NOT NULL, pg_is_in_recovery()"},
		{name: "startup_search_path", reader: nometa("pending", path), sql: "SELECT lower('job'), pg_is_in_recovery()"},
		{name: "startup_search_path_generation", reader: gen("primary", path), sql: "SELECT lower('job'), pg_is_in_recovery()"},
		{name: "one_argument_to_char", reader: nometa("pending"), sql: "SELECT to_char('job'), pg_is_in_recovery()"},
		{name: "aggregate_name", reader: nometa("pending"), sql: "SELECT string_agg('job'), pg_is_in_recovery()"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { builtinsCheck(t, c.reader(t), c) })
	}

	// A plain EXPLAIN runs no statement, but the planner folds a call of
	// an IMMUTABLE function into a constant, which EXPLAIN VERBOSE shows:
	// the function runs where the EXPLAIN does.
	t.Run("explain_folds_function", func(t *testing.T) {
		res, err := nometa("primary")(t).Exec(ctx, "EXPLAIN (VERBOSE, COSTS OFF) SELECT folded('job')").ReadAll()
		if err != nil {
			t.Fatal(err)
		}
		var plan []string
		for _, r := range res {
			for _, row := range r.Rows {
				plan = append(plan, string(row[0]))
			}
		}
		if p := strings.Join(plan, "\n"); !strings.Contains(p, "'B'") {
			t.Fatalf("EXPLAIN showed %q, want B's result folded in (from the primary)", p)
		}
	})

	// Defined after the proxy read the catalog: once it has read it again
	// (at once in a tracked database, at its next refresh in another),
	// the new overload is not trusted either.
	t.Run("overload_created_after_load", func(t *testing.T) {
		loads := cat.loads.Load()
		execOK(t, direct, "CREATE FUNCTION public.md5(k text, n int) RETURNS text LANGUAGE sql STABLE AS 'SELECT payload FROM public.results WHERE job_key = k'")
		waitLoad(t, cat, loads)
		builtinsCheck(t, nometa("pending")(t), readsCase{sql: "SELECT md5('job', 1), pg_is_in_recovery()"})
	})

	// An operator of the database's own: it runs inside any expression, so
	// a read calling it is a protected read even though it names no
	// relation (FN007 while the replica lags, or the primary). Its code
	// may change the session's state too, so since round 12 (attacker
	// X's M1) such a read runs on the primary where the proxy keeps a
	// read set: B's result (before: FN007, as still in an untracked one).
	t.Run("user_operator", func(t *testing.T) {
		loads := cat.loads.Load()
		execOK(t, direct, "CREATE OPERATOR public.#@# (LEFTARG = int, RIGHTARG = text, FUNCTION = public.peek)")
		waitLoad(t, cat, loads)
		code := fence.CodePending // untracked: only what a statement calls itself counts
		if tracked {
			code = ""
		}
		builtinsCheck(t, nometa("pending")(t), readsCase{sql: "SELECT 1 #@# 'job', pg_is_in_recovery()", code: code})
		builtinsCheck(t, gen("pending")(t), readsCase{sql: "SELECT 1 #@# 'job', pg_is_in_recovery()", code: code})
		// A read without an operator or a cast is not held back by it.
		mustWhere(t, nometa("pending")(t), "SELECT upper('x'), pg_is_in_recovery()", true)
		builtinsCheck(t, nometa("primary")(t), readsCase{sql: "SELECT 1 #@# 'job', pg_is_in_recovery()"})
		builtinsCheck(t, gen("primary", path)(t), readsCase{sql: "SELECT 1 OPERATOR(public.#@#) 'job', pg_is_in_recovery()"})
	})
}

// builtinsCheck is readsCheck (B's payload or c.code, never A's).
func builtinsCheck(t *testing.T, r *pgconn.PgConn, c readsCase) {
	t.Helper()
	readsCheck(t, r, c)
}

// waitLoad waits until the catalog has been read again since loads.
func waitLoad(t *testing.T, cat *catalog, loads int64) {
	t.Helper()
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return cat.loads.Load() > loads && cat.code.Load() != nil, nil }); err != nil {
		t.Fatalf("the catalog was not read again: %v", err)
	}
}

// bypassBuiltinsGate: on the gate's side, a function named like a
// built-in that writes a protected table runs code the gate cannot see
// into, so its transaction ends with commit_if_written (a receipt with the
// proxy's digest) like any function call's; and a set_config that is not
// PostgreSQL's does not tell the gate what the settings are.
func bypassBuiltinsGate(t *testing.T) {
	const schema = `
CREATE FUNCTION public.lower(n int) RETURNS int LANGUAGE plpgsql AS $$
BEGIN UPDATE results SET payload = 'by lower' WHERE job_key = 'r'; RETURN n; END $$;
CREATE FUNCTION public.set_config(name text, value text, is_local boolean) RETURNS text LANGUAGE sql AS 'SELECT value';
`
	for _, m := range []struct {
		name string
		mode pgx.QueryExecMode
	}{{"simple", pgx.QueryExecModeSimpleProtocol}, {"extended", pgx.QueryExecModeDescribeExec}} {
		t.Run("overload_writes_"+m.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			execOK(t, e.direct(t), schema)
			c := e.mustConnect(t, client{lease: &e.lease, mode: m.mode})
			execOK(t, c, fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'seed', %d)", e.lease.Token))
			execOK(t, c, "SET fence.step = 'lower'")
			var n int
			if err := c.QueryRow(ctxT(t), "SELECT lower(1)").Scan(&n); err != nil || n != 1 {
				t.Fatalf("SELECT lower(1): %d, %v", n, err)
			}
			e.wantResult(t, "r", "by lower", e.lease.Token)
			e.wantReceipt(t, "lower") // the proxy's digest (v1), not the backstop's
		})
		t.Run("set_config_not_postgres_"+m.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			execOK(t, e.direct(t), schema)
			c := e.mustConnect(t, client{lease: &e.lease, mode: m.mode, extra: []string{"-c search_path=public,pg_catalog", "-c fence.step=real"}})
			// public.set_config changes nothing: the step stays "real".
			execOK(t, c, "SELECT set_config('fence.step', 'forged', false)")
			if _, err := c.Exec(ctxT(t), upsert, "r", "stepped", e.lease.Token); err != nil {
				t.Fatal(err)
			}
			e.wantResult(t, "r", "stepped", e.lease.Token)
			e.wantReceipt(t, "real")
			e.wantCount(t, 0, "SELECT count(*) FROM fence.receipts WHERE step = 'forged'")
		})
	}
}
