package proxy

import (
	"fmt"
	"testing"
	"time"

	"github.com/pgfence/pgfence/fence"
)

func init() { registerBypass("fastgate", bypassFastGate) }

// bypassFastGate (issue 33, migration 025): the shortcuts of the faster
// gated write, each attacked where it trusts something.
//
//   - fence.gate, fence.enter and the backstop look for this
//     transaction's receipts and replay guards under another generation
//     or step (O-H1) only when the transaction has an id: a gate or
//     commit_if_written after a write under another step or generation,
//     after an unprotected write gave the transaction its id, or in
//     replay mode, is still FN009; a savepoint rolled back takes its
//     receipt with it, and the gate under another step then passes (one
//     receipt, the second step's).
//   - fence.commit_if_written reads this transaction's receipts and
//     guards in one statement: another step or generation is FN009, a
//     receipt rolled back to a savepoint is 'none' (and nothing commits),
//     the presented one commits its digest; tables named like the fence's
//     in pg_temp change nothing.
//   - pgfence_backstop has no WHEN: fence.backstop returns at once
//     without fence.job_key, and pgfence_backstop_nometa refuses the
//     write: an empty key set by SET, by set_config inside the
//     transaction, by a trigger before its own write, for TRUNCATE; a
//     blank key is not empty (the fence finds no such job); a bypass
//     role still writes without a generation.
func bypassFastGate(t *testing.T) {
	c := newCast(t)
	w, cur, stale := c.worker, &c.current, &c.stale
	x, err := fence.Acquire(ctxT(t), c.connectPgx(t, "direct", w, nil), "jobx", "x", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	c.as(t, c.owner, fmt.Sprintf(`
create function public.fg_clear_write() returns trigger language plpgsql as $$
begin
  perform set_config('fence.job_key', '', true);
  insert into res values (new.id %% 50 + 30, 'job', 'by trigger');
  return new;
end $$;
create trigger fg_clear_write before insert on notes for each row when (new.note = 'fg clear') execute function fg_clear_write();
grant truncate on res_1 to %s;`, w))
	gen := func(l *fence.Lease, step string) string {
		return fmt.Sprintf("'%s', %d, %d, '%s'", l.JobKey, l.Epoch, l.Token, step)
	}
	row := counter(40)
	write := func() string { return fmt.Sprintf("insert into res values (%d, 'job', 'fg')", row()) }
	// A receipt committed under step fg_replay: a later write under it
	// enters replay mode (a replay guard, no receipt).
	if err := castExec(ctxT(t), c.connect(t, "direct", w, cur), "set fence.step = 'fg_replay'; "+write(), ""); err != nil {
		t.Fatalf("the first commit under step fg_replay: %v", err)
	}
	switchCase := func(name, step, before, call string) castCase {
		return castCase{name, attempt{role: w, lease: cur, code: fence.CodeUnsupported,
			sql: fmt.Sprintf("begin; %sset local fence.step = '%s'; %s; %s; commit", before, step, write(), call)}}
	}
	c.tryEach(t, []castCase{
		switchCase("gate_other_step_after_write", "fg1", "", "select fence.gate("+gen(cur, "fg1b")+")"),
		switchCase("gate_other_generation_after_write", "fg2", "", "select fence.gate("+gen(&x, "fg2")+")"),
		switchCase("gate_other_step_after_unprotected_write", "fg3", "insert into notes (note) values ('fg3'); ", "select fence.gate("+gen(cur, "fg3b")+")"),
		switchCase("gate_other_step_in_replay", "fg_replay", "", "select fence.gate("+gen(cur, "fg4")+")"),
		switchCase("commit_if_written_other_step", "fg5", "", "select fence.commit_if_written("+gen(cur, "fg5b")+", '\\x01'::bytea, 'v1')"),
		switchCase("commit_if_written_other_generation", "fg6", "", "select fence.commit_if_written("+gen(&x, "fg6")+", '\\x01'::bytea, 'v1')"),
		switchCase("commit_if_written_other_step_in_replay", "fg_replay", "", "select fence.commit_if_written("+gen(cur, "fg7")+", '\\x01'::bytea, 'v1')"),
		switchCase("commit_if_written_other_step_after_unprotected_write", "fg8", "insert into notes (note) values ('fg8'); ",
			"select fence.commit_if_written("+gen(cur, "fg8b")+", '\\x01'::bytea, 'v1')"),
		{"empty_key_by_set", attempt{role: w, lease: cur, code: castNoMeta, sql: "set fence.job_key = ''; set fence.step = 'fg9'; " + write()}},
		{"empty_key_upsert", attempt{role: w, lease: cur, code: castNoMeta,
			sql: "set fence.job_key = ''; set fence.step = 'fg10'; insert into res values (1, 'job', 'fg') on conflict (k) do update set v = excluded.v"}},
		{"empty_key_by_set_config_in_transaction", attempt{role: w, lease: cur, code: castNoMeta,
			sql: "begin; set local fence.step = 'fg11'; select set_config('fence.job_key', '', true); " + write() + "; commit"}},
		{"empty_key_after_gated_write", attempt{role: w, lease: cur, code: castNoMeta,
			sql: "begin; set local fence.step = 'fg12'; " + write() + "; select set_config('fence.job_key', '', true); update res set v = 'cleared' where k = 1; commit"}},
		{"empty_key_by_trigger_before_its_write", attempt{role: w, lease: cur, code: castNoMeta,
			sql: "set fence.step = 'fg13'; insert into notes (note) values ('fg clear')"}},
		{"empty_key_truncate", attempt{role: w, lease: cur, code: castNoMeta, sql: "set fence.job_key = ''; truncate res_1"}},
		{"stale_with_fence_tables_in_pg_temp", attempt{role: w, lease: stale, code: castStale, sql: fmt.Sprintf(`
create temp table receipts (job_key text, epoch bigint, token bigint, step text, payload_digest bytea, digest_version text, backstop_xid xid8, backstop_started timestamptz);
create temp table fences (job_key text, epoch bigint, max_issued_token bigint, retired_at timestamptz, owner_role name, era_start timestamptz);
create temp table replay_guards (job_key text, epoch bigint, token bigint, step text, xid xid8);
begin;
set local search_path = pg_temp, public;
set local fence.step = 'fg14';
insert into pg_temp.fences values ('job', %[1]d, %[2]d, null, session_user, pg_postmaster_start_time());
insert into pg_temp.receipts values ('job', %[1]d, %[2]d, 'fg14', '\x01', 'v1', pg_current_xact_id(), pg_postmaster_start_time());
%[3]s;
commit`, stale.Epoch, stale.Token, write())}},
	})
	// A blank key is a key: the fence has no such job.
	for _, route := range castRoutes {
		t.Run("blank_key/"+route, func(t *testing.T) {
			before := c.state(t)
			err := castExec(ctxT(t), c.connect(t, route, w, cur), "set fence.job_key = ' '; set fence.step = 'fg15'; "+write(), "")
			if err == nil {
				t.Fatal("a write under fence.job_key ' ' committed")
			}
			c.unchanged(t, before)
		})
	}

	// The savepoint cases, straight to PostgreSQL (through the proxy the
	// step may not change inside a transaction at all).
	t.Run("gate_other_step_after_rolled_back_write/direct", func(t *testing.T) {
		k := row()
		sql := fmt.Sprintf("begin; set local fence.step = 'fg16a'; savepoint s; insert into res values (%d, 'job', 'rolled back'); rollback to s; "+
			"select fence.gate(%s); set local fence.step = 'fg16b'; insert into res values (%d, 'job', 'kept'); commit", k, gen(cur, "fg16b"), k)
		if err := castExec(ctxT(t), c.connect(t, "direct", w, cur), sql, ""); err != nil {
			t.Fatalf("a gate under another step after the first step's write was rolled back: %v", err)
		}
		if n := c.count(t, "select count(*) from fence.receipts where step like 'fg16%' and step = 'fg16b'"); n != 1 {
			t.Fatalf("%d receipts of step fg16b, want 1", n)
		}
		if n := c.count(t, "select count(*) from fence.receipts where step = 'fg16a'"); n != 0 {
			t.Fatalf("%d receipts of the rolled-back step fg16a, want 0", n)
		}
		if n := c.count(t, "select count(*) from res where k = $1 and v = 'kept'", k); n != 1 {
			t.Fatal("the write under step fg16b is missing")
		}
	})
	t.Run("commit_if_written_after_rolled_back_write/direct", func(t *testing.T) {
		k := row()
		conn := c.connect(t, "direct", w, cur)
		res, err := conn.Exec(ctxT(t), fmt.Sprintf("begin; set local fence.step = 'fg17'; savepoint s; insert into res values (%d, 'job', 'rolled back'); rollback to s; "+
			"select fence.commit_if_written(%s, '\\x01'::bytea, 'v1')", k, gen(cur, "fg17"))).ReadAll()
		if err != nil {
			t.Fatal(err)
		}
		if got := string(res[len(res)-1].Rows[0][0]); got != "none" {
			t.Fatalf("commit_if_written after the write was rolled back to its savepoint: %q, want none", got)
		}
		if err := castExec(ctxT(t), conn, "commit", ""); err != nil {
			t.Fatal(err)
		}
		if n := c.count(t, "select count(*) from fence.receipts where step = 'fg17'") + c.count(t, "select count(*) from res where k = $1", k); n != 0 {
			t.Fatalf("%d receipts or rows of the rolled-back write, want 0", n)
		}
	})
	t.Run("commit_if_written_same_step/direct", func(t *testing.T) {
		conn := c.connect(t, "direct", w, cur)
		res, err := conn.Exec(ctxT(t), fmt.Sprintf("begin; set local fence.step = 'fg18'; %s; select fence.commit_if_written(%s, '\\x01'::bytea, 'v1'); commit",
			write(), gen(cur, "fg18"))).ReadAll()
		if err != nil {
			t.Fatal(err)
		}
		if got := string(res[len(res)-2].Rows[0][0]); got != "committed" {
			t.Fatalf("commit_if_written of the transaction's own step: %q, want committed", got)
		}
		if n := c.count(t, "select count(*) from fence.receipts where step = 'fg18' and payload_digest = '\\x01' and digest_version = 'v1'"); n != 1 {
			t.Fatalf("%d receipts of step fg18 with the presented digest, want 1", n)
		}
	})
	// The bypass role writes without a generation: fence.backstop fires
	// and returns, pgfence_backstop_nometa lets it through.
	// (Through the proxy a session without a generation may not write a
	// protected table at all.)
	t.Run("bypass_without_generation/direct", func(t *testing.T) {
		k := row()
		if err := castExec(ctxT(t), c.connect(t, "direct", c.dba, nil), fmt.Sprintf("insert into res values (%d, 'job', 'dba')", k), ""); err != nil {
			t.Fatalf("a bypass role's write without a generation: %v", err)
		}
		if n := c.count(t, "select count(*) from res where k = $1", k); n != 1 {
			t.Fatal("the bypass role's row is missing")
		}
	})
}
