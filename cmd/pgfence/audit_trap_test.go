package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// TestAuditBoobyTrapped: a superuser runs `pgfence audit --result` in a
// database whose owner (not a superuser) laid traps for it (issue 30,
// attacker C's H3): the owner may create a schema of the DBA's name,
// first on PostgreSQL's default search_path, set the database's
// search_path, and make views, tables with row security and types with
// casts of its own. Before the fix the name resolved to the owner's view,
// whose function ran as the superuser (COPY ... TO PROGRAM made the owner
// a superuser). Now the name is resolved on a path only the user and
// superusers control, and the audit reads only a plain table whose
// reading runs nothing of anyone's; anything else is refused, naming why.
func TestAuditBoobyTrapped(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	dsn := cluster.Primary.DSN(db)
	su, err := cluster.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer su.Close(context.Background())
	owner := "trap_owner_" + db
	for _, q := range []string{
		`create table public.results (job_key text primary key, token bigint not null); select fence.protect('public.results')`,
		fmt.Sprintf(`create role %s login`, owner),
		fmt.Sprintf(`alter database %s owner to %s`, db, owner),
		fmt.Sprintf(`alter schema public owner to %s`, owner),
	} {
		if _, err := su.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		bg := context.Background()
		if c, err := cluster.Primary.Connect(bg, db); err == nil {
			c.Exec(bg, fmt.Sprintf("alter database %s owner to postgres", db))
			c.Exec(bg, fmt.Sprintf("alter schema public owner to pg_database_owner; drop owned by %s cascade", owner))
			c.Close(bg)
		}
		if c, err := cluster.Primary.Connect(bg, "postgres"); err == nil {
			c.Exec(bg, fmt.Sprintf("drop role if exists %s", owner))
			c.Close(bg)
		}
	})
	// As the owner: traps that raise when they run as a superuser.
	const trap = `
create schema trap;
create function trap.f() returns text language plpgsql as $$
begin
  if (select rolsuper from pg_catalog.pg_roles where rolname = current_user) then
    raise exception 'TRAP RAN AS SUPERUSER';
  end if;
  return 'job';
end $$;
create schema postgres;
create view postgres.results as select trap.f() as job_key, 0::bigint as token;
create view trap.results as select trap.f() as job_key, 0::bigint as token;
create materialized view trap.mv as select 'job'::text as job_key, 0::bigint as token;
create table trap.rls (job_key text, token bigint);
insert into trap.rls values ('job', 0);
alter table trap.rls enable row level security;
create policy p on trap.rls using (trap.f() is not null);
create type trap.comp as (k text);
create function trap.comp_text(trap.comp) returns text language plpgsql as $$ begin return trap.f(); end $$;
create cast (trap.comp as text) with function trap.comp_text(trap.comp);
create table trap.typed (job_key trap.comp, token bigint);
insert into trap.typed values (row('job'), 0);
create table trap.parent (job_key text, token bigint);
`
	oc, err := pgx.Connect(ctx, strings.Replace(dsn, "postgres@", owner+"@", 1))
	if err != nil {
		t.Fatal(err)
	}
	defer oc.Close(context.Background())
	if _, err := oc.Exec(ctx, trap); err != nil {
		t.Fatalf("the owner's traps: %v", err)
	}
	clean := func(t *testing.T, out string, err error) {
		t.Helper()
		if strings.Contains(out, "TRAP RAN") || strings.Contains(fmt.Sprint(err), "TRAP RAN") {
			t.Fatalf("the owner's code ran as the superuser: %v\n%s", err, out)
		}
	}

	// "$user" (postgres) is the owner's schema: not searched; the name is
	// public's table.
	t.Run("user_schema_view", func(t *testing.T) {
		out, err := pgfence(t, "audit", "--database", dsn, "--result", "results:job_key:token")
		clean(t, out, err)
		if err != nil || !strings.Contains(out, "OK: no violations") {
			t.Fatalf("audit of public.results: %v\n%s", err, out)
		}
	})
	// The database's search_path is the owner's: not used either.
	t.Run("database_search_path", func(t *testing.T) {
		if _, err := oc.Exec(ctx, fmt.Sprintf("alter database %s set search_path = trap, public", db)); err != nil {
			t.Fatal(err)
		}
		defer oc.Exec(context.Background(), fmt.Sprintf("alter database %s reset search_path", db))
		out, err := pgfence(t, "audit", "--database", dsn, "--result", "results:job_key:token")
		clean(t, out, err)
		if err != nil || !strings.Contains(out, "OK: no violations") {
			t.Fatalf("audit of public.results: %v\n%s", err, out)
		}
	})
	// Named outright: refused, saying why, running nothing.
	for _, c := range []struct{ name, table, why string }{
		{"view", "trap.results", "is not a table"},
		{"user_schema_view_qualified", "postgres.results", "is not a table"},
		{"materialized_view", "trap.mv", "is not a table"},
		{"row_security", "trap.rls", "has row security"},
		{"type_with_cast", "trap.typed", "not a built-in one"},
	} {
		t.Run(c.name, func(t *testing.T) {
			out, err := pgfence(t, "audit", "--database", dsn, "--result", c.table+":job_key:token")
			clean(t, out, err)
			if err == nil || !strings.Contains(err.Error(), c.why) {
				t.Fatalf("audit of %s: %v, want a refusal that %s\n%s", c.table, err, c.why, out)
			}
		})
	}
	// A plain table of the owner's, named outright: read (its reading
	// runs nothing).
	t.Run("owners_plain_table", func(t *testing.T) {
		out, err := pgfence(t, "audit", "--database", dsn, "--result", "trap.parent:job_key:token")
		clean(t, out, err)
		if err != nil {
			t.Fatalf("audit of trap.parent: %v\n%s", err, out)
		}
	})
	var super bool
	if err := su.QueryRow(ctx, "select rolsuper from pg_roles where rolname = $1", owner).Scan(&super); err != nil || super {
		t.Fatalf("the owner is a superuser: %v %v", super, err)
	}
}
