package fence_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/pgfence/pgfence/fence"
)

// TestReplaySkipsWrites: in replay mode (gate answered 'replay') writes to
// protected tables are no-ops, so a retried plain INSERT does not fail with
// unique_violation (23505) before the client reaches COMMIT, and COMMIT
// still fails with FN00R. Unprotected tables are not affected.
func TestReplaySkipsWrites(t *testing.T) {
	e, ctx := parallelEnv(t)
	g := e.committed(t, pgx.ReadCommitted, "first")
	for _, iso := range isoLevels {
		t.Run(isoName(iso), func(t *testing.T) {
			tx, err := e.connect().BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			if r, err := fence.Gate(ctx, tx, g); err != nil || r != fence.GateReplay {
				t.Fatalf("gate: got %v, %v; want replay", r, err)
			}
			for _, w := range []struct {
				sql  string
				args []any
			}{
				// The retried first write: would violate results' primary key.
				{"insert into results values ($1, $2, $3)", []any{g.JobKey, "first", g.Token}},
				{upsertSQL, []any{g.JobKey, "first", g.Token}},
				{"update results set payload = 'second'", nil},
				{"delete from results", nil},
				{"merge into results r using (select 'report' as k) s on r.job_key = s.k when matched then update set payload = 'merged' when not matched then insert values (s.k, 'm', 1)", nil},
			} {
				tag, err := tx.Exec(ctx, w.sql, w.args...)
				if err != nil {
					t.Fatalf("%s in replay mode: %v", w.sql, err)
				}
				if tag.RowsAffected() != 0 {
					t.Fatalf("%s in replay mode: %d rows affected, want 0", w.sql, tag.RowsAffected())
				}
			}
			// An unprotected table is written as usual (and rolled back).
			if tag, err := tx.Exec(ctx, "insert into audit values ('report', 17, 'replayed')"); err != nil || tag.RowsAffected() != 1 {
				t.Fatalf("unprotected write in replay mode: %v, %v", tag, err)
			}
			wantCode(t, tx.Commit(ctx), fence.CodeReplay)
			e.wantResult(t, "report", result{"first", 17})
			e.wantCount(t, 1, "select count(*) from audit")
		})
	}

	// The same on a direct connection that never calls fence.gate: the
	// backstop finds the receipt, and the statement's rows are skipped.
	t.Run("direct", func(t *testing.T) {
		c := e.connect()
		_, err := c.Exec(ctx, "begin; "+setSQL(g)+"; insert into results values ('report', 'first', 17); commit")
		wantCode(t, err, fence.CodeReplay)
		e.wantResult(t, "report", result{"first", 17})
	})

	// A retry through RunTx with a plain INSERT is answered Replayed.
	t.Run("runtx", func(t *testing.T) {
		res, err := fence.RunTx(ctx, e.connect(), g, []byte("first"), func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "insert into results values ($1, $2, $3)", g.JobKey, "first", g.Token)
			return err
		})
		if err != nil || res != fence.Replayed {
			t.Fatalf("retry: got %v, %v; want replayed", res, err)
		}
	})
}

// TestReplayOnlyInReplayMode: an ordinary gated transaction writes as
// before, a write after a replaying transaction on the same connection is
// not skipped, and a forged pgfence.replay suppresses nothing (since
// migration 015 a row is skipped only in a transaction with a replay
// guard: issue 30, A-M3, where an owner's index expression forged it in a
// worker's statement): it neither skips the forger's rows, nor gets a
// stale generation past the fence, nor affects other sessions.
func TestReplayOnlyInReplayMode(t *testing.T) {
	e, ctx := parallelEnv(t)
	l := e.acquire("report", "A")
	conn := e.connect()

	// A replay on this connection first, so pgfence.replay exists in the
	// session and holds an old transaction id afterwards.
	g0 := l.Generation("zero")
	e.wantWrite(t, conn, pgx.ReadCommitted, g0, "zero", fence.Committed)
	e.wantWrite(t, conn, pgx.ReadCommitted, g0, "zero", fence.Replayed)

	g := l.Generation("one")
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := fence.Gate(ctx, tx, g); err != nil || r != fence.GateOK {
		t.Fatalf("gate: %v, %v", r, err)
	}
	tag, err := tx.Exec(ctx, "insert into results values ('one', 'p', $1), ('two', 'p', $1)", l.Token)
	if err != nil || tag.RowsAffected() != 2 {
		t.Fatalf("ordinary insert: %v, %v", tag, err)
	}
	if tag, err := tx.Exec(ctx, "update results set payload = 'q' where job_key in ('one', 'two')"); err != nil || tag.RowsAffected() != 2 {
		t.Fatalf("ordinary update: %v, %v", tag, err)
	}
	if tag, err := tx.Exec(ctx, "delete from results where job_key = 'two'"); err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("ordinary delete: %v, %v", tag, err)
	}
	if r, err := fence.Commit(ctx, tx, g, fence.PayloadDigest([]byte("one")), fence.PayloadDigestVersion); err != nil || r != fence.Committed {
		t.Fatalf("commit: %v, %v", r, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	e.wantResult(t, "one", result{"q", l.Token})

	// Forging the marker: the forger's own writes are not skipped ...
	g2 := l.Generation("two")
	tx, err = conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := fence.Gate(ctx, tx, g2); err != nil || r != fence.GateOK {
		t.Fatalf("gate: %v, %v", r, err)
	}
	if _, err := tx.Exec(ctx, "select set_config('pgfence.replay', pg_current_xact_id()::text, true)"); err != nil {
		t.Fatal(err)
	}
	if tag, err := tx.Exec(ctx, "insert into results values ('forged', 'p', $1)", l.Token); err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("forged replay insert: %v, %v; want 1 row", tag, err)
	}
	// ... while another session writing at the same time is not affected.
	other := e.acquire("other", "B")
	oc := e.connect()
	if err := setGUCs(ctx, oc, other.Generation("")); err != nil {
		t.Fatal(err)
	}
	if tag, err := oc.Exec(ctx, "insert into results values ('other', 'p', $1)", other.Token); err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("other session: %v, %v", tag, err)
	}
	tx.Rollback(ctx)

	// ... and a forged marker does not get a stale generation past the
	// backstop.
	e.takeover("report", "B")
	sc := e.connect()
	_, err = sc.Exec(ctx, "begin; "+setSQL(l.Generation("three"))+
		"; select set_config('pgfence.replay', pg_current_xact_id()::text, true); insert into results values ('stale', 'p', 1)")
	wantCode(t, err, fence.CodeStale)
	e.wantCount(t, 0, "select count(*) from results where job_key in ('forged', 'stale')")
}

// TestReplayTriggerLifecycle: protect installs pgfence_replay, unprotect
// removes it with the backstop.
func TestReplayTriggerLifecycle(t *testing.T) {
	e, ctx := parallelEnv(t)
	trig := func() int {
		return e.count("select count(*) from pg_trigger where tgrelid = 'results'::regclass and tgname = 'pgfence_replay'")
	}
	if n := trig(); n != 1 {
		t.Fatalf("pgfence_replay after protect: %d", n)
	}
	if err := fence.Unprotect(ctx, e.admin, "results"); err != nil {
		t.Fatal(err)
	}
	e.wantCount(t, 0, "select count(*) from pg_trigger where tgrelid = 'results'::regclass and not tgisinternal")
	if err := fence.Protect(ctx, e.admin, "results", "job_key"); err != nil {
		t.Fatal(err)
	}
	if n := trig(); n != 1 {
		t.Fatalf("pgfence_replay after protect with a job-key column: %d", n)
	}
}
