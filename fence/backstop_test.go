package fence_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/pgfence/pgfence/fence"
)

// TestBackstop: every path that writes a protected table without valid
// metadata is refused by the trigger itself, on a direct connection.
func TestBackstop(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.exec(`
		create function write_result(k text) returns void language sql as $$ insert into results values (k, 'f', 1) $$;
		create view results_view as select * from results;
		create table jobs (id text primary key);
		create table steps (job_id text references jobs on delete cascade on update cascade, n int);
		select fence.protect('steps');
		insert into jobs values ('j1');
		create rule audit_to_results as on insert to audit where new.note = 'via rule' do also insert into results values (new.job_key, 'rule', new.token);
	`)
	// seed a protected row through the bypass role so deletes/cascades have something to touch
	e.exec("grant all on results, steps to pgfence_bypass")
	e.exec("set role pgfence_bypass; insert into steps values ('j1', 1); insert into results values ('seeded', 'x', 1); reset role")

	cases := []struct{ name, sql string }{
		{"insert", "insert into results values ('k', 'p', 1)"},
		{"update", "update results set payload = 'y'"},
		{"delete", "delete from results"},
		{"upsert", "insert into results values ('seeded', 'p', 2) on conflict (job_key) do update set payload = excluded.payload"},
		{"merge", "merge into results r using (select 'k' as k) s on r.job_key = s.k when not matched then insert values (s.k, 'm', 1)"},
		{"writable_cte", "with w as (insert into results values ('k', 'p', 1) returning 1) select * from w"},
		{"truncate", "truncate results"},
		{"function", "select write_result('k')"},
		{"do_block", "do $$ begin insert into results values ('k', 'p', 1); end $$"},
		{"updatable_view", "insert into results_view values ('k', 'p', 1)"},
		{"rule", "insert into audit values ('k', 1, 'via rule')"},
		{"fk_cascade_delete", "delete from jobs where id = 'j1'"},
		{"fk_cascade_update", "update jobs set id = 'j2' where id = 'j1'"},
	}
	ctx := ctxT(t)
	conn := e.connect() // superuser without pgfence_bypass: not exempt
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := conn.Exec(ctx, c.sql)
			wantCode(t, err, fence.CodeFencingRequired)
			if !strings.Contains(err.Error(), "fencing required") {
				t.Fatalf("message: %v", err)
			}
		})
	}
	t.Run("copy_from", func(t *testing.T) {
		_, err := conn.CopyFrom(ctx, pgx.Identifier{"results"}, []string{"job_key", "payload", "token"}, pgx.CopyFromRows([][]any{{"c", "p", int64(1)}}))
		wantCode(t, err, fence.CodeFencingRequired)
	})
	if got := e.results(); len(got) != 1 {
		t.Fatalf("results after refused writes: got %v, want only the seeded row", got)
	}
	e.wantCount(t, 1, "select count(*) from steps")

	t.Run("malformed_metadata", func(t *testing.T) {
		c := e.connect()
		l := e.acquire("m", "w")
		for _, set := range []string{
			"set fence.job_key = 'm'", // no epoch/token
			"set fence.job_key = 'm'; set fence.epoch = 1; set fence.token = 'x'",
			"set fence.job_key = 'm'; set fence.epoch = ''; set fence.token = 17",
		} {
			if _, err := c.Exec(ctx, "reset all; "+set); err != nil {
				t.Fatal(err)
			}
			_, err := c.Exec(ctx, "insert into results values ('m', 'p', 1)")
			wantCode(t, err, fence.CodeFencingRequired)
		}
		if _, err := c.Exec(ctx, "reset all"); err != nil {
			t.Fatal(err)
		}
		if err := setGUCs(ctx, c, l.Generation("")); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Exec(ctx, "insert into results values ('m', 'p', $1)", l.Token); err != nil {
			t.Fatalf("write with valid metadata: %v", err)
		}
	})

	t.Run("bypass_member_allowed", func(t *testing.T) {
		e.exec("create role dba login; grant pgfence_bypass to dba; grant all on results to dba")
		c := e.connectAs("dba")
		if _, err := c.Exec(ctx, "update results set payload = 'repaired' where job_key = 'seeded'"); err != nil {
			t.Fatalf("bypass member: %v", err)
		}
		// Indirect membership counts too; a superuser that is not a member
		// does not.
		e.exec("create role ops nologin; grant pgfence_bypass to ops; create role dba2 login; grant ops to dba2; grant all on results to dba2")
		c2 := e.connectAs("dba2")
		if _, err := c2.Exec(ctx, "update results set payload = 'repaired2' where job_key = 'seeded'"); err != nil {
			t.Fatalf("indirect bypass member: %v", err)
		}
		e.exec("create role root2 superuser login")
		c3 := e.connectAs("root2")
		_, err := c3.Exec(ctx, "update results set payload = 'nope' where job_key = 'seeded'")
		wantCode(t, err, fence.CodeFencingRequired)
	})
}

func TestBackstopRowScope(t *testing.T) {
	e, ctx := parallelEnv(t)
	e.exec("create table outputs (job_key text not null, v int); select fence.protect('outputs', 'job_key')")
	a := e.acquire("a", "w")
	b := e.acquire("b", "w")
	c := e.connect()
	if err := setGUCs(ctx, c, a.Generation("")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, "insert into outputs values ('a', 1)"); err != nil {
		t.Fatalf("own row: %v", err)
	}
	// Each refused statement below carries a step of its own: a second
	// autocommit write under the same generation and step is a retry of
	// the first (its receipt is there), refused as a replay before its
	// rows are looked at.
	_, err := c.Exec(ctx, "set fence.step = 'insert'; insert into outputs values ('b', 1)")
	wantCode(t, err, fence.CodeFencingRequired)
	_, err = c.Exec(ctx, "set fence.step = 'update'; update outputs set job_key = 'b'")
	wantCode(t, err, fence.CodeFencingRequired)
	cb := e.connect()
	if err := setGUCs(ctx, cb, b.Generation("")); err != nil {
		t.Fatal(err)
	}
	if _, err := cb.Exec(ctx, "insert into outputs values ('b', 2)"); err != nil {
		t.Fatal(err)
	}
	_, err = c.Exec(ctx, "set fence.step = 'delete'; delete from outputs where job_key = 'b'")
	wantCode(t, err, fence.CodeFencingRequired)
	_, err = c.Exec(ctx, "set fence.step = 'update2'; update outputs set v = 3 where job_key = 'b'")
	wantCode(t, err, fence.CodeFencingRequired)
	e.wantCount(t, 1, "select count(*) from outputs where job_key = 'b' and v = 2")
}

// TestReplayGuard: a transaction that gate declared a replay can never
// commit, even on a direct connection that never calls fence.commit.
func TestReplayGuard(t *testing.T) {
	e, ctx := parallelEnv(t)
	g := e.committed(t, pgx.ReadCommitted, "first")
	for _, immediate := range []bool{false, true} {
		c := e.connect()
		tx, err := c.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if immediate {
			// Making constraints immediate only moves the failure earlier.
			if _, err := tx.Exec(ctx, "set constraints all immediate"); err != nil {
				t.Fatal(err)
			}
		}
		r, err := fence.Gate(ctx, tx, g)
		if immediate {
			wantCode(t, err, fence.CodeReplay)
			tx.Rollback(ctx)
			continue
		}
		if err != nil || r != fence.GateReplay {
			t.Fatalf("gate: got %v, %v; want replay", r, err)
		}
		if _, err := tx.Exec(ctx, "update results set payload = 'second'"); err != nil {
			t.Fatalf("write in replay mode: %v", err)
		}
		if _, err := tx.Exec(ctx, "insert into audit values ('report', 17, 'replayed')"); err != nil {
			t.Fatal(err)
		}
		err = tx.Commit(ctx)
		wantCode(t, err, fence.CodeReplay)
	}
	e.wantResult(t, "report", result{"first", 17})
	e.wantCount(t, 1, "select count(*) from audit")
	e.wantCount(t, 0, "select count(*) from fence.replay_guards")
}

// TestPrivileges: a worker role calls the protocol but cannot touch the
// fence tables or the administrative functions.
func TestPrivileges(t *testing.T) {
	e, ctx := parallelEnv(t)
	e.exec("create role w login; grant pgfence_worker to w; grant select, insert, update on results, audit to w")
	c := e.connectAs("w")
	l, err := fence.Acquire(ctx, c, "report", "w", time.Minute)
	if err != nil {
		t.Fatalf("worker acquire: %v", err)
	}
	e.wantWrite(t, c, pgx.ReadCommitted, l.Generation(""), "by worker", fence.Committed)
	if _, err := fence.Renew(ctx, c, "report", l.Token, time.Minute); err != nil {
		t.Fatalf("worker renew: %v", err)
	}
	// Workers see the jobs, not the tokens (issue 17 §5).
	var n int
	if err := c.QueryRow(ctx, "select count(*) from fence.jobs where lease_live").Scan(&n); err != nil || n != 1 {
		t.Fatalf("worker reads fence.jobs: %d, %v", n, err)
	}
	for _, sql := range []string{
		"select * from fence.fences",
		"select * from fence.leases",
		"select * from fence.issuance",
		"insert into fence.fences values ('x', 1, 1)",
		"update fence.fences set max_issued_token = 1",
		"update fence.receipts set payload_digest = ''",
		"delete from fence.receipts",
		"insert into fence.receipts values ('report', 1, 99, '', '', 'v1')",
		"delete from fence.leases",
		"select * from fence.receipts",
		"select nextval('fence.token_seq')",
		"select fence.unprotect('results')",
		"select fence.protect('audit')",
		"select fence.gc('0')",
		"select fence.gate_slow('report', 1, 1, '')",
		"select fence.check_generation(null, 'report', 1, 1)",
	} {
		_, err := c.Exec(ctx, sql)
		wantCode(t, err, "42501")
	}
	// The backstop's SECURITY DEFINER check is the trigger function itself,
	// which PostgreSQL runs only as a trigger.
	_, err = c.Exec(ctx, "select fence.backstop()")
	wantCode(t, err, "0A000")
	// A role that is not a worker cannot call the protocol, but the
	// backstop still fences its writes.
	e.exec("create role plain login; grant select, insert on results to plain")
	p := e.connectAs("plain")
	_, err = fence.Acquire(ctx, p, "other", "plain", time.Minute)
	wantCode(t, err, "42501")
	_, err = p.Exec(ctx, "insert into results values ('p', 'p', 1)")
	wantCode(t, err, fence.CodeFencingRequired)
	// The worker's generation already committed, and it is not the plain
	// role's: the answer is FN011, as for any generation of another role
	// (issue 30: not 'replay', which would tell it apart).
	_, err = p.Exec(ctx, "begin; "+setSQL(l.Generation(""))+"; insert into results values ('p', 'p', 1); commit")
	wantCode(t, err, fence.CodeNotOwner)
	p.Exec(ctx, "rollback")
	// A current generation acquired by another role is not the plain
	// role's to write under (issue 17 §5).
	p2 := e.acquire("plain-job", "admin")
	_, err = p.Exec(ctx, "reset all; "+setSQL(p2.Generation(""))+"; insert into results values ('p', 'p', 1)")
	wantCode(t, err, fence.CodeNotOwner)
	e.wantCount(t, 0, "select count(*) from results where job_key = 'p'")
}

func TestBadInput(t *testing.T) {
	e, ctx := parallelEnv(t)
	db := e.admin
	acq := func(job, holder string, ttl time.Duration) error {
		_, err := fence.Acquire(ctx, db, job, holder, ttl)
		return err
	}
	wantCode(t, acq("", "w", time.Minute), "22023")
	wantCode(t, acq(strings.Repeat("k", 201), "w", time.Minute), "22023")
	if err := acq(strings.Repeat("k", 200), "w", time.Minute); err != nil {
		t.Fatalf("200-character key: %v", err)
	}
	wantCode(t, acq("job", "", time.Minute), "22023")
	wantCode(t, acq("job", "w", 0), "22023")
	wantCode(t, acq("job", "w", -time.Second), "22023")
	e.wantCount(t, 0, "select count(*) from fence.fences where job_key = 'job'")
	_, err := fence.Renew(ctx, db, "nope", 1, time.Minute)
	wantFenceError(t, err, fence.CodeUnknownJob)
	wantFenceError(t, fence.Release(ctx, db, "nope", 1), fence.CodeUnknownJob)
	wantFenceError(t, fence.Retire(ctx, db, "nope", fence.RetireOptions{Force: true}), fence.CodeUnknownJob)
	g := fence.Generation{JobKey: "nope", Epoch: 1, Token: 1}
	_, err = writeResult(ctx, e.connect(), pgx.ReadCommitted, g, "x")
	wantFenceError(t, err, fence.CodeUnknownJob)

	l := e.acquire("job", "w")
	_, err = fence.Renew(ctx, db, "job", l.Token, 0)
	wantCode(t, err, "22023")
	_, err = writeResult(ctx, e.connect(), pgx.ReadCommitted, fence.Generation{JobKey: "job", Epoch: l.Epoch + 100, Token: l.Token}, "x")
	wantFenceError(t, err, fence.CodeUnknownJob) // an epoch never issued for the job
	_, err = writeResult(ctx, e.connect(), pgx.ReadCommitted, fence.Generation{JobKey: "job", Epoch: l.Epoch, Token: l.Token + 5}, "x")
	wantFenceError(t, err, fence.CodeStale) // a token never issued
	_, err = fence.GC(ctx, db, -time.Hour)
	wantCode(t, err, "22023")

	// protect
	wantCode(t, fence.Protect(ctx, db, "no_such_table", ""), "42P01")
	if err := fence.Protect(ctx, db, "results", ""); err != nil {
		t.Fatalf("protect twice with the same options must be a no-op: %v", err)
	}
	wantCode(t, fence.Protect(ctx, db, "results", "job_key"), "55000")
	wantCode(t, fence.Protect(ctx, db, "audit", "no_col"), "42703")
	wantCode(t, fence.Protect(ctx, db, "audit", "token"), "42804")
	e.exec("create view v as select * from audit")
	wantCode(t, fence.Protect(ctx, db, "v", ""), "42809")
	// A partition is not protected alone: its root is (issue 17 §1).
	e.exec("create table parted (k text) partition by list (k); create table parted_a partition of parted for values in ('a')")
	err = fence.Protect(ctx, db, "parted_a", "")
	wantCode(t, err, "42809")
	if pg := (*pgconn.PgError)(nil); !errors.As(err, &pg) || !strings.Contains(pg.Hint, "fence.protect('public.parted')") {
		t.Fatalf("protect a partition: %v, want a hint naming its root", err)
	}
	var triggers int
	if err := db.QueryRow(ctx, "select count(*) from pg_trigger where tgrelid = 'audit'::regclass").Scan(&triggers); err != nil {
		t.Fatal(err)
	}
	if triggers != 0 {
		t.Fatalf("failed protect left %d triggers on audit", triggers)
	}
	tables, err := fence.ProtectedTables(ctx, db)
	if err != nil || len(tables) != 1 || tables[0].Table != "results" || !tables[0].Exists {
		t.Fatalf("protected tables: %+v, %v", tables, err)
	}
	if err := fence.Unprotect(ctx, db, "results"); err != nil {
		t.Fatal(err)
	}
	if err := fence.Unprotect(ctx, db, "results"); err != nil {
		t.Fatalf("unprotect twice must be a no-op: %v", err)
	}
	e.exec("insert into results values ('free', 'x', 1)") // no longer protected
	tables, err = fence.ProtectedTables(ctx, db)
	if err != nil || len(tables) != 0 {
		t.Fatalf("protected tables after unprotect: %+v, %v", tables, err)
	}
}

// TestProtectNotifies: protect and unprotect announce the table to the
// proxies listening on pgfence_protected; acquire announces takeovers.
func TestNotifications(t *testing.T) {
	e, ctx := parallelEnv(t)
	e.exec("create table t2 (x int)")
	l := e.connect()
	if _, err := l.Exec(ctx, "listen pgfence_protected; listen pgfence_takeover"); err != nil {
		t.Fatal(err)
	}
	wait := func(channel, want string) {
		t.Helper()
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		n, err := l.WaitForNotification(wctx)
		// The DDL notifications of pgfence_catalog_changed (a command tag
		// on pgfence_protected) come too: wait past them.
		for err == nil && n.Channel == "pgfence_protected" && !strings.Contains(n.Payload, ".") {
			n, err = l.WaitForNotification(wctx)
		}
		if err != nil {
			t.Fatalf("waiting for %s: %v", channel, err)
		}
		if n.Channel != channel || !strings.Contains(n.Payload, want) {
			t.Fatalf("notification: got %s %q, want %s containing %q", n.Channel, n.Payload, channel, want)
		}
	}
	if err := fence.Protect(ctx, e.admin, "t2", ""); err != nil {
		t.Fatal(err)
	}
	wait("pgfence_protected", "public.t2")
	lease := e.acquire("job", "w")
	// The job and its epoch, never the token (issue 30: any login may
	// LISTEN).
	wait("pgfence_takeover", fmt.Sprintf(`{"job_key" : "job", "epoch" : %d}`, lease.Epoch))
	if err := fence.Unprotect(ctx, e.admin, "t2"); err != nil {
		t.Fatal(err)
	}
	wait("pgfence_protected", "public.t2")
}
