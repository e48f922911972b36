package proxy

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
)

func init() { registerBypass("receipt", bypassReceipt) }

// bypassReceipt: a fenced transaction that changes a protected table
// through something no parser can see — a DO block, a function, a
// procedure, a view, a rule or a trigger on another table, an FK cascade —
// ends with exactly one receipt (the backstop writes it at COMMIT when
// nobody else did), so its retry after a lost commit answer is a replay:
// its COMMIT fails with FN00R and nothing is applied twice. PREPARE
// TRANSACTION after such a write is refused.
func bypassReceipt(t *testing.T) {
	c := newCast(t)
	w, cur := c.worker, &c.current
	c.as(t, c.owner, `
create function owner_write(val text) returns void language sql set search_path = public
  as $$ update res set v = val where k = 1 $$;
create procedure owner_proc(val text) language sql set search_path = public
  as $$ insert into inh_c values (20, 'job', val) on conflict (k) do update set v = excluded.v $$;
create view res_view as select * from res;
create rule notes_to_ledger as on insert to notes where new.note like 'ledger:%'
  do also update app.ledger set v = substr(new.note, 8) where job_key = 'job';
create function notes_to_res() returns trigger language plpgsql set search_path = public as $$
begin
  if new.note like 'res:%' then update res set v = substr(new.note, 5) where k = 120; end if;
  return new;
end $$;
create trigger notes_to_res after insert on notes for each row execute function notes_to_res();
create table parents (id int primary key);
create table kids (id int references parents on delete cascade, job_key text not null, v text not null);
insert into parents values (1), (2);
grant select, insert, update, delete on res_view, parents, kids to `+c.worker+`;
`)
	c.as(t, c.su, "select fence.protect('kids')")
	c.as(t, c.dba, "insert into kids values (1, 'job', 'seed'), (2, 'job', 'seed')")

	receipts := func(t *testing.T, step string) (n int, version string) {
		t.Helper()
		err := c.admin.QueryRow(ctxT(t), "select count(*), coalesce(min(digest_version), '') from fence.receipts where job_key = $1 and token = $2 and step = $3",
			cur.JobKey, cur.Token, step).Scan(&n, &version)
		if err != nil {
			t.Fatal(err)
		}
		return n, version
	}
	// opaque: the first commit writes its rows and one receipt; the retry
	// (the same transaction again, as after a lost commit answer) is a
	// replay: refused at COMMIT with FN00R, nothing changed.
	opaque := func(t *testing.T, step, sql, check string) {
		t.Helper()
		q := fmt.Sprintf("set fence.step = '%s'; %s", step, sql)
		if err := castExec(ctxT(t), c.connect(t, "direct", w, cur), q, ""); err != nil {
			t.Fatalf("first commit: %v", err)
		}
		if n, v := receipts(t, step); n != 1 || v != fence.BackstopDigestVersion {
			t.Fatalf("receipts after the first commit: %d (%s), want 1 (%s)", n, v, fence.BackstopDigestVersion)
		}
		if n := c.count(t, check); n == 0 {
			t.Fatalf("%s: the first commit's rows are missing", check)
		}
		c.try(t, attempt{role: w, lease: cur, sql: q, code: fence.CodeReplay, direct: true})
		t.Run("through_proxy", func(t *testing.T) {
			pq := fmt.Sprintf("set fence.step = '%s proxy'; %s", step, sql)
			if err := castExec(ctxT(t), c.connect(t, "proxy", w, cur), pq, ""); err != nil {
				t.Fatalf("first commit through the proxy: %v", err)
			}
			if n, _ := receipts(t, step+" proxy"); n != 1 {
				t.Fatalf("receipts after the first commit through the proxy: %d, want 1", n)
			}
			// The proxy answers the replay as success (with a NOTICE).
			before := c.state(t)
			if err := castExec(ctxT(t), c.connect(t, "proxy", w, cur), pq, ""); err != nil {
				t.Fatalf("retry through the proxy: %v, want the replay's success", err)
			}
			c.unchanged(t, before)
		})
	}
	for _, tc := range []struct{ name, sql, check string }{
		{"do_block", "do $$ begin insert into res values (10, 'job', 'do') on conflict (k) do update set v = excluded.v; end $$",
			"select count(*) from res where k = 10 and v = 'do'"},
		{"function", "select owner_write('function')", "select count(*) from res where k = 1 and v = 'function'"},
		{"procedure", "call owner_proc('procedure')", "select count(*) from inh_c where k = 20 and v = 'procedure'"},
		{"view", "update res_view set v = 'view' where k = 160", "select count(*) from res where k = 160 and v = 'view'"},
		{"rule_on_other_table", "insert into notes (note) values ('ledger:rule')", "select count(*) from app.ledger where v = 'rule'"},
		{"trigger_on_other_table", "insert into notes (note) values ('res:trigger')", "select count(*) from res where k = 120 and v = 'trigger'"},
		// The cascade is repeatable when the parent comes back in the same
		// transaction (its DELETE on kids fires the backstop even when no
		// child row is left).
		{"fk_cascade", "begin; delete from parents where id = 1; insert into parents values (1); commit",
			"select count(*) from kids where id = 2 and not exists (select 1 from kids where id = 1)"},
		{"several_opaque_statements", "begin; select owner_write('several'); do $$ begin delete from inh_c where k = 2; end $$; commit",
			"select count(*) from res where k = 1 and v = 'several'"},
		{"visible_and_opaque", "begin; update res set v = 'visible' where k = 120; select owner_write('visible'); commit",
			"select count(*) from res where v = 'visible'"},
	} {
		t.Run(tc.name, func(t *testing.T) { opaque(t, tc.name, tc.sql, tc.check) })
	}

	t.Run("rolled_back_write_no_receipt", func(t *testing.T) {
		// The mark goes with the savepoint that made it.
		q := "set fence.step = 'savepoint'; begin; savepoint s; do $$ begin update res set v = 'undone'; end $$; rollback to s; commit"
		before := c.state(t)
		if err := castExec(ctxT(t), c.connect(t, "direct", w, cur), q, ""); err != nil {
			t.Fatal(err)
		}
		c.unchanged(t, before)
	})
	t.Run("set_constraints_immediate_then_commit", func(t *testing.T) {
		// SET CONSTRAINTS ALL IMMEDIATE fires the mark's trigger early;
		// the transaction's own fence.commit then stores its digest.
		commit := fmt.Sprintf("select fence.commit('job', %d, %d, 'immediate', '\\x01', 'v1')", cur.Epoch, cur.Token)
		q := "set fence.step = 'immediate'; begin; select owner_write('immediate'); set constraints all immediate; " + commit + "; commit"
		if err := castExec(ctxT(t), c.connect(t, "direct", w, cur), q, ""); err != nil {
			t.Fatalf("first commit: %v", err)
		}
		if n, v := receipts(t, "immediate"); n != 1 || v != "v1" {
			t.Fatalf("receipts: %d (%s), want 1 (v1)", n, v)
		}
		c.try(t, attempt{role: w, lease: cur, sql: q, code: fence.CodeReplay})
	})
	t.Run("commit_if_written", func(t *testing.T) {
		ciw := func(step, digest string) string {
			return fmt.Sprintf("select fence.commit_if_written('job', %d, %d, '%s', '\\x%s', 'v1')", cur.Epoch, cur.Token, step, digest)
		}
		// Nothing written: 'none', no receipt.
		before := c.state(t)
		if err := castExec(ctxT(t), c.connect(t, "direct", w, cur), "begin; select count(*) from res; "+ciw("ciw", "02")+"; commit", ""); err != nil {
			t.Fatal(err)
		}
		c.unchanged(t, before)
		q := "set fence.step = 'ciw'; begin; do $$ begin update res set v = 'ciw' where k = 1; end $$; " + ciw("ciw", "02") + "; commit"
		if err := castExec(ctxT(t), c.connect(t, "direct", w, cur), q, ""); err != nil {
			t.Fatalf("first commit: %v", err)
		}
		if n, v := receipts(t, "ciw"); n != 1 || v != "v1" {
			t.Fatalf("receipts: %d (%s), want 1 (v1)", n, v)
		}
		c.try(t, attempt{role: w, lease: cur, sql: q, code: fence.CodeReplay})
		other := "set fence.step = 'ciw'; begin; do $$ begin update res set v = 'other' where k = 1; end $$; " + ciw("ciw", "03") + "; commit"
		c.try(t, attempt{role: w, lease: cur, sql: other, code: fence.CodeConflict})
	})
	t.Run("prepare_transaction_after_opaque_write", func(t *testing.T) {
		// Refused by PostgreSQL itself (issue 30: 0A000, the fenced write
		// opened a temporary relation; no statement text is read), and
		// through the proxy by its parser (FN009): TestBypass/prepare.
		c.try(t, attempt{role: w, lease: cur, code: "0A000", direct: true,
			sql: "set fence.step = 'prepared'; begin; select owner_write('prepared'); prepare transaction 'pgfence_bypass'"})
		// Nothing holds the fence row: a takeover would not wait.
		if err := castExec(ctxT(t), c.connect(t, "direct", c.su, nil), "begin; select 1 from fence.fences where job_key = 'job' for update nowait; rollback", ""); err != nil {
			t.Fatalf("the fence row is locked after the refused PREPARE: %v", err)
		}
		t.Run("through_proxy", func(t *testing.T) {
			c.tryRoute(t, "proxy", attempt{role: w, lease: cur, code: fence.CodeUnsupported,
				sql: "set fence.step = 'prepared'; begin; select owner_write('prepared'); prepare transaction 'pgfence_bypass'"}, "")
		})
	})
	t.Run("retry_after_takeover", func(t *testing.T) {
		// The receipt is consulted before the fence: a retry of an opaque
		// commit is a replay even after another holder took over.
		conn := c.connectPgx(t, "direct", c.worker2, nil)
		old := c.other
		q := "do $$ begin update app.ledger set v = 'before takeover' where job_key = 'job2'; end $$"
		if err := castExec(ctxT(t), c.connect(t, "direct", c.worker2, &old), q, ""); err != nil {
			t.Fatalf("first commit: %v", err)
		}
		c.exec(t, "update fence.leases set expires_at = clock_timestamp() - interval '1 second' where job_key = 'job2'")
		if _, err := fence.Acquire(ctxT(t), conn, "job2", "d", time.Minute); err != nil {
			t.Fatal(err)
		}
		c.try(t, attempt{role: c.worker2, lease: &old, sql: q, code: fence.CodeReplay, direct: true})
		t.Run("proxy_replay_is_success", func(t *testing.T) {
			// Through the proxy the replay is the COMMIT's success with an
			// FN00R NOTICE, and nothing changes.
			before := c.state(t)
			var notices []string
			conn := c.connectNotices(t, c.worker2, &old, &notices)
			if err := castExec(ctxT(t), conn, q, ""); err != nil {
				t.Fatalf("retry through the proxy: %v, want the replay's success", err)
			}
			if len(notices) != 1 || notices[0] != fence.CodeReplay {
				t.Fatalf("notices %v, want one %s", notices, fence.CodeReplay)
			}
			c.unchanged(t, before)
		})
		c.try(t, attempt{role: c.worker2, lease: &old, code: fence.CodeStale,
			sql: "set fence.step = 'late'; do $$ begin update app.ledger set v = 'zombie' where job_key = 'job2'; end $$"})
	})
	t.Run("forged_mark_stale", func(t *testing.T) {
		// Forging the backstop's "already marked" setting skips no check.
		c.try(t, attempt{role: w, lease: &c.stale, direct: true, code: fence.CodeStale,
			sql: fmt.Sprintf("begin; select set_config('pgfence.marked', format('%%s %%s %%s %%L %%L', pg_current_xact_id(), %d, %d, 'job', ''), true); "+
				"do $$ begin update res set v = 'zombie'; end $$; commit", c.stale.Epoch, c.stale.Token)})
	})
	t.Run("tamper_with_marks", func(t *testing.T) {
		for _, q := range []string{
			"begin; select owner_write('tamper'); delete from fence.write_marks; commit",
			"begin; select owner_write('tamper'); insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version) values ('job', 1, 1, 'x', '', 'v1'); commit",
			"begin; select owner_write('tamper'); update fence.replay_guards set xid = '0'; commit",
		} {
			c.try(t, attempt{role: w, lease: cur, direct: true, sql: "set fence.step = 'tamper'; " + q, code: "42501"})
		}
	})
}

// connectNotices connects through the proxy, collecting the SQLSTATEs of
// the notices the session receives into *codes.
func (c *cast) connectNotices(t *testing.T, role string, l *fence.Lease, codes *[]string) *pgconn.PgConn {
	t.Helper()
	cfg := c.connConfig(t, "proxy", role, l)
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { *codes = append(*codes, n.Code) }
	return connectConfig(t, cfg)
}
