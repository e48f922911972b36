package proxy

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

func init() { registerBypass("confirm", bypassConfirm) }

// bypassConfirm (round 13, attacker Y's H1–H3): in failover_mode sync a
// failover is counted lossless on the assumption that every acknowledged
// takeover reached the synchronous standby. fence.durable made the lease
// functions' commits wait for it by LOCAL settings, and code that runs
// later in the same transaction undid them: the table owner's deferred
// trigger (synchronous_commit = off, or client_min_messages = error,
// which hides the WARNING of a cancelled wait), or the SET clause of a
// helper function around fence.acquire, which restores the previous
// holder's role default client_min_messages = error when it returns.
// The takeover was acknowledged without the standby, a failover lost it,
// and the previous holder committed on the new primary.
//
// Migration 027 no longer relies on the takeover's commit: a
// generation's first write is refused (FN017) until pg_stat_replication
// shows the takeover on the synchronous standbys. So a takeover a
// failover can lose never has a write: only the previous holder's
// writes exist, in fencing order. Each attack case takes a job over by
// its route with the standby's WAL receiver stopped, then tries the new
// generation's first write directly and through the proxy: FN017, and
// the row is still the previous holder's. Before 027 the write
// committed.
//
// The class has a cluster of its own: a primary with a streaming
// replica as its synchronous standby ('*'), failover_mode sync,
// fence.settings confirm_timeout 300ms (the refused writes give up
// quickly). The set-up and the normal path run while the standby
// confirms; then its WAL receiver is stopped.
func bypassConfirm(t *testing.T) {
	e := newConfirmEnv(t)
	jobs := []string{"cf_normal", "cf_trigger_sync_off", "cf_trigger_cmm", "cf_helper_alter", "cf_helper_own_set", "cf_same_tx", "cf_wait", "cf_commit_first", "cf_catch_up"}
	for _, j := range jobs {
		e.zombieWrites(t, j)
	}

	// The normal path: the standby confirms, the first write goes on and
	// its confirmation is recorded.
	var normal fence.Lease
	t.Run("normal_first_write", func(t *testing.T) {
		normal = e.takeOver(t, "cf_normal", "")
		if err := e.write(t, "direct", normal, "first", ""); err != nil {
			t.Fatalf("first write of a generation the standby confirms: %v, want success", err)
		}
		if got := e.payload(t, "cf_normal"); got != "first" {
			t.Fatalf("payload %q, want first", got)
		}
		if !e.confirmed(t, normal) {
			t.Fatal("no fence.confirmed_takeovers row for the generation after its first write")
		}
	})
	// Round 16, attacker AD's M1: any role may write WAL
	// (pg_logical_emit_message), and the wait's target lies after it. A
	// standby still streaming it makes progress: the write waits for it,
	// as a synchronous commit would, rather than FN017 after
	// confirm_timeout. The standby's WAL receiver is stopped (SIGSTOP)
	// with 512 MB before the target, and let on (SIGCONT) only until the
	// walsender shows it took more, three times, 800ms apart: the write
	// waits 2.4s in all with a confirm_timeout of 2s and succeeds. A
	// standby receiving without pause reports no flush position, so the
	// wait counts the walsender's sent_lsn as progress too.
	t.Run("catching_up_is_waited_for", func(t *testing.T) {
		e.admin(t, "update fence.settings set value = '2s' where name = 'confirm_timeout'")
		defer e.admin(t, "update fence.settings set value = '300ms' where name = 'confirm_timeout'")
		l := e.takeOver(t, "cf_catch_up", "")
		rcv := e.walReceiver(t)
		if err := syscall.Kill(rcv, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		defer syscall.Kill(rcv, syscall.SIGCONT)
		e.admin(t, "select pg_logical_emit_message(false, 'cf.flood', repeat('x', 1048576)) from generate_series(1, 512)")
		start := time.Now()
		done := make(chan error, 1)
		go func() { done <- e.write(t, "direct", l, "caught_up", "") }()
		for i := 0; i < 3; i++ {
			time.Sleep(800 * time.Millisecond) // the quantity under test: a stall shorter than confirm_timeout
			before := e.sentLSN(t)
			if err := syscall.Kill(rcv, syscall.SIGCONT); err != nil {
				t.Fatal(err)
			}
			for deadline := time.Now().Add(30 * time.Second); e.sentLSN(t) == before; {
				if time.Now().After(deadline) {
					t.Fatal("the WAL receiver let on took nothing in 30s")
				}
			}
			if err := syscall.Kill(rcv, syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-done:
				t.Fatalf("the write ended after %v while the standby was still behind: %v, want it to wait", time.Since(start), err)
			default:
			}
		}
		if err := syscall.Kill(rcv, syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatalf("first write while the standby streams WAL written before it: %v (after %v), want it to wait and succeed", err, time.Since(start))
		}
		if got := e.payload(t, "cf_catch_up"); got != "caught_up" {
			t.Fatalf("payload %q, want caught_up", got)
		}
	})
	// failover_mode async: nothing waits, nothing is recorded.
	t.Run("async_unchanged", func(t *testing.T) {
		e.admin(t, "select fence.set_failover_mode('async')")
		defer e.admin(t, "select fence.set_failover_mode('sync')")
		l := e.takeOver(t, "cf_async", "")
		if err := e.write(t, "direct", l, "async", ""); err != nil {
			t.Fatalf("async mode: %v, want success", err)
		}
		if e.confirmed(t, l) {
			t.Fatal("async mode recorded a confirmation")
		}
	})

	// From now on nothing reaches the standby.
	if err := e.c.DetachReplica(ctxT(t)); err != nil {
		t.Fatal(err)
	}

	// A confirmed generation does not wait again: its second write goes
	// on with the standby away (a wait would end in FN017 after 300ms).
	t.Run("confirmed_does_not_wait", func(t *testing.T) {
		if err := e.write(t, "direct", normal, "second", "synchronous_commit=local"); err != nil {
			t.Fatalf("a confirmed generation's second write: %v, want success without a wait", err)
		}
	})

	type attack struct {
		name string
		job  string
		take func(t *testing.T) fence.Lease
	}
	attacks := []attack{
		// Y-H1: the owner's deferred trigger on a table the takeover's
		// transaction writes sets synchronous_commit = off: the commit
		// does not wait at all.
		{"trigger_sync_off", "cf_trigger_sync_off", func(t *testing.T) fence.Lease {
			return e.takeOver(t, "cf_trigger_sync_off", "sync_off")
		}},
		// Y-H1 with client_min_messages = error: the commit waits, the
		// wait is cancelled, and no WARNING says so.
		{"trigger_client_min_messages", "cf_trigger_cmm", func(t *testing.T) fence.Lease {
			return e.takeOverCancelled(t, "cf_trigger_cmm", "begin; select epoch, token from fence.acquire('cf_trigger_cmm', 'b', '1 hour'); insert into audit values ('cmm'); commit", "")
		}},
		// Y-H2: the worker role's helper around fence.acquire, given a SET
		// clause by the previous holder (ALTER FUNCTION), under its role
		// default client_min_messages = error.
		{"helper_alter_function", "cf_helper_alter", func(t *testing.T) fence.Lease {
			e.roleDefault(t)
			e.admin(t, "set role cf_w; alter function cf_acquire(text) set client_min_messages = error; reset role")
			t.Cleanup(func() { e.admin(t, "alter function cf_acquire(text) reset client_min_messages") })
			return e.takeOverCancelled(t, "cf_helper_alter", "select epoch, token from cf_acquire('cf_helper_alter')", "")
		}},
		// Y-H3: a helper's own SET client_min_messages = warning restores
		// the role default error when it returns.
		{"helper_own_set", "cf_helper_own_set", func(t *testing.T) fence.Lease {
			e.roleDefault(t)
			return e.takeOverCancelled(t, "cf_helper_own_set", "select epoch, token from cf_acquire_warning('cf_helper_own_set')", "")
		}},
	}
	for _, a := range attacks {
		t.Run(a.name, func(t *testing.T) {
			l := a.take(t)
			for _, route := range castRoutes {
				// synchronous_commit = local: a write let through commits at
				// once (and is seen), rather than waiting for the standby.
				err := e.write(t, route, l, "b_"+route, "synchronous_commit=local")
				if got := pgtest.SQLState(err); got != fence.CodeUnconfirmedTakeover {
					t.Errorf("%s: the new generation's first write: %v (SQLSTATE %q), want %s: the standby lacks the takeover", route, err, got, fence.CodeUnconfirmedTakeover)
				}
			}
			if got := e.payload(t, a.job); got != "zombie" {
				t.Fatalf("payload %q, want the previous holder's (zombie): a write committed under a takeover the standby lacks", got)
			}
		})
	}

	// Round 15, attacker AB's H1: fence.commit called before the first
	// write wrote the transaction's receipt without the confirmation, and
	// every write path then took that receipt as the generation's entry
	// (an own receipt: no wait). A receipt is written only after it now.
	t.Run("commit_before_first_write", func(t *testing.T) {
		l := e.takeOver(t, "cf_commit_first", "sync_off")
		for _, route := range castRoutes {
			conn := connectConfig(t, e.connConfig(t, route, "cf_commit_first_"+route, &l, "synchronous_commit=local"))
			step := "cf_" + route
			err := castExec(ctxT(t), conn, fmt.Sprintf("set fence.step = '%s'; select fence.commit('%s', %d, %d, '%s', '\\x00'::bytea, 'v1'); update results set payload = 'b_%s' where job_key = '%s'",
				step, l.JobKey, l.Epoch, l.Token, step, route, l.JobKey), "")
			if got := pgtest.SQLState(err); got != fence.CodeUnconfirmedTakeover {
				t.Errorf("%s: fence.commit, then the new generation's first write: %v (SQLSTATE %q), want %s: the standby lacks the takeover", route, err, got, fence.CodeUnconfirmedTakeover)
			}
		}
		if got := e.payload(t, "cf_commit_first"); got != "zombie" {
			t.Fatalf("payload %q, want the previous holder's (zombie): a write committed under a takeover the standby lacks", got)
		}
	})

	// The takeover and the write in one transaction: the takeover cannot
	// be confirmed before it commits.
	t.Run("same_transaction", func(t *testing.T) {
		// In a subtransaction too (round 16, attacker AD's H1: the
		// issuance row's xmin is the subtransaction's id, which was taken
		// for another transaction's, and the wait confirmed a position
		// before the takeover's commit).
		shapes := []struct {
			name, sql string
			at        int // the result holding (epoch, token)
		}{
			{"plain", "begin; select epoch, token from fence.acquire('cf_same_tx', 'b', '1 hour')", 1},
			{"savepoint_released", "begin; savepoint s; select epoch, token from fence.acquire('cf_same_tx', 'b', '1 hour'); release savepoint s", 2},
			{"savepoint_open", "begin; savepoint s; select epoch, token from fence.acquire('cf_same_tx', 'b', '1 hour')", 2},
			{"exception_block", "begin; select epoch, token from cf_acquire_block('cf_same_tx')", 1},
		}
		for _, sh := range shapes {
			for _, route := range castRoutes {
				conn := connectConfig(t, e.connConfig(t, route, "cf_same_"+route, nil, "synchronous_commit=local"))
				res, err := conn.Exec(ctxT(t), sh.sql).ReadAll()
				if err != nil || len(res) <= sh.at || len(res[sh.at].Rows) != 1 {
					t.Fatalf("%s %s: acquire: %v", sh.name, route, err)
				}
				epoch, token := string(res[sh.at].Rows[0][0]), string(res[sh.at].Rows[0][1])
				err = castExec(ctxT(t), conn, fmt.Sprintf("set local fence.job_key = 'cf_same_tx'; set local fence.epoch = %s; set local fence.token = %s; update results set payload = 'same' where job_key = 'cf_same_tx'", epoch, token), "")
				if got := pgtest.SQLState(err); got != fence.CodeUnconfirmedTakeover || !strings.Contains(err.Error(), "issued in this transaction") {
					t.Errorf("%s %s: a write in the takeover's transaction: %v (SQLSTATE %q), want %s (issued in this transaction)", sh.name, route, err, got, fence.CodeUnconfirmedTakeover)
				}
				_ = castExec(ctxT(t), conn, "rollback", "")
				conn.Close(context.Background())
			}
		}
		if got := e.payload(t, "cf_same_tx"); got != "zombie" {
			t.Fatalf("payload %q, want zombie", got)
		}
	})

	// The write waits while the standby lacks the takeover, and commits
	// once it has it.
	t.Run("waits_then_commits", func(t *testing.T) {
		e.admin(t, "update fence.settings set value = '1 minute' where name = 'confirm_timeout'")
		defer e.admin(t, "update fence.settings set value = '300ms' where name = 'confirm_timeout'")
		l := e.takeOver(t, "cf_wait", "sync_off")
		done := make(chan error, 1)
		go func() { done <- e.writeApp(t, "direct", l, "waited", "synchronous_commit=local", "cf_waiter") }()
		// Observed waiting in the confirmation's poll (pg_sleep).
		ctx := ctxT(t)
		if err := pgtest.Poll(ctx, func() (bool, error) {
			select {
			case err := <-done:
				return false, fmt.Errorf("the write returned (%v) while the standby lacked the takeover", err)
			default:
			}
			var n int
			err := e.adm.QueryRow(ctx, "select count(*) from pg_stat_activity where application_name = 'cf_waiter' and wait_event = 'PgSleep'").Scan(&n)
			return n > 0, err
		}); err != nil {
			t.Fatalf("the write never waited for the confirmation: %v", err)
		}
		if got := e.payload(t, "cf_wait"); got != "zombie" {
			t.Fatalf("payload %q while the standby lacks the takeover, want zombie", got)
		}
		e.attach(t)
		if err := <-done; err != nil {
			t.Fatalf("the write after the standby received the takeover: %v, want success", err)
		}
		if got := e.payload(t, "cf_wait"); got != "waited" {
			t.Fatalf("payload %q, want waited", got)
		}
		// The standby has the takeover the write waited for.
		if err := e.c.WaitReplicaCaughtUp(ctx); err != nil {
			t.Fatal(err)
		}
		rc, err := e.c.Replica.Connect(ctx, e.db)
		if err != nil {
			t.Fatal(err)
		}
		defer rc.Close(context.Background())
		var tok int64
		if err := rc.QueryRow(ctx, "select max_issued_token from fence.fences where job_key = 'cf_wait'").Scan(&tok); err != nil || tok != l.Token {
			t.Fatalf("the standby's fence row: token %d (%v), want %d", tok, err, l.Token)
		}
	})

	// num_sync: ANY 2 counts two standbys.
	t.Run("quorum_any_2", e.confirmQuorum)
}

// confirmQuorum: synchronous_standby_names = 'ANY 2 (*)' with two
// standbys; the second one's WAL receiver stopped, a takeover only one
// of them has is not confirmed (FN017, "1 of 2"); under 'ANY 1 (*)' it
// is.
func (e *confirmEnv) confirmQuorum(t *testing.T) {
	ctx := ctxT(t)
	second, err := e.c.AddStandby(ctx, e.c.Primary, pgtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	setNames := func(names string) {
		e.admin(t, "alter system set synchronous_standby_names = "+quoteLiteral(names))
		e.admin(t, "select pg_reload_conf()")
	}
	setNames("ANY 2 (*)")
	defer setNames("*")
	if err := pgtest.Poll(ctx, func() (bool, error) {
		var n int
		err := e.adm.QueryRow(ctx, "select count(*) from pg_stat_replication where sync_state = 'quorum' and state = 'streaming'").Scan(&n)
		return n == 2, err
	}); err != nil {
		t.Fatalf("two quorum standbys: %v", err)
	}
	e.zombieWrites(t, "cf_quorum")
	if err := e.c.DetachNode(ctx, second); err != nil {
		t.Fatal(err)
	}
	l := e.takeOver(t, "cf_quorum", "sync_off")
	err = e.write(t, "direct", l, "one_of_two", "synchronous_commit=local")
	if got := pgtest.SQLState(err); got != fence.CodeUnconfirmedTakeover || !strings.Contains(err.Error(), "1 of 2") {
		t.Fatalf("ANY 2 with one standby that has the takeover: %v (SQLSTATE %q), want %s (1 of 2)", err, got, fence.CodeUnconfirmedTakeover)
	}
	setNames("ANY 1 (*)")
	if err := e.write(t, "direct", l, "one_of_one", "synchronous_commit=local"); err != nil {
		t.Fatalf("ANY 1 with one standby that has the takeover: %v, want success", err)
	}
	if got := e.payload(t, "cf_quorum"); got != "one_of_one" {
		t.Fatalf("payload %q, want one_of_one", got)
	}
}

type confirmEnv struct {
	c        *pgtest.Cluster
	db       string
	proxy    *testProxy
	adm      *pgx.Conn // superuser, synchronous_commit = local
	conninfo string    // the replica's primary_conninfo, to attach it again

	mu      sync.Mutex
	notices map[string][]*pgconn.Notice
}

func newConfirmEnv(t *testing.T) *confirmEnv {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := pgtest.Start(ctx, pgtest.Options{Replica: true, Settings: map[string]string{
		"synchronous_standby_names": "'*'", "wal_retrieve_retry_interval": "'100ms'",
		// catching_up_is_waited_for writes 512 MB of WAL the stopped
		// standby must still be able to stream.
		"wal_keep_size": "'1GB'", "max_wal_size": "'2GB'"}})
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	db, err := c.CreateDatabase(ctx, "confirm")
	if err != nil {
		t.Fatal(err)
	}
	e := &confirmEnv{c: c, db: db, notices: map[string][]*pgconn.Notice{}}
	adm, err := c.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { adm.Close(context.Background()) })
	e.adm = adm
	if err := migrations.Apply(ctx, adm); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if _, err := adm.Exec(ctx, `
create role cf_w login; grant pgfence_worker to cf_w;
create role cf_owner;
grant create on schema public to cf_w;
create table results (job_key text primary key, payload text not null);
grant select, insert, update on results to cf_w;
insert into results select j, 'seed' from unnest(array['cf_normal', 'cf_async', 'cf_trigger_sync_off', 'cf_trigger_cmm',
  'cf_helper_alter', 'cf_helper_own_set', 'cf_same_tx', 'cf_wait', 'cf_quorum', 'cf_commit_first', 'cf_catch_up']) j;
select fence.protect('results');
create table audit (note text);
alter table audit owner to cf_owner;
grant insert on audit to cf_w;
create function cf_owner_sync_off() returns trigger language plpgsql as $$
begin
  if new.note = 'sync_off' then
    perform set_config('synchronous_commit', 'off', true);
  else
    perform set_config('client_min_messages', 'error', true);
  end if;
  return null;
end $$;
alter function cf_owner_sync_off() owner to cf_owner;
create constraint trigger audit_deferred after insert on audit deferrable initially deferred
  for each row execute function cf_owner_sync_off();
set role cf_w;
create function cf_acquire(j text) returns table (epoch bigint, token bigint) language sql
  as $$ select a.epoch, a.token from fence.acquire(j, 'b', '1 hour') a $$;
create function cf_acquire_warning(j text) returns table (epoch bigint, token bigint) language sql
  set client_min_messages = warning
  as $$ select a.epoch, a.token from fence.acquire(j, 'b', '1 hour') a $$;
create function cf_acquire_block(j text) returns table (epoch bigint, token bigint) language plpgsql
  as $$ begin
    begin
      return query select a.epoch, a.token from fence.acquire(j, 'b', '1 hour') a;
    exception when others then raise;
    end;
  end $$;
reset role;
insert into fence.settings values ('confirm_timeout', '300ms');
select fence.set_failover_mode('sync');`); err != nil {
		t.Fatal(err)
	}
	var conninfo string
	if err := c.Replica.MustConnect(t, "postgres").QueryRow(ctx, "show primary_conninfo").Scan(&conninfo); err != nil {
		t.Fatal(err)
	}
	e.conninfo = conninfo
	if _, err := adm.Exec(ctx, "set synchronous_commit = local"); err != nil {
		t.Fatal(err)
	}
	dsn := c.Primary.DSN("postgres")
	gate, err := NewFence(FenceConfig{Primary: dsn}, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(gate.Close)
	e.proxy = startProxy(t, Config{Primary: dsn, Interceptor: gate})
	return e
}

// admin runs sql as the superuser (its commits do not wait for the
// standby).
func (e *confirmEnv) admin(t *testing.T, sql string) {
	t.Helper()
	if _, err := e.adm.Exec(ctxT(t), sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// roleDefault gives cf_w client_min_messages = error for the connections
// it opens from now on, until the case ends (the previous holder can:
// ALTER ROLE of its own role).
func (e *confirmEnv) roleDefault(t *testing.T) {
	t.Helper()
	e.admin(t, "alter role cf_w set client_min_messages = error")
	t.Cleanup(func() { e.admin(t, "alter role cf_w reset client_min_messages") })
}

func (e *confirmEnv) connConfig(t *testing.T, route, app string, l *fence.Lease, extra string) *pgconn.Config {
	t.Helper()
	host := e.c.Primary.Addr()
	if route == "proxy" {
		host = e.proxy.addr.String()
	}
	cfg, err := pgconn.ParseConfig(fmt.Sprintf("postgres://cf_w@%s/%s?sslmode=disable&application_name=%s", host, e.db, url.QueryEscape(app)))
	if err != nil {
		t.Fatal(err)
	}
	var opts []string
	if l != nil {
		opts = append(opts, pgoptions(*l))
	}
	if extra != "" {
		opts = append(opts, "-c "+extra)
	}
	if len(opts) > 0 {
		cfg.RuntimeParams["options"] = strings.Join(opts, " ")
	}
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.notices[app] = append(e.notices[app], n)
	}
	return cfg
}

// zombieWrites makes job's first generation (the previous holder) and
// its write, while the standby confirms.
func (e *confirmEnv) zombieWrites(t *testing.T, job string) {
	t.Helper()
	ctx := ctxT(t)
	conn := connectConfig(t, e.connConfig(t, "direct", "cf_zombie", nil, ""))
	res, err := conn.Exec(ctx, fmt.Sprintf("select epoch, token from fence.acquire('%s', 'a', '1 hour')", job)).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	l := fence.Lease{JobKey: job}
	fmt.Sscan(string(res[0].Rows[0][0]), &l.Epoch)
	fmt.Sscan(string(res[0].Rows[0][1]), &l.Token)
	if err := e.write(t, "direct", l, "zombie", ""); err != nil {
		t.Fatalf("the previous holder's write: %v", err)
	}
	// The lease is released so that the next holder can take over at
	// once; the previous holder keeps its generation (a zombie).
	if err := castExec(ctx, conn, fmt.Sprintf("select fence.release('%s', %d)", job, l.Token), ""); err != nil {
		t.Fatal(err)
	}
}

// takeOver acquires job in a transaction that also writes audit (note:
// "" writes nothing there; "sync_off" fires the owner's deferred trigger
// that turns synchronous_commit off).
func (e *confirmEnv) takeOver(t *testing.T, job, note string) fence.Lease {
	t.Helper()
	sql := fmt.Sprintf("select epoch, token from fence.acquire('%s', 'b', '1 hour')", job)
	if note != "" {
		sql = fmt.Sprintf("begin; %s; insert into audit values ('%s'); commit", sql, note)
	}
	conn := connectConfig(t, e.connConfig(t, "direct", "cf_take_"+job, nil, ""))
	res, err := conn.Exec(ctxT(t), sql).ReadAll()
	return e.scanLease(t, job, res, err)
}

func (e *confirmEnv) scanLease(t *testing.T, job string, res []*pgconn.Result, err error) fence.Lease {
	t.Helper()
	if err != nil {
		t.Fatalf("take over %s: %v", job, err)
	}
	l := fence.Lease{JobKey: job}
	for _, r := range res {
		if len(r.Rows) == 1 && len(r.Rows[0]) == 2 {
			fmt.Sscan(string(r.Rows[0][0]), &l.Epoch)
			fmt.Sscan(string(r.Rows[0][1]), &l.Token)
		}
	}
	if l.Token == 0 {
		t.Fatalf("take over %s: no lease in %v", job, res)
	}
	return l
}

// takeOverCancelled runs sql (a takeover), waits until its commit waits
// for the standby, cancels the wait, and checks the client was told
// nothing (no WARNING: client_min_messages = error at the commit).
func (e *confirmEnv) takeOverCancelled(t *testing.T, job, sql, extra string) fence.Lease {
	t.Helper()
	app := "cf_take_" + job
	conn := connectConfig(t, e.connConfig(t, "direct", app, nil, extra))
	type result struct {
		res []*pgconn.Result
		err error
	}
	got := make(chan result, 1)
	go func() {
		res, err := conn.Exec(context.Background(), sql).ReadAll()
		got <- result{res, err}
	}()
	ctx := ctxT(t)
	if err := pgtest.Poll(ctx, func() (bool, error) {
		var n int
		err := e.adm.QueryRow(ctx, "select count(*) from pg_stat_activity where application_name = $1 and wait_event = 'SyncRep'", app).Scan(&n)
		return n > 0, err
	}); err != nil {
		t.Fatalf("waiting for %s's commit to wait for the standby: %v", app, err)
	}
	var ok bool
	if err := e.adm.QueryRow(ctx, "select bool_and(pg_cancel_backend(pid)) from pg_stat_activity where application_name = $1 and wait_event = 'SyncRep'", app).Scan(&ok); err != nil || !ok {
		t.Fatalf("pg_cancel_backend: %v %v", ok, err)
	}
	r := <-got
	l := e.scanLease(t, job, r.res, r.err)
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, n := range e.notices[app] {
		if n.SeverityUnlocalized == "WARNING" {
			t.Fatalf("the takeover's client was sent %q: the attack did not hide the cancelled wait", n.Message)
		}
	}
	return l
}

// write updates job's row under l's generation and step (a fenced write)
// on route, and returns the error.
func (e *confirmEnv) write(t *testing.T, route string, l fence.Lease, payload, extra string) error {
	t.Helper()
	return e.writeApp(t, route, l, payload, extra, "cf_write_"+route)
}

func (e *confirmEnv) writeApp(t *testing.T, route string, l fence.Lease, payload, extra, app string) error {
	conn, err := pgconn.ConnectConfig(ctxT(t), e.connConfig(t, route, app, &l, extra))
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	return castExec(ctx, conn, fmt.Sprintf("set fence.step = '%s'; update results set payload = '%s' where job_key = '%s'", payload, payload, l.JobKey), "")
}

// walReceiver is the PID of the standby's WAL receiver.
func (e *confirmEnv) walReceiver(t *testing.T) int {
	t.Helper()
	conn, err := e.c.Replica.Connect(ctxT(t), "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var pid int
	if err := conn.QueryRow(ctxT(t), "select pid from pg_stat_wal_receiver where status = 'streaming'").Scan(&pid); err != nil {
		t.Fatalf("the standby's WAL receiver: %v", err)
	}
	return pid
}

// sentLSN is how far the primary has sent WAL to its standby.
func (e *confirmEnv) sentLSN(t *testing.T) string {
	t.Helper()
	var lsn string
	if err := e.adm.QueryRow(ctxT(t), "select coalesce(max(sent_lsn)::text, '') from pg_catalog.pg_stat_get_wal_senders()").Scan(&lsn); err != nil {
		t.Fatal(err)
	}
	return lsn
}

func (e *confirmEnv) payload(t *testing.T, job string) string {
	t.Helper()
	var p string
	if err := e.adm.QueryRow(ctxT(t), "select coalesce((select payload from results where job_key = $1), '')", job).Scan(&p); err != nil {
		t.Fatal(err)
	}
	return p
}

func (e *confirmEnv) confirmed(t *testing.T, l fence.Lease) bool {
	t.Helper()
	var ok bool
	if err := e.adm.QueryRow(ctxT(t), "select exists (select 1 from fence.confirmed_takeovers where job_key = $1 and epoch = $2 and token = $3)", l.JobKey, l.Epoch, l.Token).Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}

// attach gives the replica its primary_conninfo again; its WAL receiver
// starts within wal_retrieve_retry_interval.
func (e *confirmEnv) attach(t *testing.T) {
	t.Helper()
	ctx := ctxT(t)
	rc := e.c.Replica.MustConnect(t, "postgres")
	if _, err := rc.Exec(ctx, "alter system set primary_conninfo = "+quoteLiteral(e.conninfo)); err != nil {
		t.Fatal(err)
	}
	if _, err := rc.Exec(ctx, "select pg_reload_conf()"); err != nil {
		t.Fatal(err)
	}
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
