package proxy

import (
	"fmt"
	"testing"
)

func init() { registerBypass("joining", bypassJoining) }

// bypassJoining: a table that joins a protected tree (ALTER TABLE …
// INHERIT, ATTACH PARTITION, CREATE TABLE … PARTITION OF or INHERITS, at
// any depth) brings nothing its owner controls that runs in, or decides,
// the writes and reads of protected rows: no trigger or rule of its own,
// no row-level security, and no default, generated column, CHECK or
// foreign key, index, statistics object, column type or collation of its
// own that runs or depends on code no superuser wrote (issue 30, A-H10).
// Without pgfence_bypass that is FN010; a member of pgfence_bypass may,
// and the job-key check of a keyed tree still judges the rows the
// member's own trigger rewrote.
func bypassJoining(t *testing.T) {
	c := newCast(t)
	o := c.owner
	// The owner's code: a retargeting trigger function, a function that
	// reaches the backstop's settings, a collation and a domain (all the
	// owner's, in public; an operator class needs a superuser).
	c.as(t, o, `
create function public.retarget() returns trigger language plpgsql as $$
begin new.job_key := 'job2'; return new; end $$;
create function public.jn_hook(t text) returns text language sql immutable as
  $$ select pg_catalog.set_config('fence.job_key', 'job2', true) || t $$;
create function public.jn_ok(t text) returns boolean language sql immutable as $$ select t is not null $$;
create collation public.jn_coll (provider = libc, locale = 'C');
create domain public.jn_dom as text check (public.jn_ok(value));
`)
	inhCols := "k int not null, job_key text not null, v text not null"
	// Each gadget: the owner makes table %[1]s with it, then joins it.
	type gadget struct{ name, make string }
	gadgets := []gadget{
		{"before_row_trigger", "create table %[1]s (" + inhCols + "); create trigger zzz_retarget before insert or update on %[1]s for each row execute function public.retarget()"},
		{"after_row_trigger", "create table %[1]s (" + inhCols + "); create trigger zzz after insert on %[1]s for each row execute function public.retarget()"},
		{"statement_trigger", "create table %[1]s (" + inhCols + "); create trigger aaa before insert on %[1]s for each statement execute function public.retarget()"},
		{"trigger_named_like_pgfence", "create table %[1]s (" + inhCols + "); create trigger pgfence_x before insert on %[1]s for each row execute function public.retarget()"},
		{"disabled_trigger", "create table %[1]s (" + inhCols + "); create trigger zzz before insert on %[1]s for each row execute function public.retarget(); alter table %[1]s disable trigger zzz"},
		{"rule", "create table %[1]s (" + inhCols + "); create rule r as on insert to %[1]s do instead insert into notes (note) values (new.v)"},
		{"rls_policy", "create table %[1]s (" + inhCols + "); alter table %[1]s enable row level security; create policy p on %[1]s using (job_key = 'job2')"},
		{"rls_no_policy", "create table %[1]s (" + inhCols + "); alter table %[1]s enable row level security"},
		{"default_user_function", "create table %[1]s (k int not null, job_key text not null, v text not null default public.jn_hook('x'))"},
		{"generated_user_function", "create table %[1]s (" + inhCols + ", g text generated always as (public.jn_hook(v)) stored)"},
		{"check_user_function", "create table %[1]s (" + inhCols + ", check (public.jn_ok(v)))"},
		{"index_expression_user_function", "create table %[1]s (" + inhCols + "); create index on %[1]s (public.jn_hook(job_key))"},
		{"index_predicate_user_function", "create table %[1]s (" + inhCols + "); create index on %[1]s (k) where public.jn_ok(v)"},
		{"statistics_user_function", "create table %[1]s (" + inhCols + "); create statistics jn_st_%[1]s on (public.jn_hook(v)) from %[1]s"},
		{"extra_column_user_domain", "create table %[1]s (" + inhCols + ", d public.jn_dom)"},
		{"extra_column_user_collation", "create table %[1]s (" + inhCols + ", x text collate public.jn_coll)"},
	}
	var cases []castCase
	for _, g := range gadgets {
		tbl := "jn_i_" + g.name
		c.as(t, o, fmt.Sprintf(g.make, tbl))
		cases = append(cases, castCase{"inherit_" + g.name, attempt{role: o, sql: "alter table " + tbl + " inherit inh", code: castLocked}})
	}
	// ATTACH PARTITION: the same gadgets a partition can carry (no extra
	// columns, no rules on a partition), into res and into its
	// sub-partitioned member res_2.
	for i, g := range gadgets[:14] {
		if g.name == "rule" || g.name == "generated_user_function" {
			continue
		}
		tbl := "jn_p_" + g.name
		c.as(t, o, fmt.Sprintf(g.make, tbl))
		lo := 200 + 10*i
		cases = append(cases, castCase{"attach_" + g.name, attempt{role: o, code: castLocked,
			sql: fmt.Sprintf("alter table res attach partition %s for values from (%d) to (%d)", tbl, lo, lo+10)}})
	}
	c.as(t, o, "create table jn_deep (k int not null, job_key text not null, v text not null) partition by range (k); "+
		"create table jn_deep_1 partition of jn_deep for values from (400) to (410); "+
		"create trigger zzz before insert on jn_deep_1 for each row execute function public.retarget()")
	c.as(t, o, "create table jn_sub ("+inhCols+"); create trigger zzz before insert on jn_sub for each row execute function public.retarget()")
	c.as(t, o, "create table jn_keyed (k int not null, job_key text not null, v text not null); "+
		"create trigger zzz_retarget before insert or update on jn_keyed for each row execute function public.retarget()")
	cases = append(cases,
		castCase{"attach_subtree_with_trigger_below", attempt{role: o, code: castLocked,
			sql: "alter table res attach partition jn_deep for values from (400) to (500)"}},
		castCase{"attach_into_subpartition", attempt{role: o, code: castLocked,
			sql: "alter table res_2 attach partition jn_sub default"}},
		castCase{"inherit_keyed_ledger_retarget", attempt{role: o, sql: "alter table jn_keyed inherit app.ledger", code: castLocked}},
		castCase{"create_partition_of_with_default", attempt{role: o, code: castLocked,
			sql: "create table jn_c1 partition of res (v default public.jn_hook('x')) for values from (500) to (510)"}},
		castCase{"create_partition_of_with_check", attempt{role: o, code: castLocked,
			sql: "create table jn_c2 partition of res (check (public.jn_ok(v))) for values from (510) to (520)"}},
		castCase{"create_inherits_with_default", attempt{role: o, code: castLocked,
			sql: "create table jn_c3 (v text not null default public.jn_hook('x')) inherits (inh)"}},
		castCase{"create_inherits_with_check", attempt{role: o, code: castLocked,
			sql: "create table jn_c4 (check (public.jn_ok(v))) inherits (inh)"}},
		castCase{"create_inherits_with_generated", attempt{role: o, code: castLocked,
			sql: "create table jn_c5 (g text generated always as (public.jn_hook(v)) stored) inherits (inh)"}},
		castCase{"create_inherits_with_domain_column", attempt{role: o, code: castLocked,
			sql: "create table jn_c6 (d public.jn_dom) inherits (inh)"}},
		castCase{"create_inherits_with_user_collation", attempt{role: o, code: castLocked,
			sql: "create table jn_c7 (x text collate public.jn_coll) inherits (inh)"}},
		castCase{"create_inherits_keyed_with_default", attempt{role: o, code: castLocked,
			sql: "create table app.jn_c8 (job_key text not null default public.jn_hook('')) inherits (app.ledger)"}},
	)
	c.tryEach(t, cases)

	t.Run("plain_tables_still_join", func(t *testing.T) {
		// The control: what a superuser wrote (now(), pg_catalog's
		// operators and collations) and nothing of the owner's joins.
		c.as(t, o, "create table jn_plain (k int not null, job_key text not null, v text not null default 'x', at timestamptz default now(), check (k > 0)); "+
			"create index on jn_plain (lower(v)); alter table jn_plain inherit inh; "+
			"create table jn_part partition of res (v default 'x') for values from (600) to (610)")
		c.protectedUnder(t, "inh", "jn_plain")
		c.protectedUnder(t, "res", "jn_part")
	})

	t.Run("bypass_member_joins_and_rows_are_still_judged", func(t *testing.T) {
		// A DBA may bring the retargeting trigger into the keyed tree; the
		// job-key check (AFTER, per statement, on the member named) then
		// sees the row the trigger rewrote and refuses it.
		c.as(t, c.dba, "alter table jn_keyed inherit app.ledger; grant select, insert, update, delete on jn_keyed to "+c.worker)
		c.protectedUnder(t, "app.ledger", "jn_keyed")
		c.tryEach(t, []castCase{
			{"retargeted_insert", attempt{role: c.worker, lease: &c.current, sql: "insert into jn_keyed values (70, 'job', 'mine')", code: "FN008"}},
			{"retargeted_insert_in_transaction", attempt{role: c.worker, lease: &c.current,
				sql: "begin; insert into jn_keyed values (71, 'job', 'mine'); commit", code: "FN008"}},
			{"retargeted_copy", attempt{role: c.worker, lease: &c.current, sql: "copy jn_keyed from stdin", copyIn: "72\tjob\tmine\n", code: "FN008"}},
		})
	})
}
