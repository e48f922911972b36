package proxy

import (
	"testing"
)

func init() { registerBypass("definer", bypassDefiner) }

// bypassDefiner: the backstop decides bypass on the role that
// authenticated (session_user), so code owned by a pgfence_bypass member
// — a SECURITY DEFINER function or procedure, a view, a trigger function —
// does not lend its owner's exemption to the worker that calls it, and no
// role switch inside a function gets it either. Such a call is fenced
// exactly like the worker that made it.
func bypassDefiner(t *testing.T) {
	c := newCast(t)
	w, stale := c.worker, &c.stale
	c.as(t, c.dba, `
create function dba_write(val text) returns void language sql security definer set search_path = public
  as $$ update res set v = val where k = 1 $$;
create function dba_unfenced_write(val text) returns void language plpgsql security definer set search_path = public as $$
begin
  perform set_config('fence.job_key', '', true);
  update res set v = val where k = 1;
end $$;
create function dba_set_role(val text) returns void language plpgsql security definer set search_path = public as $$
begin
  perform set_config('role', current_user, true);
  update res set v = val where k = 1;
end $$;
create function dba_replica(val text) returns void language plpgsql security definer set search_path = public as $$
begin
  set local session_replication_role = replica;
  update res set v = val where k = 1;
end $$;
create function dba_as_role(val text) returns void language sql set role = '`+c.dba+`' set search_path = public
  as $$ update res set v = val where k = 1 $$;
create procedure dba_proc(val text) language sql security definer set search_path = public
  as $$ delete from inh_c; insert into app.ledger values (9, 'job', val) $$;
create function dba_dynamic(q text) returns void language plpgsql security definer set search_path = public as $$
begin
  execute q;
end $$;
create view dba_view as select * from res;
grant select, insert, update, delete on dba_view to `+c.worker+`;
create function dba_note_trigger() returns trigger language plpgsql security definer set search_path = public as $$
begin
  update res set v = new.note where k = 1;
  return new;
end $$;
create trigger write_res after insert on notes for each row execute function dba_note_trigger();
`)
	c.as(t, c.su, `
create function su_write(val text) returns void language sql security definer set search_path = public
  as $$ update app.ledger set v = val where k = 1 $$;
`)
	c.tryEach(t, []castCase{
		{"definer_function_nometa", attempt{role: w, sql: "select dba_write('zombie')", code: castNoMeta}},
		{"definer_function_stale", attempt{role: w, lease: stale, sql: "select dba_write('zombie')", code: castStale}},
		{"definer_clears_metadata", attempt{role: w, lease: stale, sql: "select dba_unfenced_write('zombie')", code: castNoMeta}},
		{"definer_procedure_nometa", attempt{role: w, sql: "call dba_proc('zombie')", code: castNoMeta}},
		{"definer_dynamic_sql_nometa", attempt{role: w, sql: "select dba_dynamic('truncate res')", code: castNoMeta}},
		{"definer_trigger_nometa", attempt{role: w, sql: "insert into notes (note) values ('zombie')", code: castNoMeta}},
		{"definer_trigger_stale", attempt{role: w, lease: stale, sql: "insert into notes (note) values ('zombie')", code: castStale}},
		{"view_owned_by_bypass_insert", attempt{role: w, sql: "insert into dba_view values (3, 'job', 'zombie')", code: castNoMeta}},
		{"view_owned_by_bypass_update_stale", attempt{role: w, lease: stale, sql: "update dba_view set v = 'zombie'", code: castStale}},
		{"view_owned_by_bypass_delete", attempt{role: w, sql: "delete from dba_view", code: castNoMeta}},
		{"superuser_definer_nometa", attempt{role: w, sql: "select su_write('zombie')", code: castNoMeta}},
		// Role switches: refused by PostgreSQL itself, nothing written.
		{"set_role_inside_definer", attempt{role: w, sql: "select dba_set_role('zombie')", code: "42501"}},
		{"set_role_function_config", attempt{role: w, sql: "select dba_as_role('zombie')", code: "42501"}},
		{"replication_role_inside_definer", attempt{role: w, sql: "select dba_replica('zombie')", code: "42501"}},
		{"set_role_to_bypass", attempt{role: w, sql: "set role " + c.dba + "; update res set v = 'zombie'", code: "42501"}},
		{"set_session_authorization", attempt{role: w, sql: "set session authorization " + c.dba + "; update res set v = 'zombie'", code: "42501"}},
	})

	t.Run("controls", func(t *testing.T) {
		// The bypass member itself is exempt (and logged); the worker with
		// the current generation writes through the same function, fenced.
		if err := castExec(ctxT(t), c.connect(t, "direct", c.dba, nil), "select dba_write('repaired')", ""); err != nil {
			t.Fatalf("bypass member's own function: %v", err)
		}
		if err := castExec(ctxT(t), c.connect(t, "direct", w, &c.current), "select dba_write('current')", ""); err != nil {
			t.Fatalf("worker with the current generation: %v", err)
		}
		if n := c.count(t, "select count(*) from res where k = 1 and v = 'current'"); n != 1 {
			t.Fatal("the current generation's write through the definer function is missing")
		}
		if n := c.count(t, "select count(*) from fence.receipts where job_key = 'job' and token = $1", c.current.Token); n != 1 {
			t.Fatalf("receipts of the current generation: %d, want 1", n)
		}
	})
}
