package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/cutrelay"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/testbin"
)

// TestAcceptance proves the proxy-level cases of ACCEPTANCE.md (issue 4)
// with clients that know nothing of pgfence but the session GUCs.
func TestAcceptance(t *testing.T) {
	t.Run("A01_stale_holder_write_refused", testA01)
	t.Run("A02_holder_commits_first_takeover_waits", testA02)
	t.Run("A03_takeover_first_stale_commit_rolls_back", testA03)
	t.Run("A04_lost_commit_response_retry_is_replay", testA04)
	t.Run("A05_same_step_different_payload_conflict", testA05)
	t.Run("A06_retry_after_takeover_is_replay", testA06)
	t.Run("A07_no_receipt_after_takeover_is_stale", testA07)
	t.Run("A10_request_from_retired_lifecycle_rejected", testA10)
	t.Run("A11_pruned_receipt_cannot_confirm", testA11)
	t.Run("A13_every_path_without_metadata_refused", testA13)
	t.Run("A14_implicit_transactions_gated_once", testA14)
	t.Run("A15_disconnect_or_kill_inside_gated_tx", testA15)
	t.Run("A16_metadata_follows_postgres_semantics", testA16)
	t.Run("FN009_prepare_transaction_refused", testPrepareTransaction)
	t.Run("psql", testPsql)
}

// ---------------------------------------------------------------------------
// Harness

// execModes are the two protocols a receipt path must work through.
var execModes = []struct {
	name string
	mode pgx.QueryExecMode
}{
	{"extended", pgx.QueryExecModeCacheStatement},
	{"simple", pgx.QueryExecModeSimpleProtocol},
}

var isoLevels = []struct {
	name string
	iso  pgx.TxIsoLevel
}{
	{"read_committed", ""},
	{"repeatable_read", pgx.RepeatableRead},
	{"serializable", pgx.Serializable},
}

// notices collects the notices a client receives.
type notices struct {
	mu   sync.Mutex
	list []*pgconn.Notice
}

func (n *notices) add(_ *pgconn.PgConn, x *pgconn.Notice) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.list = append(n.list, x)
}

// codes returns the SQLSTATEs received so far and forgets them.
func (n *notices) take() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []string
	for _, x := range n.list {
		out = append(out, x.Code)
	}
	n.list = nil
	return out
}

// client describes how a test client connects.
type client struct {
	lease   *fence.Lease
	mode    pgx.QueryExecMode
	notices *notices
	addr    string // host:port instead of the proxy's
	db      string // instead of the env's
	extra   []string
}

// connect opens a pgx connection through the proxy (or c.addr) carrying
// the lease's generation in the startup options, as PGOPTIONS would.
func (e *fenceEnv) connect(t *testing.T, c client) (*pgx.Conn, error) {
	t.Helper()
	addr := c.addr
	if addr == "" {
		addr = e.proxy.addr.String()
	}
	db := c.db
	if db == "" {
		db = e.db
	}
	cfg, err := pgx.ParseConfig(fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", addr, db))
	if err != nil {
		t.Fatal(err)
	}
	if c.mode != 0 {
		cfg.DefaultQueryExecMode = c.mode
	}
	var opts []string
	if c.lease != nil {
		opts = append(opts, pgoptions(*c.lease))
	}
	opts = append(opts, c.extra...)
	if len(opts) > 0 {
		cfg.RuntimeParams["options"] = strings.Join(opts, " ")
	}
	if c.notices != nil {
		cfg.OnNotice = c.notices.add
	}
	conn, err := pgx.ConnectConfig(ctxT(t), cfg)
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn, nil
}

func (e *fenceEnv) mustConnect(t *testing.T, c client) *pgx.Conn {
	t.Helper()
	conn, err := e.connect(t, c)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	return conn
}

// writeTx is a worker's result transaction: a note in the unprotected
// audit table, then the conditional upsert of the result.
func writeTx(ctx context.Context, c *pgx.Conn, iso pgx.TxIsoLevel, job, payload string, token int64) error {
	tx, err := c.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "INSERT INTO audit (note) VALUES ($1)", payload); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, upsert, job, payload, token); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// result returns the job's result row (payload, token), or "", 0.
func (e *fenceEnv) result(t *testing.T, job string) (string, int64) {
	t.Helper()
	var p string
	var tok int64
	err := e.direct(t).QueryRow(ctxT(t), "SELECT payload, token FROM results WHERE job_key = $1", job).Scan(&p, &tok)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", 0
	}
	if err != nil {
		t.Fatal(err)
	}
	return p, tok
}

func (e *fenceEnv) wantResult(t *testing.T, job, payload string, token int64) {
	t.Helper()
	if p, tok := e.result(t, job); p != payload || tok != token {
		t.Fatalf("result of %s: got (%q, %d), want (%q, %d)", job, p, tok, payload, token)
	}
}

func (e *fenceEnv) wantCount(t *testing.T, want int, q string, args ...any) {
	t.Helper()
	if n := e.count(t, q, args...); n != want {
		t.Fatalf("%s: got %d, want %d", q, n, want)
	}
}

func backendPID(t *testing.T, c *pgx.Conn) uint32 {
	t.Helper()
	var pid uint32
	if err := c.QueryRow(ctxT(t), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatalf("pg_backend_pid: %v", err)
	}
	return pid
}

// waitGone waits until backend pid has ended.
func (e *fenceEnv) waitGone(t *testing.T, pid uint32) {
	t.Helper()
	obs := e.direct(t)
	err := pgtest.Poll(ctxT(t), func() (bool, error) {
		var alive bool
		err := obs.QueryRow(ctxT(t), "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", pid).Scan(&alive)
		return !alive, err
	})
	if err != nil {
		t.Fatalf("backend %d still there: %v", pid, err)
	}
}

// fenceRowFree reports whether the job's fence row can be locked right now
// (FOR UPDATE NOWAIT): a row lock is not listed in pg_locks by row, so it
// is probed instead.
func (e *fenceEnv) fenceRowFree(t *testing.T, job string) bool {
	t.Helper()
	ctx := ctxT(t)
	// A connection of its own, closed at once: callers poll this, and
	// e.direct's connections live until the test ends.
	c, err := cluster.Primary.Connect(ctx, e.db)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	tx := beginOK(t, c)
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, "SELECT 1 FROM fence.fences WHERE job_key = $1 FOR UPDATE NOWAIT", job)
	if pgtest.SQLState(err) == "55P03" {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}

// eachMode runs f once per protocol of execModes, each in a fresh env, as
// the subtests prefix+protocol.
func eachMode(t *testing.T, prefix string, f func(t *testing.T, e *fenceEnv, mode pgx.QueryExecMode)) {
	t.Helper()
	for _, m := range execModes {
		t.Run(prefix+m.name, func(t *testing.T) { f(t, newFenceEnv(t), m.mode) })
	}
}

// mustWriteTx is writeTx, which must commit.
func mustWriteTx(t *testing.T, c *pgx.Conn, iso pgx.TxIsoLevel, job, payload string, token int64) {
	t.Helper()
	if err := writeTx(ctxT(t), c, iso, job, payload, token); err != nil {
		t.Fatalf("result transaction %q with token %d: %v", payload, token, err)
	}
}

// beginOK begins a transaction on c, which must succeed; the caller
// commits it or rolls it back.
func beginOK(t *testing.T, c *pgx.Conn) pgx.Tx {
	t.Helper()
	tx, err := c.Begin(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	return tx
}

// execOK runs sql on c (a connection or a transaction), which must
// succeed.
func execOK(t *testing.T, c fence.DBTX, sql string, args ...any) {
	t.Helper()
	if _, err := c.Exec(ctxT(t), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// want checks that the notices received since the last take have exactly
// the SQLSTATEs codes, in order.
func (n *notices) want(t *testing.T, codes ...string) {
	t.Helper()
	if got := n.take(); !slices.Equal(got, codes) {
		t.Fatalf("notices: got %v, want %v", got, codes)
	}
}

// wantNothingWritten checks that the job has no result, and that no audit
// row and no receipt exist.
func (e *fenceEnv) wantNothingWritten(t *testing.T) {
	t.Helper()
	e.wantResult(t, "job", "", 0)
	e.wantCount(t, 0, "SELECT count(*) FROM audit")
	e.wantCount(t, 0, "SELECT count(*) FROM fence.receipts")
}

// wantUsable checks that c's session still answers a query.
func wantUsable(t *testing.T, c *pgx.Conn) {
	t.Helper()
	var one int
	if err := c.QueryRow(ctxT(t), "SELECT 1").Scan(&one); err != nil {
		t.Fatalf("session unusable: %v", err)
	}
}

// releasedHolder is A, whose lease of the job has ended (its token is
// still the fence's current one, so B may take over), connected.
func (e *fenceEnv) releasedHolder(t *testing.T, mode pgx.QueryExecMode) (fence.Lease, *pgx.Conn) {
	t.Helper()
	la := e.acquire(t, "job", "a", time.Minute)
	e.release(t, la)
	return la, e.mustConnect(t, client{lease: &la, mode: mode})
}

// ---------------------------------------------------------------------------
// A01–A07, A10, A11

func testA01(t *testing.T) {
	eachMode(t, "", func(t *testing.T, e *fenceEnv, mode pgx.QueryExecMode) {
		ctx := ctxT(t)
		la := e.acquire(t, "job", "a", time.Minute)
		lb := e.takeover(t, "job", "b", la) // B holds 18 and has not written
		a := e.mustConnect(t, client{lease: &la, mode: mode})
		err := writeTx(ctx, a, "", "job", "from A", la.Token)
		wantCode(t, err, fence.CodeStale)
		e.wantNothingWritten(t)
		// A's session is usable and still refused.
		_, err = a.Exec(ctx, upsert, "job", "from A again", la.Token)
		wantCode(t, err, fence.CodeStale)
		// B commits normally.
		b := e.mustConnect(t, client{lease: &lb, mode: mode})
		mustWriteTx(t, b, "", "job", "from B", lb.Token)
		e.wantResult(t, "job", "from B", lb.Token)
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE token = $1", lb.Token)
	})
}

func testA02(t *testing.T) {
	eachMode(t, "", func(t *testing.T, e *fenceEnv, mode pgx.QueryExecMode) {
		ctx := ctxT(t)
		// A's lease ends (it is still the fence's current token), so B
		// may take over; A is in the middle of its result transaction.
		la, a := e.releasedHolder(t, mode)
		tx := beginOK(t, a)
		execOK(t, tx, upsert, "job", "from A", la.Token)
		// B's takeover waits for A's fence row lock.
		bconn := e.direct(t)
		done := pgtest.Blocked(t, e.direct(t), bconn.PgConn().PID(), func() (fence.Lease, error) {
			return fence.Acquire(ctx, bconn, "job", "b", time.Minute)
		})
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("A's commit while B waits: %v", err)
		}
		r := <-done
		if r.Err != nil {
			t.Fatalf("B's acquire: %v", r.Err)
		}
		lb := r.Val
		if lb.Token <= la.Token {
			t.Fatalf("B got token %d, want > %d", lb.Token, la.Token)
		}
		// A's result stands (committed with the old token, legitimately).
		e.wantResult(t, "job", "from A", la.Token)
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE token = $1", la.Token)
		// B's write supersedes it.
		b := e.mustConnect(t, client{lease: &lb, mode: mode})
		mustWriteTx(t, b, "", "job", "from B", lb.Token)
		e.wantResult(t, "job", "from B", lb.Token)
		// And A is fenced off now: a new commit of its token (a new
		// step; the committed one would be answered from its receipt)
		// is stale.
		execOK(t, a, "SET fence.step = 'late'")
		_, err := a.Exec(ctx, upsert, "job", "from A late", la.Token)
		wantCode(t, err, fence.CodeStale)
	})
}

func testA03(t *testing.T) {
	eachMode(t, "", func(t *testing.T, e *fenceEnv, mode pgx.QueryExecMode) {
		ctx := ctxT(t)
		la, a := e.releasedHolder(t, mode)
		apid := backendPID(t, a)
		tx := beginOK(t, a)
		// A writes an unprotected table first: not gated yet.
		execOK(t, tx, "INSERT INTO audit (note) VALUES ($1)", "A was here")
		// B's takeover is in progress: its acquire holds the fence row.
		b := e.direct(t)
		btx := beginOK(t, b)
		defer btx.Rollback(ctx)
		var lb fence.Lease
		if err := btx.QueryRow(ctx, "SELECT epoch, token FROM fence.acquire('job', 'b', '1 minute')").Scan(&lb.Epoch, &lb.Token); err != nil {
			t.Fatal(err)
		}
		lb.JobKey = "job"
		// A's first protected write: its gate waits for the takeover.
		werr := pgtest.Blocked(t, e.direct(t), apid, func() (pgconn.CommandTag, error) {
			return tx.Exec(ctx, upsert, "job", "from A", la.Token)
		})
		if err := btx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		wantCode(t, (<-werr).Err, fence.CodeStale)
		err := tx.Commit(ctx)
		if !errors.Is(err, pgx.ErrTxCommitRollback) && pgtest.SQLState(err) != fence.CodeStale {
			t.Fatalf("A's COMMIT after FN001: got %v, want a rollback", err)
		}
		// Nothing of A's transaction is visible, not even the audit row.
		e.wantNothingWritten(t)
		// B commits normally; A's session is idle and usable.
		bw := e.mustConnect(t, client{lease: &lb, mode: mode})
		mustWriteTx(t, bw, "", "job", "from B", lb.Token)
		e.wantResult(t, "job", "from B", lb.Token)
		wantUsable(t, a)
	})
}

// startCutRelay puts a cutrelay in front of the proxy: once the client has
// sent a message matching cut, the proxy's answer is lost and both sides
// closed at its ReadyForQuery.
func startCutRelay(t *testing.T, target string, cut func(typ byte, body []byte) bool) *cutrelay.Relay {
	t.Helper()
	r, err := cutrelay.Start(target, cut)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	return r
}

// implicitWriteCut cuts after the Sync of a lone autocommit write of the
// results table (an implicit transaction the proxy wraps), in either
// protocol.
func implicitWriteCut() func(typ byte, body []byte) bool {
	var sawWrite atomic.Bool
	return func(typ byte, body []byte) bool {
		switch typ {
		case 'Q':
			return strings.Contains(string(body), "INSERT INTO results")
		case 'P':
			if strings.Contains(string(body), "INSERT INTO results") {
				sawWrite.Store(true)
			}
		case 'B':
			return sawWrite.Load()
		}
		return false
	}
}

func testA04(t *testing.T) {
	for _, m := range execModes {
		for _, iso := range isoLevels {
			t.Run(m.name+"/"+iso.name, func(t *testing.T) {
				testA04Retry(t, m.mode, cutrelay.IsCommitQuery, 1, func(ctx context.Context, c *pgx.Conn, token int64) error {
					return writeTx(ctx, c, iso.iso, "job", "payload", token)
				})
			})
		}
	}
	// A lone autocommit write (an implicit transaction the proxy wraps)
	// whose response is lost after its Sync.
	for _, m := range execModes {
		t.Run("implicit_"+m.name, func(t *testing.T) {
			testA04Retry(t, m.mode, implicitWriteCut(), 0, func(ctx context.Context, c *pgx.Conn, token int64) error {
				_, err := c.Exec(ctx, upsert, "job", "payload", token)
				return err
			})
		})
	}
}

// testA04Retry: the response to write is lost (cut) after its commit went
// through; the client's retry of the same payload is a replay, and the
// session is usable after it. audit is the audit rows write leaves.
func testA04Retry(t *testing.T, mode pgx.QueryExecMode, cut func(typ byte, body []byte) bool, audit int, write func(ctx context.Context, c *pgx.Conn, token int64) error) {
	e := newFenceEnv(t)
	ctx := ctxT(t)
	l := e.acquire(t, "job", "a", time.Minute)
	relay := startCutRelay(t, e.proxy.addr.String(), cut)
	a := e.mustConnect(t, client{lease: &l, mode: mode, addr: relay.Addr()})
	if err := write(ctx, a, l.Token); err == nil {
		t.Fatal("the response reached the client; the relay did not cut")
	}
	<-relay.Fired()
	// The commit went through: the receipt and the rows exist.
	e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'job' AND token = $1", l.Token)
	e.wantResult(t, "job", "payload", l.Token)
	// The client reconnects and retries the same payload.
	var ns notices
	a2 := e.mustConnect(t, client{lease: &l, mode: mode, notices: &ns})
	if err := write(ctx, a2, l.Token); err != nil {
		t.Fatalf("retry after the lost response: %v", err)
	}
	ns.want(t, fence.CodeReplay)
	e.wantResult(t, "job", "payload", l.Token)
	e.wantCount(t, audit, "SELECT count(*) FROM audit")
	e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts")
	// The session is idle and usable after the replay.
	wantUsable(t, a2)
}

func testA05(t *testing.T) {
	for _, m := range execModes {
		for _, iso := range isoLevels {
			t.Run(m.name+"/"+iso.name, func(t *testing.T) {
				e := newFenceEnv(t)
				ctx := ctxT(t)
				l := e.acquire(t, "job", "a", time.Minute)
				var ns notices
				a := e.mustConnect(t, client{lease: &l, mode: m.mode, notices: &ns})
				mustWriteTx(t, a, iso.iso, "job", "first", l.Token)
				err := writeTx(ctx, a, iso.iso, "job", "second", l.Token)
				wantCode(t, err, fence.CodeConflict)
				ns.want(t)
				e.wantResult(t, "job", "first", l.Token)
				e.wantCount(t, 1, "SELECT count(*) FROM audit")
				e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts")
				// Idle and usable: a different step commits.
				execOK(t, a, "SET fence.step = 'next'")
				mustWriteTx(t, a, iso.iso, "job", "second", l.Token)
				e.wantResult(t, "job", "first", l.Token) // same token: the upsert keeps the first
				e.wantCount(t, 2, "SELECT count(*) FROM fence.receipts")
			})
		}
	}
}

// committedThenTakenOver is A06's and A11's start: A commits "payload"
// with lease la, then B takes the job over.
func committedThenTakenOver(t *testing.T, e *fenceEnv, mode pgx.QueryExecMode) (la fence.Lease) {
	t.Helper()
	la = e.acquire(t, "job", "a", time.Minute)
	a := e.mustConnect(t, client{lease: &la, mode: mode})
	mustWriteTx(t, a, "", "job", "payload", la.Token)
	e.takeover(t, "job", "b", la)
	return la
}

func testA06(t *testing.T) {
	eachMode(t, "", func(t *testing.T, e *fenceEnv, mode pgx.QueryExecMode) {
		la := committedThenTakenOver(t, e, mode)
		var ns notices
		a2 := e.mustConnect(t, client{lease: &la, mode: mode, notices: &ns})
		if err := writeTx(ctxT(t), a2, "", "job", "payload", la.Token); err != nil {
			t.Fatalf("A's retry after the takeover: got %v, want replay success", err)
		}
		ns.want(t, fence.CodeReplay)
		e.wantResult(t, "job", "payload", la.Token)
		e.wantCount(t, 1, "SELECT count(*) FROM audit")
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts")
	})
}

func testA07(t *testing.T) {
	eachMode(t, "", func(t *testing.T, e *fenceEnv, mode pgx.QueryExecMode) {
		la := e.acquire(t, "job", "a", time.Minute)
		e.takeover(t, "job", "b", la)
		var ns notices
		a := e.mustConnect(t, client{lease: &la, mode: mode, notices: &ns})
		err := writeTx(ctxT(t), a, "", "job", "payload", la.Token)
		wantCode(t, err, fence.CodeStale)
		ns.want(t)
		e.wantNothingWritten(t)
	})
}

func testA10(t *testing.T) {
	eachMode(t, "", func(t *testing.T, e *fenceEnv, mode pgx.QueryExecMode) {
		ctx := ctxT(t)
		old := e.acquire(t, "job", "a", time.Minute)
		a := e.mustConnect(t, client{lease: &old, mode: mode})
		mustWriteTx(t, a, "", "job", "old lifecycle", old.Token)
		// Clean up: retire, collect receipts, delete the business row.
		if err := fence.Retire(ctx, e.direct(t), "job", fence.RetireOptions{Force: true}); err != nil {
			t.Fatal(err)
		}
		e.wantGC(t, 1)
		// A DBA (member of pgfence_bypass) deletes the business row.
		dba := pgx.Identifier{"dba_" + e.db}.Sanitize()
		execOK(t, e.direct(t), fmt.Sprintf("CREATE ROLE %[1]s IN ROLE pgfence_bypass; GRANT DELETE ON results TO %[1]s; SET ROLE %[1]s; DELETE FROM results; RESET ROLE", dba))
		e.wantResult(t, "job", "", 0)
		// The same business key again: a new lifecycle.
		nl := e.acquire(t, "job", "b", time.Minute)
		if nl.Epoch == old.Epoch || nl.Token <= old.Token {
			t.Fatalf("new lifecycle (epoch %d, token %d) does not supersede the old (epoch %d, token %d)", nl.Epoch, nl.Token, old.Epoch, old.Token)
		}
		var maxOld int64
		if err := e.direct(t).QueryRow(ctx, "SELECT max(token) FROM fence.issuance WHERE epoch = $1", old.Epoch).Scan(&maxOld); err != nil || nl.Token <= maxOld {
			t.Fatalf("new token %d not larger than every old one (%d, %v)", nl.Token, maxOld, err)
		}
		b := e.mustConnect(t, client{lease: &nl, mode: mode})
		mustWriteTx(t, b, "", "job", "new lifecycle", nl.Token)
		// A request saved from before the clean-up: the same payload,
		// and a different one.
		for _, payload := range []string{"old lifecycle", "late write"} {
			stale := e.mustConnect(t, client{lease: &old, mode: mode})
			err := writeTx(ctx, stale, "", "job", payload, old.Token)
			wantCode(t, err, fence.CodeRetired)
		}
		e.wantResult(t, "job", "new lifecycle", nl.Token)
		e.wantCount(t, 2, "SELECT count(*) FROM audit")
		e.wantCount(t, 0, "SELECT count(*) FROM fence.receipts WHERE epoch = $1", old.Epoch)
	})
}

// wantGC collects every receipt it may and checks it collected n.
func (e *fenceEnv) wantGC(t *testing.T, n int64) {
	t.Helper()
	if got, err := fence.GC(ctxT(t), e.direct(t), 0); err != nil || got != n {
		t.Fatalf("gc: %d, %v; want %d receipt(s)", got, err, n)
	}
}

func testA11(t *testing.T) {
	eachMode(t, "", func(t *testing.T, e *fenceEnv, mode pgx.QueryExecMode) {
		la := committedThenTakenOver(t, e, mode)
		e.wantGC(t, 1)
		var ns notices
		a2 := e.mustConnect(t, client{lease: &la, mode: mode, notices: &ns})
		err := writeTx(ctxT(t), a2, "", "job", "payload", la.Token)
		wantCode(t, err, fence.CodeExpired)
		ns.want(t)
		e.wantCount(t, 1, "SELECT count(*) FROM audit")
		e.wantCount(t, 0, "SELECT count(*) FROM fence.receipts")
		e.wantResult(t, "job", "payload", la.Token)
	})
}

// ---------------------------------------------------------------------------
// A13: every path to a protected table without valid metadata

const a13Schema = `
CREATE FUNCTION write_results(k text) RETURNS void LANGUAGE sql AS
  $$ INSERT INTO results (job_key, payload, token) VALUES (k, 'via function', 999) $$;
CREATE VIEW results_view AS SELECT job_key, payload, token FROM results;
CREATE TABLE staging (job_key text, payload text, token bigint);
INSERT INTO staging VALUES ('merged', 'via merge', 999);
`

// newA13Env is an env with a13Schema whose job has a result ("legit",
// committed with the lease it returns) and was then taken over: the
// lease is stale.
func newA13Env(t *testing.T) (*fenceEnv, fence.Lease) {
	t.Helper()
	e := newEnv(t, envSpec{schema: fenceSchema + a13Schema})
	l := e.acquire(t, "job", "a", time.Minute)
	w := e.mustConnect(t, client{lease: &l})
	execOK(t, w, upsert, "job", "legit", l.Token)
	e.takeover(t, "job", "b", l)
	return e, l
}

func testA13(t *testing.T) {
	e, l := newA13Env(t)
	// Each subtest (run one after another) gets its own deadline: the
	// paths read ctx, set before each runs. One deadline for all 70 ran
	// out under load (a CI-like run with other tests beside it).
	ctx := ctxT(t)
	stale := l

	type path struct {
		name string
		run  func(c *pgx.Conn) error
	}
	simple := pgx.QueryExecModeSimpleProtocol
	paths := []path{
		{"insert_extended", func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, upsert, "x", "plain", 999)
			return err
		}},
		{"update_simple", func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, "UPDATE results SET payload = 'plain'", simple)
			return err
		}},
		{"delete_extended", func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, "DELETE FROM results WHERE token > $1", 0)
			return err
		}},
		{"multi_statement_simple", func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, "INSERT INTO audit (note) VALUES ('multi'); INSERT INTO results VALUES ('m', 'multi', 999); INSERT INTO audit (note) VALUES ('after')")
			return err
		}},
		{"pipeline", func(c *pgx.Conn) error {
			p := c.PgConn().StartPipeline(ctx)
			p.SendQueryParams("INSERT INTO audit (note) VALUES ($1)", [][]byte{[]byte("pipelined")}, nil, nil, nil)
			p.SendQueryParams("INSERT INTO results VALUES ($1, 'pipelined', 999)", [][]byte{[]byte("p")}, nil, nil, nil)
			p.SendQueryParams("INSERT INTO audit (note) VALUES ($1)", [][]byte{[]byte("after")}, nil, nil, nil)
			p.SendPipelineSync()
			if err := p.Flush(); err != nil {
				return err
			}
			var first error
			for {
				r, err := p.GetResults()
				if err != nil {
					if first == nil {
						first = err
					}
					continue
				}
				if r == nil {
					break
				}
				switch r := r.(type) {
				case *pgconn.ResultReader:
					if _, err := r.Close(); err != nil && first == nil {
						first = err
					}
				case *pgconn.PipelineSync:
					if err := p.Close(); err != nil && first == nil {
						first = err
					}
					return first
				}
			}
			if err := p.Close(); err != nil && first == nil {
				first = err
			}
			return first
		}},
		{"writable_cte", func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, "WITH w AS (INSERT INTO results VALUES ($1, 'cte', 999) RETURNING *) SELECT count(*) FROM w", "cte")
			return err
		}},
		{"merge", func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, `MERGE INTO results r USING staging s ON r.job_key = s.job_key
				WHEN MATCHED THEN UPDATE SET payload = s.payload WHEN NOT MATCHED THEN INSERT VALUES (s.job_key, s.payload, s.token)`)
			return err
		}},
		{"copy_from", func(c *pgx.Conn) error {
			_, err := c.CopyFrom(ctx, pgx.Identifier{"results"}, []string{"job_key", "payload", "token"},
				pgx.CopyFromRows([][]any{{"c1", "copied", int64(999)}, {"c2", "copied", int64(999)}}))
			return err
		}},
		// COPY FROM STDIN from a client that waits for CopyInResponse
		// before sending data (as psql does; pgconn answers an unexpected
		// CopyInResponse with CopyFail): a refusal must answer the query.
		{"copy_from_waiting_client", func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, "COPY results (job_key, payload, token) FROM STDIN")
			return err
		}},
		{"truncate", func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, "TRUNCATE results")
			return err
		}},
		{"function", func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, "SELECT write_results($1)", "f")
			return err
		}},
		{"updatable_view", func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, "INSERT INTO results_view VALUES ($1, 'via view', 999)", "v")
			return err
		}},
		{"do_block", func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, "DO $$BEGIN DELETE FROM results; END$$")
			return err
		}},
	}
	direct := cluster.Primary.Addr()
	sessions := []struct {
		name  string
		c     client
		codes []string
	}{
		{"no_metadata", client{}, []string{fence.CodeFencingRequired}},
		// A stale token for a step it never committed (the committed step
		// would be answered from its receipt: replay or conflict).
		{"stale_token", client{lease: &stale, extra: []string{"-c fence.step=other"}}, []string{fence.CodeStale}},
		{"job_key_only", client{extra: []string{"-c fence.job_key=job"}}, []string{fence.CodeFencingRequired}},
		{"direct_no_metadata", client{addr: direct}, []string{fence.CodeFencingRequired}},
		{"direct_stale_token", client{addr: direct, lease: &stale, extra: []string{"-c fence.step=other"}}, []string{fence.CodeStale}},
	}
	for _, s := range sessions {
		for _, p := range paths {
			t.Run(s.name+"/"+p.name, func(t *testing.T) {
				ctx = ctxT(t)
				c := e.mustConnect(t, s.c)
				err := p.run(c)
				if got := pgtest.SQLState(err); !slices.Contains(s.codes, got) {
					t.Fatalf("got %v (SQLSTATE %q), want SQLSTATE %v", err, got, s.codes)
				}
				e.wantResult(t, "job", "legit", l.Token)
				e.wantCount(t, 1, "SELECT count(*) FROM results")
				e.wantCount(t, 0, "SELECT count(*) FROM audit")
				e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts")
				// The session is idle and usable after the refusal.
				wantUsable(t, c)
			})
		}
	}
}

// ---------------------------------------------------------------------------
// A14

func testA14(t *testing.T) {
	eachMode(t, "lone_write_", func(t *testing.T, e *fenceEnv, mode pgx.QueryExecMode) {
		l := e.acquire(t, "job", "a", time.Minute)
		w := e.mustConnect(t, client{lease: &l, mode: mode})
		execOK(t, w, upsert, "job", "lone", l.Token)
		e.wantResult(t, "job", "lone", l.Token)
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts")
		// One transaction: the result row and the receipt share an xid.
		e.wantCount(t, 1, `SELECT count(DISTINCT x) FROM (SELECT xmin::text x FROM results
			UNION ALL SELECT xmin::text FROM fence.receipts) s`)
		e.wantCount(t, 0, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'")
	})
	t.Run("multi_statement_simple", func(t *testing.T) {
		e := newFenceEnv(t)
		ctx := ctxT(t)
		l := e.acquire(t, "job", "a", time.Minute)
		w := e.mustConnect(t, client{lease: &l})
		execOK(t, w, fmt.Sprintf("INSERT INTO audit (note) VALUES ('one'); INSERT INTO results VALUES ('job', 'multi', %d); INSERT INTO audit (note) VALUES ('two'); UPDATE results SET payload = 'multi2'", l.Token))
		e.wantResult(t, "job", "multi2", l.Token)
		e.wantCount(t, 2, "SELECT count(*) FROM audit")
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts")
		e.wantCount(t, 1, `SELECT count(DISTINCT x) FROM (SELECT xmin::text x FROM results
			UNION ALL SELECT xmin::text FROM audit UNION ALL SELECT xmin::text FROM fence.receipts) s`)
		// A failure late in the query undoes all of it, the receipt too.
		execOK(t, w, "SET fence.step = 'two'")
		_, err := w.Exec(ctx, "INSERT INTO audit (note) VALUES ('three'); UPDATE results SET payload = 'multi3'; SELECT 1/0")
		wantCode(t, err, "22012")
		e.wantResult(t, "job", "multi2", l.Token)
		e.wantCount(t, 2, "SELECT count(*) FROM audit")
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts")
		// The same step retried succeeds as a first commit.
		execOK(t, w, "INSERT INTO audit (note) VALUES ('three'); UPDATE results SET payload = 'multi3'")
		e.wantResult(t, "job", "multi3", l.Token)
		e.wantCount(t, 2, "SELECT count(*) FROM fence.receipts")
	})
}

// ---------------------------------------------------------------------------
// A15

func testA15(t *testing.T) {
	eachMode(t, "client_disconnects_", func(t *testing.T, e *fenceEnv, mode pgx.QueryExecMode) {
		l := e.acquire(t, "job", "a", time.Minute)
		e.release(t, l)
		other := e.mustConnect(t, client{lease: &l, mode: mode, extra: []string{"-c fence.step=other"}})
		a := e.mustConnect(t, client{lease: &l, mode: mode})
		pid := backendPID(t, a)
		e.beginHoldingFence(t, a, l)
		// The client vanishes without a word.
		a.PgConn().Conn().Close()
		e.waitFenceFreed(t, pid, "the client left")
		// The other session of the same proxy continues.
		if _, err := other.Exec(ctxT(t), upsert, "job", "from other", l.Token); err != nil {
			t.Fatalf("other session: %v", err)
		}
		e.wantTakeoverNow(t, "after the disconnect")
	})
	t.Run("proxy_killed", func(t *testing.T) {
		e := newFenceEnv(t)
		addr := startFenceServe(t) // may build the binary first: before the deadline starts
		ctx := ctxT(t)
		l := e.acquire(t, "job", "a", time.Minute)
		e.release(t, l)
		a := e.mustConnect(t, client{lease: &l, addr: addr.String()})
		pid := backendPID(t, a)
		tx := e.beginHoldingFence(t, a, l)
		addr.kill(t)
		if err := tx.Commit(ctx); err == nil {
			t.Fatal("COMMIT succeeded through a killed proxy")
		}
		e.waitFenceFreed(t, pid, "the proxy died")
		// Other sessions (through the in-process proxy) continue.
		w := e.mustConnect(t, client{lease: &l})
		if _, err := w.Exec(ctx, upsert, "job", "after", l.Token); err != nil {
			t.Fatalf("other session: %v", err)
		}
		e.wantResult(t, "job", "after", l.Token)
		e.wantTakeoverNow(t, "after the kill")
	})
}

// beginHoldingFence begins a transaction on c, with l's generation, that
// writes the audit table and then the result (so it is gated), and checks
// that it holds the job's fence row.
func (e *fenceEnv) beginHoldingFence(t *testing.T, c *pgx.Conn, l fence.Lease) pgx.Tx {
	t.Helper()
	tx := beginOK(t, c)
	execOK(t, tx, "INSERT INTO audit (note) VALUES ('a')")
	execOK(t, tx, upsert, "job", "from A", l.Token)
	if e.fenceRowFree(t, "job") {
		t.Fatal("the fence row is not locked inside the gated transaction")
	}
	return tx
}

// waitFenceFreed waits until the backend pid of beginHoldingFence's
// transaction has ended (because why), and checks that the fence row is
// free and that nothing of the transaction remains.
func (e *fenceEnv) waitFenceFreed(t *testing.T, pid uint32, why string) {
	t.Helper()
	e.waitGone(t, pid)
	if !e.fenceRowFree(t, "job") {
		t.Fatalf("the fence row is still locked after %s", why)
	}
	e.wantNothingWritten(t)
}

// wantTakeoverNow checks that a takeover of the job does not wait for a
// lock (lock_timeout 2s).
func (e *fenceEnv) wantTakeoverNow(t *testing.T, when string) {
	t.Helper()
	c := e.direct(t)
	execOK(t, c, "SET lock_timeout = '2s'")
	if _, err := fence.Acquire(ctxT(t), c, "job", "b", time.Minute); err != nil {
		t.Fatalf("takeover %s: %v", when, err)
	}
}

// serveProc is a `pgfence serve` process (with the write gate).
type serveProc struct {
	net.Addr
	cmd *exec.Cmd
}

func (p *serveProc) kill(t *testing.T) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	p.cmd.Wait()
}

// startFenceServe starts `pgfence serve` in front of the test cluster on a
// free port, with auth trust and the extra args.
func startFenceServe(t *testing.T, args ...string) *serveProc {
	t.Helper()
	cmd, addr := testbin.Serve(t, nil, append([]string{"--listen", "127.0.0.1:0", "--primary", cluster.Primary.DSN("postgres"), "--auth", "trust"}, args...)...)
	return &serveProc{Addr: addr, cmd: cmd}
}

// ---------------------------------------------------------------------------
// A16

func testA16(t *testing.T) {
	for _, m := range execModes {
		t.Run(m.name, func(t *testing.T) { testA16Mode(t, m.mode) })
	}
}

func testA16Mode(t *testing.T, mode pgx.QueryExecMode) {
	e := newFenceEnv(t)
	ctx := ctxT(t)
	old := e.acquire(t, "job", "a", time.Minute)
	cur := e.takeover(t, "job", "b", old)
	setCur := fmt.Sprintf("SET fence.token = %d", cur.Token)
	setGen := fmt.Sprintf("SET fence.job_key = 'job'; SET fence.epoch = %d; SET fence.token = %d", cur.Epoch, cur.Token)
	step := 0
	var lastErr error
	// write does one gated write as its own step; it reports the SQLSTATE.
	write := func(t *testing.T, c *pgx.Conn) string {
		t.Helper()
		step++
		if _, err := c.Exec(ctx, fmt.Sprintf("SET fence.step = 's%d'", step)); err != nil {
			t.Fatalf("SET fence.step: %v", err)
		}
		_, err := c.Exec(ctx, upsert, "job", fmt.Sprintf("write %d", step), cur.Token)
		lastErr = err
		if err != nil && pgtest.SQLState(err) == "" {
			t.Fatalf("write: %v", err)
		}
		return pgtest.SQLState(err)
	}
	want := func(t *testing.T, c *pgx.Conn, what, code string) {
		t.Helper()
		if got := write(t, c); got != code {
			t.Fatalf("%s: write got SQLSTATE %q (%v), want %q", what, got, lastErr, code)
		}
	}
	// resetsToStartup checks that reset (RESET ALL, DISCARD ALL) brings
	// back the startup metadata, and leaves none where the startup had
	// none; it returns that session, without metadata.
	resetsToStartup := func(t *testing.T, mode pgx.QueryExecMode, reset string) *pgx.Conn {
		t.Helper()
		c := e.mustConnect(t, client{lease: &old, mode: mode})
		execOK(t, c, setCur)
		want(t, c, "after SET", "")
		execOK(t, c, reset)
		want(t, c, "after "+reset+" to the startup token", fence.CodeStale)
		n := e.mustConnect(t, client{mode: mode})
		execOK(t, n, setGen)
		want(t, n, "after SET of a generation", "")
		execOK(t, n, reset)
		want(t, n, "after "+reset, fence.CodeFencingRequired)
		return n
	}

	t.Run("set_in_rolled_back_tx", func(t *testing.T) {
		c := e.mustConnect(t, client{lease: &old, mode: mode})
		execOK(t, c, "BEGIN")
		execOK(t, c, setCur)
		execOK(t, c, "ROLLBACK")
		want(t, c, "after SET undone by ROLLBACK", fence.CodeStale)
		execOK(t, c, "BEGIN")
		execOK(t, c, setCur)
		execOK(t, c, "COMMIT")
		want(t, c, "after SET committed", "")
	})
	t.Run("set_in_rolled_back_savepoint", func(t *testing.T) {
		c := e.mustConnect(t, client{lease: &old, mode: mode})
		execOK(t, c, "BEGIN")
		execOK(t, c, "SAVEPOINT s")
		execOK(t, c, setCur)
		execOK(t, c, "ROLLBACK TO SAVEPOINT s")
		execOK(t, c, "COMMIT")
		want(t, c, "after SET undone by ROLLBACK TO", fence.CodeStale)
	})
	t.Run("set_local", func(t *testing.T) {
		c := e.mustConnect(t, client{lease: &old, mode: mode})
		step++
		execOK(t, c, fmt.Sprintf("SET fence.step = 's%d'", step))
		tx := beginOK(t, c)
		execOK(t, tx, fmt.Sprintf("SET LOCAL fence.token = %d", cur.Token))
		if _, err := tx.Exec(ctx, upsert, "job", "set local", cur.Token); err != nil {
			t.Fatalf("write under SET LOCAL: %v", err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("commit under SET LOCAL: %v", err)
		}
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE token = $1 AND step = $2", cur.Token, fmt.Sprintf("s%d", step))
		want(t, c, "after SET LOCAL ended", fence.CodeStale)
	})
	t.Run("reset_all", func(t *testing.T) {
		// Startup values come back (RESET restores the session default).
		// Without startup metadata RESET ALL leaves none.
		n := resetsToStartup(t, mode, "RESET ALL")
		execOK(t, n, setGen)
		execOK(t, n, "RESET fence.token")
		want(t, n, "after RESET fence.token", fence.CodeFencingRequired)
	})
	t.Run("discard_all", func(t *testing.T) {
		// DISCARD ALL drops the client's own prepared statements too, so
		// pgx's statement cache cannot be used across it (directly to
		// PostgreSQL either): describe each statement instead, still with
		// the extended protocol.
		mode := mode
		if mode == pgx.QueryExecModeCacheStatement {
			mode = pgx.QueryExecModeDescribeExec
		}
		n := resetsToStartup(t, mode, "DISCARD ALL")
		// The gate's own prepared statements are gone with DISCARD ALL;
		// gating again must still work.
		execOK(t, n, setGen)
		want(t, n, "after DISCARD ALL and a new SET", "")
	})
	t.Run("set_config", func(t *testing.T) {
		c := e.mustConnect(t, client{lease: &old, mode: mode})
		execOK(t, c, "SELECT set_config('fence.token', $1, false)", fmt.Sprint(cur.Token))
		want(t, c, "after set_config", "")
	})
	t.Run("malformed_token", func(t *testing.T) {
		c := e.mustConnect(t, client{lease: &cur, mode: mode})
		for _, q := range []string{"SET fence.token = 'abc'", "SET fence.token = '-5'", "SET fence.epoch = 'x1'", "SET LOCAL fence.token = '1.5'"} {
			_, err := c.Exec(ctx, q)
			wantCode(t, err, "22023")
		}
		_, err := c.Exec(ctx, "SELECT set_config('fence.token', $1, false)", "seventeen")
		wantCode(t, err, "22023")
		// Refused before anything runs: the rest of the query too.
		_, err = c.Exec(ctx, "INSERT INTO audit (note) VALUES ('before'); SET fence.token = 'abc'")
		wantCode(t, err, "22023")
		e.wantCount(t, 0, "SELECT count(*) FROM audit")
		// The setting is untouched, upstream and in the gate.
		var v string
		if err := c.QueryRow(ctx, "SELECT current_setting('fence.token')").Scan(&v); err != nil || v != fmt.Sprint(cur.Token) {
			t.Fatalf("fence.token after refused SETs: got %q (%v), want %d", v, err, cur.Token)
		}
		want(t, c, "after refused SETs", "")
		// In the startup packet: the connection is refused.
		_, err = e.connect(t, client{mode: mode, extra: []string{"-c fence.job_key=job -c fence.epoch=1 -c fence.token=abc"}})
		if pgtest.SQLState(err) != "22023" {
			t.Fatalf("malformed token in the startup options: got %v, want SQLSTATE 22023", err)
		}
	})
}

// ---------------------------------------------------------------------------
// FN009

func testPrepareTransaction(t *testing.T) {
	eachMode(t, "", func(t *testing.T, e *fenceEnv, mode pgx.QueryExecMode) {
		ctx := ctxT(t)
		l := e.acquire(t, "job", "a", time.Minute)
		c := e.mustConnect(t, client{lease: &l, mode: mode})
		tx := beginOK(t, c)
		execOK(t, tx, upsert, "job", "2pc", l.Token)
		_, err := tx.Exec(ctx, "PREPARE TRANSACTION 'pgfence_test'")
		wantCode(t, err, fence.CodeUnsupported)
		tx.Rollback(ctx)
		e.wantCount(t, 0, "SELECT count(*) FROM pg_prepared_xacts")
		e.wantResult(t, "job", "", 0)
		e.wantCount(t, 0, "SELECT count(*) FROM fence.receipts")
		if _, err := c.Exec(ctx, upsert, "job", "after", l.Token); err != nil {
			t.Fatalf("session after FN009: %v", err)
		}
	})
}

// ---------------------------------------------------------------------------
// psql: an unmodified legacy client

// runPsqlScript runs a script from testdata/psql with PGOPTIONS and returns its
// output (stdout and stderr).
func runPsqlScript(t *testing.T, port int, db, script, pgoptions string, vars ...string) string {
	t.Helper()
	cmd := psqlCmd(port, db, script, pgoptions, vars...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("psql %s: %v\n%s", script, err, out)
	}
	return string(out)
}

func psqlCmd(port int, db, script, pgoptions string, vars ...string) *exec.Cmd {
	args := []string{"-X", "-v", "ON_ERROR_STOP=0", "-h", "127.0.0.1", "-p", fmt.Sprint(port), "-U", "postgres", "-d", db,
		"-f", filepath.Join("testdata", "psql", script)}
	for _, v := range vars {
		args = append(args, "-v", v)
	}
	cmd := exec.Command("psql", args...)
	cmd.Env = append(os.Environ(), "PGOPTIONS="+pgoptions, "PGAPPNAME=psql_"+strings.TrimSuffix(script, ".sql"), "PGSSLMODE=disable")
	return cmd
}

// wantLines checks that each marker line appears in out, in order.
func wantLines(t *testing.T, out string, lines ...string) {
	t.Helper()
	rest := out
	for _, l := range lines {
		i := strings.Index(rest, l+"\n")
		if i < 0 {
			t.Fatalf("psql output lacks %q (in order):\n%s", l, out)
		}
		rest = rest[i+len(l):]
	}
}

func testPsql(t *testing.T) {
	if _, err := exec.LookPath("psql"); err != nil {
		t.Fatalf("psql not found: %v", err)
	}
	t.Run("A01", func(t *testing.T) {
		e := newFenceEnv(t)
		la := e.acquire(t, "job", "a", time.Minute)
		lb := e.takeover(t, "job", "b", la)
		out := runPsqlScript(t, e.proxy.addr.Port, e.db, "a01.sql", pgoptions(la), fmt.Sprintf("token=%d", la.Token))
		wantLines(t, out, "write FN001", "commit 00000", "state 00000")
		if !strings.Contains(out, "FN001") || !strings.Contains(out, "stale") {
			t.Fatalf("psql output lacks the stale-token error:\n%s", out)
		}
		e.wantResult(t, "job", "", 0)
		e.wantCount(t, 0, "SELECT count(*) FROM audit")
		out = runPsqlScript(t, e.proxy.addr.Port, e.db, "a01.sql", pgoptions(lb), fmt.Sprintf("token=%d", lb.Token))
		wantLines(t, out, "write 00000", "commit 00000", "state 00000")
		e.wantResult(t, "job", "from psql", lb.Token)
	})
	t.Run("A03", func(t *testing.T) {
		e := newFenceEnv(t)
		ctx := ctxT(t)
		la := e.acquire(t, "job", "a", time.Minute)
		e.release(t, la)
		// B's takeover holds the fence row while psql's write waits for it.
		btx := beginOK(t, e.direct(t))
		defer btx.Rollback(ctx)
		execOK(t, btx, "SELECT fence.acquire('job', 'b', '1 minute')")
		cmd := psqlCmd(e.proxy.addr.Port, e.db, "a03.sql", pgoptions(la), fmt.Sprintf("token=%d", la.Token))
		var buf strings.Builder
		cmd.Stdout, cmd.Stderr = &buf, &buf
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer cmd.Process.Kill()
		var pid uint32
		obs := e.direct(t)
		if err := pgtest.Poll(ctx, func() (bool, error) {
			err := obs.QueryRow(ctx, `SELECT a.pid FROM pg_stat_activity a JOIN pg_locks l USING (pid)
				WHERE a.application_name = 'psql_a03' AND NOT l.granted AND a.wait_event_type = 'Lock' LIMIT 1`).Scan(&pid)
			if errors.Is(err, pgx.ErrNoRows) {
				return false, nil
			}
			return err == nil, err
		}); err != nil {
			t.Fatalf("psql's write never waited for the fence row: %v", err)
		}
		if err := btx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := cmd.Wait(); err != nil {
			t.Fatalf("psql: %v\n%s", err, buf.String())
		}
		out := buf.String()
		wantLines(t, out, "audit 00000", "write FN001", "commit 00000", "state 00000")
		e.wantCount(t, 0, "SELECT count(*) FROM audit")
		e.wantResult(t, "job", "", 0)
	})
	t.Run("A05", func(t *testing.T) {
		e := newFenceEnv(t)
		l := e.acquire(t, "job", "a", time.Minute)
		out := runPsqlScript(t, e.proxy.addr.Port, e.db, "a05.sql", pgoptions(l), fmt.Sprintf("token=%d", l.Token))
		wantLines(t, out, "first 00000", "replay 00000", "second FN003", "state 00000")
		if !strings.Contains(out, "FN00R") {
			t.Fatalf("psql output lacks the replay notice:\n%s", out)
		}
		e.wantResult(t, "job", "first", l.Token)
		e.wantCount(t, 1, "SELECT count(*) FROM audit")
		e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts")
	})
	t.Run("A13", func(t *testing.T) {
		e, l := newA13Env(t)
		stale := l
		paths := []string{"insert", "update", "delete", "multi", "cte", "merge", "copy", "truncate", "function", "view", "do"}
		for _, target := range []struct {
			name string
			port int
			opts string
			code string
		}{
			{"proxy_no_metadata", e.proxy.addr.Port, "", fence.CodeFencingRequired},
			{"proxy_stale", e.proxy.addr.Port, pgoptions(stale, "-c fence.step=other"), fence.CodeStale},
			{"direct_no_metadata", cluster.Primary.Port, "", fence.CodeFencingRequired},
			{"direct_stale", cluster.Primary.Port, pgoptions(stale, "-c fence.step=other"), fence.CodeStale},
		} {
			t.Run(target.name, func(t *testing.T) {
				out := runPsqlScript(t, target.port, e.db, "a13.sql", target.opts)
				var want []string
				for _, p := range paths {
					want = append(want, p+" "+target.code)
				}
				wantLines(t, out, append(want, "state 00000")...)
				e.wantResult(t, "job", "legit", l.Token)
				e.wantCount(t, 1, "SELECT count(*) FROM results")
				e.wantCount(t, 0, "SELECT count(*) FROM audit")
			})
		}
	})
}
