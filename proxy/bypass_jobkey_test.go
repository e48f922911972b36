package proxy

import (
	"bytes"
	"fmt"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("jobkey", bypassJobKey) }

// bypassJobKey (issue 30, HIGH 2): on a table protected with a job-key
// column, a fenced session changes only rows of its own job, whatever code
// runs during the statement. The row check used to read fence.job_key per
// row, so a function called in the statement switched to another job's
// rows half-way. Now the rows of a statement are judged, after it, against
// one read of the settings verified in the same function. Every way client
// code runs during a statement gets a case: a function in WHERE, SET or
// VALUES, a view's function, a column DEFAULT, a domain CHECK, an index
// expression and a CHECK constraint and a row-level-security policy made
// by the table's owner, a trigger on another table, an FK cascade, INSERT
// … SELECT, ON CONFLICT, MERGE, COPY, partitions, inheritance children, a
// row moved between partitions, savepoints; and TRUNCATE, which removes
// every job's rows.
func bypassJobKey(t *testing.T) {
	c := newCast(t)
	w, cur, other := c.worker, &c.current, c.other
	// The owner's gadgets: functions that switch the settings (any client
	// may write such a function: set_config is PUBLIC), and keyed tables
	// of its own: kt (with the gadgets that run per row), kp (partitioned),
	// ki (inheritance), kids (an FK child of parents).
	c.as(t, c.owner, fmt.Sprintf(`
create function public.rt_setkey(k text) returns text language sql as $$ select set_config('fence.job_key', k, true) $$;
create function public.rt_setgen(k text, e bigint, tk bigint) returns text language sql as $$
  select set_config('fence.job_key', k, true) || set_config('fence.epoch', e::text, true) || set_config('fence.token', tk::text, true) $$;
create function public.rt_default() returns text language sql as $$ select 'd' || rt_setkey('job2') $$;
create function public.rt_check(v text) returns boolean language sql as $$ select v is null or rt_setkey('job2') is not null $$;
create function public.rt_idx(v text) returns text language sql immutable as $$ select v || set_config('fence.job_key', 'job2', true) $$;
create domain public.switching as text check (rt_check(value));
create table public.kt (k int primary key, job_key text not null, v text not null, d text default rt_default(), s public.switching);
create table public.kp (k int not null, job_key text not null, v text not null) partition by list (job_key);
create table public.kp_job partition of public.kp for values in ('job');
create table public.kp_job2 partition of public.kp for values in ('job2');
create table public.kp_other partition of public.kp default;
create table public.ki (k int not null, job_key text not null, v text not null);
create table public.ki_c () inherits (public.ki);
create table public.kparents (id int primary key);
create table public.kids (id int references public.kparents on delete cascade on update cascade, job_key text not null, v text not null);
create view public.ledger_switch as select l.k, l.job_key from app.ledger l where rt_setkey('job2') is not null;
create view public.ledger_back as select l.k from app.ledger l where rt_setgen('job', %[2]d, %[3]d) is not null;
create table public.switches (id int);
create function public.switches_fire() returns trigger language plpgsql as $$
begin perform rt_setkey('job2'); update app.ledger set v = 'via trigger' where job_key = 'job2'; return null; end $$;
create trigger switches_fire after insert on public.switches for each statement execute function public.switches_fire();
grant execute on function rt_setkey(text), rt_setgen(text, bigint, bigint) to %[1]s;
grant select, insert, update, delete, truncate on kt, kp, kp_job, kp_job2, kp_other, ki, ki_c, kparents, kids, ledger_switch, ledger_back, switches to %[1]s;
`, pgx.Identifier{w}.Sanitize(), cur.Epoch, cur.Token))
	c.as(t, c.su, `select fence.protect('kt', 'job_key'), fence.protect('kp', 'job_key'), fence.protect('ki', 'job_key'), fence.protect('kids', 'job_key')`)
	c.as(t, c.dba, `
insert into kt values (1, 'job', 'seed', null, null), (2, 'job2', 'seed', null, null);
insert into kp values (1, 'job', 'seed'), (2, 'job2', 'seed'), (3, 'job3', 'seed');
insert into ki values (1, 'job', 'seed'), (2, 'job2', 'seed');
insert into ki_c values (3, 'job', 'seed'), (4, 'job2', 'seed');
insert into kparents values (1), (2);
insert into kids values (1, 'job', 'seed'), (2, 'job2', 'seed');`)
	const rows = `select 'kt ' || r::text from kt r union all select 'kp ' || tableoid::regclass || ' ' || r::text from kp r
union all select 'ki ' || tableoid::regclass || ' ' || r::text from ki r union all select 'kids ' || r::text from kids r
union all select 'kparents ' || r::text from kparents r`

	const (
		noMeta   = fence.CodeFencingRequired
		notOwner = fence.CodeNotOwner
	)
	switchTo := func(what string) string { return "rt_setkey('" + what + "') is not null" }
	otherGen := fmt.Sprintf("rt_setgen('job2', %d, %d) is not null", other.Epoch, other.Token)
	cases := []castCase{
		// The repro, and the statement's own settings switched
		// every way: a generation that is not the worker's is refused
		// (FN011); its own generation with another job's rows too (FN008).
		{"repro_where_function", attempt{sql: "update app.ledger set v = 'overwritten' where job_key = 'job2' and " + switchTo("job2"), code: notOwner}},
		{"where_function_whole_generation", attempt{sql: "update app.ledger set v = 'overwritten' where job_key = 'job2' and " + otherGen, code: notOwner}},
		{"set_clause_function", attempt{sql: "update app.ledger set v = rt_setkey('job2') where job_key = 'job2'", code: notOwner}},
		{"switch_and_back", attempt{sql: "update app.ledger set v = 'x' where (k = 1 and " + switchTo("job2") + ") or (k = 2 and " + switchTo("job") + ")", code: noMeta}},
		{"switch_back_in_later_row", attempt{sql: "update app.ledger set v = 'x' where job_key = 'job2' and " + switchTo("job2") + " and " + switchTo("job"), code: noMeta}},
		{"values_function", attempt{sql: "insert into app.ledger values (3, rt_setkey('job2'), 'x')", code: notOwner}},
		{"values_two_rows_switching", attempt{sql: "insert into app.ledger values (3, 'job', rt_setkey('job2')), (4, 'job2', rt_setkey('job'))", code: noMeta}},
		{"insert_select", attempt{sql: "insert into app.ledger select 3, rt_setkey('job2'), 'x'", code: notOwner}},
		{"insert_select_other_job", attempt{sql: "insert into app.ledger select k + 10, job_key, v from app.ledger", code: noMeta}},
		{"on_conflict_other_job", attempt{sql: "insert into app.ledger values (2, 'job', 'x') on conflict (k) do update set v = excluded.v", code: noMeta}},
		{"on_conflict_switching", attempt{sql: "insert into app.ledger values (2, 'job', 'x') on conflict (k) do update set v = excluded.v where " + switchTo("job2"), code: notOwner}},
		{"on_conflict_moves_key", attempt{sql: "insert into app.ledger values (1, 'job', 'x') on conflict (k) do update set job_key = 'job2'", code: noMeta}},
		{"merge_other_job", attempt{sql: "merge into app.ledger l using (values (2)) s(k) on l.k = s.k when matched then update set v = 'x'", code: noMeta}},
		{"merge_switching", attempt{sql: "merge into app.ledger l using (select 2 as k where " + switchTo("job2") + ") s on l.k = s.k when matched then update set v = 'x'", code: notOwner}},
		{"merge_insert_other_job", attempt{sql: "merge into app.ledger l using (values (5, 'job2')) s(k, j) on l.k = s.k when not matched then insert values (s.k, s.j, 'x')", code: noMeta}},
		{"delete_switching", attempt{sql: "delete from app.ledger where job_key = 'job2' and " + switchTo("job2"), code: notOwner}},
		{"delete_other_job", attempt{sql: "delete from app.ledger where job_key = 'job2'", code: noMeta}},
		{"view_function", attempt{sql: "update app.ledger set v = 'x' where k in (select k from ledger_switch where job_key = 'job2')", code: notOwner}},
		{"view_switches_back", attempt{sql: "update app.ledger set v = 'x' where job_key = 'job2' and " + switchTo("job2") + " and k in (select k from ledger_back)", code: noMeta}},
		{"column_default", attempt{sql: "insert into kt (k, job_key, v) values (3, 'job2', 'x')", code: notOwner}},
		{"column_default_own_key", attempt{sql: "insert into kt (k, job_key, v) values (3, 'job', 'x')", code: notOwner}},
		{"domain_check", attempt{sql: "insert into kt (k, job_key, v, s) values (3, 'job2', 'x', 'y')", code: notOwner}},
		{"domain_check_update", attempt{sql: "update kt set s = 'y' where k = 2", code: notOwner}},
		{"trigger_on_other_table", attempt{sql: "insert into switches values (1)", code: notOwner}},
		{"fk_cascade_delete", attempt{sql: "delete from kparents where id = 2", code: noMeta}},
		{"fk_cascade_update", attempt{sql: "update kparents set id = 20 where id = 2", code: noMeta}},
		{"partition_root", attempt{sql: "insert into kp values (4, 'job2', 'x')", code: noMeta}},
		{"partition_leaf", attempt{sql: "insert into kp_job2 values (4, 'job2', 'x')", code: noMeta}},
		{"partition_default_leaf", attempt{sql: "update kp_other set v = 'x'", code: noMeta}},
		{"partition_root_switching", attempt{sql: "update kp set v = 'x' where job_key = 'job2' and " + switchTo("job2"), code: notOwner}},
		{"partition_row_moved", attempt{sql: "update kp set job_key = 'job2' where k = 1", code: noMeta}},
		{"partition_row_moved_in", attempt{sql: "update kp set job_key = 'job' where k = 2", code: noMeta}},
		{"inheritance_parent_reaches_child", attempt{sql: "update ki set v = 'x' where k = 4", code: noMeta}},
		{"inheritance_parent_switching", attempt{sql: "delete from ki where job_key = 'job2' and " + switchTo("job2"), code: notOwner}},
		{"inheritance_child", attempt{sql: "insert into ki_c values (5, 'job2', 'x')", code: noMeta}},
		{"copy_other_job", attempt{sql: "copy app.ledger from stdin", copyIn: "3\tjob\tmine\n4\tjob2\tnot mine\n", code: noMeta}},
		{"copy_partition_root", attempt{sql: "copy kp from stdin", copyIn: "5\tjob\tmine\n6\tjob3\tnot mine\n", code: noMeta}},
		{"copy_domain_switching", attempt{sql: "copy kt (k, job_key, v, s) from stdin", copyIn: "3\tjob2\tx\ty\n", code: notOwner}},
		{"savepoint_switch_released", attempt{sql: "begin; savepoint a; select " + switchTo("job2") + "; release a; update app.ledger set v = 'x' where job_key = 'job2'; commit", code: notOwner}},
		{"savepoint_switch_rolled_back", attempt{sql: "begin; savepoint a; select " + switchTo("job2") + "; rollback to a; update app.ledger set v = 'x' where job_key = 'job2'; commit", code: noMeta}},
		{"savepoint_then_other_job", attempt{sql: "begin; update app.ledger set v = 'mine' where k = 1; savepoint a; update app.ledger set v = 'x' where k = 2; commit", code: noMeta}},
		{"clear_settings_mid_statement", attempt{sql: "update app.ledger set v = 'x' where job_key = 'job2' and set_config('fence.job_key', '', true) is not null", code: noMeta}},
		{"truncate_keyed", attempt{sql: "truncate app.ledger", code: noMeta}},
		{"truncate_keyed_root", attempt{sql: "truncate kp", code: noMeta}},
		{"truncate_keyed_leaf", attempt{sql: "truncate kp_job", code: noMeta}},
		{"truncate_keyed_inheritance", attempt{sql: "truncate ki", code: noMeta}},
		{"truncate_keyed_with_its_parent", attempt{sql: "truncate kids, kparents", code: noMeta}},
	}
	for i := range cases {
		cases[i].a.role, cases[i].a.lease = w, cur
	}
	t.Run("attacks", func(t *testing.T) {
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) { c.tryRows(t, tc.a, rows) })
		}
	})

	// The owner's gadgets on the table itself: an index expression, a
	// CHECK constraint and a row-level-security policy that switch the
	// settings for every row they see.
	t.Run("owner_gadgets", func(t *testing.T) {
		// The DDL guard refuses the owner an index calling its own
		// function (FN010, round 25, BA-H2); one a bypass member adds
		// must still not switch keys.
		c.refusedAs(t, c.owner, `create index kt_switch on kt (rt_idx(v))`, "FN010")
		// Not even a bypass member's may resolve names under the
		// caller's search_path (round 27, BG-H4): the gadgets get one.
		c.refusedAs(t, c.dba, `create index kt_switch on kt (rt_idx(v))`, "FN010")
		c.as(t, c.owner, `alter function public.rt_idx(text) set search_path = pg_catalog, public;
alter function public.rt_check(text) set search_path = pg_catalog, public`)
		c.as(t, c.dba, `create index kt_switch on kt (rt_idx(v));`)
		c.tryRows(t, attempt{role: w, lease: cur, sql: "update kt set v = 'x' where k = 1", code: notOwner}, rows)
		c.as(t, c.dba, "drop index kt_switch")
		// The DDL guard refuses the owner a CHECK calling its own
		// function (FN010, round 24, AX-H1); one a bypass member adds
		// must still not switch keys.
		c.refusedAs(t, c.owner, `alter table kt add constraint kt_switch check (rt_check(v))`, "FN010")
		c.as(t, c.dba, `alter table kt add constraint kt_switch check (rt_check(v))`)
		c.tryRows(t, attempt{role: w, lease: cur, sql: "insert into kt (k, job_key, v) values (3, 'job', 'x')", code: notOwner}, rows)
		c.as(t, c.dba, "alter table kt drop constraint kt_switch")
		// The DDL guard refuses the owner a policy on a protected table
		// (FN010); one a bypass member adds must still not switch keys.
		rls := `alter table kt enable row level security;
create policy kt_all on kt using (true) with check (rt_check(v));`
		c.refusedAs(t, c.owner, rls, "FN010")
		c.as(t, c.dba, rls)
		c.tryRows(t, attempt{role: w, lease: cur, sql: "update kt set v = 'x' where k = 2", code: notOwner}, rows)
		c.as(t, c.dba, "drop policy kt_all on kt; alter table kt disable row level security")
	})

	// A collation or a domain on the job-key column does not make another
	// job's key equal: the row check compares bytes.
	t.Run("collation_and_domain", func(t *testing.T) {
		c.as(t, c.owner, `create collation public.nd (provider = icu, locale = 'und-u-ks-level2', deterministic = false);
create domain public.jk as text collate public.nd;
create table public.kc (k int primary key, job_key text collate public.nd not null);
create table public.kd (k int primary key, job_key public.jk not null);
grant select, insert, update, delete on kc, kd to `+pgx.Identifier{w}.Sanitize())
		c.as(t, c.su, "select fence.protect('kc', 'job_key')")
		// A domain is not a job-key type: it is made one after protecting.
		c.as(t, c.owner, "alter table kd alter column job_key type text")
		c.as(t, c.su, "select fence.protect('kd', 'job_key')")
		// The DDL guard refuses the owner a type change of a read shape
		// (FN010); the key must still compare bytes when a bypass member
		// makes it.
		c.refusedAs(t, c.owner, "alter table kd alter column job_key type public.jk", "FN010")
		c.as(t, c.dba, "alter table kd alter column job_key type public.jk")
		kc := rows + ` union all select 'kc ' || r::text from kc r union all select 'kd ' || r::text from kd r`
		for _, tc := range []castCase{
			{"case_insensitive_key", attempt{sql: "insert into kc values (1, 'JOB')", code: noMeta}},
			{"accent_and_case", attempt{sql: "insert into kc values (1, 'Job')", code: noMeta}},
			{"domain_case_insensitive_key", attempt{sql: "insert into kd values (1, 'JOB')", code: noMeta}},
			{"trailing_space", attempt{sql: "insert into kc values (1, 'job ')", code: noMeta}},
		} {
			tc.a.role, tc.a.lease = w, cur
			t.Run(tc.name, func(t *testing.T) { c.tryRows(t, tc.a, kc) })
		}
		// Its own key, exactly, is written.
		c.currentWrites(t, func(route string) string {
			return fmt.Sprintf("set fence.step = 'collation %s'; insert into kc values (%d, 'job'); insert into kd values (%[2]d, 'job')", route, len(route))
		})
	})

	// The control: the holder writes its own rows by every route, the
	// owner's switching gadgets notwithstanding when they switch to its
	// own key, and every row of a 1,000-row COPY.
	t.Run("own_rows", func(t *testing.T) {
		c.currentWrites(t, func(route string) string {
			n := len(route) * 100
			return fmt.Sprintf(`set fence.step = 'own %[1]s'; update app.ledger set v = '%[1]s' where job_key = 'job' and rt_setkey('job') is not null;
insert into kp values (%[2]d, 'job', '%[1]s');
update kp set v = '%[1]s' where job_key = 'job';
update ki set v = '%[1]s' where job_key = 'job';
insert into app.ledger values (%[2]d, 'job', '%[1]s') on conflict (k) do update set v = excluded.v;
merge into app.ledger l using (values (%[2]d)) s(k) on l.k = s.k when matched then update set v = 'merged';
delete from kp where k = %[2]d`, route, n)
		})
		var data []byte
		for i := 0; i < 1000; i++ {
			data = fmt.Appendf(data, "%d\tjob\tbulk\n", 10000+i)
		}
		conn := c.connect(t, "direct", w, cur)
		if _, err := conn.CopyFrom(ctxT(t), bytes.NewReader(data), "copy app.ledger from stdin"); err != nil {
			t.Fatalf("COPY of 1,000 own rows: %v", err)
		}
		if n := c.count(t, "select count(*) from app.ledger where v = 'bulk'"); n != 1000 {
			t.Fatalf("%d rows copied, want 1000", n)
		}
	})
}

// tryRows is try, with the rows of extra (a query of the class's own
// tables, one text per row) unchanged as well.
func (c *cast) tryRows(t *testing.T, a attempt, extra string) {
	t.Helper()
	for _, route := range castRoutes {
		if route == "proxy" && a.direct {
			continue
		}
		t.Run(route, func(t *testing.T) { c.tryRoute(t, route, a, extra) })
	}
}

// tryRoute runs a by one route, asserting its SQLSTATE and that neither
// the cast's state nor the rows of extra (when not empty) changed.
func (c *cast) tryRoute(t *testing.T, route string, a attempt, extra string) {
	t.Helper()
	before, beforeRows := c.state(t), c.lines(t, extra)
	conn := c.connect(t, route, a.role, a.lease)
	err := castExec(ctxT(t), conn, a.sql, a.copyIn)
	if got := pgtest.SQLState(err); got != a.code {
		t.Fatalf("%s as %s: got %v (SQLSTATE %q), want SQLSTATE %s", a.sql, a.role, err, got, a.code)
	}
	c.unchanged(t, before)
	if after := c.lines(t, extra); !slices.Equal(beforeRows, after) {
		t.Fatalf("the attempt changed rows:\n before %v\n after  %v", beforeRows, after)
	}
}

// lines runs q (one text column) on the cast's own connection, sorted.
func (c *cast) lines(t *testing.T, q string) []string {
	t.Helper()
	if q == "" {
		return nil
	}
	rows, err := c.admin.Query(ctxT(t), q)
	if err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	slices.Sort(out)
	return out
}
