package proxy

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
)

func init() { registerBypass("prepare_locks", bypassPrepareLocks) }

// bypassPrepareLocks (issue 30, attacker C's M1): a role with no lease
// and no fence metadata locks another job's rows of a protected table
// (FOR UPDATE, LOCK TABLE, any read) and prepares the transaction: the
// locks outlive its client until an administrator runs ROLLBACK
// PREPARED, and the job's holder waits for ever. The database refuses
// PREPARE only after a fenced write (a locking read runs no pgfence
// code); through the proxy, PREPARE TRANSACTION of a transaction that
// holds any lock on a protected table is refused (FN009), decided by
// PostgreSQL's lock table in a probe right before it. Directly, it is a
// known limit (docs/security.md: max_prepared_transactions = 0).
func bypassPrepareLocks(t *testing.T) {
	c := newCast(t)
	c.as(t, c.owner, `
create function public.lock_res() returns int language sql as $$ select k from res where k = 1 for update $$;
create view public.res_v as select * from res;
grant select, update on public.res_v to public;
create table public.dtrig (x int);
create table public.dtrig2 (x int);
grant insert on public.dtrig, public.dtrig2 to public;
create function public.dtrig_lock() returns trigger language plpgsql as $$ begin perform 1 from res where k = 1 for update; return null; end $$;
create function public.dtrig_table() returns trigger language plpgsql as $$ begin lock table res in exclusive mode; return null; end $$;
create constraint trigger dtrig_lock after insert on public.dtrig deferrable initially deferred for each row execute function public.dtrig_lock();
create constraint trigger dtrig_table after insert on public.dtrig2 deferrable initially deferred for each row execute function public.dtrig_table();
create table public.dtrig3 (x int);
grant insert on public.dtrig3 to public;
create function public.dtrig_again() returns trigger language plpgsql as $$ begin
  if new.x = 1 then set constraints all deferred; insert into public.dtrig3 values (2); else perform 1 from res where k = 1 for update; end if;
  return null; end $$;
create constraint trigger dtrig_again after insert on public.dtrig3 deferrable initially deferred for each row execute function public.dtrig_again();
`)
	const gid = "'pgfence_bypass_l'"
	cases := []struct{ name, lock string }{
		{"for_update", "select k from res where k = 1 for update"},
		{"for_no_key_update", "select k from res where k = 1 for no key update"},
		{"for_share", "select k from res where k = 1 for share"},
		{"for_key_share", "select k from res where k = 1 for key share"},
		{"keyed_ledger_for_update", "select job_key from app.ledger where job_key = 'job' for update"},
		{"inheritance_parent_for_update", "select k from inh for update"},
		{"cte_for_update", "with x as (select k from res where k = 1 for update) select count(*) from x"},
		{"view_for_update", "select k from res_v where k = 1 for update"},
		{"function_for_update", "select lock_res()"},
		{"lock_table", "lock table res in row share mode"},
		{"lock_table_access_share", "lock table res in access share mode"},
		{"plain_read", "select count(*) from res"},
		// (round 2, attacker E's M1) Deferred triggers fire at PREPARE,
		// after the probe: the probe fires them first.
		{"deferred_trigger_for_update", "insert into dtrig values (1)"},
		{"deferred_trigger_lock_table", "insert into dtrig2 values (1)"},
		{"deferred_trigger_defers_again", "insert into dtrig3 values (1)"},
	}
	for _, tc := range cases {
		for _, role := range []string{c.worker2, c.worker} {
			who := "other_role"
			if role == c.worker {
				who = "holder_role"
			}
			t.Run(tc.name+"/"+who, func(t *testing.T) {
				conn := c.connect(t, "proxy", role, nil)
				c.prepareRefused(t, conn, "begin; "+tc.lock, "", nil)
				c.prepareRefused(t, conn, "prepare transaction "+gid, fence.CodeUnsupported, nil)
			})
		}
		t.Run(tc.name+"/one_query", func(t *testing.T) {
			conn := c.connect(t, "proxy", c.worker2, nil)
			c.prepareRefused(t, conn, "begin; "+tc.lock+"; prepare transaction "+gid, fence.CodeUnsupported, nil)
		})
	}
	t.Run("extended_protocol", func(t *testing.T) {
		conn := c.connect(t, "proxy", c.worker2, nil)
		c.prepareRefused(t, conn, "", fence.CodeUnsupported, func(ctx context.Context) error {
			b := &pgconn.Batch{}
			b.ExecParams("begin", nil, nil, nil, nil)
			b.ExecParams("select k from res where k = 1 for update", nil, nil, nil, nil)
			b.ExecParams("prepare transaction "+gid, nil, nil, nil, nil)
			_, err := conn.ExecBatch(ctx, b).ReadAll()
			return err
		})
	})
	t.Run("extended_protocol_separate_batches", func(t *testing.T) {
		conn := c.connect(t, "proxy", c.worker2, nil)
		c.prepareRefused(t, conn, "", "", func(ctx context.Context) error {
			b := &pgconn.Batch{}
			b.ExecParams("begin", nil, nil, nil, nil)
			b.ExecParams("select k from res where k = 1 for update", nil, nil, nil, nil)
			_, err := conn.ExecBatch(ctx, b).ReadAll()
			return err
		})
		c.prepareRefused(t, conn, "", fence.CodeUnsupported, func(ctx context.Context) error {
			_, err := conn.ExecParams(ctx, "prepare transaction "+gid, nil, nil, nil, nil).Close()
			return err
		})
	})
	// The control: a transaction that locked only an unprotected table
	// prepares through the proxy as before.
	t.Run("unprotected_prepare_works", func(t *testing.T) {
		conn := c.connect(t, "proxy", c.worker2, nil)
		if err := castExec(ctxT(t), conn, "begin; insert into notes (note) values ('2pc'); select id from notes for update", ""); err != nil {
			t.Fatal(err)
		}
		if err := castExec(ctxT(t), conn, "prepare transaction 'pgfence_bypass_ok2'", ""); err != nil {
			t.Fatalf("prepare without a lock on a protected table: %v", err)
		}
		c.exec(t, "rollback prepared 'pgfence_bypass_ok2'")
	})
}
