package proxy

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestBypass/replica_guc (issue 30, round 10, attacker T's M1 and M2): a
// custom (placeholder) setting such as app.tenant, set by code the proxy
// cannot see into, is not in pg_settings, so the proxy's reads of the
// session's state missed it. M1: code on the primary session (a SECURITY
// DEFINER set_tenant(), a DO block) set it; the session was not pinned,
// and the next read routed to the replica ran without it (row security
// reading current_setting('app.tenant') answered for another tenant).
// M2: code on the replica session (a DO block or a function in a
// read-only transaction there, a view's or a policy's function in an
// autocommit read) set it; replicaStateCheck did not see it, and later
// replica reads ran with it. Every read after the code answers as the
// primary session would. Round 12, attacker X's M1: an autocommit read
// whose code may set it goes to the primary (testBypassReplicaGUCKept);
// code in a read-only transaction on the replica still loses it.
//
// Only through the proxy: the two sessions are the proxy's.
func init() { registerBypass("replica_guc", testBypassReplicaGUC) }

const replicaGUCSchema = fenceSchema + `
CREATE FUNCTION public.gc_set_tenant(t text) RETURNS text LANGUAGE plpgsql SECURITY DEFINER
  AS $$ BEGIN PERFORM set_config('app.tenant', t, false); RETURN t; END $$;
CREATE VIEW public.gc_v AS SELECT public.gc_set_tenant('B') AS x;
CREATE FUNCTION public.gc_sp() RETURNS boolean LANGUAGE plpgsql
  AS $$ BEGIN PERFORM set_config('app.tenant', 'B', false); RETURN true; END $$;
CREATE TABLE public.gc_t2 (x int);
INSERT INTO public.gc_t2 VALUES (1);
ALTER TABLE public.gc_t2 ENABLE ROW LEVEL SECURITY;
ALTER TABLE public.gc_t2 FORCE ROW LEVEL SECURITY;
CREATE POLICY gc_p2 ON public.gc_t2 FOR SELECT USING (public.gc_sp());
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'gc_viewer') THEN CREATE ROLE gc_viewer LOGIN; END IF;
END $$;
GRANT SELECT ON public.gc_t2, public.gc_v TO gc_viewer;
CREATE TABLE public.gc_t3 (r text);
INSERT INTO public.gc_t3 VALUES ('A'), ('B');
CREATE VIEW public.gc_v3 AS SELECT r FROM public.gc_t3
  WHERE current_setting('app.region', true) IS NULL OR r = current_setting('app.region', true);
GRANT EXECUTE ON FUNCTION public.gc_set_tenant(text), public.gc_sp() TO gc_viewer;
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'gc_def') THEN CREATE ROLE gc_def LOGIN; END IF;
END $$;
CREATE FUNCTION public.gc_dept() RETURNS text LANGUAGE plpgsql
  AS $$ BEGIN RETURN current_setting('app.dept', true) || current_setting('plpgsql.variable_conflict'); END $$;
GRANT EXECUTE ON FUNCTION public.gc_dept() TO gc_def;
CREATE VIEW public.gc_vdept AS SELECT current_setting('app.dept', true) AS d;
GRANT SELECT ON public.gc_vdept TO gc_def;
CREATE TABLE public.gc_tn3 (tenant text, note text);
INSERT INTO public.gc_tn3 VALUES ('A', 'a-row'), ('B', 'b-row');
ALTER TABLE public.gc_tn3 ENABLE ROW LEVEL SECURITY;
ALTER TABLE public.gc_tn3 FORCE ROW LEVEL SECURITY;
CREATE FUNCTION public.gc_cur_t3() RETURNS text LANGUAGE sql STABLE BEGIN ATOMIC SELECT current_setting('app.t3', true); END;
CREATE FUNCTION public.gc_set_t3(t text) RETURNS text LANGUAGE sql SECURITY DEFINER BEGIN ATOMIC SELECT set_config('app.t3', t, false); END;
CREATE POLICY gc_p3 ON public.gc_tn3 FOR SELECT USING (tenant = coalesce(public.gc_cur_t3(), 'A'));
CREATE TABLE public.gc_tna (tenant text, note text);
INSERT INTO public.gc_tna VALUES ('A', 'a-row'), ('B', 'b-row');
ALTER TABLE public.gc_tna ENABLE ROW LEVEL SECURITY;
ALTER TABLE public.gc_tna FORCE ROW LEVEL SECURITY;
CREATE FUNCTION public.gc_cur_a() RETURNS text LANGUAGE sql STABLE AS $f$ SELECT current_setting($q$app.ta$q$, true) $f$;
CREATE FUNCTION public.gc_set_a(t text) RETURNS text LANGUAGE plpgsql SECURITY DEFINER
  AS $f$ BEGIN PERFORM set_config($k$app.ta$k$, t, false); RETURN t; END $f$;
CREATE POLICY gc_pa ON public.gc_tna FOR SELECT USING (tenant = coalesce(public.gc_cur_a(), 'A'));
CREATE TABLE public.gc_tnb (tenant text, note text);
INSERT INTO public.gc_tnb VALUES ('A', 'a-row'), ('B', 'b-row');
CREATE VIEW public.gc_vtnb AS SELECT tenant FROM public.gc_tnb WHERE tenant = coalesce(current_setting('app.tb'::name, true), 'A');
CREATE FUNCTION public.gc_set_b(t text) RETURNS text LANGUAGE plpgsql SECURITY DEFINER
  AS $f$ BEGIN PERFORM set_config($k$app.tb$k$, t, false); RETURN t; END $f$;
CREATE FUNCTION public.gc_sp5() RETURNS boolean LANGUAGE plpgsql
  AS $f$ BEGIN PERFORM set_config($k$app.t5$k$, 'B', false); RETURN true; END $f$;
CREATE TABLE public.gc_t5 (x int);
INSERT INTO public.gc_t5 VALUES (1);
ALTER TABLE public.gc_t5 ENABLE ROW LEVEL SECURITY;
ALTER TABLE public.gc_t5 FORCE ROW LEVEL SECURITY;
CREATE POLICY gc_p5 ON public.gc_t5 FOR SELECT USING (public.gc_sp5());
CREATE TABLE public.gc_tn5 (tenant text, note text);
INSERT INTO public.gc_tn5 VALUES ('A', 'a-row'), ('B', 'b-row');
ALTER TABLE public.gc_tn5 ENABLE ROW LEVEL SECURITY;
ALTER TABLE public.gc_tn5 FORCE ROW LEVEL SECURITY;
CREATE FUNCTION public.gc_cur_t5() RETURNS text LANGUAGE sql STABLE AS $f$ SELECT current_setting($q$app.t5$q$, true) $f$;
CREATE POLICY gc_p5n ON public.gc_tn5 FOR SELECT USING (tenant = coalesce(public.gc_cur_t5(), 'A'));
GRANT SELECT ON public.gc_tn3, public.gc_tna, public.gc_vtnb, public.gc_t5, public.gc_tn5 TO gc_viewer;
GRANT EXECUTE ON FUNCTION public.gc_set_t3(text), public.gc_set_a(text), public.gc_set_b(text) TO gc_viewer;
CREATE TABLE public.gc_tn4 (tenant text, note text);
INSERT INTO public.gc_tn4 VALUES ('A', 'a-row'), ('B', 'b-row');
ALTER TABLE public.gc_tn4 ENABLE ROW LEVEL SECURITY;
ALTER TABLE public.gc_tn4 FORCE ROW LEVEL SECURITY;
CREATE FUNCTION public.gc_cur_t4() RETURNS text LANGUAGE plpgsql STABLE AS $f$ DECLARE v text; BEGIN
  EXECUTE 'select pg_catalog.' || 'current_' || 'setting($1, true)' INTO v USING 'app.' || 'tn'; RETURN v; END $f$;
CREATE POLICY gc_p4 ON public.gc_tn4 FOR SELECT USING (tenant = coalesce(public.gc_cur_t4(), 'A'));
CREATE FUNCTION public.gc_set_b4() RETURNS text LANGUAGE plpgsql
  AS $f$ BEGIN PERFORM set_config('app.tn', 'B', false); RETURN 'set'; END $f$;
CREATE VIEW public.gc_vset AS SELECT public.gc_set_b4() AS s;
CREATE VIEW public.gc_vsc AS SELECT pg_catalog.set_config('app.tn', 'B', false) AS s;
CREATE VIEW public.gc_vsc2 AS SELECT s FROM public.gc_vsc;
CREATE TABLE public.gc_tw (tenant text DEFAULT current_setting('app.tn', true), v text);
CREATE FUNCTION public.gc_sp6() RETURNS boolean LANGUAGE plpgsql
  AS $f$ BEGIN PERFORM set_config('app.tn', 'B', false); RETURN true; END $f$;
CREATE TABLE public.gc_t6 (x int);
INSERT INTO public.gc_t6 VALUES (1);
ALTER TABLE public.gc_t6 ENABLE ROW LEVEL SECURITY;
ALTER TABLE public.gc_t6 FORCE ROW LEVEL SECURITY;
CREATE POLICY gc_p6 ON public.gc_t6 FOR SELECT USING (public.gc_sp6());
CREATE TABLE public.gc_t7 (x int);
INSERT INTO public.gc_t7 VALUES (1);
ALTER TABLE public.gc_t7 ENABLE ROW LEVEL SECURITY;
ALTER TABLE public.gc_t7 FORCE ROW LEVEL SECURITY;
CREATE POLICY gc_p7 ON public.gc_t7 FOR SELECT USING (pg_catalog.set_config('app.tn', 'B', false) IS NOT NULL);
CREATE TABLE public.gc_plain (x int);
INSERT INTO public.gc_plain VALUES (1);
CREATE VIEW public.gc_vcur AS SELECT current_setting('app.tn', true) AS c;
GRANT SELECT ON public.gc_tn4, public.gc_vset, public.gc_vsc, public.gc_vsc2, public.gc_t6, public.gc_t7,
  public.gc_plain, public.gc_vcur TO gc_viewer;
GRANT SELECT, INSERT ON public.gc_tw TO gc_viewer;
CREATE SEQUENCE public.gc_seq;
CREATE VIEW public.gc_vnext AS SELECT nextval('public.gc_seq') AS n;
CREATE VIEW public.gc_vlock AS SELECT pg_catalog.pg_advisory_lock(4242)::text AS l;
GRANT USAGE ON SEQUENCE public.gc_seq TO gc_viewer;
GRANT SELECT ON public.gc_vnext, public.gc_vlock TO gc_viewer;
`

func testBypassReplicaGUC(t *testing.T) {
	ctx := ctxT(t)
	e := newRouteEnvMode(t, true, replicaGUCSchema)
	const check = "SELECT COALESCE(current_setting('app.tenant', true), '<unset>'), pg_is_in_recovery()"
	const regionRows = "SELECT (SELECT string_agg(r, ',' ORDER BY r) FROM gc_v3), pg_is_in_recovery()"
	cases := []struct {
		name    string
		replica bool   // get the session's reads onto the replica first
		tx      bool   // inside BEGIN READ ONLY on the replica, then COMMIT
		code    string // what runs the code
		want    string // app.tenant as the primary session has it
		check   string // the read, if not app.tenant's
		user    string // the login, if not postgres (row security applies)
		prep    string // run first, on the primary, in its own request
	}{
		// M1: the code runs on the primary session.
		{name: "primary_definer_function", code: "SELECT gc_set_tenant('B')", want: "B"},
		{name: "primary_do", code: "DO $$ BEGIN PERFORM set_config('app.tenant', 'B', false); END $$", want: "B"},
		{name: "primary_function_in_tx", code: "BEGIN; SELECT gc_set_tenant('B'); COMMIT", want: "B"},
		// M2: the code runs on the replica session.
		{name: "replica_do", replica: true, tx: true, code: "DO $$ BEGIN PERFORM set_config('app.tenant', 'B', false); END $$", want: "<unset>"},
		{name: "replica_function", replica: true, tx: true, code: "SELECT gc_set_tenant('B')", want: "<unset>"},
		// An autocommit read of a view or a policy whose code sets it,
		// with the session's reads on the replica: since round 12
		// (attacker X's M1) such a read goes to the primary, and the
		// setting is the session's, as straight to PostgreSQL (before:
		// it ran on the replica and was lost, want "<unset>").
		{name: "replica_view", replica: true, code: "SELECT x FROM gc_v", want: "B"},
		{name: "replica_policy", replica: true, code: "SELECT x FROM gc_t2", want: "B", user: "gc_viewer"},
		// The name built at run time where it is set, spelled only by the
		// view that reads it ("unset" means every row).
		{name: "primary_dynamic_name_view", code: "DO $$ BEGIN PERFORM set_config('app.' || 'region', 'B', false); END $$", check: regionRows, want: "B"},
		{name: "replica_dynamic_name_view", replica: true, tx: true, code: "DO $$ BEGIN PERFORM set_config('app.' || 'region', 'B', false); END $$", check: regionRows, want: "A,B"},
		// Round 11, attacker V's M1: names the database's code spells
		// where a reader of its text would not find them, read by the
		// database's code on the replica.
		{name: "sql_standard_body", code: "SELECT gc_set_t3('B')", check: "SELECT (SELECT string_agg(tenant, ',') FROM gc_tn3), pg_is_in_recovery()", want: "B", user: "gc_viewer"},
		{name: "dollar_quoted_names", code: "SELECT gc_set_a('B')", check: "SELECT (SELECT string_agg(tenant, ',') FROM gc_tna), pg_is_in_recovery()", want: "B", user: "gc_viewer"},
		{name: "view_name_constant", code: "SELECT gc_set_b('B')", check: "SELECT (SELECT string_agg(tenant, ',') FROM gc_vtnb), pg_is_in_recovery()", want: "B", user: "gc_viewer"},
		{name: "replica_policy_sets_dollar_quoted", replica: true, code: "SELECT x FROM gc_t5", check: "SELECT (SELECT string_agg(tenant, ',') FROM gc_tn5), pg_is_in_recovery()", want: "B", user: "gc_viewer"},
		// An EXECUTE is judged by the statement it runs, as the proxy
		// knows it (so an EXECUTE of a plain read keeps read-only
		// transactions on the replica); one the same request may
		// replace counts as code.
		{name: "primary_execute_prepared", prep: "PREPARE gc_ps AS SELECT gc_set_tenant('B')", code: "EXECUTE gc_ps", want: "B"},
		{name: "primary_execute_replaced_in_request", prep: "PREPARE gc_ps AS SELECT 1",
			code: "DEALLOCATE gc_ps; PREPARE gc_ps AS SELECT gc_set_tenant('B'); EXECUTE gc_ps", want: "B"},
		{name: "replica_execute_prepared", prep: "PREPARE gc_ps AS SELECT gc_set_tenant('B')", replica: true, tx: true, code: "EXECUTE gc_ps", want: "<unset>"},
	}
	testBypassReplicaGUCDefaults(t, e)
	testBypassReplicaGUCKept(t, e)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			check := check
			if c.check != "" {
				check = c.check
			}
			r := e.reader(t, nil)
			if c.user != "" {
				cfg, err := pgconn.ParseConfig(e.proxy.dsn(e.db))
				if err != nil {
					t.Fatal(err)
				}
				cfg.User = c.user
				r = connectConfig(t, cfg)
			}
			if c.prep != "" {
				mustExec(t, r, c.prep)
			}
			if c.replica {
				if err := pgtest.Poll(ctx, func() (bool, error) {
					q := "SELECT 1, pg_is_in_recovery()"
					if c.tx {
						q = "BEGIN READ ONLY; " + q
					}
					_, rep, err := where(t, r, q)
					if err != nil || rep {
						return rep, err
					}
					if c.tx {
						_, err = r.Exec(ctx, "ROLLBACK").ReadAll()
					}
					return false, err
				}); err != nil {
					t.Fatalf("never on the replica: %v", err)
				}
			}
			var res []*pgconn.Result
			res, err := r.Exec(ctx, c.code).ReadAll()
			if err != nil {
				t.Fatalf("%s: %v", c.code, err)
			}
			_ = res
			if c.tx {
				mustExec(t, r, "COMMIT")
			}
			// The primary session's own view, in a read-write transaction.
			mustExec(t, r, "BEGIN")
			if vals, _, err := where(t, r, check); err != nil || vals[0] != c.want {
				t.Fatalf("primary session: %v (%v), want %q", vals, err, c.want)
			}
			mustExec(t, r, "COMMIT")
			// Autocommit reads (routed as the proxy sees fit) and a
			// read-only transaction's read agree with it.
			for i := range 2 {
				vals, rep, err := where(t, r, check)
				if err != nil || vals[0] != c.want {
					t.Fatalf("%s (read %d, replica=%v): %v (%v), want %q: the replica session's settings are not the session's", check, i, rep, vals, err, c.want)
				}
			}
			mustExec(t, r, "BEGIN READ ONLY")
			if vals, rep, err := where(t, r, check); err != nil || vals[0] != c.want {
				t.Fatalf("read-only tx (replica=%v): %v (%v), want %q", rep, vals, err, c.want)
			}
			mustExec(t, r, "COMMIT")
		})
	}
}

// testBypassReplicaGUCDefaults: custom settings a connection takes from
// its role's defaults (ALTER ROLE ... IN DATABASE ... SET app.dept) are a
// new connection's state, not the session's own: a session that has them
// and runs code is still routed to the replica (the read-back does not
// count a default as set, nor a loaded extension's setting a function
// spells, plpgsql.variable_conflict). A default changed after the session
// opened gives a replica connection opened later another value than the
// session kept: every read answers the session's value (T-M1's third
// route).
func testBypassReplicaGUCDefaults(t *testing.T, e *routeEnv) {
	ctx := ctxT(t)
	admin, err := cluster.Primary.Connect(ctx, e.db)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	setDefault := func(v string) {
		t.Helper()
		if _, err := admin.Exec(ctx, "ALTER ROLE gc_def IN DATABASE "+e.db+" SET app.dept = '"+v+"'"); err != nil {
			t.Fatal(err)
		}
		if err := cluster.WaitReplicaCaughtUp(ctx); err != nil {
			t.Fatal(err)
		}
	}
	login := func() *pgconn.PgConn {
		cfg, err := pgconn.ParseConfig(e.proxy.dsn(e.db))
		if err != nil {
			t.Fatal(err)
		}
		cfg.User = "gc_def"
		return connectConfig(t, cfg)
	}
	const check = "SELECT current_setting('app.dept', true), pg_is_in_recovery()"
	t.Run("role_default_routes", func(t *testing.T) {
		setDefault("D1")
		r := login()
		if _, err := r.Exec(ctx, "SELECT gc_dept()").ReadAll(); err != nil {
			t.Fatal(err)
		}
		// (A read that calls current_setting stays on the primary: the
		// routing is asked with one that does not.)
		if err := pgtest.Poll(ctx, func() (bool, error) {
			_, rep, err := where(t, r, "SELECT 1, pg_is_in_recovery()")
			return rep, err
		}); err != nil {
			t.Fatalf("a session whose custom settings are its role's defaults never reads on the replica: %v", err)
		}
		if vals, rep, err := where(t, r, check); err != nil || vals[0] != "D1" {
			t.Fatalf("app.dept is %v (%v, replica=%v), want the role's default D1", vals, err, rep)
		}
	})
	t.Run("role_default_changed_after_open", func(t *testing.T) {
		setDefault("D1")
		r := login()
		setDefault("D2")
		// Read through a view: a read that calls current_setting itself
		// stays on the primary, one of a view that does may be routed.
		for i := range 3 {
			vals, rep, err := where(t, r, "SELECT (SELECT d FROM gc_vdept), pg_is_in_recovery()")
			if err != nil || vals[0] != "D1" {
				t.Fatalf("read %d (replica=%v): app.dept %v (%v), want D1, the session's", i, rep, vals, err)
			}
		}
	})
}

// testBypassReplicaGUCKept (round 12, attacker X's M1): a custom setting
// that code makes during a read the proxy would route to the replica (a
// view's or a policy's function, a view or policy that calls set_config
// itself) is the session's, as straight to PostgreSQL: such a read goes
// to the primary, so a later read through row security, a write whose
// column default reads the setting, and SHOW see it. Each case runs the
// same statements as gc_viewer straight to the primary and through the
// proxy (after the session's reads have reached the replica) and
// compares what they answer. And reads that change nothing still go to
// the replica: a plain read, and one of a view that only calls
// current_setting.
func testBypassReplicaGUCKept(t *testing.T, e *routeEnv) {
	ctx := ctxT(t)
	login := func(t *testing.T, dsn string) *pgconn.PgConn {
		cfg, err := pgconn.ParseConfig(dsn)
		if err != nil {
			t.Fatal(err)
		}
		cfg.User = "gc_viewer"
		return connectConfig(t, cfg)
	}
	onReplica := func(t *testing.T, c *pgconn.PgConn) {
		t.Helper()
		if err := pgtest.Poll(ctx, func() (bool, error) {
			_, rep, err := where(t, c, "SELECT count(*), pg_is_in_recovery() FROM gc_plain")
			return rep, err
		}); err != nil {
			t.Fatalf("never on the replica: %v", err)
		}
	}
	// answers runs each statement and gives its first value, or its
	// SQLSTATE.
	answers := func(t *testing.T, c *pgconn.PgConn, stmts []string) []string {
		t.Helper()
		var out []string
		for _, q := range stmts {
			res, err := c.Exec(ctx, q).ReadAll()
			if err != nil {
				var pe *pgconn.PgError
				if errors.As(err, &pe) {
					out = append(out, "ERROR "+pe.Code)
					continue
				}
				t.Fatalf("%s: %v", q, err)
			}
			v := "<no row>"
			for _, r := range res {
				if len(r.Rows) > 0 {
					v = string(r.Rows[0][0])
				}
			}
			out = append(out, v)
		}
		return out
	}
	after := []string{
		"SELECT string_agg(tenant || '|' || note, ',') FROM gc_tn4",
		"INSERT INTO gc_tw (v) VALUES ('q') RETURNING coalesce(tenant, '<null>')",
		"SHOW app.tn",
		"SELECT coalesce(c, '<unset>') FROM gc_vcur",
	}
	cases := []struct {
		name string
		prep string // run first, in its own request
		code string // the read that runs the code
	}{
		// X-M1 as reported: a view whose function sets app.tn.
		{name: "view_function_sets", code: "SELECT s FROM gc_vset"},
		// A view that calls the built-in set_config itself (the read set
		// counted no built-in but those that run SQL or read the
		// session), and a view over it.
		{name: "view_calls_set_config", code: "SELECT s FROM gc_vsc"},
		{name: "view_over_set_config_view", code: "SELECT s FROM gc_vsc2"},
		// A policy whose function sets it, and one that calls set_config.
		{name: "policy_function_sets", code: "SELECT x FROM gc_t6"},
		{name: "policy_calls_set_config", code: "SELECT x FROM gc_t7"},
		// The setter view read by a prepared statement.
		{name: "execute_prepared_setter_view", prep: "PREPARE gc_px AS SELECT s FROM gc_vset", code: "EXECUTE gc_px"},
		// A read-only transaction whose first request reads it.
		{name: "read_only_tx_first_request", code: "BEGIN READ ONLY; SELECT s FROM gc_vset; COMMIT"},
	}
	for _, c := range cases {
		t.Run("kept_"+c.name, func(t *testing.T) {
			direct := login(t, cluster.Primary.DSN(e.db))
			if c.prep != "" {
				mustExec(t, direct, c.prep)
			}
			want := answers(t, direct, append([]string{c.code}, after...))
			r := login(t, e.proxy.dsn(e.db))
			if c.prep != "" {
				mustExec(t, r, c.prep)
			}
			onReplica(t, r)
			stats := e.proxy.srv.RouteStats()
			rep, prim := stats.Replica.Load(), stats.Primary.Load()
			got := answers(t, r, []string{c.code})
			if n := stats.Replica.Load() - rep; n != 0 {
				t.Errorf("%s: %d sent to the replica", c.code, n)
			}
			if n := stats.Primary.Load() - prim; c.prep == "" && n != 1 {
				t.Errorf("%s: RouteStats.Primary counted %d, want 1", c.code, n)
			}
			got = append(got, answers(t, r, after)...)
			if !slices.Equal(got, want) {
				t.Fatalf("through the proxy %q, straight to PostgreSQL %q", got, want)
			}
			if want[len(want)-2] != "B" {
				t.Fatalf("straight to PostgreSQL the code did not set app.tn: %q", want)
			}
		})
	}
	// Other session state a view's built-in changes: a sequence's
	// (nextval: refused on the replica, 25006) and an advisory lock
	// (held by the replica's session, which the client's own unlock
	// does not find).
	t.Run("kept_nextval_view", func(t *testing.T) {
		r := login(t, e.proxy.dsn(e.db))
		onReplica(t, r)
		if got := answers(t, r, []string{"SELECT n FROM gc_vnext", "SELECT currval('public.gc_seq') > 0"}); got[0] == "" || strings.HasPrefix(got[0], "ERROR") || got[1] != "t" {
			t.Fatalf("nextval through a view, then currval: %q", got)
		}
	})
	t.Run("kept_advisory_lock_view", func(t *testing.T) {
		r := login(t, e.proxy.dsn(e.db))
		onReplica(t, r)
		if got := answers(t, r, []string{"SELECT l FROM gc_vlock", "SELECT pg_advisory_unlock(4242)"}); got[1] != "t" {
			t.Fatalf("advisory lock through a view, then unlock: %q (the lock is not the session's)", got)
		}
	})
	// The same built-in written as a field ((k).f is f(k)): the
	// statement names no function, and the read set's fields now list
	// the built-ins not on its allowlist.
	t.Run("kept_advisory_lock_field", func(t *testing.T) {
		r := login(t, e.proxy.dsn(e.db))
		onReplica(t, r)
		if got := answers(t, r, []string{"SELECT ((4243::bigint).pg_advisory_lock)::text", "SELECT pg_advisory_unlock(4243)"}); got[1] != "t" {
			t.Fatalf("advisory lock written as a field, then unlock: %q (the lock is not the session's)", got)
		}
	})
	t.Run("reads_still_routed", func(t *testing.T) {
		r := login(t, e.proxy.dsn(e.db))
		onReplica(t, r)
		mustWhere(t, r, "SELECT coalesce(c, '<unset>'), pg_is_in_recovery() FROM gc_vcur", true)
		// Reading the session's settings changes nothing: the replica
		// connection is kept for the next read.
		mustWhere(t, r, "SELECT count(*), pg_is_in_recovery() FROM gc_plain", true)
		mustWhere(t, r, "SELECT coalesce(c, '<unset>'), pg_is_in_recovery() FROM gc_vcur", true)
	})
}
