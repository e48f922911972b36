package proxy

import (
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("session_unseen", bypassSessionUnseen) }

// bypassSessionUnseen (round 5, attacker K's M2): session state changed by
// code the proxy cannot see (search_path by set_config inside a DO block
// or a function, SET ROLE by EXECUTE or set_config('role', ...)) was not
// on the replica connection, and later reads routed there resolved names
// and privileges otherwise than the session would: another schema's
// table, a table the session's current role may not read served under the
// login role. Reads stay on the primary until the proxy knows the two
// sessions agree (it read the settings back), for good once they may not.
// Functions that report the node or the session (current_schema,
// current_user, pg_last_wal_replay_lsn, ...) run on the primary.
func bypassSessionUnseen(t *testing.T) {
	e := newRouteEnv(t)
	d := e.direct(t)
	for _, q := range []string{
		"CREATE SCHEMA sp",
		"CREATE TABLE sp.sp_t (v text)", "INSERT INTO sp.sp_t VALUES ('sp')",
		"CREATE TABLE public.sp_t (v text)", "INSERT INTO public.sp_t VALUES ('public')",
		"DROP ROLE IF EXISTS l4_norights", "CREATE ROLE l4_norights NOLOGIN",
		"CREATE FUNCTION public.l4_set_path() RETURNS text LANGUAGE sql AS $$ SELECT set_config('search_path', 'sp, public', false) $$",
		"CREATE FUNCTION public.l4_set_role() RETURNS text LANGUAGE sql AS $$ SELECT set_config('role', 'l4_norights', false) $$",
	} {
		execOK(t, d, q)
	}
	if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	const read = "SELECT v, pg_is_in_recovery() FROM sp_t"
	// A reader whose plain reads reach the replica (the control).
	onReplica := func(t *testing.T) *pgconn.PgConn {
		r := e.reader(t, nil)
		if err := pgtest.Poll(ctxT(t), func() (bool, error) {
			vals, rep, err := where(t, r, read)
			return rep && len(vals) == 1 && vals[0] == "public", err
		}); err != nil {
			t.Fatalf("plain reads never reach the replica: %v", err)
		}
		return r
	}
	for _, k := range []struct{ name, code string }{
		{"path_do", "DO $$ BEGIN PERFORM set_config('search_path', 'sp, public', false); END $$"},
		{"path_do_execute", "DO $$ BEGIN EXECUTE 'SET search_path = sp, public'; END $$"},
		{"path_function", "SELECT l4_set_path()"},
	} {
		t.Run(k.name, func(t *testing.T) {
			r := onReplica(t)
			mustExec(t, r, k.code)
			for i := 0; i < 3; i++ {
				if vals, _, err := where(t, r, read); err != nil || len(vals) != 1 || vals[0] != "sp" {
					t.Fatalf("read %d after the code: %v (%v), want the session's search_path's table (sp)", i, vals, err)
				}
			}
		})
	}
	for _, k := range []struct{ name, code string }{
		{"role_do_execute", "DO $$ BEGIN EXECUTE 'SET ROLE l4_norights'; END $$"},
		{"role_do_set_config", "DO $$ BEGIN PERFORM set_config('role', 'l4_norights', false); END $$"},
		{"role_function", "SELECT l4_set_role()"},
	} {
		t.Run(k.name, func(t *testing.T) {
			r := onReplica(t)
			mustExec(t, r, k.code)
			for i := 0; i < 3; i++ {
				_, err := r.Exec(ctxT(t), read).ReadAll()
				wantCode(t, err, "42501") // as PostgreSQL answers the session's current role
			}
			if vals, rep, err := where(t, r, "SELECT current_user, pg_is_in_recovery()"); err != nil || rep || vals[0] != "l4_norights" {
				t.Fatalf("current_user: %v replica=%v (%v), want l4_norights from the primary", vals, rep, err)
			}
		})
	}
	t.Run("node_functions", func(t *testing.T) {
		r := onReplica(t)
		for _, q := range []string{
			"SELECT pg_last_wal_replay_lsn() IS NULL, pg_is_in_recovery()",
			"SELECT pg_last_wal_receive_lsn() IS NULL, pg_is_in_recovery()",
			"SELECT pg_catalog.pg_last_wal_replay_lsn() IS NULL, pg_is_in_recovery()",
			"SELECT current_schema(), pg_is_in_recovery()",
			"SELECT current_schema, pg_is_in_recovery()",
			"SELECT current_schemas(false)::text, pg_is_in_recovery()",
			"SELECT current_user, pg_is_in_recovery()",
			"SELECT current_role, pg_is_in_recovery()",
			"SELECT user, pg_is_in_recovery()",
			"SELECT session_user, pg_is_in_recovery()",
			"SELECT version(), pg_is_in_recovery()",
		} {
			if vals, rep, err := where(t, r, q); err != nil || rep {
				t.Errorf("%s: %v answered by the replica=%v (%v)", q, vals, rep, err)
			}
		}
	})
}
