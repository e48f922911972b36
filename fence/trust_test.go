package fence_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgfence/pgfence/fence"
)

// role is a role name of the test's own: roles are cluster-wide.
func (e *env) role(suffix string) string {
	prefix, _, _ := strings.Cut(e.db, "_")
	return prefix + "_" + suffix
}

// trustEnv is newEnv with two worker roles of its own (issue 17 §5), the
// first holding job "report".
func trustEnv(t *testing.T) (e *env, w1, w2 *pgx.Conn, l fence.Lease) {
	t.Helper()
	e = newEnv(t)
	r1, r2 := e.role("w1"), e.role("w2")
	for _, r := range []string{r1, r2} {
		e.exec(fmt.Sprintf("create role %s login in role pgfence_worker; grant select, insert, update, delete on results, audit to %[1]s", pgx.Identifier{r}.Sanitize()))
	}
	w1, w2 = e.connectAs(r1), e.connectAs(r2)
	l, err := fence.Acquire(ctxT(t), w1, "report", "a", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	return e, w1, w2, l
}

func TestRetireOptions(t *testing.T) {
	t.Parallel()
	e, w1, w2, l := trustEnv(t)
	ctx := ctxT(t)
	wantFenceError(t, fence.Retire(ctx, w1, "report", fence.RetireOptions{}), fence.CodeNotOwner)
	// Another role is told it does not hold the lease, as for any token
	// (issue 30: FN011 for the current token told it from the others).
	wantFenceError(t, fence.Retire(ctx, w2, "report", fence.RetireOptions{Token: l.Token}), fence.CodeStale)
	wantFenceError(t, fence.Retire(ctx, w1, "report", fence.RetireOptions{Token: l.Token + 1}), fence.CodeStale)
	wantFenceError(t, fence.Retire(ctx, e.admin, "report", fence.RetireOptions{}), fence.CodeLeaseHeld)
	e.wantCount(t, 0, "select count(*) from fence.fences where retired_at is not null")
	// The holder ends its own job, live lease and all.
	if err := fence.Retire(ctx, w1, "report", fence.RetireOptions{Token: l.Token}); err != nil {
		t.Fatalf("holder's retire: %v", err)
	}
	if err := fence.Retire(ctx, w1, "report", fence.RetireOptions{Token: l.Token}); err != nil {
		t.Fatalf("retire of a retired job: %v, want a no-op", err)
	}
	// An administrator with force ends someone's live lease.
	if _, err := fence.Acquire(ctx, w2, "report", "b", time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := fence.Retire(ctx, e.admin, "report", fence.RetireOptions{Force: true}); err != nil {
		t.Fatalf("forced retire: %v", err)
	}
	e.wantCount(t, 0, "select count(*) from fence.leases")
}

// TestOwnedGenerations: only the acquiring role renews, releases, gates,
// writes under and commits its generation (renew and release answer FN001
// to another role, whatever token it presents; the others FN011);
// takeovers by naming the holder do not work across roles.
func TestOwnedGenerations(t *testing.T) {
	t.Parallel()
	e, w1, w2, l := trustEnv(t)
	ctx := ctxT(t)
	g := l.Generation("")
	_, err := fence.Renew(ctx, w2, "report", l.Token, time.Minute)
	wantFenceError(t, err, fence.CodeStale)
	wantFenceError(t, fence.Release(ctx, w2, "report", l.Token), fence.CodeStale)
	_, err = fence.Acquire(ctx, w2, "report", "a", time.Minute)
	wantFenceError(t, err, fence.CodeLeaseHeld)
	_, err = writeResult(ctx, w2, pgx.ReadCommitted, g, "pre-empted")
	wantFenceError(t, err, fence.CodeNotOwner)
	tx, err := w2.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = fence.Commit(ctx, tx, g, []byte("bogus"), "v1")
	tx.Rollback(ctx)
	wantFenceError(t, err, fence.CodeNotOwner)
	e.wantCount(t, 0, "select count(*) from fence.receipts")
	e.wantWrite(t, w1, pgx.ReadCommitted, g, "mine", fence.Committed)
	// An administrator may commit under any generation.
	e.wantWrite(t, e.admin, pgx.ReadCommitted, l.Generation("repair"), "repair", fence.Committed)
	var role string
	if err := e.admin.QueryRow(ctx, "select role from fence.issuance where token = $1", l.Token).Scan(&role); err != nil || role != e.role("w1") {
		t.Fatalf("issuance role: %q, %v", role, err)
	}
}

// TestOpaqueWriteReceipt: a fenced write the caller did not receipt gets
// the backstop's receipt at COMMIT; its retry cannot commit; CommitIfWritten
// writes the caller's receipt instead, or nothing.
func TestOpaqueWriteReceipt(t *testing.T) {
	t.Parallel()
	e, w1, _, l := trustEnv(t)
	ctx := ctxT(t)
	do := fmt.Sprintf("do $$ begin insert into results values ('report', 'opaque', %d) on conflict (job_key) do update set payload = excluded.payload; end $$", l.Token)
	if err := setGUCs(ctx, w1, l.Generation("")); err != nil {
		t.Fatal(err)
	}
	if _, err := w1.Exec(ctx, do); err != nil {
		t.Fatalf("opaque write: %v", err)
	}
	var version string
	if err := e.admin.QueryRow(ctx, "select digest_version from fence.receipts where token = $1 and step = ''", l.Token).Scan(&version); err != nil || version != fence.BackstopDigestVersion {
		t.Fatalf("receipt: %q, %v; want %s", version, err, fence.BackstopDigestVersion)
	}
	_, err := w1.Exec(ctx, do)
	wantCode(t, err, fence.CodeReplay)
	e.wantCount(t, 0, "select count(*) from fence.write_marks")

	run := func(step string, write bool, digest string) (fence.CommitResult, error) {
		g := l.Generation(step)
		tx, err := w1.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if err := setGUCs(ctx, tx, g); err != nil {
			t.Fatal(err)
		}
		if write {
			if _, err := tx.Exec(ctx, do); err != nil {
				return 0, err
			}
		}
		res, err := fence.CommitIfWritten(ctx, tx, g, []byte(digest), "v1")
		if err == nil && res != fence.Replayed {
			err = tx.Commit(ctx)
		}
		return res, err
	}
	if res, err := run("none", false, "d"); err != nil || res != fence.NotWritten {
		t.Fatalf("nothing written: %v, %v", res, err)
	}
	if res, err := run("ciw", true, "d"); err != nil || res != fence.Committed {
		t.Fatalf("written: %v, %v", res, err)
	}
	if res, err := run("ciw", true, "d"); err != nil || res != fence.Replayed {
		t.Fatalf("retry: %v, %v; want Replayed", res, err)
	}
	_, err = run("ciw", true, "other")
	wantFenceError(t, err, fence.CodeConflict)
	e.wantCount(t, 1, "select count(*) from fence.receipts where step in ('none', 'ciw')")
	// RunTx gates, so the backstop does not mark its opaque writes: its
	// own receipt is the one.
	res, err := fence.RunTx(ctx, w1, l.Generation("runtx"), []byte("p"), func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, do)
		return err
	})
	if err != nil || res != fence.Committed {
		t.Fatalf("RunTx with an opaque write: %v, %v", res, err)
	}
	if err := e.admin.QueryRow(ctx, "select digest_version from fence.receipts where step = 'runtx'").Scan(&version); err != nil || version != fence.PayloadDigestVersion {
		t.Fatalf("RunTx's receipt: %q, %v", version, err)
	}
}

// TestPrepareAfterFencedWrite: PREPARE TRANSACTION after any fenced
// write is refused by PostgreSQL itself (0A000: the first fenced write
// opened a temporary relation), however the statement is written, and
// leaves the fence row free; this cluster allows prepared transactions.
func TestPrepareAfterFencedWrite(t *testing.T) {
	t.Parallel()
	e, w1, _, l := trustEnv(t)
	ctx := ctxT(t)
	gate := func(step string) string {
		return fmt.Sprintf("select fence.gate('report', %d, %d, '%s')", l.Epoch, l.Token, step)
	}
	commit := func(step string) string {
		return fmt.Sprintf("select fence.commit('report', %d, %d, '%s', '\\x01', 'v1')", l.Epoch, l.Token, step)
	}
	for i, q := range []string{
		"begin; update results set payload = 'x'; prepare transaction 'p'",
		"begin; update results set payload = 'x'; /* the end */ PREPARE\n\tTRANSACTION 'p'",
		"begin; update results set payload = 'x'; prepare -- a comment PostgreSQL ends at CR\r transaction 'p'",
		"begin; update results set payload = 'x'; prepare /* nested /* comment */ here */ transaction 'p'",
		"begin; do $$ begin update results set payload = 'x'; end $$; prepare transaction 'p'",
		"begin; savepoint s; update results set payload = 'x'; release s; prepare transaction 'p'",
		"begin; savepoint s; update results set payload = 'x'; rollback to s; prepare transaction 'p'",
		// fence.commit wrote the receipt (the proxy, RunTx): refused too.
		// Under the session's step (this is case 7): a gate under another
		// step than the write's is refused (FN009, one step per
		// transaction) before PREPARE is reached.
		"begin; " + gate("p7") + "; update results set payload = 'x'; " + commit("p7") + "; prepare transaction 'p'",
		// The gate alone is the transaction's first fenced write.
		"begin; " + gate("g2") + "; prepare transaction 'p'",
	} {
		if err := setGUCs(ctx, w1, l.Generation(fmt.Sprint("p", i))); err != nil {
			t.Fatal(err)
		}
		_, err := w1.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol)
		wantCode(t, err, "0A000")
		w1.Exec(ctx, "rollback")
	}
	e.wantCount(t, 0, "select count(*) from pg_prepared_xacts")
	e.wantCount(t, 0, "select count(*) from fence.receipts")
	if _, err := e.admin.Exec(ctx, "begin; select 1 from fence.fences for update nowait; rollback"); err != nil {
		t.Fatalf("the fence row stays locked: %v", err)
	}
	// Without a fenced write PREPARE works (prepared transactions are on
	// in this cluster), in the same session too.
	if _, err := w1.Exec(ctx, "begin; insert into audit values ('x', 1, 'y'); prepare transaction 'p3'", pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatalf("prepare without a protected write: %v", err)
	}
	e.exec("rollback prepared 'p3'")
}

// TestForgedMarkChangesNothing: pgfence.marked, the setting by which
// the backstop once skipped marking a transaction, is read by nobody: a
// client that forges it, or gates and never calls fence.commit, still
// commits exactly one receipt, and skips no check.
func TestForgedMarkChangesNothing(t *testing.T) {
	t.Parallel()
	e, w1, _, _ := trustEnv(t)
	ctx := ctxT(t)
	old, err := fence.Acquire(ctx, w1, "report", "a", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	e.expireLease("report")
	cur, err := fence.Acquire(ctx, w1, "report", "b", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	forge := func(l fence.Lease) string {
		return fmt.Sprintf("select set_config('pgfence.marked', format('%%s %%s %%s %%L %%L', pg_current_xact_id(), %d, %d, 'report', ''), true)", l.Epoch, l.Token)
	}
	for _, l := range []fence.Lease{old, cur} {
		if err := setGUCs(ctx, w1, l.Generation("")); err != nil {
			t.Fatal(err)
		}
		_, err := w1.Exec(ctx, "begin; "+forge(l)+"; update results set payload = 'forged'; commit", pgx.QueryExecModeSimpleProtocol)
		if l == old {
			wantCode(t, err, fence.CodeStale)
			w1.Exec(ctx, "rollback")
		} else if err != nil {
			t.Fatalf("current generation with a forged mark: %v", err)
		}
	}
	e.wantCount(t, 1, "select count(*) from fence.receipts where step = '' and digest_version = 'backstop-v1'")
	// A transaction that gates and commits without fence.commit has the
	// receipt its gate wrote.
	tx, err := w1.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := fence.Gate(ctx, tx, cur.Generation("gated")); err != nil || r != fence.GateOK {
		t.Fatalf("gate: %v, %v", r, err)
	}
	if _, err := tx.Exec(ctx, "update results set payload = 'gated'"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	e.wantCount(t, 1, "select count(*) from fence.receipts where step = 'gated' and digest_version = 'backstop-v1'")
	// Its retry is a replay.
	tx, err = w1.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if r, err := fence.Gate(ctx, tx, cur.Generation("gated")); err != nil || r != fence.GateReplay {
		t.Fatalf("retry's gate: %v, %v; want replay", r, err)
	}
}

// TestProtectTree: a whole tree is protected, listed with its root, and
// unprotected as one.
func TestProtectTree(t *testing.T) {
	e, ctx := parallelEnv(t)
	e.exec(`create table pt (k int, v text) partition by range (k);
		create table pt_1 partition of pt for values from (0) to (10);
		create table pt_2 partition of pt for values from (10) to (20) partition by range (k);
		create table pt_2a partition of pt_2 for values from (10) to (20)`)
	if err := fence.Protect(ctx, e.admin, "pt", ""); err != nil {
		t.Fatal(err)
	}
	tables, err := fence.ProtectedTables(ctx, e.admin)
	if err != nil {
		t.Fatal(err)
	}
	roots := map[string]string{}
	for _, tb := range tables {
		roots[tb.Table] = tb.Root
	}
	for _, m := range []string{"pt", "pt_1", "pt_2", "pt_2a"} {
		if roots[m] != "pt" {
			t.Fatalf("%s: root %q, want pt (all: %v)", m, roots[m], roots)
		}
	}
	_, err = e.admin.Exec(ctx, "insert into pt values (15, 'x')")
	wantCode(t, err, fence.CodeFencingRequired)
	if err := fence.Protect(ctx, e.admin, "pt_2a", ""); err != nil {
		t.Fatalf("protect a member again: %v, want a no-op", err)
	}
	wantCode(t, fence.Unprotect(ctx, e.admin, "pt_2"), "42809")
	if err := fence.Unprotect(ctx, e.admin, "pt"); err != nil {
		t.Fatal(err)
	}
	e.wantCount(t, 0, "select count(*) from pg_trigger where tgname like 'pgfence%' and tgrelid in ('pt'::regclass, 'pt_1'::regclass, 'pt_2'::regclass, 'pt_2a'::regclass)")
	if _, err := e.admin.Exec(ctx, "insert into pt values (15, 'x')"); err != nil {
		t.Fatalf("write after unprotect: %v", err)
	}
	// Unprotecting needs an administrator even with EXECUTE.
	e.exec(fmt.Sprintf("create role %[1]s login; grant execute on function fence.unprotect(regclass) to %[1]s", e.role("owner")))
	wantFenceError(t, fence.Unprotect(ctx, e.connectAs(e.role("owner")), "results"), fence.CodeProtectionLocked)
}

// TestHasGeneration: read routing's replica question, answered for the
// caller's own generations only.
func TestHasGeneration(t *testing.T) {
	t.Parallel()
	e, w1, w2, l := trustEnv(t)
	ctx := ctxT(t)
	ask := func(c *pgx.Conn, token int64) bool {
		t.Helper()
		var ok bool
		if err := c.QueryRow(ctx, "select fence.has_generation('report', $1)", token).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !ask(w1, l.Token) || !ask(e.admin, l.Token) {
		t.Fatal("the holder or an administrator is told the generation is not there")
	}
	if ask(w2, l.Token) || ask(w1, l.Token+1) {
		t.Fatal("has_generation answered for another role's token, or a token not yet issued")
	}
	// A bypass member sees the tokens themselves.
	e.exec(fmt.Sprintf("create role %s login in role pgfence_bypass", e.role("dba")))
	var max int64
	if err := e.connectAs(e.role("dba")).QueryRow(ctx, "select max_issued_token from fence.fences where job_key = 'report'").Scan(&max); err != nil || max != l.Token {
		t.Fatalf("bypass member reads fence.fences: %d, %v", max, err)
	}
}
