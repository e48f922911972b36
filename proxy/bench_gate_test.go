package proxy

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/seedbench"
)

// benchSchema adds, beside fenceSchema's protected results table, the
// same table unprotected (for the unfenced baseline) and the seed's
// hand-written protocol tables (no triggers).
const benchSchema = `
CREATE TABLE results_plain (job_key text PRIMARY KEY, payload text NOT NULL, token bigint NOT NULL);
` + seedbench.Schema

const upsertPlain = `INSERT INTO results_plain (job_key, payload, token) VALUES ($1, $2, $3)
ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token
WHERE results_plain.token < excluded.token`

// BenchmarkGatedWrite measures one result transaction three ways,
// interleaved in the same run on the same cluster so they share
// conditions (pgx, extended protocol, one connection each):
//
//   - gated: through the proxy with the write gate, a worker that knows
//     only the session GUCs (generation in the startup options, acquired
//     once): "BEGIN; SET LOCAL fence.step = 'n'" as one simple query, the
//     upsert into the protected table, COMMIT. The proxy splices the gate
//     before the upsert and the receipt before COMMIT. Every commit writes
//     a receipt keyed by its step, so each iteration needs a new step; it
//     rides in the BEGIN's query, costing no round trip (a separate SET
//     would add one; SET LOCAL keeps it to the transaction).
//   - direct: the same transaction straight to PostgreSQL without fencing
//     (BEGIN, upsert into an unprotected twin table, COMMIT).
//   - fenced: the statements the proxy sends, by hand, straight to
//     PostgreSQL in the same three round trips — the protocol's own
//     server-side cost; gated/fenced is the proxy's share.
//   - seed: the seed's hand-written fence SQL straight to PostgreSQL:
//     BEGIN, SELECT ... FOR UPDATE on the fence row, receipt INSERT,
//     conditional upsert, COMMIT (five round trips).
//
// All three are three (five for seed) client round trips. ns/op is the
// sum of the three cycles; gated-ns/op, direct-ns/op, seed-ns/op and the
// ratios gated/direct (target ≤ 1.5) and gated/seed (target ≤ 1) are the
// figures to read.
func BenchmarkGatedWrite(b *testing.B) {
	ctx := context.Background()
	db := cluster.NewDatabaseWith(b, fenceSchema+benchSchema)
	direct := cluster.Primary.MustConnect(b, db)
	l, err := fence.Acquire(ctx, direct, "bench-job", "bench", time.Hour)
	if err != nil {
		b.Fatal(err)
	}
	gate := newGateWith(b, FenceConfig{}, zap.NewNop())
	p := startProxyLog(b, Config{Interceptor: gate}, zap.NewNop())
	// The same gate behind a proxy whose loop waits in poll(2).
	pg := startProxyLog(b, Config{Interceptor: gate, Poller: "poll"}, zap.NewNop())

	cfg, err := pgx.ParseConfig(p.dsn(db))
	if err != nil {
		b.Fatal(err)
	}
	cfg.RuntimeParams["options"] = pgoptions(l)
	gated, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer gated.Close(ctx)
	cfgP := cfg.Copy()
	cfgP.Port = uint16(pg.addr.Port)
	gatedP, err := pgx.ConnectConfig(ctx, cfgP)
	if err != nil {
		b.Fatal(err)
	}
	defer gatedP.Close(ctx)

	const payload = "benchmark payload"
	var d fence.Digest
	params := []fence.Param{{TypeOID: 25, Value: []byte(l.JobKey)}, {TypeOID: 25, Value: []byte(payload)}, {TypeOID: 20, Value: []byte(strconv.FormatInt(l.Token, 10))}}
	begin := make([]byte, 0, 64)

	gatedOn := func(conn *pgx.Conn, prefix string) func(int) {
		return func(i int) {
			begin = append(append(begin[:0], "BEGIN; SET LOCAL fence.step = '"+prefix...), strconv.Itoa(i)...)
			begin = append(begin, '\'')
			if _, err := conn.Exec(ctx, string(begin)); err != nil {
				b.Fatal(err)
			}
			if _, err := conn.Exec(ctx, upsert, l.JobKey, payload, l.Token); err != nil {
				b.Fatal(err)
			}
			if _, err := conn.Exec(ctx, "COMMIT"); err != nil {
				b.Fatal(err)
			}
		}
	}
	gatedCycle, gatedPCycle := gatedOn(gated, "s"), gatedOn(gatedP, "p")
	directCycle := func(int) {
		tx, err := direct.Begin(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := tx.Exec(ctx, upsertPlain, l.JobKey, payload, l.Token); err != nil {
			b.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			b.Fatal(err)
		}
	}
	seedCycle := func(i int) {
		d.Reset()
		d.Statement(upsert, params)
		if err := seedbench.Cycle(ctx, direct, "s"+strconv.Itoa(i), d.Sum(), payload); err != nil {
			b.Fatal(err)
		}
	}
	// fenced: what the proxy sends, written by hand straight to
	// PostgreSQL in the same three round trips (gate with BEGIN, the
	// upsert through the backstop trigger, receipt with COMMIT): the
	// protocol's server-side cost without the proxy. gated/fenced is what
	// the proxy itself adds.
	fenced, err := pgx.ConnectConfig(ctx, func() *pgx.ConnConfig {
		c, err := pgx.ParseConfig(cluster.Primary.DSN(db))
		if err != nil {
			b.Fatal(err)
		}
		c.RuntimeParams["options"] = cfg.RuntimeParams["options"]
		return c
	}())
	if err != nil {
		b.Fatal(err)
	}
	defer fenced.Close(ctx)
	fencedCycle := func(i int) {
		step := "f" + strconv.Itoa(i)
		if _, err := fenced.Exec(ctx, fmt.Sprintf("BEGIN; SET LOCAL fence.step = '%s'; SELECT fence.gate('%s', %d, %d, '%s')", step, l.JobKey, l.Epoch, l.Token, step)); err != nil {
			b.Fatal(err)
		}
		if _, err := fenced.Exec(ctx, upsert, l.JobKey, payload, l.Token); err != nil {
			b.Fatal(err)
		}
		if _, err := fenced.Exec(ctx, fmt.Sprintf("SELECT fence.commit('%s', %d, %d, '%s', '\\x00'::bytea, 'v1'); COMMIT", l.JobKey, l.Epoch, l.Token, step)); err != nil {
			b.Fatal(err)
		}
	}
	ns, i := seedbench.Interleave(b, directCycle, gatedCycle, seedCycle, fencedCycle, gatedPCycle)
	if i == 0 {
		return
	}
	dn, g, s, f, gp := ns[0], ns[1], ns[2], ns[3], ns[4]
	b.ReportMetric(gp/dn, "poll/direct")
	b.ReportMetric(g, "gated-ns/op")
	b.ReportMetric(dn, "direct-ns/op")
	b.ReportMetric(s, "seed-ns/op")
	b.ReportMetric(f, "fenced-ns/op")
	b.ReportMetric(g/dn, "gated/direct")
	b.ReportMetric(g/s, "gated/seed")
	b.ReportMetric(g/f, "gated/fenced")
	b.Logf("gated %.0f ns/op, direct %.0f ns/op, seed %.0f ns/op, fenced SQL direct %.0f ns/op; gated/direct %.2f (target ≤ 1.5), gated/seed %.2f (target ≤ 1), gated/fenced %.2f (the proxy's share); its loop on poll(2): %.0f ns/op, %.2f of direct (n=%d)",
		g, dn, s, f, g/dn, g/s, g/f, gp, gp/dn, i)
	if got := gate.Stats.Committed.Load(); got < 2*int64(i) {
		b.Fatalf("gate committed %d receipts, want at least %d", got, 2*i)
	}
	if n := p.srv.ops.stats.SessionsLoop.Load(); n != 1 {
		b.Fatalf("%d gated sessions on the event loop, want 1", n)
	}
}
