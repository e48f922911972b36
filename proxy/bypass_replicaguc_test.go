package proxy

import (
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
// primary session would.
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
	}{
		// M1: the code runs on the primary session.
		{name: "primary_definer_function", code: "SELECT gc_set_tenant('B')", want: "B"},
		{name: "primary_do", code: "DO $$ BEGIN PERFORM set_config('app.tenant', 'B', false); END $$", want: "B"},
		{name: "primary_function_in_tx", code: "BEGIN; SELECT gc_set_tenant('B'); COMMIT", want: "B"},
		// M2: the code runs on the replica session.
		{name: "replica_do", replica: true, tx: true, code: "DO $$ BEGIN PERFORM set_config('app.tenant', 'B', false); END $$", want: "<unset>"},
		{name: "replica_function", replica: true, tx: true, code: "SELECT gc_set_tenant('B')", want: "<unset>"},
		{name: "replica_view", replica: true, code: "SELECT x FROM gc_v", want: "<unset>"},
		{name: "replica_policy", replica: true, code: "SELECT x FROM gc_t2", want: "<unset>", user: "gc_viewer"},
		// The name built at run time where it is set, spelled only by the
		// view that reads it ("unset" means every row).
		{name: "primary_dynamic_name_view", code: "DO $$ BEGIN PERFORM set_config('app.' || 'region', 'B', false); END $$", check: regionRows, want: "B"},
		{name: "replica_dynamic_name_view", replica: true, tx: true, code: "DO $$ BEGIN PERFORM set_config('app.' || 'region', 'B', false); END $$", check: regionRows, want: "A,B"},
	}
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
