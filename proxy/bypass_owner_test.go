package proxy

import (
	"testing"

	"github.com/pgfence/pgfence/fence"
)

func init() { registerBypass("owner", bypassOwner) }

// bypassOwner: the role that owns a protected table, but is not in
// pgfence_bypass, cannot switch the fence off: not its triggers, not by
// rewriting rows without DML, not by rules, renames, moves, a new owner,
// dropping it, unprotecting it or removing its job-key column. The DDL
// guard refuses with FN010 (docs/security.md).
func bypassOwner(t *testing.T) {
	c := newCast(t)
	o := c.owner
	c.exec(t, "grant create on schema app to "+c.owner2+"; grant create on database "+c.db+" to "+o)
	c.tryEach(t, append(castAttempts(o, castLocked, [][2]string{
		// The attack: switch the triggers off, then write.
		{"disable_trigger_user_then_write", "begin; alter table res disable trigger user; do $$ begin update res set v = 'zombie'; end $$; commit"},
		{"disable_trigger_all", "alter table app.ledger disable trigger all"},
		{"disable_trigger_by_name", "alter table res_1 disable trigger pgfence_backstop_nometa"},
		{"disable_job_key_trigger", "alter table app.ledger disable trigger pgfence_job_key_update"},
		{"disable_job_key_insert_trigger", "alter table app.ledger disable trigger pgfence_job_key_insert"},
		{"drop_job_key_delete_trigger", "drop trigger pgfence_job_key_delete on app.ledger"},
		{"enable_replica_trigger", "alter table inh_c enable replica trigger pgfence_backstop"},
		{"enable_always_trigger", "alter table inh enable always trigger pgfence_backstop"},
		{"drop_trigger", "drop trigger pgfence_backstop on res"},
		{"rename_trigger", "alter trigger pgfence_backstop on app.ledger rename to off"},
		{"replace_trigger",
			"create function public.noop() returns trigger language plpgsql as $$ begin return null; end $$; " +
				"create or replace trigger pgfence_backstop before insert on app.ledger for each statement execute function public.noop()"},
		// A trigger that fires before the backstop's could change what it
		// reads; one could change a row's job key after the job-key check.
		{"create_trigger",
			"create function public.rekey() returns trigger language plpgsql as $$ begin new.job_key := 'job2'; return new; end $$; " +
				"create trigger zz_rekey before insert or update on app.ledger for each row execute function public.rekey()"},
		{"create_rule_instead", "create rule divert as on insert to res_1 do instead insert into notes (note) values (new.v)"},
		{"create_rule_also", "create rule echo as on update to app.ledger do also delete from notes"},
		{"alter_column_type_using", "alter table app.ledger alter column v type text using 'rewritten'"},
		{"alter_partitioned_column_type_using", "alter table res alter column v type varchar(100) using upper(v)"},
		{"add_column_volatile_default", "alter table inh add column at timestamptz default clock_timestamp()"},
		{"add_stored_generated_column", "alter table app.ledger add column w text generated always as (upper(v)) stored"},
		{"set_unlogged", "alter table app.ledger set unlogged"},
		{"rename_table", "alter table app.ledger rename to ledger_old"},
		{"rename_and_recreate", "alter table res_2a rename to res_2a_old; create table res_2a (k int, job_key text, v text)"},
		{"set_schema", "alter table app.ledger set schema public"},
		{"rename_schema", "alter schema app rename to app_old"},
		{"owner_to", "alter table app.ledger owner to " + c.owner2},
		{"drop_table", "drop table app.ledger"},
		{"drop_schema_cascade", "drop schema app cascade"},
		{"drop_owned", "drop owned by " + o},
		{"drop_job_key_column", "alter table app.ledger drop column job_key"},
		{"rename_job_key_column", "alter table app.ledger rename column job_key to jk"},
		{"unprotect", "select fence.unprotect('app.ledger')"},
	}),
		// protect cannot loosen: the job-key scoping stays.
		castCase{"protect_without_job_key", attempt{role: o, sql: "select fence.protect('app.ledger')", code: "55000"}},
		// What only a superuser could do, an owner cannot.
		castCase{"replication_role", attempt{role: o, sql: "set session_replication_role = replica; update res set v = 'zombie'", code: "42501"}},
		castCase{"disable_event_trigger", attempt{role: o, sql: "alter event trigger pgfence_guard_ddl disable", code: "42501"}},
		castCase{"replace_backstop_function", attempt{role: o, code: "42501",
			sql: "create or replace function fence.backstop() returns trigger language plpgsql as $$ begin return null; end $$"}},
		castCase{"forge_own_ddl", attempt{role: o, direct: true, code: "42501",
			sql: "insert into fence.own_ddl values (pg_current_xact_id()); alter table res disable trigger user"}},
	))

	t.Run("ordinary_schema_changes_pass", func(t *testing.T) {
		// The guard is not a schema freeze: changes that leave the fence,
		// and what existing rows read, as they are stay the owner's. (Issue
		// 30: a column added with a default, and any column dropped, change
		// what existing rows read, so this adds one without a default and
		// gives it a default for rows to come; TestBypass/owner_reads.)
		c.as(t, o, `alter table app.ledger add column note text;
			alter table app.ledger alter column note set default 'n';
			create index on app.ledger (note);
			alter table app.ledger add constraint v_not_empty check (v <> '');
			comment on table res is 'results';
			create table res_5 partition of res for values from (500) to (600);
			grant select on app.ledger to `+c.worker2+`;
			grant insert on res_5 to `+c.worker)
		c.try(t, attempt{role: c.worker, lease: &c.stale, sql: "insert into res_5 values (550, 'job', 'zombie')", code: fence.CodeStale, direct: true})
	})
	t.Run("bypass_member_may", func(t *testing.T) {
		// The control: a DBA (pgfence_bypass, and in the owner role) may
		// rename; protection follows the table, and its names follow.
		c.as(t, c.dba, "alter table res_2b rename to res_2z")
		var schema, name string
		if err := c.admin.QueryRow(ctxT(t), "select schema_name, table_name from fence.protected_tables where relid = 'res_2z'::regclass").Scan(&schema, &name); err != nil || schema != "public" || name != "res_2z" {
			t.Fatalf("protected_tables after the rename: %s.%s, %v", schema, name, err)
		}
		c.try(t, attempt{role: c.worker, lease: &c.stale, sql: "update res_2z set v = 'zombie'", code: fence.CodeStale})
		c.try(t, attempt{role: c.worker, sql: "delete from res_2z", code: fence.CodeFencingRequired})
		c.try(t, attempt{role: o, sql: "alter table res_2z rename to res_2b", code: castLocked})
	})
}
