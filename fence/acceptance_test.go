package fence_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestAcceptance proves the SQL-level cases of ACCEPTANCE.md through the
// fence package and the server-side functions alone.
func TestAcceptance(t *testing.T) {
	runEnv(t, "A01_stalled_holder_commits_after_takeover_gets_stale", func(t *testing.T, e *env) {
		ctx := ctxT(t)
		a := e.acquire("report", "A")
		if a.Token != 17 {
			t.Fatalf("A's token: got %d, want 17", a.Token)
		}
		b := e.takeover("report", "B") // B stops before writing
		if b.Token != 18 || b.Epoch != a.Epoch {
			t.Fatalf("B's generation: got epoch %d token %d, want epoch %d token 18", b.Epoch, b.Token, a.Epoch)
		}
		connA := e.connect()
		_, err := writeResult(ctx, connA, pgx.ReadCommitted, a.Generation(""), "A's report")
		wantFenceError(t, err, fence.CodeStale)
		if !fence.IsStale(err) {
			t.Fatalf("IsStale(%v) = false", err)
		}
		e.wantNoResults(t)
		e.wantCount(t, 0, "select count(*) from audit")
		e.wantWrite(t, e.connect(), pgx.ReadCommitted, b.Generation(""), "B's report", fence.Committed)
		e.wantResult(t, "report", result{"B's report", 18})
	})

	runEnv(t, "A02_takeover_waits_for_gated_transaction", func(t *testing.T, e *env) {
		ctx := ctxT(t)
		a, _, txA := e.holderTx(t)
		if r, err := fence.Gate(ctx, txA, a.Generation("")); err != nil || r != fence.GateOK {
			t.Fatalf("A's gate: got %v, %v; want ok", r, err)
		}
		if _, err := txA.Exec(ctx, upsertSQL, "report", "A's report", a.Token); err != nil {
			t.Fatal(err)
		}
		e.expireLease("report") // A's lease ran out while it was committing

		connB := e.connect()
		done := pgtest.Blocked(t, e.admin, connB.PgConn().PID(), func() (fence.Lease, error) {
			return fence.Acquire(ctx, connB, "report", "B", time.Minute)
		}) // B's takeover waits on A's fence row lock
		if r, err := fence.Commit(ctx, txA, a.Generation(""), fence.PayloadDigest([]byte("A's report")), fence.PayloadDigestVersion); err != nil || r != fence.Committed {
			t.Fatalf("A's commit: got %v, %v", r, err)
		}
		if err := txA.Commit(ctx); err != nil {
			t.Fatalf("A's COMMIT: %v", err)
		}
		r := <-done
		if r.Err != nil {
			t.Fatalf("B's acquire: %v", r.Err)
		}
		if r.Val.Token != 18 {
			t.Fatalf("B's token: got %d, want 18", r.Val.Token)
		}
		e.wantResult(t, "report", result{"A's report", 17})
		e.wantWrite(t, connB, pgx.ReadCommitted, r.Val.Generation(""), "B's report", fence.Committed)
		e.wantResult(t, "report", result{"B's report", 18})
	})

	runEnv(t, "A03_takeover_first_stale_commit_rolls_back", func(t *testing.T, e *env) {
		ctx := ctxT(t)
		a, connA, txA := e.holderTx(t)
		// A has already written to an unprotected table in this transaction.
		if _, err := txA.Exec(ctx, "insert into audit values ('report', $1, 'started')", a.Token); err != nil {
			t.Fatal(err)
		}
		e.takeover("report", "B") // commits first
		_, err := fence.Gate(ctx, txA, a.Generation(""))
		wantCode(t, err, fence.CodeStale)
		txA.Rollback(ctx)
		e.wantCount(t, 0, "select count(*) from audit")
		// The same through the backstop alone: A writes the protected table
		// with its metadata set but never calls fence.gate.
		txA2 := begin(t, connA, "")
		if err := setGUCs(ctx, txA2, a.Generation("")); err != nil {
			t.Fatal(err)
		}
		if _, err := txA2.Exec(ctx, "insert into audit values ('report', $1, 'again')", a.Token); err != nil {
			t.Fatal(err)
		}
		_, err = txA2.Exec(ctx, upsertSQL, "report", "A's report", a.Token)
		wantCode(t, err, fence.CodeStale)
		txA2.Rollback(ctx)
		e.wantNoResults(t)
		e.wantCount(t, 0, "select count(*) from audit")
	})

	eachIso(t, "A04_lost_commit_response_retry_is_replay", func(t *testing.T, e *env, iso pgx.TxIsoLevel) {
		ctx := ctxT(t)
		a := e.acquire("report", "A")
		g := a.Generation("")
		commitAndLoseResponse(t, e, g, "A's report")
		e.wantResult(t, "report", result{"A's report", 17})
		// A retries the same payload on a new connection.
		res, err := writeResult(ctx, e.connect(), iso, g, "A's report")
		if err != nil {
			t.Fatalf("retry: %v", err)
		}
		if res != fence.Replayed {
			t.Fatalf("retry: got %v, want replayed", res)
		}
		e.wantCount(t, 1, "select count(*) from audit")
		e.wantCount(t, 1, "select count(*) from fence.receipts")
	})

	eachIso(t, "A05_same_token_different_payload_conflicts", func(t *testing.T, e *env, iso pgx.TxIsoLevel) {
		ctx := ctxT(t)
		g := e.committed(t, iso, "first")
		// A non-deterministic recomputation: same token, other payload.
		// The upsert uses <=, so without the receipt it would silently
		// overwrite the first result.
		_, err := fence.RunTxOptions(ctx, e.connect(), pgx.TxOptions{IsoLevel: iso}, g, []byte("second"), func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `update results set payload = 'second' where job_key = 'report' and token <= $1`, g.Token)
			return err
		})
		wantFenceError(t, err, fence.CodeConflict)
		if !fence.IsConflict(err) {
			t.Fatalf("IsConflict(%v) = false", err)
		}
		e.wantResult(t, "report", result{"first", 17})
		e.wantCount(t, 1, "select count(*) from fence.receipts")
		// Without Gate: the write runs (the backstop sees a replay),
		// then fence.commit finds the other digest and rolls it all back.
		conn := e.connect()
		tx := begin(t, conn, iso)
		if err := setGUCs(ctx, tx, g); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `update results set payload = 'third' where job_key = 'report'`); err != nil {
			t.Fatalf("write in replay mode: %v", err)
		}
		_, err = fence.Commit(ctx, tx, g, fence.PayloadDigest([]byte("third")), fence.PayloadDigestVersion)
		wantFenceError(t, err, fence.CodeConflict)
		tx.Rollback(ctx)
		e.wantResult(t, "report", result{"first", 17})
	})

	runEnv(t, "A06_retry_after_takeover_is_replay_not_stale", func(t *testing.T, e *env) {
		g := e.committed(t, pgx.ReadCommitted, "A's report")
		b := e.takeover("report", "B")
		if b.Token != 18 {
			t.Fatalf("B's token: got %d, want 18", b.Token)
		}
		e.wantWrite(t, e.connect(), pgx.ReadCommitted, g, "A's report", fence.Replayed)
		e.wantCount(t, 1, "select count(*) from audit")
	})

	runEnv(t, "A07_no_receipt_and_fence_moved_is_stale", func(t *testing.T, e *env) {
		ctx := ctxT(t)
		g := e.acquire("report", "A").Generation("")
		e.takeover("report", "B")
		res, err := writeResult(ctx, e.connect(), pgx.ReadCommitted, g, "A's report")
		wantCode(t, err, fence.CodeStale)
		if res == fence.Replayed {
			t.Fatal("a generation that never committed was answered as a replay")
		}
		e.wantNoResults(t)
	})

	runEnv(t, "A10_request_from_retired_lifecycle_is_rejected", func(t *testing.T, e *env) {
		ctx := ctxT(t)
		old := e.acquire("report", "A")
		oldG := old.Generation("")
		e.wantWrite(t, e.connect(), pgx.ReadCommitted, oldG, "old", fence.Committed)
		// A request saved before the clean-up, for a second step.
		saved := old.Generation("late-step")

		if err := fence.Retire(ctx, e.admin, "report", fence.RetireOptions{Force: true}); err != nil {
			t.Fatal(err)
		}
		pruned, err := fence.GC(ctx, e.admin, 0)
		if err != nil {
			t.Fatal(err)
		}
		if pruned != 1 {
			t.Fatalf("gc after retire: pruned %d, want 1", pruned)
		}
		e.exec("grant select, delete on results to pgfence_bypass")
		e.exec("set role pgfence_bypass") // the DBA's clean-up of the business row
		e.exec("delete from results where job_key = 'report'")
		e.exec("reset role")

		nu := e.acquire("report", "C")
		if nu.Epoch <= old.Epoch {
			t.Fatalf("new epoch %d not after old %d", nu.Epoch, old.Epoch)
		}
		var maxOld int64
		if err := e.admin.QueryRow(ctx, "select max(token) from fence.issuance where epoch = $1", old.Epoch).Scan(&maxOld); err != nil {
			t.Fatal(err)
		}
		if nu.Token <= maxOld {
			t.Fatalf("new lifecycle token %d not larger than every old token (max %d)", nu.Token, maxOld)
		}
		for _, g := range []fence.Generation{saved, oldG} {
			_, err = writeResult(ctx, e.connect(), pgx.ReadCommitted, g, "old")
			wantFenceError(t, err, fence.CodeRetired)
		}
		e.wantNoResults(t)
		e.wantWrite(t, e.connect(), pgx.ReadCommitted, nu.Generation(""), "new", fence.Committed)
		e.wantResult(t, "report", result{"new", nu.Token})
	})

	runEnv(t, "A11_pruned_receipt_retry_cannot_be_confirmed", func(t *testing.T, e *env) {
		ctx := ctxT(t)
		g := e.committed(t, pgx.ReadCommitted, "A's report")
		// The current generation is never pruned.
		if n, err := fence.GC(ctx, e.admin, 0); err != nil || n != 0 {
			t.Fatalf("gc of a current generation: got %d, %v; want 0", n, err)
		}
		e.takeover("report", "B")
		if n, err := fence.GC(ctx, e.admin, time.Hour); err != nil || n != 0 {
			t.Fatalf("gc inside retention: got %d, %v; want 0", n, err)
		}
		if n, err := fence.GC(ctx, e.admin, 0); err != nil || n != 1 {
			t.Fatalf("gc: got %d, %v; want 1", n, err)
		}
		res, err := writeResult(ctx, e.connect(), pgx.ReadCommitted, g, "A's report")
		wantFenceError(t, err, fence.CodeExpired)
		if res == fence.Committed {
			t.Fatal("a pruned generation was treated as a first commit")
		}
		e.wantCount(t, 1, "select count(*) from audit")
		e.wantCount(t, 0, "select count(*) from fence.receipts")
	})

	runEnv(t, "A12_consumer_rejects_older_and_retired_generations", func(t *testing.T, e *env) {
		ctx := ctxT(t)
		e.exec("create table applied (job_key text, epoch bigint, token bigint)")
		l17 := e.acquire("report", "A")
		l18 := e.takeover("report", "B")
		// deliver applies the event only if accept_event accepts it, in one
		// transaction.
		deliver := func(epoch, token int64) bool {
			t.Helper()
			tx, err := e.admin.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			ok, err := fence.AcceptEvent(ctx, tx, "mailer", "report", epoch, token)
			if err != nil {
				t.Fatalf("accept (%d, %d): %v", epoch, token, err)
			}
			if ok {
				if _, err := tx.Exec(ctx, "insert into applied values ('report', $1, $2)", epoch, token); err != nil {
					t.Fatal(err)
				}
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			return ok
		}
		if !deliver(l18.Epoch, l18.Token) {
			t.Fatal("event 18 rejected")
		}
		if deliver(l17.Epoch, l17.Token) {
			t.Fatal("event 17 after 18 accepted")
		}
		if !deliver(l18.Epoch, l18.Token) {
			t.Fatal("a second event of generation 18 rejected")
		}
		if err := fence.Retire(ctx, e.admin, "report", fence.RetireOptions{Force: true}); err != nil {
			t.Fatal(err)
		}
		l19 := e.acquire("report", "C")
		if deliver(l18.Epoch, l18.Token) {
			t.Fatal("event of the retired epoch accepted")
		}
		if !deliver(l19.Epoch, l19.Token) {
			t.Fatal("event of the newer epoch rejected")
		}
		// An older epoch with a larger token was never issued: rejected
		// (issue 17 §6), the watermark unchanged, with the answer an older
		// event gets (issue 30: an error told issued tokens from others).
		tx, err := e.admin.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ok, err := fence.AcceptEvent(ctx, tx, "mailer", "report", l18.Epoch, l18.Token+100)
		tx.Rollback(ctx)
		if err != nil || ok {
			t.Fatalf("an event never issued: %v, %v; want false", ok, err)
		}
		if !deliver(l19.Epoch, l19.Token) {
			t.Fatal("the current generation's event rejected after a forged one")
		}
		var got []int64
		rows, _ := e.admin.Query(ctx, "select token from applied order by token")
		got, err = pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		want := []int64{18, 18, l19.Token, l19.Token}
		if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] || got[2] != want[2] || got[3] != want[3] {
			t.Fatalf("applied tokens: got %v, want %v", got, want)
		}
		var wEpoch, wToken int64
		if err := e.admin.QueryRow(ctx, "select epoch, token from fence.consumer_watermarks where consumer = 'mailer' and job_key = 'report'").Scan(&wEpoch, &wToken); err != nil {
			t.Fatal(err)
		}
		if wEpoch != l19.Epoch || wToken != l19.Token {
			t.Fatalf("watermark: got (%d, %d), want (%d, %d)", wEpoch, wToken, l19.Epoch, l19.Token)
		}
	})

	runEnv(t, "A17_lease_held_stale_renew_and_acquire_after_expiry", func(t *testing.T, e *env) {
		ctx := ctxT(t)
		a := e.acquire("report", "A")
		_, err := fence.Acquire(ctx, e.admin, "report", "B", time.Minute)
		wantFenceError(t, err, fence.CodeLeaseHeld)
		if !fence.IsLeaseHeld(err) {
			t.Fatalf("IsLeaseHeld(%v) = false", err)
		}
		// The same holder re-acquiring gets a new token.
		a2 := e.acquire("report", "A")
		if a2.Token <= a.Token {
			t.Fatalf("re-acquire: token %d, want > %d", a2.Token, a.Token)
		}
		exp, err := fence.Renew(ctx, e.admin, "report", a2.Token, 2*time.Minute)
		if err != nil {
			t.Fatalf("renew: %v", err)
		}
		if !exp.After(a2.ExpiresAt) {
			t.Fatalf("renew: expiry %v not after %v", exp, a2.ExpiresAt)
		}
		_, err = fence.Renew(ctx, e.admin, "report", a.Token, time.Minute)
		wantCode(t, err, fence.CodeStale)
		e.expireLease("report")
		b := e.acquire("report", "B")
		if b.Token <= a2.Token {
			t.Fatalf("acquire after expiry: token %d, want > %d", b.Token, a2.Token)
		}
		_, err = fence.Renew(ctx, e.admin, "report", a2.Token, time.Minute)
		wantCode(t, err, fence.CodeStale)
		err = fence.Release(ctx, e.admin, "report", a2.Token)
		wantCode(t, err, fence.CodeStale)
		if err := fence.Release(ctx, e.admin, "report", b.Token); err != nil {
			t.Fatalf("release: %v", err)
		}
		_, err = fence.Renew(ctx, e.admin, "report", b.Token, time.Minute)
		wantCode(t, err, fence.CodeStale)
		// After release anyone may acquire, with a new token.
		c := e.acquire("report", "C")
		if c.Token <= b.Token {
			t.Fatalf("acquire after release: token %d, want > %d", c.Token, b.Token)
		}
	})
}

// commitAndLoseResponse commits g's result and cuts the connection after
// COMMIT reached the server and took effect, without reading the answer.
func commitAndLoseResponse(t *testing.T, e *env, g fence.Generation, payload string) {
	t.Helper()
	ctx := ctxT(t)
	conn := e.connect()
	tx := beginGated(t, ctx, conn, g)
	if _, err := tx.Exec(ctx, upsertSQL, g.JobKey, payload, g.Token); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "insert into audit values ($1, $2, $3)", g.JobKey, g.Token, "wrote "+payload); err != nil {
		t.Fatal(err)
	}
	if r, err := fence.Commit(ctx, tx, g, fence.PayloadDigest([]byte(payload)), fence.PayloadDigestVersion); err != nil || r != fence.Committed {
		t.Fatalf("commit: %v, %v", r, err)
	}
	pc := conn.PgConn()
	pid := pc.PID()
	pc.Frontend().Send(&pgproto3.Query{String: "COMMIT"})
	if err := pc.Frontend().Flush(); err != nil {
		t.Fatal(err)
	}
	// Wait until the COMMIT took effect, then cut the connection unread.
	err := pgtest.Poll(ctx, func() (bool, error) {
		var n int
		err := e.admin.QueryRow(ctx, `select count(*) from fence.receipts r where r.job_key = $1 and r.token = $2`, g.JobKey, g.Token).Scan(&n)
		return n == 1, err
	})
	if err != nil {
		t.Fatalf("COMMIT never took effect: %v", err)
	}
	pc.Conn().Close()
	_ = pid
}
