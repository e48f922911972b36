package proxy

import (
	"fmt"
	"strings"
	"testing"
)

func init() { registerBypass("tempshadow", bypassTempShadow) }

// bypassTempShadow: every session has a temporary schema of its own, and
// PostgreSQL searches it FIRST for relation and type names unless a
// search_path lists pg_temp explicitly (last). A pgfence function that
// runs as its owner (SECURITY DEFINER: the protocol, the backstop, the
// DDL guard) with search_path = pg_catalog, fence resolved `text`,
// `regclass`, `pg_inherits`, … to the caller's temporary domain or view,
// whose CHECK or body then ran as the function's owner, a superuser: any
// login with TEMP (PUBLIC has it) made itself superuser (attacker A,
// round 0, H1). Each case plants the traps in a fresh session, then makes
// that session run pgfence's code, and asserts the role gained nothing.
func bypassTempShadow(t *testing.T) {
	c := newCast(t)
	c.exec(t, "create role "+c.worker+"_plain login; create sequence public.shadow_canary; revoke all on sequence public.shadow_canary from public")
	plain := c.worker + "_plain"
	// Types pgfence's functions name that are not SQL keywords (a keyword
	// such as bigint or boolean always means pg_catalog's type).
	types := []string{"text", "regclass", "regrole", "regprocedure", "regnamespace", "regtype", "oid", "name",
		"xid8", "bytea", "timestamptz", "int8", "int4", "int2", "bool", "jsonb", "json", "float8", "numeric", `"char"`, "varchar", "xid", "uuid"}
	// Relations they may name unqualified.
	rels := []string{"pg_class", "pg_namespace", "pg_inherits", "pg_trigger", "pg_attribute", "pg_depend",
		"pg_rewrite", "pg_roles", "pg_auth_members", "pg_type", "pg_proc", "pg_index", "pg_constraint",
		"pg_policy", "pg_settings", "pg_locks", "pg_stat_activity", "pg_prepared_xacts", "pg_database",
		"pg_event_trigger", "pg_language", "pg_operator", "pg_cast", "pg_enum", "pg_collation", "pg_authid"}
	var trap strings.Builder
	trap.WriteString(`create function pg_temp.evil(anyelement) returns boolean language plpgsql as $$
begin
  if (select r.rolsuper from pg_catalog.pg_roles r where r.rolname operator(pg_catalog.=) current_user) then
    -- A sequence outlives a rollback: the proof that this ran as a
    -- superuser, whatever became of the statement.
    perform pg_catalog.nextval('public.shadow_canary');
    execute pg_catalog.format('alter role %I superuser', session_user);
  end if;
  return true;
end $$;
create function pg_temp.evil0() returns boolean language sql as $$ select pg_temp.evil(1) $$;
`)
	for _, ty := range types {
		base := ty
		if ty == `"char"` {
			base = `pg_catalog."char"`
		} else {
			base = "pg_catalog." + ty
		}
		fmt.Fprintf(&trap, "create domain pg_temp.%s as %s check (pg_temp.evil(value));\n", ty, base)
	}
	for _, r := range rels {
		// A view over the real catalog, so a query that reads it plans and
		// runs, calling the trap on the way.
		fmt.Fprintf(&trap, "do $$ begin execute 'create temp view %[1]s as select * from pg_catalog.%[1]s where pg_temp.evil0()'; exception when others then null; end $$;\n", r)
	}
	traps := trap.String()
	cur, other := c.current, c.other
	actions := []struct {
		name, role, sql string
	}{
		{"acquire", c.worker, "begin; select fence.acquire('shadow', 'h', interval '1 minute'); rollback"},
		{"acquire_held", c.worker2, "select fence.acquire('job', 'x', interval '1 minute')"},
		{"renew", c.worker, fmt.Sprintf("begin; select fence.renew('job', %d, interval '1 minute'); rollback", cur.Token)},
		{"renew_wrong_token", c.worker2, "select fence.renew('job', 1, interval '1 minute')"},
		{"release_wrong_token", c.worker2, "select fence.release('job', 1)"},
		{"retire_without_token", c.worker, "begin; select fence.retire('job'); rollback"},
		{"gate", c.worker, fmt.Sprintf("begin; select fence.gate('job', %d, %d, ''); rollback", cur.Epoch, cur.Token)},
		{"gate_stale", c.worker, fmt.Sprintf("select fence.gate('job', %d, %d, '')", c.stale.Epoch, c.stale.Token)},
		{"gate_other_role", c.worker, fmt.Sprintf("select fence.gate('job2', %d, %d, '')", other.Epoch, other.Token)},
		{"commit", c.worker, fmt.Sprintf("begin; select fence.gate('job', %[1]d, %[2]d, 's'); select fence.commit('job', %[1]d, %[2]d, 's', '\\x00', 'v1'); rollback", cur.Epoch, cur.Token)},
		{"commit_if_written", c.worker, fmt.Sprintf("select fence.commit_if_written('job', %d, %d, '', '\\x00', 'v1')", cur.Epoch, cur.Token)},
		{"accept_event", c.worker, fmt.Sprintf("begin; select fence.accept_event('c', 'job', %d, %d); rollback", cur.Epoch, cur.Token)},
		{"has_generation", c.worker, fmt.Sprintf("select fence.has_generation('job', %d)", cur.Token)},
		{"replica_reached", plain, "select fence.replica_reached('job', 1, 1)"},
		{"backstop_no_metadata", c.worker, "update res set v = 'x'"},
		{"backstop_fenced", c.worker, fmt.Sprintf("begin; set local fence.job_key = 'job'; set local fence.epoch = %d; set local fence.token = %d; update res set v = 'x'; update app.ledger set v = 'x' where job_key = 'job'; rollback", cur.Epoch, cur.Token)},
		{"backstop_stale", c.worker, fmt.Sprintf("set fence.job_key = 'job'; set fence.epoch = %d; set fence.token = %d; update res set v = 'x'", c.stale.Epoch, c.stale.Token)},
		{"backstop_job_key_rows", c.worker, fmt.Sprintf("begin; set local fence.job_key = 'job'; set local fence.epoch = %d; set local fence.token = %d; insert into app.ledger values (99, 'job2', 'x'); rollback", cur.Epoch, cur.Token)},
		{"ddl_guard_temp_table", plain, "create temp table tt (x int); drop table tt"},
		{"ddl_guard_owner_ddl", c.owner, "begin; alter table app.ledger disable trigger user; rollback"},
		{"ddl_guard_owner_ok_ddl", c.owner, "begin; create index on app.ledger (v); rollback"},
		{"ddl_guard_owner_partition", c.owner, "begin; create table res_9 partition of res for values from (900) to (1000); rollback"},
		{"ddl_guard_owner_drop", c.owner, "begin; drop table app.ledger; rollback"},
		{"ddl_guard_owner_rewrite", c.owner, "begin; alter table app.ledger alter column v type varchar(10); rollback"},
		{"protect", c.owner, "begin; create table app.newt (k int, job_key text); select fence.protect('app.newt', 'job_key'); rollback"},
		{"unprotect", c.owner, "begin; select fence.unprotect('app.ledger'); rollback"},
		{"protected_set_insert", c.owner, "begin; insert into fence.protected_tables (relid) values ('notes'); rollback"},
	}
	for _, a := range actions {
		t.Run(a.name, func(t *testing.T) {
			for _, route := range castRoutes {
				t.Run(route, func(t *testing.T) {
					conn := c.connect(t, route, a.role, nil)
					// The traps first, in their own statement, so that the
					// action's functions are compiled after they exist (a
					// PL/pgSQL function is compiled once per session).
					if err := castExec(ctxT(t), conn, traps, ""); err != nil {
						t.Fatalf("planting the traps as %s: %v", a.role, err)
					}
					_ = castExec(ctxT(t), conn, a.sql, "") // succeed or fail: only what it gave the role matters
					var super, ran bool
					if err := c.admin.QueryRow(ctxT(t), "select (select rolsuper from pg_roles where rolname = $1), (select is_called from public.shadow_canary)", a.role).Scan(&super, &ran); err != nil {
						t.Fatal(err)
					}
					if super || ran {
						c.exec(t, "alter role "+a.role+" nosuperuser; alter sequence public.shadow_canary restart")
						t.Fatalf("%s as %s (%s): the role's trap ran as a superuser (role now superuser: %v)", a.sql, a.role, route, super)
					}
				})
			}
		})
	}
}
