package proxy

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/rewrite"
)

// TestBypass/rotx_round8 (issue 30, round 8, attacker P's H4, H5, M3, M2):
// the read-only transaction on the replica of TestBypass/rotx, attacked
// where the proxy judged nothing.
//
//   - H4: a failed transaction (an error, or the proxy's own FN007)
//     brought back by ROLLBACK TO SAVEPOINT, COMMIT AND CHAIN or ROLLBACK
//     AND CHAIN at the head of a Query: the statements after it ran
//     unjudged and read A's result from the lagging replica. Every
//     statement that can run is judged: the Query is split after the
//     statement that brings the transaction back.
//   - H5, M3: text PostgreSQL 15 runs and the classifier (PostgreSQL 17's
//     grammar) cannot parse ("FROM results system_user": system_user is a
//     reserved word since 16) was sent into the transaction unjudged, and
//     a SET hidden in it changed the replica's session only. Text the
//     proxy cannot read is never run inside a transaction on the replica
//     (0A000), in the simple and the extended protocol, with or without a
//     generation.
//   - M2: a statement of SQL PREPARE, made on the primary, EXECUTEd or
//     bound inside the transaction on the replica failed there (26000):
//     it is made again on the replica before each use, and judged like
//     any statement that is not a plain read (FN007 when the transaction
//     began before the takeover). TestBypass/sqlprepared_replica: served
//     by the replica as directly.
//
// Only through the proxy: reading a replica is the proxy's routing.
func init() {
	registerBypass("rotx_round8", func(t *testing.T) { runRotx(t, false, rotx8Cases()) })
}

// rotxUnread is rotxRead as PostgreSQL 15 reads it and pg_query cannot.
const rotxUnread = "SELECT payload, pg_is_in_recovery() FROM results system_user WHERE job_key = 'job'"

func rotx8Cases() []rotxCase {
	pending := fence.CodePending
	w := []string{"-c fence.read_wait=50ms"}
	sp := []string{"BEGIN READ ONLY", "SAVEPOINT a", rotxRead}
	spRR := []string{"BEGIN READ ONLY ISOLATION LEVEL REPEATABLE READ", "SAVEPOINT a", rotxRead}
	rc := []string{"BEGIN READ ONLY", rotxRead}
	prep := []string{"PREPARE s1 AS " + rotxRead, "BEGIN READ ONLY", rotxRead}
	return []rotxCase{
		// H4: a failed transaction brought back in the Query that reads.
		{name: "failed_rollback_to_read", opts: w, begin: sp, then: []string{"!SELECT 1/0", "ROLLBACK TO SAVEPOINT a; " + rotxRead}, code: pending},
		{name: "failed_rollback_to_generation", opts: w, begin: sp, then: []string{"!SELECT 1/0"},
			last: func(sc *readsScene) string { return "ROLLBACK TO SAVEPOINT a; " + rotxGen(sc) + "; " + rotxRead }, code: pending},
		{name: "failed_rollback_to_then_commit", opts: w, begin: sp, then: []string{"!SELECT 1/0", "ROLLBACK TO SAVEPOINT a; " + rotxRead + "; COMMIT; SELECT 1"}, code: pending},
		{name: "failed_rollback_to_twice", opts: w, begin: sp, then: []string{"!SELECT 1/0", "ROLLBACK TO SAVEPOINT a; ROLLBACK TO SAVEPOINT a; " + rotxRead}, code: pending},
		{name: "fn007_then_rollback_to", opts: w, begin: sp, then: []string{"!" + rotxRead, "ROLLBACK TO SAVEPOINT a; " + rotxRead}, code: pending},
		{name: "failed_commit_and_chain", opts: w, begin: sp, then: []string{"!SELECT 1/0", "COMMIT AND CHAIN; " + rotxRead}, code: pending},
		{name: "failed_rollback_and_chain", opts: w, begin: sp, then: []string{"!SELECT 1/0", "ROLLBACK AND CHAIN; " + rotxRead}, code: pending},
		{name: "failed_rollback_to_rr", begin: spRR, then: []string{"!SELECT 1/0", "ROLLBACK TO SAVEPOINT a; " + rotxRead}, code: pending},
		{name: "late_failed_rollback_to_served", late: true, begin: sp, then: []string{"!SELECT 1/0", "ROLLBACK TO SAVEPOINT a; " + rotxRead}},
		// H5, M3: text the proxy cannot read.
		{name: "unread_nometa", opts: w, begin: rc, then: []string{rotxUnread}, code: "0A000"},
		{name: "unread_min_lsn", begin: rc, sql: func(sc *readsScene) string {
			var lsn string
			if err := sc.direct.QueryRow(context.Background(), "SELECT pg_current_wal_insert_lsn()::text").Scan(&lsn); err != nil {
				panic(err)
			}
			return fmt.Sprintf("SET LOCAL fence.min_lsn = '%s'", lsn)
		}, then: []string{"", rotxUnread}, code: "0A000"},
		{name: "unread_failed_rollback_to", opts: w, begin: sp, then: []string{"!SELECT 1/0", "ROLLBACK TO SAVEPOINT a; " + rotxUnread}, code: "25P02"},
		{name: "unread_set_search_path", begin: rc, then: []string{"SET search_path = pg_catalog; SELECT 1 AS x FROM pg_class system_user LIMIT 1"}, code: "0A000"},
		{name: "unread_extended", opts: w, begin: rc, then: []string{rotxUnread}, proto: "params", code: "0A000"},
		{name: "late_unread_nometa", late: true, begin: rc, then: []string{rotxUnread}, code: "0A000"},
		// M2: SQL PREPARE before the transaction.
		{name: "sql_prepared_execute", opts: w, begin: prep, then: []string{"EXECUTE s1"}, code: pending},
		{name: "sql_prepared_bind", opts: w, begin: prep, then: []string{"s1"}, proto: "prepared", code: pending},
		// After catch-up the statement exists on the replica (not 26000);
		// the transaction began before the takeover, and an EXECUTE or a
		// portal is not a plain read: refused as TestBypass/rotx's
		// late_pgx_extended is.
		{name: "late_sql_prepared_execute", late: true, begin: prep, then: []string{"EXECUTE s1"}, code: pending},
		{name: "late_sql_prepared_bind", late: true, begin: prep, then: []string{"s1"}, proto: "prepared", code: pending},
		{name: "late_sql_prepared_execute_params", late: true, begin: prep, then: []string{"EXECUTE s1"}, proto: "params", code: pending},
	}
}

func init() { registerBypass("sqlprepared_replica", bypassSQLPreparedReplica) }

// bypassSQLPreparedReplica (round 8, attacker P's M2): statements of SQL
// PREPARE, EXECUTEd or bound inside a read-only transaction on a current
// replica, answer there as they do directly; one prepared again under the
// same name is the new version there.
func bypassSQLPreparedReplica(t *testing.T) {
	e := newRouteEnv(t)
	d := e.direct(t)
	for _, q := range []string{
		"CREATE SCHEMA sq",
		"CREATE TABLE public.sq_t (v text)", "INSERT INTO public.sq_t VALUES ('public')",
	} {
		execOK(t, d, q)
	}
	if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	// The proxy's read set must know sq_t, and the replica have replayed
	// it, before a session reads it: while the set is read again after
	// the DDL, sq_t is a name the proxy does not know, which may run code
	// that changes the session (route.go runsSessionCode). Such a read
	// goes to the primary and marks the session's primary as having run
	// code (rt.primaryCodeRan, fence_text.go noteSent), and from then on
	// every read-only transaction of the session goes to the primary:
	// begin's poll could never succeed in that session.
	waitReadSetKnows(t, e.gate, e.db, rewrite.RelName{Schema: "public", Name: "sq_t"})
	waitCatalogReplayed(t, e.proxy, e.gate, e.db)
	// begin opens a read-only transaction on the replica.
	begin := func(t *testing.T, ctx context.Context, r *pgconn.PgConn) {
		if err := pgtest.Poll(ctx, func() (bool, error) {
			_, rep, err := where(t, r, "BEGIN READ ONLY; SELECT v, pg_is_in_recovery() FROM sq_t")
			if err != nil || rep {
				return rep, err
			}
			_, err = r.Exec(ctx, "ROLLBACK").ReadAll()
			return false, err
		}); err != nil {
			t.Fatalf("the transaction never began on the replica: %v", err)
		}
	}
	want := func(t *testing.T, ctx context.Context, how string, r *pgconn.PgConn, name, v string) {
		t.Helper()
		var res *pgconn.Result
		switch how {
		case "execute_params":
			res = r.ExecParams(ctx, "EXECUTE "+name, nil, nil, nil, nil).Read()
			if res.Err != nil {
				t.Fatalf("EXECUTE %s (extended): %v", name, res.Err)
			}
		case "execute":
			rs, err := r.Exec(ctx, "EXECUTE "+name).ReadAll()
			if err != nil {
				t.Fatalf("EXECUTE %s: %v", name, err)
			}
			res = rs[len(rs)-1]
		default:
			res = r.ExecPrepared(ctx, name, nil, nil, nil).Read()
			if res.Err != nil {
				t.Fatalf("Bind %s: %v", name, res.Err)
			}
		}
		if len(res.Rows) != 1 || string(res.Rows[0][0]) != v || string(res.Rows[0][1]) != "t" {
			t.Fatalf("%s %s: %q, want %s from the replica", how, name, res.Rows, v)
		}
	}
	for _, how := range []string{"execute", "bind", "execute_params"} {
		t.Run(how, func(t *testing.T) {
			ctx := ctxT(t) // its own: one subtest's timeout is not the next one's
			r := e.reader(t, nil)
			mustExec(t, r, "PREPARE s1 AS SELECT v, pg_is_in_recovery() FROM sq_t")
			begin(t, ctx, r)
			want(t, ctx, how, r, "s1", "public")
			want(t, ctx, how, r, "s1", "public") // again: made again
			mustExec(t, r, "COMMIT")
			mustExec(t, r, "DEALLOCATE s1")
			mustExec(t, r, "PREPARE s1 AS SELECT 'v2' || v, pg_is_in_recovery() FROM sq_t")
			begin(t, ctx, r)
			want(t, ctx, how, r, "s1", "v2public")
			mustExec(t, r, "COMMIT")
		})
	}
}
