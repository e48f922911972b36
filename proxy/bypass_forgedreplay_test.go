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
				if got := pgtest.SQLState(err); got != forgedCode(route) {
					t.Fatalf("query %d: %v (SQLSTATE %q), want %s", i, err, got, forgedCode(route))
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
			if got := pgtest.SQLState(err); got != forgedCode(route) {
				t.Fatalf("insert: %v (SQLSTATE %q), want %s", err, got, forgedCode(route))
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
	for _, route := range castRoutes {
		// Round 26, BE-1: at a COMMIT AND CHAIN, the forged FN00R got
		// the proxy's own answer to a replay, step and all.
		t.Run("commit_and_chain_"+route, func(t *testing.T) {
			conn := c.connect(t, route, c.worker, &c.current)
			for _, q := range []string{"set fence.step = 'forged-commit-chain'", "begin; insert into app.ledger (k, job_key) values (9004, 'job')"} {
				if _, err := conn.Exec(ctxT(t), q).ReadAll(); err != nil {
					t.Fatal(err)
				}
			}
			_, err := conn.Exec(ctxT(t), "commit and chain").ReadAll()
			if got := pgtest.SQLState(err); got != forgedCode(route) {
				t.Fatalf("commit and chain: %v (SQLSTATE %q), want %s", err, got, forgedCode(route))
			}
			conn.Exec(ctxT(t), "rollback").ReadAll()
			if step := showStep(t, conn); step != "forged-commit-chain" {
				t.Fatalf("fence.step %q after a forged FN00R, want the client's", step)
			}
		})
		// Round 26, BE-2: an FN00R in a savepoint rolled back to wedged
		// the session (the settings sent again and again before the next
		// request, which never ran) and held the job's fence row.
		t.Run("savepoint_rolled_back_"+route, func(t *testing.T) {
			conn := c.connect(t, route, c.worker, &c.current)
			k := 9010 + len(route)*10
			for _, q := range []string{
				"set fence.step = 'sp-" + route + "'",
				"begin",
				fmt.Sprintf("insert into app.ledger (k, job_key, v) values (%d, 'job', 'x')", k),
				"savepoint s",
			} {
				if _, err := conn.Exec(ctxT(t), q).ReadAll(); err != nil {
					t.Fatalf("%s: %v", q, err)
				}
			}
			_, err := conn.Exec(ctxT(t), "do $$ begin raise exception 'boom' using errcode = 'FN00R'; end $$").ReadAll()
			if got := pgtest.SQLState(err); got != forgedCode(route) {
				t.Fatalf("do: %v (SQLSTATE %q), want %s", err, got, forgedCode(route))
			}
			for _, q := range []string{
				"rollback to s",
				fmt.Sprintf("insert into app.ledger (k, job_key, v) values (%d, 'job', 'x')", k+1),
				"commit",
			} {
				if _, err := conn.Exec(ctxT(t), q).ReadAll(); err != nil {
					t.Fatalf("%s: %v", q, err)
				}
			}
			if n := c.count(t, "select count(*) from app.ledger where k in ($1, $2)", k, k+1); n != 2 {
				t.Fatalf("%d rows committed, want 2", n)
			}
		})
		// An FN00R before the gate ran (the proxy cannot tell whose it
		// is: it takes it for a replay's, and the step is no longer
		// known): the request after ROLLBACK AND CHAIN is answered, not
		// held.
		t.Run("before_the_gate_then_rollback_and_chain_"+route, func(t *testing.T) {
			conn := c.connect(t, route, c.worker, &c.current)
			for _, q := range []string{"set fence.step = 'chain-" + route + "'", "begin"} {
				if _, err := conn.Exec(ctxT(t), q).ReadAll(); err != nil {
					t.Fatal(err)
				}
			}
			conn.Exec(ctxT(t), "do $$ begin raise exception 'boom' using errcode = 'FN00R'; end $$").ReadAll()
			if _, err := conn.Exec(ctxT(t), "rollback and chain").ReadAll(); err != nil {
				t.Fatal(err)
			}
			_, err := conn.Exec(ctxT(t), fmt.Sprintf("insert into app.ledger (k, job_key, v) values (%d, 'job', 'x')", 9050+len(route))).ReadAll()
			if got := pgtest.SQLState(err); route == "proxy" && got != fence.CodeFencingRequired || route == "direct" && err != nil {
				t.Fatalf("insert after rollback and chain: %v (SQLSTATE %q)", err, got)
			}
			conn.Exec(ctxT(t), "rollback").ReadAll()
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

// forgedCode is the SQLSTATE a client gets for an FN00R raised by code
// other than pgfence's in a transaction that replays nothing: as
// PostgreSQL sent it, direct; P0001, said not to be a replay, through the
// proxy.
func forgedCode(route string) string {
	if route == "proxy" {
		return "P0001"
	}
	return fence.CodeReplay
}
