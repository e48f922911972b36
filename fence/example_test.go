package fence_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgfence/pgfence/fence"
)

// A worker takes the lease, writes its result in one gated, receipted
// transaction, and learns on a retry that the first commit stood. A stalled
// holder whose lease was taken over is refused.
func Example() {
	ctx := context.Background()
	// In the examples the database comes from the test cluster; a worker
	// would use pgx.Connect or pgxpool.New with its own DSN.
	name, err := cluster.CreateDatabase(ctx, "example")
	if err != nil {
		panic(err)
	}
	defer cluster.DropDatabase(ctx, name)
	conn, err := pgx.Connect(ctx, cluster.Primary.DSN(name))
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `create table results (job_key text primary key, payload text, token bigint);
		select fence.protect('results')`); err != nil {
		panic(err)
	}

	lease, err := fence.Acquire(ctx, conn, "nightly-report", "worker-1", 30*time.Second)
	if err != nil {
		panic(err)
	}
	write := func(l fence.Lease, step, payload string) (fence.CommitResult, error) {
		return fence.RunTx(ctx, conn, l.Generation(step), []byte(payload), func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `insert into results values ($1, $2, $3)
				on conflict (job_key) do update set payload = excluded.payload, token = excluded.token
				where results.token < excluded.token`, l.JobKey, payload, l.Token)
			return err
		})
	}
	res, err := write(lease, "", "42 rows")
	fmt.Println(res, err)
	res, err = write(lease, "", "42 rows") // a retry after a lost response
	fmt.Println(res, err)

	// worker-1 stalls; its lease expires and worker-2 takes over.
	conn.Exec(ctx, "update fence.leases set expires_at = now() - interval '1 second'")
	if _, err := fence.Acquire(ctx, conn, "nightly-report", "worker-2", 30*time.Second); err != nil {
		panic(err)
	}
	// worker-1 resumes and commits its next step: refused, nothing written.
	_, err = write(lease, "totals", "41 rows")
	fmt.Println(fence.IsStale(err))
	// Re-sending the first step with other content is a conflict, not a
	// silent overwrite.
	_, err = write(lease, "", "41 rows")
	fmt.Println(fence.IsConflict(err))
	// Output:
	// committed <nil>
	// replayed <nil>
	// true
	// true
}
