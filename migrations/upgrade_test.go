package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

func connect(t *testing.T, ctx context.Context, db, user string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(cluster.Primary.DSN(db))
	if err != nil {
		t.Fatal(err)
	}
	if user != "" {
		cfg.User = user
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// wantRefused checks that migrations.Apply on conn fails with SQLSTATE code
// and a message that says says, leaving the database at version v.
func wantRefused(t *testing.T, ctx context.Context, conn *pgx.Conn, code, says string, v int32) {
	t.Helper()
	err := migrations.Apply(ctx, conn)
	if pgtest.SQLState(err) != code || !strings.Contains(err.Error(), says) {
		t.Fatalf("apply: %v, want SQLSTATE %s saying %q", err, code, says)
	}
	if got, err := migrations.Current(ctx, conn); err != nil || got != v {
		t.Fatalf("version after the refused migration: %d, %v; want %d", got, err, v)
	}
}

// TestMigrateNeedsSuperuser: a role that could install versions 1-4 stops
// at 5 with a clear error, and nothing of 5 is applied.
func TestMigrateNeedsSuperuser(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	prefix, _, _ := strings.Cut(db, "_")
	role := prefix + "_migrator"
	admin := connect(t, ctx, db, "")
	if _, err := admin.Exec(ctx, fmt.Sprintf("create role %[1]s login createrole; grant create on database %[2]s to %[1]s; grant create on schema public to %[1]s",
		role, pgx.Identifier{db}.Sanitize())); err != nil {
		t.Fatal(err)
	}
	conn := connect(t, ctx, db, role)
	if err := migrations.MigrateTo(ctx, conn, 4); err != nil {
		t.Fatalf("versions 1-4 as a non-superuser: %v", err)
	}
	wantRefused(t, ctx, conn, "42501", "must run as a superuser", 4)
	// A superuser does not build on a schema fence someone else owns
	// (issue 30: its functions would run the owner's code with the
	// superuser's rights) until it is a superuser's.
	if err := migrations.Apply(ctx, admin); !errors.Is(err, migrations.ErrUntrusted) {
		t.Fatalf("apply as a superuser on the migrator's schema fence: %v, want ErrUntrusted", err)
	}
	if _, err := admin.Exec(ctx, "reassign owned by "+role+" to current_user"); err != nil {
		t.Fatal(err)
	}
	if err := migrations.Apply(ctx, admin); err != nil {
		t.Fatalf("apply as a superuser afterwards: %v", err)
	}
}

// TestUpgradeAdoptsTrees: tables protected before version 7 (partitions
// one by one, the only option then; a parent whose child was left out)
// are protected as whole trees by the upgrade; a tree whose protected
// members disagree on the job-key column stops it with the tables named.
func TestUpgradeAdoptsTrees(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	conn := connect(t, ctx, db, "")
	if err := migrations.MigrateTo(ctx, conn, 4); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `
create table pt (k int, job_key text, v text) partition by range (k);
create table pt_1 partition of pt for values from (0) to (10);
create table pt_2 partition of pt for values from (10) to (20);
create table pt_3 partition of pt for values from (20) to (30);
select fence.protect('pt_1'), fence.protect('pt_2');
create table sc (k int, job_key text) partition by list (k);
create table sc_1 partition of sc for values in (1);
create table sc_2 partition of sc for values in (2);
select fence.protect('sc_1', 'job_key');
create table parent (k int, v text);
create table child () inherits (parent);
select fence.protect('parent');
create table alone (k int);
select fence.protect('alone');
drop table alone;`); err != nil {
		t.Fatal(err)
	}
	// Before: a write naming the root is not fenced.
	if _, err := conn.Exec(ctx, "insert into pt values (1, 'j', 'unfenced'); delete from pt; insert into child values (1, 'unfenced'); delete from child"); err != nil {
		t.Fatalf("version 4's hole: %v", err)
	}
	if err := migrations.Apply(ctx, conn); err != nil {
		t.Fatal(err)
	}
	rows, err := conn.Query(ctx, "select relid::text || ':' || root::text || ':' || coalesce(job_key_column, '-') from fence.protected_tables order by 1")
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := "child:parent:- parent:parent:- pt:pt:- pt_1:pt:- pt_2:pt:- pt_3:pt:- sc:sc:job_key sc_1:sc:job_key sc_2:sc:job_key"
	if strings.Join(got, " ") != want {
		t.Fatalf("protected tables after the upgrade:\n got %s\nwant %s", strings.Join(got, " "), want)
	}
	for _, q := range []string{"insert into pt values (1, 'j', 'x')", "insert into pt values (21, 'j', 'x')", "insert into child values (1, 'x')", "insert into sc values (2, 'j')"} {
		if _, err := conn.Exec(ctx, q); pgtest.SQLState(err) != "FN008" {
			t.Fatalf("%s after the upgrade: %v, want FN008", q, err)
		}
	}

	t.Run("conflicting_columns", func(t *testing.T) {
		db := cluster.NewDatabase(t)
		conn := connect(t, ctx, db, "")
		if err := migrations.MigrateTo(ctx, conn, 4); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, `
create table pt (k int, job_key text) partition by range (k);
create table pt_1 partition of pt for values from (0) to (10);
create table pt_2 partition of pt for values from (10) to (20);
select fence.protect('pt_1', 'job_key'), fence.protect('pt_2');`); err != nil {
			t.Fatal(err)
		}
		wantRefused(t, ctx, conn, "55000", "pt", 6)
	})
}

// TestGuardLeavesOtherDDLAlone: with protected tables present, DDL on
// other tables (and a migration run again) is not refused.
func TestGuardLeavesOtherDDLAlone(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	conn := connect(t, ctx, db, "")
	if err := migrations.Apply(ctx, conn); err != nil {
		t.Fatal(err)
	}
	prefix, _, _ := strings.Cut(db, "_")
	role := prefix + "_app"
	if _, err := conn.Exec(ctx, fmt.Sprintf(`
create table results (k int primary key, v text);
select fence.protect('results');
create role %[1]s login;
grant create on schema public to %[1]s;
grant references on results to %[1]s;`, role)); err != nil {
		t.Fatal(err)
	}
	app := connect(t, ctx, db, role)
	if _, err := app.Exec(ctx, `
create table other (k int primary key, r int references results, v text);
alter table other add column w text default 'x', alter column v type varchar(10);
alter table other add column at timestamptz default clock_timestamp();
alter table other disable trigger user;
create function f() returns trigger language plpgsql as $$ begin return new; end $$;
create trigger t before insert on other for each row execute function f();
create rule r as on update to other do also nothing;
alter table other rename to other2;
create table part (k int) partition by list (k);
create table part_1 partition of part for values in (1);
alter table part detach partition part_1;
create temp table tmp (k int);
drop table other2, part, part_1;`); err != nil {
		t.Fatalf("DDL on unprotected tables: %v", err)
	}
	if err := migrations.Apply(ctx, conn); err != nil {
		t.Fatalf("apply again: %v", err)
	}
}
