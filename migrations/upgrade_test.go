package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
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

// TestUpgradeReceiptsInPlace: 011 upgrades a live database: leases held,
// receipts present, a fenced transaction in flight across the migration,
// keyed and unkeyed protected tables, partition and inheritance trees.
// Afterwards every keyed member has the statement job-key triggers and no
// row trigger, the DDL guard finds every member as installed, old
// receipts still answer retries, and the transaction that marked its
// write under 010 commits with its one receipt.
func TestUpgradeReceiptsInPlace(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	conn := connect(t, ctx, db, "")
	if err := migrations.MigrateTo(ctx, conn, 10); err != nil {
		t.Fatal(err)
	}
	prefix, _, _ := strings.Cut(db, "_")
	w := prefix + "_w"
	if _, err := conn.Exec(ctx, fmt.Sprintf(`
create role %[1]s login in role pgfence_worker;
create table kt (k int primary key, job_key text not null, v text);
create table ut (k int primary key, v text);
create table kp (k int not null, job_key text not null, v text) partition by range (k);
create table kp_1 partition of kp for values from (0) to (10);
create table kp_2 partition of kp for values from (10) to (20) partition by range (k);
create table kp_2a partition of kp_2 for values from (10) to (20);
create table ki (k int, job_key text not null, v text);
create table ki_c () inherits (ki);
grant all on kt, ut, kp, kp_1, kp_2, kp_2a, ki, ki_c to %[1]s;
select fence.protect('kt', 'job_key'), fence.protect('ut'), fence.protect('kp', 'job_key'), fence.protect('ki', 'job_key');`, w)); err != nil {
		t.Fatal(err)
	}
	wc := connect(t, ctx, db, w)
	var epoch, token int64
	if err := wc.QueryRow(ctx, "select epoch, token from fence.acquire('j', 'h', '1 hour')").Scan(&epoch, &token); err != nil {
		t.Fatal(err)
	}
	set := fmt.Sprintf("set fence.job_key = 'j'; set fence.epoch = %d; set fence.token = %d", epoch, token)
	// A receipt from before: 010's fence.commit.
	if _, err := wc.Exec(ctx, set+fmt.Sprintf("; set fence.step = 'before'; begin; select fence.gate('j', %d, %d, 'before'); insert into kt values (1, 'j', 'before'); select fence.commit('j', %[1]d, %[2]d, 'before', '\\x01', 'v1'); commit", epoch, token)); err != nil {
		t.Fatal(err)
	}
	// In flight across the migration: a write 010 marked, not receipted
	// (the table it writes is one the migration does not lock).
	flight := connect(t, ctx, db, w)
	if _, err := flight.Exec(ctx, set+"; set fence.step = 'flight'; begin; do $$ begin insert into ut values (1, 'in flight'); end $$"); err != nil {
		t.Fatal(err)
	}
	// Across every migration up to 018; 019 alters fence.fences, whose
	// lock a transaction in flight holds (TestUpgradeErasLive).
	if err := migrations.MigrateTo(ctx, conn, 18); err != nil {
		t.Fatal(err)
	}
	if _, err := flight.Exec(ctx, "commit"); err != nil {
		t.Fatalf("the transaction in flight: %v", err)
	}
	if err := migrations.Apply(ctx, conn); err != nil {
		t.Fatal(err)
	}
	count := func(q string, args ...any) int {
		t.Helper()
		var n int
		if err := conn.QueryRow(ctx, q, args...).Scan(&n); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		return n
	}
	if n := count("select count(*) from fence.receipts where step = 'flight' and digest_version = 'backstop-v1'"); n != 1 {
		t.Fatalf("%d receipts of the transaction in flight, want 1", n)
	}
	var got string
	if err := conn.QueryRow(ctx, `select string_agg(format('%s:%s', tgrelid::regclass, tgname), ' ' order by tgrelid::regclass::text, tgname)
from pg_trigger where tgname like 'pgfence\_job\_key%'`).Scan(&got); err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, m := range []string{"ki", "ki_c", "kp", "kp_1", "kp_2", "kp_2a", "kt"} {
		for _, e := range []string{"delete", "insert", "update"} {
			want = append(want, m+":pgfence_job_key_"+e)
		}
	}
	if got != strings.Join(want, " ") {
		t.Fatalf("job-key triggers after the upgrade:\n got %s\nwant %s", got, strings.Join(want, " "))
	}
	if n := count("select count(*) from fence.protected_tables p where fence.backstop_problem(p) is not null"); n != 0 {
		t.Fatalf("%d members not as installed after the upgrade", n)
	}
	if n := count("select count(*) from pg_proc where proname = 'backstop_row' and pronamespace = 'fence'::regnamespace"); n != 0 {
		t.Fatal("fence.backstop_row is still there")
	}
	// The guard is satisfied: an owner's harmless DDL passes.
	if _, err := conn.Exec(ctx, "alter table kp add column note text; comment on table ki is 'x'"); err != nil {
		t.Fatalf("DDL after the upgrade: %v", err)
	}
	// The old receipt answers its retry; another job's rows are refused
	// by the new triggers, on every member; the job's own rows are written
	// with one receipt.
	if _, err := wc.Exec(ctx, "set fence.step = 'before'; begin; insert into kt values (2, 'j', 'retry'); commit"); pgtest.SQLState(err) != "FN00R" {
		t.Fatalf("retry of an old receipt: %v, want FN00R", err)
	}
	wc.Exec(ctx, "rollback")
	if _, err := wc.Exec(ctx, "set fence.step = 'after'; insert into kp values (1, 'j', 'x'), (15, 'j', 'y'); insert into ki_c values (1, 'j', 'z')"); err != nil {
		t.Fatalf("own rows after the upgrade: %v", err)
	}
	if n := count("select count(*) from fence.receipts where step = 'after'"); n != 1 {
		t.Fatalf("%d receipts of the write after the upgrade, want 1", n)
	}
	for i, q := range []string{"insert into kt values (3, 'other', 'x')", "insert into kp values (11, 'other', 'x')", "insert into kp_2a values (12, 'other', 'x')",
		"insert into ki_c values (2, 'other', 'x')", "update ki set job_key = 'other'", "update kp set job_key = 'other' where k = 15"} {
		if _, err := wc.Exec(ctx, fmt.Sprintf("set fence.step = 'refused %d'; %s", i, q)); pgtest.SQLState(err) != "FN008" {
			t.Fatalf("%s after the upgrade: %v, want FN008", q, err)
		}
	}
}

// TestUpgradeLiveTo12: migration 12 upgrades a database in use in place.
// Leases held before it are renewed and written under after it (one held
// for longer than the new cap keeps its time), receipts answer retries,
// consumer watermarks stand; the protected tables' read shapes are
// recorded at once, so a table owner's DROP COLUMN right after the
// upgrade is refused; notifications no longer carry the token.
func TestUpgradeLiveTo12(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	conn := connect(t, ctx, db, "")
	if err := migrations.MigrateTo(ctx, conn, 11); err != nil {
		t.Fatal(err)
	}
	prefix, _, _ := strings.Cut(db, "_")
	owner, worker := prefix+"_owner", prefix+"_worker"
	if _, err := conn.Exec(ctx, fmt.Sprintf(`
create role %[1]s login;
create role %[2]s login in role pgfence_worker;
grant create on schema public to %[1]s;
set session authorization %[1]s;
create table results (job_key text primary key, v text not null, n int);
grant select, insert, update, delete on results to %[2]s;
reset session authorization;
select fence.protect('results', 'job_key');`, owner, worker)); err != nil {
		t.Fatal(err)
	}
	w := connect(t, ctx, db, worker)
	held, err := fence.Acquire(ctx, w, "job", "w", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	squat, err := fence.Acquire(ctx, w, "squat", "w", 100*365*24*time.Hour)
	if err != nil {
		t.Fatalf("a century-long lease before the cap: %v", err)
	}
	write := func(step, v string) (fence.CommitResult, error) {
		return fence.RunTx(ctx, w, held.Generation(step), []byte(v), func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "insert into results values ('job', $1) on conflict (job_key) do update set v = excluded.v", v)
			return err
		})
	}
	if res, err := write("before", "before"); err != nil || res != fence.Committed {
		t.Fatalf("write before the upgrade: %v, %v", res, err)
	}
	if ok, err := fence.AcceptEvent(ctx, w, "mailer", "job", held.Epoch, held.Token); err != nil || !ok {
		t.Fatalf("accept before the upgrade: %v, %v", ok, err)
	}
	var squatUntil time.Time
	if err := conn.QueryRow(ctx, "select expires_at from fence.leases where job_key = 'squat'").Scan(&squatUntil); err != nil {
		t.Fatal(err)
	}

	if err := migrations.MigrateTo(ctx, conn, 12); err != nil {
		t.Fatalf("upgrade to 12: %v", err)
	}

	// The held lease goes on: renewed, written under, its receipt answers
	// the retry of the write before the upgrade.
	if _, err := fence.Renew(ctx, w, "job", held.Token, time.Minute); err != nil {
		t.Fatalf("renew after the upgrade: %v", err)
	}
	if res, err := write("before", "before"); err != nil || res != fence.Replayed {
		t.Fatalf("retry of the write before the upgrade: %v, %v; want a replay", res, err)
	}
	if res, err := write("after", "after"); err != nil || res != fence.Committed {
		t.Fatalf("write after the upgrade: %v, %v", res, err)
	}
	if ok, err := fence.AcceptEvent(ctx, w, "mailer", "job", held.Epoch, held.Token); err != nil || !ok {
		t.Fatalf("accept of the current generation after the upgrade: %v, %v", ok, err)
	}
	if ok, err := fence.AcceptEvent(ctx, w, "mailer", "job", held.Epoch, held.Token+1000); err != nil || ok {
		t.Fatalf("accept of a generation never issued: %v, %v; want false", ok, err)
	}
	// The squatter keeps what it had (the cap is for new leases and
	// renewals); renewing it for as long is refused.
	var until time.Time
	var cap string
	if err := conn.QueryRow(ctx, "select l.expires_at, s.value from fence.leases l, fence.settings s where l.job_key = 'squat' and s.name = 'max_lease_ttl'").Scan(&until, &cap); err != nil {
		t.Fatal(err)
	}
	if !until.Equal(squatUntil) || cap != "1 day" {
		t.Fatalf("after the upgrade: the long lease ends %v (was %v), the cap is %q", until, squatUntil, cap)
	}
	if _, err := fence.Renew(ctx, w, "squat", squat.Token, 100*365*24*time.Hour); pgtest.SQLState(err) != "22023" {
		t.Fatalf("renewing the long lease for a century: %v, want 22023", err)
	}
	// The shape of results was recorded by the upgrade: its owner's DDL
	// that changes what rows read is refused, the rest passes.
	o := connect(t, ctx, db, owner)
	if _, err := o.Exec(ctx, "alter table results drop column n"); pgtest.SQLState(err) != "FN010" {
		t.Fatalf("the owner's drop column after the upgrade: %v, want FN010", err)
	}
	if _, err := o.Exec(ctx, "alter table results add column m int; alter table results alter column m set default 1"); err != nil {
		t.Fatalf("the owner's ordinary change after the upgrade: %v", err)
	}
	// Takeovers are notified without their token.
	if _, err := conn.Exec(ctx, "listen pgfence_takeover"); err != nil {
		t.Fatal(err)
	}
	l, err := fence.Acquire(ctx, conn, "new-job", "a", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	n, err := conn.WaitForNotification(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf(`{"job_key" : "new-job", "epoch" : %d}`, l.Epoch); n.Payload != want {
		t.Fatalf("takeover notification %q, want %q (no token)", n.Payload, want)
	}
}

// TestUpgradeTo16DropsRejectedClaims: under migration 015 the first
// accept_event under a consumer name claimed it, even for an event it
// rejected (issue 30, round 2, E-M3). Migration 16 drops the claims under
// which no event was ever accepted (no watermark row), so the squatted
// name goes to the role whose event is accepted first; a claim with an
// accepted event stands.
func TestUpgradeTo16DropsRejectedClaims(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	conn := connect(t, ctx, db, "")
	if err := migrations.MigrateTo(ctx, conn, 15); err != nil {
		t.Fatal(err)
	}
	prefix, _, _ := strings.Cut(db, "_")
	app, app2 := prefix+"_app", prefix+"_app2"
	if _, err := conn.Exec(ctx, fmt.Sprintf("create role %s login in role pgfence_worker; create role %s login in role pgfence_worker", app, app2)); err != nil {
		t.Fatal(err)
	}
	a, a2 := connect(t, ctx, db, app), connect(t, ctx, db, app2)
	l, err := fence.Acquire(ctx, a, "job-a", "w", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	accept := func(c *pgx.Conn, consumer string, epoch, token int64) (bool, error) {
		var ok bool
		err := c.QueryRow(ctx, "select fence.accept_event($1, $2, $3, $4)", consumer, "job-a", epoch, token).Scan(&ok)
		return ok, err
	}
	if ok, err := accept(a2, "billing", 1, 987654); ok || err != nil {
		t.Fatalf("never-issued event under 015: %v, %v; want false", ok, err)
	}
	if _, err := accept(a, "billing", l.Epoch, l.Token); pgtest.SQLState(err) != "42501" {
		t.Fatalf("the real consumer under 015: %v; want 42501 (the breach this upgrade undoes)", err)
	}
	if ok, err := accept(a, "ledger", l.Epoch, l.Token); !ok || err != nil {
		t.Fatalf("own consumer under 015: %v, %v; want true", ok, err)
	}
	if err := migrations.Apply(ctx, conn); err != nil {
		t.Fatal(err)
	}
	if _, err := accept(a2, "ledger", l.Epoch, l.Token); pgtest.SQLState(err) != "42501" {
		t.Fatalf("another role under app's consumer after 16: %v; want 42501", err)
	}
	if ok, err := accept(a, "billing", l.Epoch, l.Token); !ok || err != nil {
		t.Fatalf("the real consumer after 16: %v, %v; want true", ok, err)
	}
	var role string
	if err := conn.QueryRow(ctx, "select role from fence.consumers where consumer = 'billing'").Scan(&role); err != nil || role != app {
		t.Fatalf("billing belongs to %q (%v), want %q", role, err, app)
	}
}

// TestUpgradeErasLive: migration 19 adds a column to fence.fences, whose
// lock every gated transaction holds. A gated transaction in flight makes
// the migration wait (it gives up after lock_timeout and Apply tries
// again), not fail or stall forever; the transaction commits with its
// receipt; a lease held across the upgrade writes and renews after it,
// its first write stamping the fence row with this server's start.
func TestUpgradeErasLive(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	conn := connect(t, ctx, db, "")
	if err := migrations.MigrateTo(ctx, conn, 18); err != nil {
		t.Fatal(err)
	}
	prefix, _, _ := strings.Cut(db, "_")
	w := prefix + "_w"
	if _, err := conn.Exec(ctx, fmt.Sprintf(`
create role %[1]s login in role pgfence_worker;
create table et (k int primary key, v text);
grant all on et to %[1]s;
select fence.protect('et');`, w)); err != nil {
		t.Fatal(err)
	}
	wc, flight := connect(t, ctx, db, w), connect(t, ctx, db, w)
	l, err := fence.Acquire(ctx, wc, "j", "h", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	set := fmt.Sprintf("set fence.job_key = 'j'; set fence.epoch = %d; set fence.token = %d", l.Epoch, l.Token)
	if _, err := flight.Exec(ctx, set+"; set fence.step = 'flight'; begin; insert into et values (1, 'in flight')"); err != nil {
		t.Fatal(err)
	}
	applied := make(chan error, 1)
	go func() { applied <- migrations.Apply(ctx, conn) }()
	// The migration waits for the fence row's transaction, gives up after
	// its lock_timeout (so gated transactions behind its lock request wait
	// no longer than that), and waits again.
	observer := connect(t, ctx, db, "")
	await := func(want bool) {
		t.Helper()
		awaitLockWait(t, ctx, observer, applied, "fence.fences", want, "while a transaction held a fence row")
	}
	await(true)
	await(false)
	await(true)
	if _, err := flight.Exec(ctx, "commit"); err != nil {
		t.Fatalf("the transaction in flight: %v", err)
	}
	if err := <-applied; err != nil {
		t.Fatalf("the migration after the transaction in flight ended: %v", err)
	}
	if v, err := migrations.Current(ctx, conn); err != nil || v < 19 {
		t.Fatalf("version %d (%v), want 19 or later", v, err)
	}
	count := func(q string) int {
		t.Helper()
		var n int
		if err := conn.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		return n
	}
	if n := count("select count(*) from fence.receipts where step = 'flight'"); n != 1 {
		t.Fatalf("%d receipts of the transaction in flight, want 1", n)
	}
	if n := count("select count(*) from fence.fences where era_start is not null"); n != 0 {
		t.Fatalf("%d fence rows stamped by the migration, want 0 (a stamp says a server checked the row)", n)
	}
	// The lease held across the upgrade: renewed, written twice (the first
	// write checks the era and stamps the row; the second takes the fast
	// path), each with its one receipt.
	if _, err := wc.Exec(ctx, "select fence.renew('j', $1, '1 hour')", l.Token); err != nil {
		t.Fatalf("renewing a lease held across the upgrade: %v", err)
	}
	for i := 2; i <= 3; i++ {
		if _, err := wc.Exec(ctx, fmt.Sprintf("%s; set fence.step = 'after %d'; insert into et values (%d, 'after')", set, i, i)); err != nil {
			t.Fatalf("write %d under a lease held across the upgrade: %v", i, err)
		}
		if n := count("select count(*) from fence.fences where job_key = 'j' and era_start = pg_postmaster_start_time()"); n != 1 {
			t.Fatalf("after write %d the fence row is not stamped with this server's start", i)
		}
	}
	if n := count("select count(*) from fence.receipts where step like 'after %'"); n != 2 {
		t.Fatalf("%d receipts of the writes after the upgrade, want 2", n)
	}
}

// TestUpgradeFastGateLive (migration 025, issue 33): the backstop's
// statement trigger loses its WHEN on every protected table, partitions
// and keyed tables included, with its firing mode, while a fenced
// transaction that wrote a protected table is in flight (the migration
// waits for it, giving up its lock request after lock_timeout and
// trying again); afterwards the fence refuses and accepts as before.
func TestUpgradeFastGateLive(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	conn := connect(t, ctx, db, "")
	if err := migrations.MigrateTo(ctx, conn, 24); err != nil {
		t.Fatal(err)
	}
	prefix, _, _ := strings.Cut(db, "_")
	w := prefix + "_w"
	if _, err := conn.Exec(ctx, fmt.Sprintf(`
create role %[1]s login in role pgfence_worker;
create table ft (k int primary key, v text);
create table fp (k int, job_key text, v text) partition by range (k);
create table fp_1 partition of fp for values from (0) to (10);
create table fp_2 partition of fp for values from (10) to (20);
create table fk (k int primary key, job_key text not null);
grant all on ft, fp, fp_1, fp_2, fk to %[1]s;
select fence.protect('ft'), fence.protect('fp'), fence.protect('fk', 'job_key');`, w)); err != nil {
		t.Fatal(err)
	}
	whens := func() int {
		t.Helper()
		var n int
		if err := conn.QueryRow(ctx, "select count(*) from pg_trigger where tgname = 'pgfence_backstop' and tgqual is not null").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := whens(); n != 5 {
		t.Fatalf("%d backstop triggers with a WHEN before the upgrade, want 5 (ft, fp, fp_1, fp_2, fk)", n)
	}
	wc, flight := connect(t, ctx, db, w), connect(t, ctx, db, w)
	l, err := fence.Acquire(ctx, wc, "j", "h", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	set := fmt.Sprintf("set fence.job_key = 'j'; set fence.epoch = %d; set fence.token = %d", l.Epoch, l.Token)
	if _, err := flight.Exec(ctx, set+"; set fence.step = 'flight'; begin; insert into ft values (1, 'in flight')"); err != nil {
		t.Fatal(err)
	}
	applied := make(chan error, 1)
	go func() { applied <- migrations.Apply(ctx, conn) }()
	observer := connect(t, ctx, db, "")
	await := func(want bool) {
		t.Helper()
		awaitLockWait(t, ctx, observer, applied, "ft", want, "while a transaction that wrote ft was in flight")
	}
	await(true)
	await(false)
	await(true)
	if _, err := flight.Exec(ctx, "insert into ft values (2, 'in flight'); commit"); err != nil {
		t.Fatalf("the transaction in flight: %v", err)
	}
	if err := <-applied; err != nil {
		t.Fatalf("the migration after the transaction in flight ended: %v", err)
	}
	if v, err := migrations.Current(ctx, conn); err != nil || v < 25 {
		t.Fatalf("version %d (%v), want 25 or later", v, err)
	}
	if n := whens(); n != 0 {
		t.Fatalf("%d backstop triggers with a WHEN after the upgrade, want 0", n)
	}
	var problems int
	if err := conn.QueryRow(ctx, `select count(*) from pg_trigger where tgname = 'pgfence_backstop' and (tgenabled <> 'O' or tgfoid <> 'fence.backstop()'::regprocedure)`).Scan(&problems); err != nil || problems != 0 {
		t.Fatalf("%d backstop triggers not enabled or not fence.backstop after the upgrade (%v)", problems, err)
	}
	count := func(q string) int {
		t.Helper()
		var n int
		if err := conn.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		return n
	}
	if n := count("select count(*) from fence.receipts where step = 'flight'"); n != 1 {
		t.Fatalf("%d receipts of the transaction in flight, want 1", n)
	}
	// Without a generation every table refuses, as before.
	bare := connect(t, ctx, db, w)
	for _, q := range []string{"insert into ft values (3, 'x')", "insert into fp values (3, 'j', 'x')", "insert into fp_2 values (13, 'j', 'x')",
		"insert into fk values (3, 'j')", "update ft set v = 'x'", "delete from fp", "truncate ft"} {
		if _, err := bare.Exec(ctx, q); pgtest.SQLState(err) != "FN008" {
			t.Fatalf("%s without a generation after the upgrade: %v, want FN008", q, err)
		}
	}
	// A stale generation is refused, the current one writes with one
	// receipt per step, a foreign job key is refused.
	if _, err := wc.Exec(ctx, fmt.Sprintf("set fence.job_key = 'j'; set fence.epoch = %d; set fence.token = %d; set fence.step = 'stale'; insert into ft values (4, 'stale')", l.Epoch, l.Token-1)); pgtest.SQLState(err) == "" {
		t.Fatal("a write under a token that was never the fence row's committed after the upgrade")
	}
	for i, q := range []string{"insert into ft values (5, 'after') on conflict (k) do update set v = excluded.v",
		"insert into fp values (15, 'j', 'after')", "insert into fk values (5, 'j')"} {
		if _, err := wc.Exec(ctx, fmt.Sprintf("%s; set fence.step = 'after %d'; %s", set, i, q)); err != nil {
			t.Fatalf("%s under the current generation after the upgrade: %v", q, err)
		}
	}
	if n := count("select count(*) from fence.receipts where step like 'after %'"); n != 3 {
		t.Fatalf("%d receipts of the writes after the upgrade, want 3", n)
	}
	if _, err := wc.Exec(ctx, set+"; set fence.step = 'foreign'; insert into fk values (6, 'not j')"); pgtest.SQLState(err) != "FN008" {
		t.Fatalf("a row of another job key after the upgrade: %v, want FN008", err)
	}
}

// awaitLockWait waits until a lock request of the migration (applied, not
// yet ended) for rel's AccessExclusiveLock is waiting (want) or not: the
// migration waits for a transaction in flight, gives up after its
// lock_timeout, and waits again. It fails if the migration ends first
// (while, what it was waiting behind).
func awaitLockWait(t *testing.T, ctx context.Context, observer *pgx.Conn, applied chan error, rel string, want bool, while string) {
	t.Helper()
	for {
		var waiting bool
		if err := observer.QueryRow(ctx, `select exists (select from pg_locks
where not granted and locktype = 'relation' and relation = $1::regclass and mode = 'AccessExclusiveLock')`, rel).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting == want {
			return
		}
		select {
		case err := <-applied:
			t.Fatalf("the migration ended (%v) %s", err, while)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// versionNamed is the version of the migration whose file name ends in
// _name.sql (found in this directory, so the test names no number).
func versionNamed(t *testing.T, name string) int32 {
	t.Helper()
	files, err := filepath.Glob("*_" + name + ".sql")
	if err != nil || len(files) != 1 {
		t.Fatalf("migration %q: files %v, %v; want one", name, files, err)
	}
	n, err := strconv.Atoi(strings.SplitN(files[0], "_", 2)[0])
	if err != nil {
		t.Fatalf("migration file %s: %v", files[0], err)
	}
	return int32(n)
}

// TestUpgradeNamesCatalogValueColumns (attack round 14, AA Break 2): a
// table protected before the migration that refuses columns whose values
// read through the catalog (oid_alias_columns) keeps such a column, since
// nothing rewrites it; the migration names it in a WARNING and
// fence.catalog_value_tables lists it, with the column, for an
// administrator. A protected table without one is not named.
func TestUpgradeNamesCatalogValueColumns(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	cfg, err := pgx.ParseConfig(cluster.Primary.DSN(db))
	if err != nil {
		t.Fatal(err)
	}
	var warnings []string
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if n.Severity == "WARNING" {
			warnings = append(warnings, n.Message)
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if err := migrations.MigrateTo(ctx, conn, versionNamed(t, "oid_alias_columns")-1); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `
create type pair as (a int, p regproc);
create table had_regclass (k int, job_key text, r regclass);
create table had_composite (k int, job_key text, c pair[]);
create table plain (k int, job_key text, r oid, t text);
select fence.protect('had_regclass', 'job_key'), fence.protect('had_composite', 'job_key'), fence.protect('plain', 'job_key');`); err != nil {
		t.Fatal(err)
	}
	if err := migrations.Apply(ctx, conn); err != nil {
		t.Fatal(err)
	}
	want := "protected tables whose rows hold values that read through the catalog: had_composite (column c of type public.pair[] (which holds regproc)); had_regclass (column r of type regclass)"
	if len(warnings) != 1 || warnings[0] != want {
		t.Fatalf("warnings of the migration: got %q, want [%q]", warnings, want)
	}
	rows, err := conn.Query(ctx, "select relid::text || ': ' || what from fence.catalog_value_tables()")
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if w := "had_composite: column c of type public.pair[] (which holds regproc)|had_regclass: column r of type regclass"; strings.Join(got, "|") != w {
		t.Fatalf("fence.catalog_value_tables: got %q, want %q", strings.Join(got, "|"), w)
	}
}
