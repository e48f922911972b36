package fence_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

var cluster *pgtest.Cluster

func TestMain(m *testing.M) {
	// Prepared transactions are on, so that the backstop's refusal of
	// PREPARE TRANSACTION after an unreceipted write is what stops it.
	os.Exit(pgtest.Run(m, pgtest.Options{Settings: map[string]string{"max_prepared_transactions": "4"}}, migrations.Prepare, &cluster))
}

// demoSchema is the seed's result table, protected, plus an unprotected
// audit table written in the same transactions.
const demoSchema = `
create table results (job_key text primary key, payload text not null, token bigint not null);
create table audit (job_key text not null, token bigint not null, note text not null);
select fence.protect('results');
-- tokens start at 17 so the tests read like the design's examples
select setval('fence.token_seq', 16);
`

// upsertSQL is the seed's conditional upsert (L1).
const upsertSQL = `insert into results (job_key, payload, token) values ($1, $2, $3)
on conflict (job_key) do update set payload = excluded.payload, token = excluded.token
where results.token < excluded.token`

type env struct {
	t     *testing.T
	db    string
	admin *pgx.Conn // superuser, outside any test transaction
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// newEnv creates a database with the demo schema.
func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{t: t, db: cluster.NewDatabase(t)}
	e.admin = e.connect()
	if _, err := e.admin.Exec(ctxT(t), demoSchema); err != nil {
		t.Fatalf("demo schema: %v", err)
	}
	return e
}

// parallelEnv marks t parallel and returns a fresh env and t's context.
func parallelEnv(t *testing.T) (*env, context.Context) {
	t.Helper()
	t.Parallel()
	return newEnv(t), ctxT(t)
}

// runEnv runs f as the parallel subtest name of t, in a fresh env.
func runEnv(t *testing.T, name string, f func(t *testing.T, e *env)) {
	t.Helper()
	t.Run(name, func(t *testing.T) {
		t.Parallel()
		f(t, newEnv(t))
	})
}

// eachIso runs f once per isolation level of isoLevels, each in a fresh
// env, as the subtests of the parallel subtest name.
func eachIso(t *testing.T, name string, f func(t *testing.T, e *env, iso pgx.TxIsoLevel)) {
	t.Helper()
	t.Run(name, func(t *testing.T) {
		t.Parallel()
		for _, iso := range isoLevels {
			t.Run(isoName(iso), func(t *testing.T) { f(t, newEnv(t), iso) })
		}
	})
}

// begin begins a transaction on conn at iso; it is rolled back when t
// ends unless it ended before.
func begin(t *testing.T, conn *pgx.Conn, iso pgx.TxIsoLevel) pgx.Tx {
	t.Helper()
	tx, err := conn.BeginTx(ctxT(t), pgx.TxOptions{IsoLevel: iso})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(context.Background()) })
	return tx
}

func (e *env) connect() *pgx.Conn { return e.connectAs("") }

func (e *env) connectAs(user string) *pgx.Conn {
	e.t.Helper()
	cfg, err := pgx.ParseConfig(cluster.Primary.DSN(e.db))
	if err != nil {
		e.t.Fatal(err)
	}
	if user != "" {
		cfg.User = user
	}
	conn, err := pgx.ConnectConfig(ctxT(e.t), cfg)
	if err != nil {
		e.t.Fatalf("connect as %q: %v", user, err)
	}
	e.t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.admin.Exec(ctxT(e.t), sql, args...); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
}

func (e *env) acquire(job, holder string) fence.Lease {
	e.t.Helper()
	l, err := fence.Acquire(ctxT(e.t), e.admin, job, holder, time.Minute)
	if err != nil {
		e.t.Fatalf("acquire %s for %s: %v", job, holder, err)
	}
	return l
}

// expireLease makes the job's lease expired, as if its holder stalled past
// the TTL (a GC pause), without waiting.
func (e *env) expireLease(job string) {
	e.t.Helper()
	e.exec("update fence.leases set expires_at = clock_timestamp() - interval '1 second' where job_key = $1", job)
}

// takeover expires the current lease and acquires the job for holder.
func (e *env) takeover(job, holder string) fence.Lease {
	e.t.Helper()
	e.expireLease(job)
	return e.acquire(job, holder)
}

type result struct {
	Payload string
	Token   int64
}

// results returns the results table as job -> row.
func (e *env) results() map[string]result {
	e.t.Helper()
	rows, err := e.admin.Query(ctxT(e.t), "select job_key, payload, token from results")
	if err != nil {
		e.t.Fatal(err)
	}
	out := map[string]result{}
	for rows.Next() {
		var k string
		var r result
		if err := rows.Scan(&k, &r.Payload, &r.Token); err != nil {
			e.t.Fatal(err)
		}
		out[k] = r
	}
	if err := rows.Err(); err != nil {
		e.t.Fatal(err)
	}
	return out
}

func (e *env) count(sql string, args ...any) int {
	e.t.Helper()
	var n int
	if err := e.admin.QueryRow(ctxT(e.t), sql, args...).Scan(&n); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// wantCount checks that sql counts want rows.
func (e *env) wantCount(t *testing.T, want int, sql string, args ...any) {
	t.Helper()
	if n := e.count(sql, args...); n != want {
		t.Fatalf("%s: got %d, want %d", sql, n, want)
	}
}

// wantResult checks job's row in the results table.
func (e *env) wantResult(t *testing.T, job string, want result) {
	t.Helper()
	if got, ok := e.results()[job]; !ok || got != want {
		t.Fatalf("result of %s: got %+v (present %v), want %+v", job, got, ok, want)
	}
}

// wantNoResults checks that the results table is empty.
func (e *env) wantNoResults(t *testing.T) {
	t.Helper()
	if got := e.results(); len(got) != 0 {
		t.Fatalf("results: got %v, want none", got)
	}
}

// wantWrite is writeResult of payload under g on conn at iso, which must
// end as want.
func (e *env) wantWrite(t *testing.T, conn *pgx.Conn, iso pgx.TxIsoLevel, g fence.Generation, payload string, want fence.CommitResult) {
	t.Helper()
	if res, err := writeResult(ctxT(t), conn, iso, g, payload); err != nil || res != want {
		t.Fatalf("writeResult %q under token %d: got %v, %v; want %v", payload, g.Token, res, err, want)
	}
}

// committed is holder A's generation of job "report", whose result
// payload committed at iso.
func (e *env) committed(t *testing.T, iso pgx.TxIsoLevel, payload string) fence.Generation {
	t.Helper()
	g := e.acquire("report", "A").Generation("")
	e.wantWrite(t, e.connect(), iso, g, payload, fence.Committed)
	return g
}

// holderTx is holder A's lease of job "report" and a transaction begun
// on a connection of A's own (rolled back when t ends).
func (e *env) holderTx(t *testing.T) (fence.Lease, *pgx.Conn, pgx.Tx) {
	t.Helper()
	a := e.acquire("report", "A")
	conn := e.connect()
	return a, conn, begin(t, conn, "")
}

// beginGated begins a transaction on conn and gates it as g, which must
// be answered GateOK.
func beginGated(tb testing.TB, ctx context.Context, conn *pgx.Conn, g fence.Generation) pgx.Tx {
	tb.Helper()
	tx, err := conn.Begin(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	if r, err := fence.Gate(ctx, tx, g); err != nil || r != fence.GateOK {
		tx.Rollback(ctx)
		tb.Fatalf("gate: %v, %v", r, err)
	}
	return tx
}

// writeResult is a worker's gated transaction: the protected upsert and an
// unprotected audit row, committed with a receipt of payload.
func writeResult(ctx context.Context, conn *pgx.Conn, iso pgx.TxIsoLevel, g fence.Generation, payload string) (fence.CommitResult, error) {
	return fence.RunTxOptions(ctx, conn, pgx.TxOptions{IsoLevel: iso}, g, []byte(payload), func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, upsertSQL, g.JobKey, payload, g.Token); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "insert into audit values ($1, $2, $3)", g.JobKey, g.Token, "wrote "+payload)
		return err
	})
}

// wantCode fails unless err carries SQLSTATE code. Errors of class FN may
// be a *fence.Error (from the fence API) or a raw *pgconn.PgError (from a
// plain statement that fired the backstop).
func wantCode(t *testing.T, err error, code string) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want SQLSTATE %s", code)
	}
	if got := pgtest.SQLState(err); got != code {
		t.Fatalf("got %v, want SQLSTATE %s", err, code)
	}
}

// wantFenceError is wantCode for errors returned by the fence API: they
// must be a *fence.Error.
func wantFenceError(t *testing.T, err error, code string) {
	t.Helper()
	wantCode(t, err, code)
	var fe *fence.Error
	if !errors.As(err, &fe) {
		t.Fatalf("got %T, want *fence.Error", err)
	}
	if fe.Code != code || fe.Message == "" || fe.Hint == "" {
		t.Fatalf("fence.Error: got code %q message %q hint %q, want code %s with a message and a hint", fe.Code, fe.Message, fe.Hint, code)
	}
}

var isoLevels = []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable}

func isoName(l pgx.TxIsoLevel) string { return strings.ReplaceAll(string(l), " ", "_") }

func setGUCs(ctx context.Context, db fence.DBTX, g fence.Generation) error {
	_, err := db.Exec(ctx, setSQL(g))
	return err
}

func setSQL(g fence.Generation) string {
	return fmt.Sprintf("set fence.job_key = %s; set fence.epoch = %d; set fence.token = %d; set fence.step = %s",
		quoteLit(g.JobKey), g.Epoch, g.Token, quoteLit(g.Step))
}

func quoteLit(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
