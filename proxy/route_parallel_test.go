package proxy

import (
	"context"
	"testing"

	"github.com/pgfence/pgfence/rewrite"
)

// TestReadBuiltinsParallelSafe: PostgreSQL marks a built-in whose result
// depends on the backend that runs it (its random generator's seed,
// setseed; its session's settings, snapshot, temporary schema, identity)
// PARALLEL RESTRICTED or UNSAFE (pg_proc.proparallel <> 's'): a parallel
// worker, another backend, would answer otherwise. A replica connection
// is another backend too. So every built-in the classifier lets reach a
// replica by name must be parallel safe in every overload, or be on the
// session-local list, which keeps it on the primary (round 6, attacker
// M's L1: random() after setseed() was answered by the replica). The one
// exception is pg_is_in_recovery, restricted and on neither list on
// purpose: the test suite tells the node that answered by it.
func TestReadBuiltinsParallelSafe(t *testing.T) {
	ctx := ctxT(t)
	conn, err := cluster.Primary.Connect(ctx, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	names, _ := rewrite.TrustedByName()
	rows, err := conn.Query(ctx, `SELECT DISTINCT p.proname::text FROM pg_catalog.pg_proc p
		WHERE p.pronamespace = 'pg_catalog'::regnamespace AND p.proparallel <> 's' AND p.proname = ANY ($1::name[])
		ORDER BY 1`, names)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		ro, local := rewrite.ReadOnlyBuiltin(n)
		if ro && !local && n != "pg_is_in_recovery" {
			t.Errorf("%s is not parallel safe (its result depends on the backend), yet a read calling it may reach a replica: add it to sessionLocalFuncs", n)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
}
