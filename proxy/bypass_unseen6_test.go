package proxy

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// Issue 30, round 6: the replica connection's session was not the
// primary session's, and reads routed there answered for another session
// (attacker M's M1, M2, L1; attacker L's M1).

func init() {
	registerBypass("temp_unseen", bypassTempUnseen)
	registerBypass("replica_defaults", bypassReplicaDefaults)
	registerBypass("backend_state_funcs", bypassBackendStateFuncs)
}

// unseenEnv is a database with a table tu_t in public (row 'public') and
// in schema sp (row 'sp'), replayed on the replica.
func unseenEnv(t *testing.T) *routeEnv {
	e := newRouteEnv(t)
	d := e.direct(t)
	for _, q := range []string{
		"CREATE SCHEMA sp",
		"CREATE TABLE public.tu_t (v text)", "INSERT INTO public.tu_t VALUES ('public')",
		"CREATE TABLE sp.tu_t (v text)", "INSERT INTO sp.tu_t VALUES ('sp')",
		"CREATE TABLE public.tu_log (n int)",
		"CREATE FUNCTION public.tu_mk() RETURNS void LANGUAGE plpgsql AS $$ BEGIN CREATE TEMP TABLE tu_t AS SELECT 'temp'::text AS v; END $$",
		"CREATE FUNCTION public.tu_mk_sql() RETURNS void LANGUAGE sql AS $$ CREATE TEMP TABLE tu_t AS SELECT 'temp'::text AS v $$",
	} {
		execOK(t, d, q)
	}
	if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	return e
}

const unseenRead = "SELECT v, pg_is_in_recovery() FROM tu_t"

// unseenOnReplica is a reader whose plain reads reach the replica.
func unseenOnReplica(t *testing.T, e *routeEnv, opts ...string) *pgconn.PgConn {
	r := e.reader(t, nil, opts...)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		vals, rep, err := where(t, r, unseenRead)
		return rep && len(vals) == 1 && vals[0] == "public", err
	}); err != nil {
		t.Fatalf("plain reads never reach the replica: %v", err)
	}
	return r
}

// unseenWant reads unseenRead three times: each must answer want.
func unseenWant(t *testing.T, r *pgconn.PgConn, want string) {
	t.Helper()
	for i := 0; i < 3; i++ {
		if vals, rep, err := where(t, r, unseenRead); err != nil || len(vals) != 1 || vals[0] != want {
			t.Fatalf("read %d: %v replica=%v (%v), want the session's %s", i, vals, rep, err, want)
		}
	}
}

// bypassTempUnseen (M-M1, L-M1): a temporary table made by code the proxy
// cannot see (a DO block's EXECUTE, a function), or in a transaction whose
// statements went through the write gate rather than the router, did not
// keep the session on the primary: unqualified reads of its name went to
// the replica, where the name is another relation (a protected table's,
// for attacker L). The session is read back after code, temporary objects
// included, and every statement that visibly makes one pins it, whatever
// path sent it.
func bypassTempUnseen(t *testing.T) {
	e := unseenEnv(t)
	for _, k := range []struct{ name, code string }{
		{"do_execute_table", "DO $$ BEGIN EXECUTE 'CREATE TEMP TABLE tu_t (v text)'; INSERT INTO pg_temp.tu_t VALUES ('temp'); END $$"},
		{"do_execute_concat", "DO $$ BEGIN EXECUTE 'create tem' || 'p table tu_t as select ''temp''::text as v'; END $$"},
		{"do_execute_view", "DO $$ BEGIN EXECUTE 'CREATE TEMP VIEW tu_t AS SELECT ''temp''::text AS v'; END $$"},
		{"function_plpgsql", "SELECT tu_mk()"},
		{"function_sql", "SELECT tu_mk_sql()"},
		{"tx_write_then_temp", "BEGIN; INSERT INTO tu_log VALUES (1); CREATE TEMP TABLE tu_t AS SELECT 'temp'::text AS v; COMMIT"},
		{"tx_separate_queries", ""},
		{"extended_create", ""},
		{"extended_set_search_path", ""},
	} {
		t.Run(k.name, func(t *testing.T) {
			r := unseenOnReplica(t, e)
			want := "temp"
			switch k.name {
			case "tx_separate_queries":
				for _, q := range []string{"BEGIN", "INSERT INTO tu_log VALUES (1)", "CREATE TEMP TABLE tu_t AS SELECT 'temp'::text AS v", "COMMIT"} {
					mustExec(t, r, q)
				}
			case "extended_create":
				stmtBatch(t, r, &pgproto3.Parse{Query: "CREATE TEMP TABLE tu_t AS SELECT 'temp'::text AS v"}, &pgproto3.Bind{}, &pgproto3.Execute{})
			case "extended_set_search_path":
				stmtBatch(t, r, &pgproto3.Parse{Query: "SET search_path = sp, public"}, &pgproto3.Bind{}, &pgproto3.Execute{})
				want = "sp"
			default:
				mustExec(t, r, k.code)
			}
			unseenWant(t, r, want)
		})
	}
	// Attacker L's shape: a fenced session's gated transaction makes a
	// temporary table named like the protected one.
	t.Run("fenced_tx_shadows_protected", func(t *testing.T) {
		l := e.acquire(t, "job", "h", time.Minute)
		r := unseenOnReplica(t, e, pgoptions(l))
		mustExec(t, r, "BEGIN; INSERT INTO results (job_key, payload, token) VALUES ('job', 'P', "+fmt.Sprint(l.Token)+"); CREATE TEMP TABLE results (job_key text, payload text, token bigint); COMMIT")
		for i := 0; i < 3; i++ {
			vals, rep, err := where(t, r, "SELECT count(*), pg_is_in_recovery() FROM results")
			if err != nil || rep || vals[0] != "0" {
				t.Fatalf("read %d: %v replica=%v (%v), want the session's empty temporary table on the primary", i, vals, rep, err)
			}
		}
	})
}

// bypassReplicaDefaults (M-M2): the replica connection, opened at the
// session's first routed read, started with the role's and database's
// defaults as they were then (ALTER ROLE/DATABASE ... SET since the client
// connected), the primary session with those of its start: reads there
// resolved names otherwise. A replica connection whose settings differ
// from the primary session's is not used.
func bypassReplicaDefaults(t *testing.T) {
	e := unseenEnv(t)
	d := e.direct(t)
	for _, k := range []struct{ name, before, after, want string }{
		{"database_set", "", "ALTER DATABASE %s SET search_path = sp, public", "public"},
		{"role_in_database_set", "", "ALTER ROLE postgres IN DATABASE %s SET search_path = sp, public", "public"},
		{"database_reset", "ALTER DATABASE %s SET search_path = sp, public", "ALTER DATABASE %s RESET search_path", "sp"},
	} {
		t.Run(k.name, func(t *testing.T) {
			if k.before != "" {
				execOK(t, d, fmt.Sprintf(k.before, e.db))
			}
			r := e.reader(t, nil)
			execOK(t, d, fmt.Sprintf(k.after, e.db))
			t.Cleanup(func() {
				d.Exec(context.Background(), fmt.Sprintf("ALTER DATABASE %s RESET search_path", e.db))
				d.Exec(context.Background(), fmt.Sprintf("ALTER ROLE postgres IN DATABASE %s RESET search_path", e.db))
			})
			if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
				t.Fatal(err)
			}
			unseenWant(t, r, k.want)
		})
	}
	t.Run("control_unchanged_defaults_use_the_replica", func(t *testing.T) {
		r := e.reader(t, nil)
		if err := pgtest.Poll(ctxT(t), func() (bool, error) {
			vals, rep, err := where(t, r, unseenRead)
			return rep && len(vals) == 1 && vals[0] == "public", err
		}); err != nil {
			t.Fatalf("plain reads never reach the replica: %v", err)
		}
	})
}

// bypassBackendStateFuncs (M-L1): random() after setseed() in the session
// was answered by the replica's backend, whose generator was not seeded.
// Built-ins whose result depends on the backend's own state
// (pg_proc.proparallel not 's') run on the primary.
func bypassBackendStateFuncs(t *testing.T) {
	e := unseenEnv(t)
	var want [2]string
	d := e.direct(t)
	if err := d.QueryRow(ctxT(t), "SELECT setseed(0.5)::text, random()::text").Scan(&want[0], &want[1]); err != nil {
		t.Fatal(err)
	}
	r := unseenOnReplica(t, e)
	mustExec(t, r, "SELECT setseed(0.5)")
	vals, rep, err := where(t, r, "SELECT random()::text, pg_is_in_recovery()")
	if err != nil || rep || vals[0] != want[1] {
		t.Fatalf("random() after setseed(0.5): %v replica=%v (%v), want %s from the session's backend", vals, rep, err, want[1])
	}
}
