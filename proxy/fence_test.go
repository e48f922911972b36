package proxy

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// fenceEnv is a fresh database with a protected results table, an
// unprotected audit table, and a proxy with the write gate in front.
type fenceEnv struct {
	db    string
	proxy *testProxy
	gate  *Fence
}

const fenceSchema = `
CREATE TABLE results (job_key text PRIMARY KEY, payload text NOT NULL, token bigint NOT NULL);
CREATE TABLE audit (id bigserial PRIMARY KEY, note text NOT NULL);
SELECT fence.protect('results');
`

// upsert is the seed's conditional upsert (L1).
const upsert = `INSERT INTO results (job_key, payload, token) VALUES ($1, $2, $3)
ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token
WHERE results.token < excluded.token`

func newFenceEnv(t *testing.T) *fenceEnv { return newEnv(t, envSpec{}) }

// envSpec is what an env differs in from newFenceEnv's; its zero value is
// newFenceEnv's.
type envSpec struct {
	schema string      // run in the new database instead of fenceSchema
	gate   FenceConfig // the write gate's settings (Primary is the cluster's)
	log    *zap.Logger // the gate's logger instead of zaptest's
	proxy  Config      // the proxy's settings (Interceptor is the gate)
}

// newEnv is newFenceEnv as s says.
func newEnv(t *testing.T, s envSpec) *fenceEnv {
	t.Helper()
	if s.schema == "" {
		s.schema = fenceSchema
	}
	db := cluster.NewDatabaseWith(t, s.schema)
	gate := newGateWith(t, s.gate, s.log)
	s.proxy.Interceptor = gate
	return &fenceEnv{db: db, proxy: startProxy(t, s.proxy), gate: gate}
}

// direct is a connection straight to the primary (not through pgfence).
func (e *fenceEnv) direct(t *testing.T) *pgx.Conn {
	t.Helper()
	ctx := ctxT(t)
	c, err := cluster.Primary.Connect(ctx, e.db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

func (e *fenceEnv) acquire(t *testing.T, job, holder string, ttl time.Duration) fence.Lease {
	t.Helper()
	l, err := fence.Acquire(ctxT(t), e.direct(t), job, holder, ttl)
	if err != nil {
		t.Fatalf("acquire %s for %s: %v", job, holder, err)
	}
	return l
}

// release ends l's lease (its token stays the fence's current one).
func (e *fenceEnv) release(t *testing.T, l fence.Lease) {
	t.Helper()
	if err := fence.Release(ctxT(t), e.direct(t), l.JobKey, l.Token); err != nil {
		t.Fatalf("release: %v", err)
	}
}

// takeover ends the current lease of job and acquires a new one.
func (e *fenceEnv) takeover(t *testing.T, job, holder string, old fence.Lease) fence.Lease {
	t.Helper()
	e.release(t, fence.Lease{JobKey: job, Token: old.Token})
	return e.acquire(t, job, holder, time.Minute)
}

// pgoptions are the startup options that carry l's generation, as
// PGOPTIONS would, followed by extra.
func pgoptions(l fence.Lease, extra ...string) string {
	gen := fmt.Sprintf("-c fence.job_key=%s -c fence.epoch=%d -c fence.token=%d", l.JobKey, l.Epoch, l.Token)
	return strings.Join(append([]string{gen}, extra...), " ")
}

// worker connects through the proxy carrying l's generation in the
// startup packet, as PGOPTIONS would.
func (e *fenceEnv) worker(t *testing.T, l *fence.Lease, extra ...string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(e.proxy.dsn(e.db))
	if err != nil {
		t.Fatal(err)
	}
	if l != nil {
		cfg.RuntimeParams["options"] = pgoptions(*l, extra...)
	}
	return connectPgx(t, cfg)
}

func wantCode(t *testing.T, err error, code string) {
	t.Helper()
	if got := pgtest.SQLState(err); got != code {
		t.Fatalf("got error %v (SQLSTATE %q), want SQLSTATE %s", err, got, code)
	}
}

func (e *fenceEnv) count(t *testing.T, q string, args ...any) int {
	t.Helper()
	var n int
	if err := e.direct(t).QueryRow(ctxT(t), q, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return n
}

func TestGateSmoke(t *testing.T) {
	e := newFenceEnv(t)
	ctx := ctxT(t)
	l := e.acquire(t, "job1", "a", time.Minute)
	w := e.worker(t, &l)

	// Lone autocommit write: wrapped, gated, one receipt.
	if _, err := w.Exec(ctx, upsert, "job1", "first", l.Token); err != nil {
		t.Fatalf("gated upsert: %v", err)
	}
	if n := e.count(t, "SELECT count(*) FROM fence.receipts WHERE job_key = 'job1'"); n != 1 {
		t.Fatalf("got %d receipts, want 1", n)
	}
	// Simple protocol, as a second step of the same token.
	execOK(t, w, "SET fence.step = 'two'")
	if _, err := w.Exec(ctx, "INSERT INTO audit (note) VALUES ('x'); UPDATE results SET payload = 'second' WHERE job_key = 'job1'", pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatalf("gated simple query: %v", err)
	}
	// Explicit transaction, a third step.
	execOK(t, w, "SET fence.step = 'three'")
	tx := beginOK(t, w)
	if _, err := tx.Exec(ctx, "UPDATE results SET payload = 'third' WHERE job_key = $1", "job1"); err != nil {
		t.Fatalf("update in tx: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit: %v", err)
	}
	var payload string
	if err := e.direct(t).QueryRow(ctx, "SELECT payload FROM results WHERE job_key = 'job1'").Scan(&payload); err != nil || payload != "third" {
		t.Fatalf("got payload %q (%v), want third", payload, err)
	}
	if n := e.count(t, "SELECT count(*) FROM fence.receipts WHERE job_key = 'job1'"); n != 3 {
		t.Fatalf("got %d receipts, want 3", n)
	}
	if n := e.count(t, "SELECT count(*) FROM audit"); n != 1 {
		t.Fatalf("got %d audit rows, want 1", n)
	}
	// No metadata: FN008 from the proxy itself.
	anon := e.worker(t, nil)
	_, err := anon.Exec(ctx, "DELETE FROM results")
	wantCode(t, err, fence.CodeFencingRequired)
	if n := e.count(t, "SELECT count(*) FROM results"); n != 1 {
		t.Fatalf("got %d rows, want 1", n)
	}
	// Stale token after a takeover: FN001, session usable after.
	l2 := e.takeover(t, "job1", "b", l)
	execOK(t, w, "SET fence.step = 'four'")
	_, err = w.Exec(ctx, "UPDATE results SET payload = 'zombie' WHERE job_key = 'job1'")
	wantCode(t, err, fence.CodeStale)
	var one int
	if err := w.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
		t.Fatalf("session unusable after FN001: %v", err)
	}
	_ = l2
}

// TestSharedShapeWritesDigestTheirOwnText: unprotected writes with inlined
// values share one parse by shape (rewrite.Classifier.ClassifyShared), but
// inside a gated transaction each is digested with its own text: after a
// commit, the same transaction again is a replay, and one whose
// unprotected write differs only in a literal is a conflict (FN003). If the
// shared parse's text were digested, both would digest alike.
func TestSharedShapeWritesDigestTheirOwnText(t *testing.T) {
	e := newFenceEnv(t)
	ctx := ctxT(t)
	l := e.acquire(t, "job", "a", time.Minute)
	w := e.worker(t, &l)
	// Teach the classifier the shape, outside any gated transaction.
	for _, note := range []string{"warm-1", "warm-2"} {
		execOK(t, w, "INSERT INTO audit (note) VALUES ('"+note+"')", pgx.QueryExecModeSimpleProtocol)
	}
	tx := func(note string) error {
		for _, q := range []string{
			"BEGIN",
			fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('job', 'p', %d)", l.Token),
			"INSERT INTO audit (note) VALUES ('" + note + "')",
		} {
			if _, err := w.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol); err != nil {
				w.Exec(ctx, "ROLLBACK")
				return err
			}
		}
		_, err := w.Exec(ctx, "COMMIT", pgx.QueryExecModeSimpleProtocol)
		return err
	}
	if err := tx("first"); err != nil {
		t.Fatalf("first commit: %v", err)
	}
	if err := tx("first"); err != nil {
		t.Fatalf("the same transaction again: %v, want a replay (COMMIT)", err)
	}
	// After a replay fence.step is replayStep: the same step again, set.
	if _, err := w.Exec(ctx, "SET fence.step = ''", pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	wantCode(t, tx("other"), fence.CodeConflict)
	e.wantCount(t, 1, "SELECT count(*) FROM audit WHERE note = 'first'")
	e.wantCount(t, 0, "SELECT count(*) FROM audit WHERE note = 'other'")
}

// TestExecuteOfParsedStatement: protocol-level and SQL-level prepared
// statements share one namespace, so EXECUTE runs a statement the client
// parsed with the extended protocol, and what it sets is read from the
// statements as the connection accepted them (session.Statements, which
// the session's State refers to). A worker connects with a token that is
// not its lease's, parses a statement that sets the right one, and
// EXECUTEs it: the gate must check the token the session now has, not
// the one it started with.
func TestExecuteOfParsedStatement(t *testing.T) {
	e := newFenceEnv(t)
	ctx := ctxT(t)
	l := e.acquire(t, "job", "a", time.Minute)
	wrong := l
	wrong.Token += 1000
	w := e.worker(t, &wrong)
	setter := fmt.Sprintf("SELECT set_config('fence.token', '%d', false)", l.Token)
	if _, err := w.PgConn().Prepare(ctx, "set_token", setter, nil); err != nil {
		t.Fatalf("Parse set_token: %v", err)
	}
	execOK(t, w, "EXECUTE set_token", pgx.QueryExecModeSimpleProtocol)
	if _, err := w.Exec(ctx, "INSERT INTO results (job_key, payload, token) VALUES ('job', 'p', $1)", l.Token); err != nil {
		t.Fatalf("gated insert after EXECUTE set_token: %v, want the token it set checked", err)
	}
	e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'job'")
	e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'job'")
}
