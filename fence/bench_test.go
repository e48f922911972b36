package fence_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/seedbench"
)

// BenchmarkGateVsSeed measures one gated write cycle both ways, interleaved
// on the same database and connection so they share conditions:
//
//   - fence: BEGIN; fence.Gate; the seed's upsert into a protected table
//     (its backstop trigger runs the gate check again); fence.Commit with a
//     v1 digest; COMMIT.
//   - seed:  BEGIN; SELECT ... FOR UPDATE on the fence row; receipt INSERT;
//     the same upsert into an unprotected table; COMMIT.
//
// Both are five round trips. The token is fixed and every iteration uses a
// new step, so every cycle writes a receipt (the fair comparison: the
// receipt insert is part of both protocols). ns/op is the sum of both
// cycles; fence-ns/op, seed-ns/op and fence/seed are the figures to read.
func BenchmarkGateVsSeed(b *testing.B) {
	ctx := context.Background()
	conn, l := benchConn(b, demoSchema+seedbench.Schema)
	const payload = "benchmark payload"
	var d fence.Digest
	params := []fence.Param{{TypeOID: 25, Value: []byte(l.JobKey)}, {TypeOID: 25, Value: []byte(payload)}, {TypeOID: 20, Value: []byte(strconv.FormatInt(l.Token, 10))}}
	step := make([]byte, 0, 24)

	fenceCycle := func(i int) {
		g := l.Generation(string(strconv.AppendInt(step[:0], int64(i), 10)))
		tx := beginGated(b, ctx, conn, g)
		if _, err := tx.Exec(ctx, upsertSQL, l.JobKey, payload, l.Token); err != nil {
			b.Fatal(err)
		}
		d.Reset()
		d.Statement(upsertSQL, params)
		if r, err := fence.Commit(ctx, tx, g, d.Sum(), fence.DigestVersion); err != nil || r != fence.Committed {
			b.Fatalf("commit: %v, %v", r, err)
		}
		if err := tx.Commit(ctx); err != nil {
			b.Fatal(err)
		}
	}
	seedCycle := func(i int) {
		d.Reset()
		d.Statement(upsertSQL, params)
		if err := seedbench.Cycle(ctx, conn, string(strconv.AppendInt(step[:0], int64(i), 10)), d.Sum(), payload); err != nil {
			b.Fatal(err)
		}
	}
	ns, i := seedbench.Interleave(b, seedCycle, fenceCycle)
	if i == 0 {
		return
	}
	reportRatio(b, "gate+upsert+commit", "fence", ns[1], "seed", ns[0], "fence/seed", i)
}

// BenchmarkReplayTrigger measures what the pgfence_replay row trigger costs
// an ordinary (non-replay) write: the same 100-row UPDATE and single-row
// upsert on two protected tables, one with the trigger disabled, interleaved
// in one gated transaction per iteration. with-ns/op and without-ns/op are
// the two tables' statement times, overhead the ratio.
func BenchmarkReplayTrigger(b *testing.B) {
	ctx := context.Background()
	conn, l := benchConn(b, demoSchema+`
create table rt_on (k int primary key, job_key text not null, token bigint not null);
create table rt_off (k int primary key, job_key text not null, token bigint not null);
insert into rt_on select g, 'bench-job', 0 from generate_series(1, 100) g;
insert into rt_off select g, 'bench-job', 0 from generate_series(1, 100) g;
select fence.protect('rt_on'), fence.protect('rt_off');
alter table rt_off disable trigger pgfence_replay;
`)
	stmts := func(tbl string) []string {
		return []string{
			"update " + tbl + " set token = $1",
			"insert into " + tbl + " values (1, 'bench-job', $1) on conflict (k) do update set token = excluded.token",
		}
	}
	on, off := stmts("rt_on"), stmts("rt_off")
	var withTime, withoutTime time.Duration
	run := func(i int, measure bool) {
		tx := beginGated(b, ctx, conn, l.Generation(strconv.Itoa(i)))
		defer tx.Rollback(ctx)
		for j := range on {
			// alternate which table goes first
			first, second, ft, st := on[j], off[j], &withTime, &withoutTime
			if i%2 == 1 {
				first, second, ft, st = off[j], on[j], &withoutTime, &withTime
			}
			t0 := time.Now()
			if _, err := tx.Exec(ctx, first, l.Token); err != nil {
				b.Fatal(err)
			}
			t1 := time.Now()
			if _, err := tx.Exec(ctx, second, l.Token); err != nil {
				b.Fatal(err)
			}
			t2 := time.Now()
			if measure {
				*ft += t1.Sub(t0)
				*st += t2.Sub(t1)
			}
		}
	}
	for i := range 50 {
		run(-1-i, false)
	}
	i := 0
	for b.Loop() {
		run(i, true)
		i++
	}
	if i == 0 {
		return
	}
	reportRatio(b, "100-row update + upsert, with and without pgfence_replay",
		"with", float64(withTime.Nanoseconds())/float64(i), "without", float64(withoutTime.Nanoseconds())/float64(i), "overhead", i)
}

// BenchmarkPartitionedBackstop measures what the backstop costs a bulk
// write into a partitioned table (issue 17 §1): 10,000 rows by INSERT …
// SELECT and by COPY FROM, naming the root, into two identical trees of
// four partitions (two of them under a sub-partitioned one), one protected,
// one not, interleaved in one gated transaction each (rolled back, so the
// tables stay empty). protected-ns/op and plain-ns/op are the two trees'
// times, overhead their ratio.
//
// Versions before migration 005 refuse to protect a partitioned table
// (42809): the benchmark then protects each leaf partition, the only
// option they had, so the same benchmark measures both.
func BenchmarkPartitionedBackstop(b *testing.B) {
	ctx := context.Background()
	var trees string
	for _, tree := range []string{"pt_on", "pt_off"} {
		trees += strings.ReplaceAll(`
create table T (k int not null, job_key text not null, v text not null) partition by range (k);
create table T_1 partition of T for values from (0) to (2500);
create table T_2 partition of T for values from (2500) to (5000);
create table T_3 partition of T for values from (5000) to (10001) partition by range (k);
create table T_3a partition of T_3 for values from (5000) to (7500);
create table T_3b partition of T_3 for values from (7500) to (10001);
`, "T", tree)
	}
	conn, l := benchConn(b, trees)
	if _, err := conn.Exec(ctx, "select fence.protect('pt_on')"); err != nil {
		if pgtest.SQLState(err) != "42809" {
			b.Fatal(err)
		}
		if _, err := conn.Exec(ctx, "select fence.protect(t) from unnest(array['pt_on_1', 'pt_on_2', 'pt_on_3a', 'pt_on_3b']::regclass[]) t"); err != nil {
			b.Fatal(err)
		}
		b.Log("protect: partitioned tables refused; protected the leaf partitions")
	}
	rows := make([][]any, 10000)
	for i := range rows {
		rows[i] = []any{int32(i + 1), "bench-job", "v"}
	}
	for _, bc := range []struct {
		name  string
		write func(tx pgx.Tx, tree string) error
	}{
		{"insert_select", func(tx pgx.Tx, tree string) error {
			_, err := tx.Exec(ctx, "insert into "+tree+" select g, 'bench-job', 'v' from generate_series(1, 10000) g")
			return err
		}},
		{"copy", func(tx pgx.Tx, tree string) error {
			n, err := tx.CopyFrom(ctx, pgx.Identifier{tree}, []string{"k", "job_key", "v"}, pgx.CopyFromRows(rows))
			if err == nil && n != int64(len(rows)) {
				err = fmt.Errorf("copied %d rows, want %d", n, len(rows))
			}
			return err
		}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			cycle := func(tree string) func(i int) {
				return func(i int) {
					tx := beginGated(b, ctx, conn, l.Generation(""))
					defer tx.Rollback(ctx)
					if err := bc.write(tx, tree); err != nil {
						b.Fatal(err)
					}
				}
			}
			// Alternate which tree goes first: the second write of an
			// iteration finds the other's pages in the cache.
			on, off := cycle("pt_on"), cycle("pt_off")
			for i := range 10 {
				on(-1 - i)
				off(-1 - i)
			}
			var ns [2]float64
			i := 0
			for b.Loop() {
				for k := range 2 {
					k := (k + i) % 2
					t0 := time.Now()
					[]func(int){on, off}[k](i)
					ns[k] += float64(time.Since(t0).Nanoseconds())
				}
				i++
			}
			if i == 0 {
				return
			}
			reportRatio(b, "10,000 rows into a partitioned table by "+bc.name,
				"protected", ns[0]/float64(i), "plain", ns[1]/float64(i), "overhead", i)
		})
	}
}

// benchConn is a connection to a fresh database with schema, and the lease
// of job "bench-job" acquired on it.
func benchConn(b *testing.B, schema string) (*pgx.Conn, fence.Lease) {
	b.Helper()
	conn := cluster.Primary.MustConnect(b, cluster.NewDatabaseWith(b, schema))
	l, err := fence.Acquire(context.Background(), conn, "bench-job", "bench", time.Hour)
	if err != nil {
		b.Fatal(err)
	}
	return conn, l
}

// reportRatio reports x and y, the ns/op of two ways of doing what, as the
// metrics xName-ns/op and yName-ns/op and their ratio x/y as ratio, and
// logs them (n iterations).
func reportRatio(b *testing.B, what, xName string, x float64, yName string, y float64, ratio string, n int) {
	b.Helper()
	b.ReportMetric(x, xName+"-ns/op")
	b.ReportMetric(y, yName+"-ns/op")
	b.ReportMetric(x/y, ratio)
	b.Logf("%s: %s %.0f ns/op, %s %.0f ns/op, ratio %.3f (n=%d)", what, xName, x, yName, y, x/y, n)
}
