package proxy

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
)

func init() { registerBypass("owner_reads", bypassOwnerReads) }

// ownerReadsSchema is the class's own protected tables (over the cast's):
// app.typed uses types the owner owns, directly, in arrays, through a
// domain and inside composites; app.locked has row-level security and a
// policy an administrator set up before protecting it; app.typed_of is a
// typed table. Run as the cast's superuser; the owner owns all of it.
const ownerReadsSchema = `
set session authorization %[1]s;
create type app.mood as enum ('sad', 'ok', 'happy');
create type app.mood2 as enum ('sad', 'ok', 'happy');
create type app.mood3 as enum ('sad', 'ok', 'happy');
create type app.mood4 as enum ('sad', 'ok', 'happy');
create type app.pair as (a int, b text);
create domain app.dmood as app.mood2;
create type app.box as (m app.mood4, p app.pair);
create type app.rec as (x int, y text);
create domain app.dtext as text default 'dflt';
create function app.visible(k int) returns boolean language sql immutable as 'select k > 0';
create table app.typed (k int primary key, job_key text not null, m app.mood, d app.dmood, a app.mood3[],
  p app.pair, b app.box, o oid, c cidr, t text collate "C", v varchar(10), n numeric(10,2), ts timestamp(3), dt app.dtext);
create table app.locked (k int primary key, job_key text not null, v text);
create table app.typed_of of app.rec (primary key (x));
grant select, insert, update, delete on app.typed, app.locked, app.typed_of to %[2]s;
reset session authorization;
alter table app.locked enable row level security;
create policy everyone on app.locked using (app.visible(k));
select fence.protect('app.typed', 'job_key'), fence.protect('app.locked', 'job_key'), fence.protect('app.typed_of');
set session authorization %[3]s;
insert into app.typed values (1, 'job', 'ok', 'happy', '{sad,ok}', '(1,x)', '(ok,"(2,y)")', 1259, '10.1.2.3/32', 'c', 'v', 1.5, '2026-01-01 00:00:00.123', 'd');
insert into app.locked values (1, 'job', 'seen');
insert into app.typed_of values (1, 'x');
reset session authorization;
`

// bypassOwnerReads: only a gated write changes what a protected row
// reads (bypass members aside). A table owner that is not in
// pgfence_bypass cannot make existing rows read something else by DDL:
// drop or rename a column (and add one back with a default), add a
// column whose existing rows read a value, change a column's type or
// collation where the output changes (even without a rewrite), rename or
// change the values of an enum or the attributes of a composite a column
// uses (directly, in an array, through a domain, nested), enable, force
// or disable row-level security or change its policies, or drop any of
// those things with CASCADE. The DDL guard refuses with FN010. Ordinary
// changes that leave what rows read as it is still pass.
func bypassOwnerReads(t *testing.T) {
	c := newCast(t)
	o := c.owner
	c.exec(t, sprintfIdents(ownerReadsSchema, c.owner, c.worker, c.dba)+"grant create on schema app to "+c.owner2)
	c.tryEach(t, castAttempts(o, castLocked, [][2]string{
		// The attacks.
		{"drop_then_add_with_default", "alter table app.ledger drop column v; alter table app.ledger add column v text default 'forged'"},
		{"swap_columns_by_renaming", "begin; alter table app.ledger rename column v to tmp; alter table app.ledger rename column job_key to v; alter table app.ledger rename column tmp to job_key; commit"},
		{"enum_rename_value", "alter type app.mood rename value 'ok' to 'happy2'"},
		{"policy_hiding_rows", "alter table app.ledger enable row level security; create policy hide on app.ledger using (false)"},
		// Columns.
		{"drop_column", "alter table app.ledger drop column v"},
		{"drop_column_if_exists", "alter table app.typed drop column if exists t"},
		{"drop_column_of_partitioned_root", "alter table res drop column v"},
		{"drop_column_of_inheritance_parent", "alter table inh drop column v"},
		{"rename_column", "alter table app.typed rename column v to w"},
		{"rename_column_of_partitioned_root", "alter table res rename column v to w"},
		{"rename_column_of_inheritance_parent", "alter table inh rename column v to w"},
		{"add_column_constant_default", "alter table app.ledger add column w text default 'forged'"},
		{"add_column_numeric_default", "alter table res add column w int default 0"},
		{"add_column_domain_default", "alter table app.ledger add column w app.dtext"},
		{"add_column_default_in_a_do_block", "do $$ begin execute 'alter table app.ledger add column w text default ''x'''; end $$"},
		// Types whose output changes without a rewrite.
		{"cidr_to_inet", "alter table app.typed alter column c type inet"},
		{"oid_to_regclass", "alter table app.typed alter column o type regclass"},
		{"collation_change", "alter table app.typed alter column t type text collate \"POSIX\""},
		{"collation_reset", "alter table app.typed alter column t type text"},
		{"text_to_domain", "alter table app.typed alter column v type app.dtext"},
		// Enums and composites a column uses.
		{"enum_rename_value_via_domain", "alter type app.mood2 rename value 'happy' to 'sad2'"},
		{"enum_rename_value_via_array", "alter type app.mood3 rename value 'sad' to 'ok2'"},
		{"enum_rename_value_nested_in_composite", "alter type app.mood4 rename value 'ok' to 'fine'"},
		{"composite_rename_attribute", "alter type app.pair rename attribute b to bb"},
		{"composite_swap_attributes", "alter type app.pair rename attribute a to tmp; alter type app.pair rename attribute b to a"},
		{"composite_add_attribute", "alter type app.pair add attribute c int"},
		{"composite_drop_attribute", "alter type app.pair drop attribute b"},
		{"nested_composite_rename_attribute", "alter type app.box rename attribute m to mm"},
		{"typed_table_rename_attribute_cascade", "alter type app.rec rename attribute y to z cascade"},
		{"rename_enum_type", "alter type app.mood rename to mood_renamed"},
		{"move_composite_type", "alter type app.pair set schema public"},
		// Row-level security.
		{"enable_rls", "alter table app.typed enable row level security"},
		{"enable_rls_on_a_partition", "alter table res_1 enable row level security"},
		{"enable_rls_on_an_inheritance_child", "alter table inh_c enable row level security"},
		{"force_rls", "alter table app.locked force row level security"},
		{"disable_rls", "alter table app.locked disable row level security"},
		{"create_policy", "create policy hide on app.locked as restrictive using (k < 0)"},
		{"create_policy_before_enabling", "create policy hide on app.typed using (false)"},
		{"alter_policy", "alter policy everyone on app.locked using (false)"},
		{"alter_policy_roles", "alter policy everyone on app.locked to " + c.owner2},
		{"rename_policy", "alter policy everyone on app.locked rename to nobody"},
		{"drop_policy", "drop policy everyone on app.locked"},
		// Drops that take a column or a policy with them.
		{"drop_enum_cascade", "drop type app.mood cascade"},
		{"drop_domain_cascade", "drop domain app.dmood cascade"},
		{"drop_composite_cascade", "drop type app.pair cascade"},
		{"drop_policy_function_cascade", "drop function app.visible(int) cascade"},
		// A drop that takes an attribute of a composite a column holds.
		{"drop_enum_cascade_from_composite", "drop type app.mood4 cascade"},
	}))

	t.Run("ordinary_changes_pass", func(t *testing.T) {
		// What existing rows read stays as it was: a column without a
		// default (existing rows read NULL, as for a column nobody
		// wrote), defaults for rows to come, wider types whose output is
		// the same, new enum values, domain constraints, indexes,
		// constraints, comments, grants, statistics, new partitions.
		c.as(t, o, `alter table app.ledger add column note text;
			alter table app.ledger add column note2 text default null;
			alter table app.ledger alter column note set default 'n';
			create index on app.ledger (note);
			alter table app.ledger add constraint note_short check (length(note) < 100);
			alter table app.typed alter column v type varchar(20);
			alter table app.typed alter column v type varchar;
			alter table app.typed alter column v type text collate "default";
			alter table app.typed alter column n type numeric(12,2);
			alter table app.typed alter column n type numeric;
			alter table app.typed alter column ts type timestamp(6);
			alter type app.mood add value 'ecstatic';
			alter type app.mood add value 'meh' before 'ok';
			alter domain app.dmood set default 'sad';
			alter domain app.dmood add constraint not_ok check (value <> 'ok');
			alter type app.pair owner to `+c.owner2+`;
			alter table app.typed alter column m set statistics 500;
			alter table app.locked alter column v set storage external;
			comment on column app.typed.m is 'mood';
			grant select on app.typed to `+c.worker2+`;
			create table res_6 partition of res for values from (600) to (700);
			alter table app.ledger drop constraint note_short`)
		// What was recorded moved with them: the new column is the
		// table's now, and dropping it changes what rows read.
		c.try(t, attempt{role: o, sql: "alter table app.ledger drop column note", code: castLocked})
		c.try(t, attempt{role: o, sql: "alter type app.mood rename value 'ecstatic' to 'e'", code: castLocked})
		c.try(t, attempt{role: o, sql: "alter table res_6 enable row level security", code: castLocked})
	})

	t.Run("bypass_member_may", func(t *testing.T) {
		// A DBA's change passes and becomes the recorded shape: after it,
		// the owner's ordinary changes pass and its other changes are
		// still refused.
		c.as(t, c.dba, `alter table app.typed drop column o;
			alter table app.typed rename column t to t2;
			alter type app.mood rename value 'sad' to 'blue';
			alter table app.locked force row level security;
			alter policy everyone on app.locked using (k > 1)`)
		c.as(t, o, "alter table app.typed add column o2 oid; comment on table app.locked is 'dba changed'")
		c.try(t, attempt{role: o, sql: "alter table app.locked no force row level security", code: castLocked})
		c.try(t, attempt{role: o, sql: "alter table app.typed rename column t2 to t", code: castLocked})
		c.try(t, attempt{role: o, sql: "alter type app.mood rename value 'blue' to 'sad'", code: castLocked})
	})
}

// sprintfIdents is fmt.Sprintf of format with names as quoted identifiers.
func sprintfIdents(format string, names ...string) string {
	args := make([]any, len(names))
	for i, n := range names {
		args[i] = pgx.Identifier{n}.Sanitize()
	}
	return fmt.Sprintf(format, args...)
}
