package proxy

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("receipt_db", bypassReceiptDB) }

// bypassReceiptDB (issue 30, HIGH 3): a fenced transaction that changed a
// protected table commits with exactly one receipt however it commits —
// COMMIT inside a procedure or a DO block in an extended batch that then
// fails before its Sync, the proxy's receipt statement replaced by client
// code (a trigger, a view, a column DEFAULT), a gate by hand without
// fence.commit — because the database writes the receipt at the
// transaction's first fenced write. Each first attempt is followed by its
// retry, which must be answered as a replay (or a conflict) and change
// nothing; the receipts are counted on a separate connection.
func bypassReceiptDB(t *testing.T) {
	c := newCast(t)
	w, cur := c.worker, &c.current
	c.as(t, c.owner, `
create procedure public.p_commit() language plpgsql as $$ begin commit; end $$;
create procedure public.p_write_commit(val text) language plpgsql as $$
begin
  update res set v = val where k = 1;
  commit;
end $$;
create procedure public.p_write_twice(val text) language plpgsql as $$
begin
  update res set v = val where k = 1;
  commit;
  update res set v = val || ' again' where k = 120;
end $$;
create function public.rt_replace() returns text language plpgsql as $$
begin
  begin execute 'deallocate pgfence_commit'; exception when others then null; end;
  begin execute 'deallocate pgfence_commit_if'; exception when others then null; end;
  execute 'prepare pgfence_commit(text, int8, int8, text, bytea, text) as select ''committed''::text';
  execute 'prepare pgfence_commit_if(text, int8, int8, text, bytea, text) as select ''none''::text';
  return 'replaced';
end $$;
create view public.replacing as select rt_replace() as r;
create table public.replaces (id int, r text default rt_replace());
create function public.replaces_fire() returns trigger language plpgsql as $$ begin perform rt_replace(); return null; end $$;
create trigger replaces_fire after insert on public.replaces for each statement execute function public.replaces_fire();
grant select on replacing to `+w+`;
grant insert on replaces to `+w+`;
`)
	receipts := func(t *testing.T, step string) int {
		t.Helper()
		return c.count(t, "select count(*) from fence.receipts where job_key = 'job' and token = $1 and step = $2", cur.Token, step)
	}
	// once runs first by route (it must end with first's error, "" for
	// none), wants one receipt for step and the write's row, then runs the
	// retry (the same again) by both routes: a replay or a conflict, and
	// nothing changed.
	type run func(t *testing.T, conn *pgconn.PgConn) error
	once := func(t *testing.T, route, step string, firstCode, check string, first, retry run) {
		t.Helper()
		conn := c.connect(t, route, w, cur)
		if err := castExec(ctxT(t), conn, "set fence.step = '"+step+"'", ""); err != nil {
			t.Fatal(err)
		}
		if err := first(t, conn); pgtest.SQLState(err) != firstCode {
			t.Fatalf("first attempt: %v, want SQLSTATE %q", err, firstCode)
		}
		if n := receipts(t, step); n != 1 {
			t.Fatalf("%d receipts after the first attempt, want exactly 1", n)
		}
		if n := c.count(t, check); n == 0 {
			t.Fatalf("%s: the first attempt's write is missing", check)
		}
		for _, r := range castRoutes {
			t.Run("retry_"+r, func(t *testing.T) {
				before := c.state(t)
				conn := c.connect(t, r, w, cur)
				if err := castExec(ctxT(t), conn, "set fence.step = '"+step+"'", ""); err != nil {
					t.Fatal(err)
				}
				err := retry(t, conn)
				switch pgtest.SQLState(err) {
				case "", fence.CodeReplay, fence.CodeConflict:
				case "2D000":
					// Through the proxy a simple CALL or DO is wrapped in
					// the proxy's transaction, where PostgreSQL refuses
					// its COMMIT: refused, nothing applied.
				default:
					t.Fatalf("retry: %v, want a replay", err)
				}
				c.unchanged(t, before)
				if n := receipts(t, step); n != 1 {
					t.Fatalf("%d receipts after the retry, want 1", n)
				}
			})
		}
	}
	simple := func(sql string) run {
		return func(t *testing.T, conn *pgconn.PgConn) error { return castExec(ctxT(t), conn, sql, "") }
	}
	// batch sends sqls as one extended-protocol batch (one Sync at the end).
	batch := func(sqls ...string) run {
		return func(t *testing.T, conn *pgconn.PgConn) error {
			b := &pgconn.Batch{}
			for _, q := range sqls {
				b.ExecParams(q, nil, nil, nil, nil)
			}
			_, err := conn.ExecBatch(ctxT(t), b).ReadAll()
			return err
		}
	}
	gate := func(step string) string {
		return fmt.Sprintf("select fence.gate('job', %d, %d, '%s')", cur.Epoch, cur.Token, step)
	}
	n := 0
	for _, route := range castRoutes {
		for _, tc := range []struct {
			name, code string
			sql        func(step string) run
			proxyOnly  bool
			directOnly bool
		}{
			// An ordinary application can hit these: the write, a
			// procedure that COMMITs, then an error before Sync.
			{name: "call_commit_then_error_before_sync", code: "22012", sql: func(s string) run {
				return batch(fmt.Sprintf("insert into res values (%d, 'job', 'batch') on conflict (k) do update set v = excluded.v", 30+len(s)), "call p_commit()", "select 1/0")
			}},
			{name: "call_writing_procedure_then_error", code: "22012", sql: func(s string) run {
				return batch("call p_write_commit('proc "+s+"')", "select 1/0")
			}},
			{name: "do_commit_then_error_before_sync", code: "22012", sql: func(s string) run {
				return batch("do $$ begin update res set v = 'do "+s+"' where k = 1; commit; end $$", "select 1/0")
			}},
			{name: "call_commit_simple", directOnly: true, sql: func(s string) run {
				return simple("call p_write_commit('simple " + s + "')")
			}},
			// A procedure that commits and writes again: the second
			// transaction is a retry of the first (same generation and
			// step), which cannot commit.
			{name: "procedure_commits_twice", code: fence.CodeReplay, directOnly: true, sql: func(s string) run {
				return simple("call p_write_twice('twice " + s + "')")
			}},
			// The gate by hand, COMMIT without fence.commit.
			{name: "gate_without_commit_step", directOnly: true, sql: func(s string) run {
				return simple("begin; " + gate(s) + "; update res set v = 'by hand " + s + "' where k = 1; commit")
			}},
			{name: "gate_without_commit_step_extended", code: "22012", directOnly: true, sql: func(s string) run {
				return batch("begin", gate(s), "update res set v = 'by hand x "+s+"' where k = 1", "commit", "select 1/0")
			}},
			{name: "write_without_commit_step", directOnly: true, sql: func(s string) run {
				return simple("begin; update res set v = 'unreceipted " + s + "' where k = 1; commit")
			}},
			// The proxy's receipt statement replaced by code the proxy
			// does not count as opaque.
			{name: "commit_statement_replaced_by_view", proxyOnly: true, sql: func(s string) run {
				return simple("begin; update res set v = 'view " + s + "' where k = 1; select r from replacing; commit")
			}},
			{name: "commit_statement_replaced_by_trigger", proxyOnly: true, sql: func(s string) run {
				return simple("begin; update res set v = 'trigger " + s + "' where k = 1; insert into replaces (id, r) values (1, 'x'); commit")
			}},
			{name: "commit_statement_replaced_by_default", proxyOnly: true, sql: func(s string) run {
				return simple("begin; update res set v = 'default " + s + "' where k = 1; insert into replaces (id) values (1); commit")
			}},
			{name: "commit_statement_replaced_then_copy", proxyOnly: true, sql: func(s string) run {
				return func(t *testing.T, conn *pgconn.PgConn) error {
					if err := castExec(ctxT(t), conn, "begin; update res set v = 'copy "+s+"' where k = 1", ""); err != nil {
						return err
					}
					if err := castExec(ctxT(t), conn, "copy replaces (id) from stdin", "1\n"); err != nil {
						return err
					}
					return castExec(ctxT(t), conn, "commit", "")
				}
			}},
		} {
			if tc.proxyOnly && route != "proxy" || tc.directOnly && route != "direct" {
				continue
			}
			n++
			step := fmt.Sprintf("%s %s", tc.name, route)
			t.Run(tc.name+"/"+route, func(t *testing.T) {
				once(t, route, step, tc.code, "select count(*) from res where v like '%"+route+"%' or k = "+fmt.Sprint(30+len(step)), tc.sql(step), tc.sql(step))
			})
		}
	}
	t.Logf("%d commit paths", n)
}
