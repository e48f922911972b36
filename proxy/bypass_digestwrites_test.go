package proxy

import (
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("digest_writes", bypassDigestWrites) }

// bypassDigestWrites (round 22, attacker AQ): writes the receipt's
// payload digest left out, so that a different write under a committed
// step was answered as its replay "with the same payload" (and nothing
// of it applied), or an identical retry as a conflict (FN003, whose hint
// tells the client to redo its committed work under a new token).
//
//   - M1: a write inside COPY (… RETURNING) TO STDOUT. The gate gated it
//     (its Writes), the digest chose statements by kind and COPY TO was
//     not one: every such transaction had the same digest. Now whatever
//     writes a relation is digested (plan.Digested), whatever its kind.
//   - M2: a write run by an Execute with a row limit, answered
//     PortalSuspended: PostgreSQL runs the write whole at the portal's
//     first Execute, and the transaction may commit without the portal
//     ever completing; the digest item came only with CommandComplete.
//     Now the first PortalSuspended records it, and the completion does
//     not again.
//
// Each shape: a first commit, the same transaction again (a replay,
// success, nothing applied twice), a different write under the same
// step (FN003, not applied).
func bypassDigestWrites(t *testing.T) {
	c := newCast(t)
	w, cur := c.worker, &c.current
	copyTo := func(t *testing.T, conn *pgconn.PgConn, sql string) error {
		_, err := conn.CopyTo(ctxT(t), io.Discard, sql)
		return err
	}
	type shape struct {
		name         string
		first, other string
		run          func(t *testing.T, step, sql string) error
		// applied counts what the other write would leave (default: res
		// rows it set to 'other'); $1 is k + 1000.
		applied string
	}
	overQueries := func(t *testing.T, step, sql string) error {
		conn := c.connect(t, "proxy", w, cur)
		if err := castExec(ctxT(t), conn, "set fence.step = '"+step+"'; begin", ""); err != nil {
			return err
		}
		if err := copyTo(t, conn, sql); err != nil {
			return err
		}
		return castExec(ctxT(t), conn, "commit", "")
	}
	replaying := map[string]bool{} // steps committed once: their retries are replays
	// suspended runs sql in an explicit transaction by Parse, Bind,
	// Execute with a limit of one row and Sync, then commits: the portal
	// is never run to its end.
	suspended := func(t *testing.T, step, sql string) error {
		conn := c.connect(t, "proxy", w, cur)
		if err := castExec(ctxT(t), conn, "set fence.step = '"+step+"'; begin", ""); err != nil {
			return err
		}
		f := conn.Frontend()
		f.Send(&pgproto3.Parse{Query: sql})
		f.Send(&pgproto3.Bind{})
		f.Send(&pgproto3.Execute{MaxRows: 1})
		f.Send(&pgproto3.Sync{})
		if err := f.Flush(); err != nil {
			t.Fatalf("send: %v", err)
		}
		sawSuspended := false
		for {
			m, err := f.Receive()
			if err != nil {
				t.Fatalf("receive: %v", err)
			}
			switch m := m.(type) {
			case *pgproto3.PortalSuspended:
				sawSuspended = true
			case *pgproto3.ErrorResponse:
				t.Fatalf("the limited Execute: %s %s", m.Code, m.Message)
			}
			if _, ok := m.(*pgproto3.ReadyForQuery); ok {
				break
			}
		}
		if err := castExec(ctxT(t), conn, "commit", ""); err != nil {
			return err
		}
		if step != "" && !sawSuspended && !replaying[step] {
			// A replay's writes skip their rows (RETURNING nothing, so
			// the portal completes); a first commit's must be suspended.
			t.Fatal("the Execute was not answered PortalSuspended: the case tests nothing")
		}
		return nil
	}
	explicit := func(extended bool) func(t *testing.T, step, sql string) error {
		return func(t *testing.T, step, sql string) error {
			conn := c.connect(t, "proxy", w, cur)
			if err := castExec(ctxT(t), conn, "set fence.step = '"+step+"'; begin", ""); err != nil {
				return err
			}
			var err error
			if extended {
				err = conn.ExecParams(ctxT(t), sql, nil, nil, nil, nil).Read().Err
			} else {
				err = castExec(ctxT(t), conn, sql, "")
			}
			if err != nil {
				return err
			}
			return castExec(ctxT(t), conn, "commit", "")
		}
	}
	// Round 23, attacker AV's M1: a read that calls a writing function,
	// and a write to another table whose trigger writes a protected one,
	// were classified once per shape: the second text of a shape had the
	// first's digest item.
	c.as(t, c.owner, `create function public.dw_ins(k int) returns int language sql as $$ insert into inh_c values (k, 'job', 'first') returning k $$;
create table public.dw_side (k int);
create function public.dw_side_trg() returns trigger language plpgsql as $$ begin insert into inh_c values (new.k, 'job', 'first'); return new; end $$;
create trigger dw_side_ins after insert on public.dw_side for each row execute function public.dw_side_trg();
grant insert, select on public.dw_side to public`)
	inhApplied := "select count(*) from inh_c where k = $1"
	// oneQuery runs sql as one simple query on a fenced connection.
	oneQuery := func(t *testing.T, step, sql string) error {
		return castExec(ctxT(t), c.connect(t, "proxy", w, cur), sql, "")
	}
	// Round 23, attacker AW's M2: an extended-protocol batch (one Sync,
	// the unnamed portal bound again for each statement, as libpq's
	// pipeline mode and pgx's batches send it).
	// batchAfter is batch after the simple query set, run first.
	batchAfter := func(set string) func(t *testing.T, step, sql string) error {
		return func(t *testing.T, step, sql string) error {
			conn := c.connect(t, "proxy", w, cur)
			if err := castExec(ctxT(t), conn, "set fence.step = '"+step+"'"+set, ""); err != nil {
				return err
			}
			b := &pgconn.Batch{}
			for _, q := range strings.Split(sql, "; ") {
				b.ExecParams(q, nil, nil, nil, nil)
			}
			_, err := conn.ExecBatch(ctxT(t), b).ReadAll()
			return err
		}
	}
	batch := batchAfter("")
	// Round 23, attacker AW's M1: json is a keyword from PostgreSQL 16
	// on, so the deparse writes json as pg_catalog.json; PostgreSQL 15
	// looks it up on the search path, where a temporary domain comes
	// first.
	tempJSON := func(t *testing.T, step, sql string) error {
		conn := c.connect(t, "proxy", w, cur)
		for _, q := range []string{"create domain pg_temp.json as numeric", "set fence.step = '" + step + "'", "begin", sql, "commit"} {
			if err := castExec(ctxT(t), conn, q, ""); err != nil {
				return err
			}
		}
		return nil
	}
	shapes := []shape{
		{"json_keyword_by_text", "insert into inh_c values (%[1]d, 'job', 'first'), (%[3]d, 'job', ('1e2'::json)::text)",
			"insert into inh_c values (%[1]d, 'job', 'first'), (%[3]d, 'job', ('1e2'::pg_catalog.json)::text)", tempJSON,
			"select count(*) from inh_c where k = $1 and v = '1e2'"},
		{"batch_rebinds_unnamed_portal", "insert into inh_c values (%[1]d, 'job', 'first'); insert into inh_c values (%[1]d + 500, 'job', 'first')",
			"insert into inh_c values (%[1]d, 'job', 'first'); insert into inh_c values (%[3]d, 'job', 'other')", batch, inhApplied},
		{"batch_tentative_then_gated", "select public.dw_ins(%[1]d); insert into inh_c values (%[1]d + 500, 'job', 'first')",
			"select public.dw_ins(%[3]d); insert into inh_c values (%[1]d + 500, 'job', 'first')", batch, inhApplied},
		{"batch_commit_in_explicit", "insert into inh_c values (%[1]d, 'job', 'first'); insert into inh_c values (%[1]d + 500, 'job', 'first'); commit",
			"insert into inh_c values (%[1]d, 'job', 'first'); insert into inh_c values (%[3]d, 'job', 'other'); commit", batchAfter("; begin"), inhApplied},
		{"batch_then_query_commit", "insert into inh_c values (%[1]d, 'job', 'first'); insert into inh_c values (%[1]d + 500, 'job', 'first')",
			"insert into inh_c values (%[1]d, 'job', 'first'); insert into inh_c values (%[3]d, 'job', 'other')", func(t *testing.T, step, sql string) error {
				// Executes, then COMMIT as a Query message in the same
				// batch, before its Sync.
				conn := c.connect(t, "proxy", w, cur)
				if err := castExec(ctxT(t), conn, "set fence.step = '"+step+"'; begin", ""); err != nil {
					return err
				}
				f := conn.Frontend()
				for _, q := range strings.Split(sql, "; ") {
					f.Send(&pgproto3.Parse{Query: q})
					f.Send(&pgproto3.Bind{})
					f.Send(&pgproto3.Execute{})
				}
				f.Send(&pgproto3.Query{String: "commit"})
				f.Send(&pgproto3.Sync{})
				if err := f.Flush(); err != nil {
					t.Fatal(err)
				}
				for _, code := range rawAnswers(t, conn, 2) { // the Query's, the Sync's
					if code != "" {
						return &pgconn.PgError{Code: code}
					}
				}
				return nil
			}, inhApplied},
		{"batch_gated_then_begin", "insert into inh_c values (%[1]d, 'job', 'first'); begin; insert into inh_c values (%[1]d + 500, 'job', 'first'); commit",
			"insert into inh_c values (%[1]d, 'job', 'first'); begin; insert into inh_c values (%[3]d, 'job', 'other'); commit", batch, inhApplied},
		{"savepoint_before_first_write", "set fence.step = '%[2]s'; begin; savepoint s; insert into inh_c values (%[3]d, 'job', 'rolled back'); rollback to s; insert into inh_c values (%[1]d, 'job', 'first'); commit",
			"set fence.step = '%[2]s'; begin; insert into inh_c values (%[3]d, 'job', 'rolled back'); insert into inh_c values (%[1]d, 'job', 'first'); commit", oneQuery, inhApplied},
		{"savepoint_released_then_rolled_back", "set fence.step = '%[2]s'; begin; insert into inh_c values (%[1]d, 'job', 'first'); savepoint s; insert into inh_c values (%[3]d, 'job', 'x'); savepoint s; insert into inh_c values (%[3]d + 1, 'job', 'x'); release s; rollback to s; commit",
			"set fence.step = '%[2]s'; begin; insert into inh_c values (%[1]d, 'job', 'first'); insert into inh_c values (%[3]d, 'job', 'x'); commit", oneQuery, inhApplied},
		{"copy_to_over_queries", "copy (insert into inh_c values (%[1]d, 'job', 'first') returning k) to stdout",
			"copy (update res set v = 'other' where k = 1 returning k) to stdout", overQueries, ""},
		{"copy_to_one_query", "set fence.step = '%[2]s'; begin; copy (insert into inh_c values (%[1]d, 'job', 'first') returning k) to stdout; commit",
			"set fence.step = '%[2]s'; begin; copy (update res set v = 'other' where k = 1 returning k) to stdout; commit",
			func(t *testing.T, step, sql string) error {
				return copyTo(t, c.connect(t, "proxy", w, cur), sql)
			}, ""},
		{"copy_to_autocommit", "set fence.step = '%[2]s'; copy (insert into inh_c values (%[1]d, 'job', 'first') returning k) to stdout",
			"set fence.step = '%[2]s'; copy (update res set v = 'other' where k = 1 returning k) to stdout",
			func(t *testing.T, step, sql string) error {
				return copyTo(t, c.connect(t, "proxy", w, cur), sql)
			}, ""},
		{"copy_to_beside_a_write", "set fence.step = '%[2]s'; begin; insert into inh_c values (%[1]d + 500, 'job', 'first'); copy (insert into inh_c values (%[1]d, 'job', 'first') returning k) to stdout; commit",
			"set fence.step = '%[2]s'; begin; insert into inh_c values (%[1]d + 500, 'job', 'first'); copy (update res set v = 'other' where k = 1 returning k) to stdout; commit",
			func(t *testing.T, step, sql string) error {
				return copyTo(t, c.connect(t, "proxy", w, cur), sql)
			}, ""},
		{"suspended_returning", "insert into inh_c values (%[1]d, 'job', 'first'), (%[1]d + 100, 'job', 'first') returning k",
			"with d as (update res set v = 'other' where k = 1 returning k) select g from generate_series(1, 3) g", suspended, ""},
		{"opaque_read_shape", "select public.dw_ins(%[1]d)", "select public.dw_ins(%[3]d)", explicit(false), inhApplied},
		{"opaque_read_shape_extended", "select public.dw_ins(%[1]d)", "select public.dw_ins(%[3]d)", explicit(true), inhApplied},
		{"opaque_read_shape_autocommit", "set fence.step = '%[2]s'; select public.dw_ins(%[1]d)", "set fence.step = '%[2]s'; select public.dw_ins(%[3]d)",
			func(t *testing.T, step, sql string) error {
				conn := c.connect(t, "proxy", w, cur)
				// The statement alone, after the step: a shape of its own.
				parts := strings.SplitN(sql, "; ", 2)
				if err := castExec(ctxT(t), conn, parts[0], ""); err != nil {
					return err
				}
				return castExec(ctxT(t), conn, parts[1], "")
			}, inhApplied},
		{"trigger_write_shape", "insert into public.dw_side values (%[1]d)", "insert into public.dw_side values (%[3]d)", explicit(false), inhApplied},
		{"suspended_returning_other_write", "insert into inh_c values (%[1]d, 'job', 'first'), (%[1]d + 100, 'job', 'first') returning k",
			"update res set v = 'other' where k in (1, 2) returning k", suspended, ""},
	}
	for i, sh := range shapes {
		t.Run(sh.name, func(t *testing.T) {
			step, k := "dw_"+sh.name, 70+i
			fill := func(s string) string { // %[1]d: k, %[2]s: the step
				if !strings.Contains(s, "%") {
					return s
				}
				return fmt.Sprintf(s, k, step, k+1000)
			}
			first, other := fill(sh.first), fill(sh.other)
			if err := sh.run(t, step, first); err != nil {
				t.Fatalf("first commit: %v", err)
			}
			if n := c.count(t, "select count(*) from inh_c where k = $1 and v = 'first'", k); n != 1 {
				t.Fatalf("the first commit's row: %d, want 1", n)
			}
			replaying[step] = true
			t.Run("same_transaction_replays", func(t *testing.T) {
				if err := sh.run(t, step, first); err != nil {
					t.Fatalf("the retry of the same transaction: %v (SQLSTATE %q), want its replay (success)", err, pgtest.SQLState(err))
				}
				if n := c.count(t, "select count(*) from inh_c where k = $1", k); n != 1 {
					t.Fatalf("rows after the retry: %d, want 1", n)
				}
			})
			t.Run("different_write_conflicts", func(t *testing.T) {
				err := sh.run(t, step, other)
				if got := pgtest.SQLState(err); got != fence.CodeConflict {
					t.Fatalf("a different write under committed step %q: %v (SQLSTATE %q), want %s", step, err, got, fence.CodeConflict)
				}
				if sh.applied == "" {
					if n := c.count(t, "select count(*) from res where v = 'other'"); n != 0 {
						t.Fatal("the different write was applied")
					}
				} else if n := c.count(t, sh.applied, k+1000); n != 0 {
					t.Fatal("the different write was applied")
				}
			})
		})
	}
	// Round 23, attacker AV's M2: a fast-path FunctionCall's arguments
	// were in no digest (the proxy's, or the backstop's current_query(),
	// empty on the fast path): in a fenced session a user's function is
	// refused there (FN009), in autocommit and in a transaction.
	t.Run("function_call_refused", func(t *testing.T) {
		oid := c.count(t, "select 'public.dw_ins(int)'::regprocedure::oid::int")
		for _, inTx := range []bool{false, true} {
			conn := c.connect(t, "proxy", w, cur)
			if err := castExec(ctxT(t), conn, "set fence.step = 'dw_fcall'", ""); err != nil {
				t.Fatal(err)
			}
			if inTx {
				if err := castExec(ctxT(t), conn, "begin", ""); err != nil {
					t.Fatal(err)
				}
			}
			arg := []byte{0, 0, 0x04, 0x4c} // int4 1100, binary
			f := conn.Frontend()
			f.Send(&pgproto3.FunctionCall{Function: uint32(oid), ArgFormatCodes: []uint16{1}, Arguments: [][]byte{arg}, ResultFormatCode: 1})
			if err := f.Flush(); err != nil {
				t.Fatal(err)
			}
			if code := rawAnswers(t, conn, 1)[0]; code != fence.CodeUnsupported {
				t.Fatalf("a FunctionCall of a user's writing function in a fenced session (transaction %v): %q, want SQLSTATE %s", inTx, code, fence.CodeUnsupported)
			}
			if inTx {
				castExec(ctxT(t), conn, "rollback", "")
			}
		}
		if n := c.count(t, "select count(*) from inh_c where k = 1100"); n != 0 {
			t.Fatal("the call wrote")
		}
	})
	// Round 23, attacker AW's M3: a COMMIT in the query of a ROLLBACK TO
	// of an earlier query's savepoint, in a transaction that owes a
	// receipt: FN009, nothing committed.
	t.Run("commit_after_earlier_savepoint_refused", func(t *testing.T) {
		conn := c.connect(t, "proxy", w, cur)
		if err := castExec(ctxT(t), conn, "set fence.step = 'dw_earlier'; begin; savepoint s; insert into inh_c values (1200, 'job', 'first')", ""); err != nil {
			t.Fatal(err)
		}
		err := castExec(ctxT(t), conn, "rollback to s; commit", "")
		if got := pgtest.SQLState(err); got != fence.CodeUnsupported {
			t.Fatalf("ROLLBACK TO an earlier query's savepoint and COMMIT in one query: %v (SQLSTATE %q), want %s", err, got, fence.CodeUnsupported)
		}
		castExec(ctxT(t), conn, "rollback", "")
		if n := c.count(t, "select count(*) from fence.receipts where step = 'dw_earlier'"); n != 0 {
			t.Fatal("a receipt was committed")
		}
	})
}
