// Package seedbench is the seed's hand-written fencing protocol (the
// design discussion's SQL: a fence row locked FOR UPDATE, a receipt insert,
// the conditional upsert, on tables without triggers), the baseline the
// benchmarks compare pgfence with.
package seedbench

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Schema creates the seed's tables, with one fence row: job JobKey at
// token Token.
const Schema = `
create table report_fences (job_key text primary key, max_issued_token bigint not null);
create table report_results (job_key text primary key, payload text, applied_fencing_token bigint);
create table report_commit_receipts (
  job_key text not null, fencing_token bigint not null, step text not null,
  payload_digest bytea not null, committed_at timestamptz not null default clock_timestamp(),
  primary key (job_key, fencing_token, step));
insert into report_fences values ('seed-job', 17);
`

// The fence row Schema creates.
const (
	JobKey = "seed-job"
	Token  = int64(17)
)

// Cycle runs one fenced write the seed's way, in five round trips: BEGIN,
// the fence row check FOR UPDATE, the receipt for step with digest, the
// conditional upsert of payload, COMMIT.
func Cycle(ctx context.Context, conn *pgx.Conn, step string, digest []byte, payload string) error {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	var max int64
	if err := tx.QueryRow(ctx, `select max_issued_token from report_fences
		where job_key = $1 and max_issued_token = $2 for update`, JobKey, Token).Scan(&max); err != nil {
		return fmt.Errorf("seed fence check: %w", err)
	}
	if _, err := tx.Exec(ctx, `insert into report_commit_receipts (job_key, fencing_token, step, payload_digest)
		values ($1, $2, $3, $4) on conflict do nothing`, JobKey, Token, step, digest); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `insert into report_results (job_key, payload, applied_fencing_token) values ($1, $2, $3)
		on conflict (job_key) do update set payload = excluded.payload, applied_fencing_token = excluded.applied_fencing_token
		where report_results.applied_fencing_token < excluded.applied_fencing_token`, JobKey, payload, Token); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// Interleave warms each cycle up 50 times, then runs them in turn once per
// benchmark iteration (so they share the machine's conditions) and returns
// each one's mean ns per call, in order, and the number of iterations
// (ns is nil when there was none). Cycle i is called with the iteration
// number, negative while warming up.
func Interleave(b *testing.B, cycles ...func(i int)) (ns []float64, n int) {
	for i := range 50 {
		for _, c := range cycles {
			c(-1 - i)
		}
	}
	total := make([]time.Duration, len(cycles))
	for b.Loop() {
		for k, c := range cycles {
			t0 := time.Now()
			c(n)
			total[k] += time.Since(t0)
		}
		n++
	}
	if n == 0 {
		return nil, 0
	}
	ns = make([]float64, len(cycles))
	for k, t := range total {
		ns[k] = float64(t.Nanoseconds()) / float64(n)
	}
	return ns, n
}
