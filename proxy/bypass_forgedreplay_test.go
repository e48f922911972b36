package proxy

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("forged_replay", bypassForgedReplay) }

// bypassForgedReplay (round 25, attacker BB): FN00R is an SQLSTATE any
// code can raise, and the table owner's code runs in a worker's writes
// (a column default on a protected table is allowed DDL).
//
//   - H1: the owner's default inserted into the owner's table, whose
//     deferred constraint trigger raised FN00R at the COMMIT of the
//     worker's autocommit query. PostgreSQL reports a COMMIT's error
//     before the last statement's CommandComplete, the receipt step's
//     there, so the proxy took it for the receipt's replay: the worker
//     was told INSERT 0 1 and "idempotent replay … nothing was applied
//     twice", and nothing had committed, with no receipt.
//   - M1: the default raised FN00R in an explicit transaction: the proxy
//     ended the transaction itself, so the client's COMMIT was answered
//     COMMIT where PostgreSQL answers ROLLBACK.
//
// An FN00R after the receipt step returned its row is not the receipt's
// (fence.commit raises its replay before any row); a failed transaction
// is ended by the proxy only after a replay it answered as committed.
func bypassForgedReplay(t *testing.T) {
	c := newCast(t)
	raise := `raise exception 'job "%": epoch % token % step "%" already committed at now with the same payload: idempotent replay',
    current_setting('fence.job_key', true), current_setting('fence.epoch', true), current_setting('fence.token', true), current_setting('fence.step', true)
    using errcode = 'FN00R'`
	c.as(t, c.owner, fmt.Sprintf(`
create table public.fr_w (x int);
create function public.fr_w_fire() returns trigger language plpgsql as $$
begin
  if current_setting('fence.step', true) like 'forged-commit%%' then %s; end if;
  return null;
end $$;
create constraint trigger fr_w_fire after insert on public.fr_w deferrable initially deferred for each row execute function public.fr_w_fire();
create function public.fr_default() returns text language plpgsql security definer set search_path = pg_catalog, public as $$
begin
  if current_setting('fence.step', true) like 'forged-now%%' then %s; end if;
  insert into public.fr_w values (0);
  return 'dflt';
end $$;
alter table app.ledger alter column v set default public.fr_default()`, raise, raise))
	rows := "select 'ledger ' || r::text from app.ledger r"
	for _, route := range castRoutes {
		t.Run("commit_time_fn00r_is_an_error_"+route, func(t *testing.T) {
			conn := c.connect(t, route, c.worker, &c.current)
			before := c.lines(t, rows)
			for i, q := range []string{
				"insert into app.ledger (k, job_key) values (9001, 'job')",
				"insert into app.ledger (k, job_key) values (9002, 'job'); select 1",
			} {
				if _, err := conn.Exec(ctxT(t), fmt.Sprintf("set fence.step = 'forged-commit-%d'", i+1)).ReadAll(); err != nil {
					t.Fatal(err)
				}
				_, err := conn.Exec(ctxT(t), q).ReadAll()
				if got := pgtest.SQLState(err); got != fence.CodeReplay {
					t.Fatalf("query %d: %v (SQLSTATE %q), want the FN00R error PostgreSQL sent", i, err, got)
				}
				if step := showStep(t, conn); step != fmt.Sprintf("forged-commit-%d", i+1) {
					t.Fatalf("query %d: fence.step %q after an error, want the client's", i, step)
				}
			}
			if after := c.lines(t, rows); fmt.Sprint(after) != fmt.Sprint(before) {
				t.Fatalf("rows changed: %v -> %v", before, after)
			}
		})
		t.Run("statement_fn00r_commit_answered_rollback_"+route, func(t *testing.T) {
			conn := c.connect(t, route, c.worker, &c.current)
			if _, err := conn.Exec(ctxT(t), "set fence.step = 'forged-now'; begin").ReadAll(); err != nil {
				t.Fatal(err)
			}
			_, err := conn.Exec(ctxT(t), "insert into app.ledger (k, job_key) values (9003, 'job')").ReadAll()
			if got := pgtest.SQLState(err); got != fence.CodeReplay {
				t.Fatalf("insert: %v (SQLSTATE %q), want FN00R", err, got)
			}
			res, err := conn.Exec(ctxT(t), "commit").ReadAll()
			if err != nil {
				t.Fatalf("commit: %v", err)
			}
			if tag := res[0].CommandTag.String(); tag != "ROLLBACK" {
				t.Fatalf("the COMMIT of a failed transaction answered %q, want ROLLBACK", tag)
			}
		})
	}
	// The control: the same worker's write under a step the owner's code
	// leaves alone commits, default and all.
	c.currentWrites(t, func(route string) string {
		return fmt.Sprintf("insert into app.ledger (k, job_key) values (%d, 'job')", 9100+len(route))
	})
}

// showStep returns the session's fence.step.
func showStep(t *testing.T, conn *pgconn.PgConn) string {
	t.Helper()
	res := conn.ExecParams(ctxT(t), "select coalesce(current_setting('fence.step', true), '')", nil, nil, nil, nil).Read()
	if res.Err != nil || len(res.Rows) != 1 {
		t.Fatalf("fence.step: %v", res.Err)
	}
	return string(res.Rows[0][0])
}
