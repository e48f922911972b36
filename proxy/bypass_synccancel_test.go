package proxy

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

func init() { registerBypass("synccancel", bypassSyncCancel) }

// bypassSyncCancel (round 11, attacker U's H1): in failover_mode sync a
// takeover is acknowledged only once the synchronous standby has it. A
// cancel ends a commit's wait for the standby (the client's own
// CancelRequest, a driver's timeout, pg_cancel_backend by any session of
// the same role): the commit stands on the primary, and PostgreSQL
// answers success with only a WARNING ("canceling wait for synchronous
// replication due to user request"). A failover then loses the takeover
// while the era is lossless, and the previous holder commits. Through the
// proxy such a commit must not be an acknowledgement: the client gets
// FN016 for the statement (or transaction) that committed, then
// ReadyForQuery, in the simple and the extended protocol, and its
// connection goes on.
//
// The class has a cluster of its own: a primary with a streaming replica
// as its synchronous standby (synchronous_standby_names '*'), and
// failover_mode sync. The set-up runs while the standby confirms; then
// its WAL receiver is stopped, so every commit that waits for it waits
// until cancelled (each case sees its backend in wait_event SyncRep in
// pg_stat_activity, then cancels it from another session of the same
// role, or by the client's own CancelRequest).
func bypassSyncCancel(t *testing.T) {
	e := newSyncCancelEnv(t)
	const want = fence.CodeUnconfirmed
	acquire := func(job string) string {
		return fmt.Sprintf("select epoch, token from fence.acquire('%s', 'h', '1 minute')", job)
	}
	// Each case runs on a connection of its own with application_name
	// app (how the canceller finds its backend), and returns the error
	// the client was given.
	type syncCase struct {
		name string
		run  func(t *testing.T, route, app string) error
	}
	simple := func(sql string, l *fence.Lease) func(t *testing.T, route, app string) error {
		return func(t *testing.T, route, app string) error {
			conn := e.connect(t, route, app, l)
			done := make(chan error, 1)
			go func() { done <- castExec(context.Background(), conn, sql, "") }()
			e.cancelWait(t, app)
			err := <-done
			e.usable(t, conn)
			return err
		}
	}
	cases := []syncCase{
		{"simple_autocommit", simple(acquire("sc_simple"), nil)},
		{"simple_two_statements", simple(acquire("sc_two")+"; select 1", nil)},
		{"simple_transaction", simple("begin; "+acquire("sc_tx")+"; commit", nil)},
		{"renew", simple(fmt.Sprintf("select fence.renew('sc_renew', %d, '1 minute')", e.renew.Token), nil)},
		// A fenced write: the proxy commits its implicit transaction
		// itself (a hidden step); each route under a step of its own.
		{"gated_write", func(t *testing.T, route, app string) error {
			return simple("set fence.step = '"+app+"'; update results set payload = 'x' where job_key = 'sc_gated'", &e.gated)(t, route, app)
		}},
		{"commit_statement", func(t *testing.T, route, app string) error {
			conn := e.connect(t, route, app, nil)
			if err := castExec(ctxT(t), conn, "begin; "+acquire("sc_commit"), ""); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- castExec(context.Background(), conn, "commit", "") }()
			e.cancelWait(t, app)
			err := <-done
			e.usable(t, conn)
			return err
		}},
		{"extended_autocommit", func(t *testing.T, route, app string) error {
			conn := e.connectPgx(t, route, app)
			done := make(chan error, 1)
			go func() {
				var epoch, token int64
				done <- conn.QueryRow(context.Background(), "select epoch, token from fence.acquire($1, 'h', '1 minute')", "sc_ext").Scan(&epoch, &token)
			}()
			e.cancelWait(t, app)
			err := <-done
			e.usable(t, conn.PgConn())
			return err
		}},
		{"extended_transaction", func(t *testing.T, route, app string) error {
			conn := e.connectPgx(t, route, app)
			ctx := ctxT(t)
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := fence.Acquire(ctx, tx, "sc_exttx", "h", time.Minute); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- tx.Commit(context.Background()) }()
			e.cancelWait(t, app)
			err = <-done
			e.usable(t, conn.PgConn())
			return err
		}},
		{"batch", func(t *testing.T, route, app string) error {
			conn := e.connectPgx(t, route, app)
			done := make(chan error, 1)
			go func() {
				b := &pgx.Batch{}
				b.Queue("select epoch, token from fence.acquire($1, 'h', '1 minute')", "sc_batch")
				b.Queue("select 1")
				br := conn.SendBatch(context.Background(), b)
				var epoch, token int64
				err := br.QueryRow().Scan(&epoch, &token)
				var one int
				if err2 := br.QueryRow().Scan(&one); err == nil {
					err = err2
				}
				if err2 := br.Close(); err == nil {
					err = err2
				}
				done <- err
			}()
			e.cancelWait(t, app)
			err := <-done
			e.usable(t, conn.PgConn())
			return err
		}},
		// libpq (psql): the row is printed, then the error; psql exits 1.
		{"psql", func(t *testing.T, route, app string) error {
			host, port := e.c.Primary.Host, e.c.Primary.Port
			if route == "proxy" {
				host, port = e.proxy.addr.IP.String(), e.proxy.addr.Port
			}
			type result struct {
				stderr string
				err    error
			}
			done := make(chan result, 1)
			go func() {
				_, stderr, err := e.c.Client(host, port, "", "psql", "-X", "-v", "ON_ERROR_STOP=1", "-v", "VERBOSITY=verbose",
					"-d", fmt.Sprintf("dbname=%s user=sc_w application_name=%s", e.db, app), "-c", acquire("sc_psql"))
				done <- result{stderr, err}
			}()
			e.cancelWait(t, app)
			r := <-done
			if strings.Contains(r.stderr, "WARNING:  01000: canceling wait for synchronous replication") && strings.Contains(r.stderr, "LOCATION:  SyncRepWaitForLSN") {
				e.mu.Lock()
				e.notices[app] = append(e.notices[app], &pgconn.Notice{SeverityUnlocalized: "WARNING", Code: "01000", Routine: "SyncRepWaitForLSN",
					Message: "canceling wait for synchronous replication (psql)"})
				e.mu.Unlock()
			}
			if r.err == nil {
				return nil
			}
			if i := strings.Index(r.stderr, "ERROR:  "); i >= 0 && len(r.stderr) >= i+13 {
				return &pgconn.PgError{Code: r.stderr[i+8 : i+13], Message: r.stderr}
			}
			return fmt.Errorf("psql: %v: %s", r.err, r.stderr)
		}},
		// Round 12, attacker W's H1: client_min_messages = error kept the
		// WARNING off the wire, so nothing could turn it into FN016. The
		// lease functions raise it for their own transaction
		// (fence.durable, migration 026): a session SET, a set_config
		// by code, a role default any worker can give its own role.
		{"client_min_messages_set", simple("set client_min_messages = error; "+acquire("sc_cmm_set"), nil)},
		{"client_min_messages_set_config", simple("select pg_catalog.set_config('client_min_messages', 'error', false); "+acquire("sc_cmm_cfg"), nil)},
		{"client_min_messages_in_transaction", simple("begin; set local client_min_messages = error; "+acquire("sc_cmm_tx")+"; commit", nil)},
		{"client_min_messages_role_default", func(t *testing.T, route, app string) error {
			e.roleDefault(t, "client_min_messages", "error")
			return simple(acquire("sc_cmm_role"), nil)(t, route, app)
		}},
		// The client's own CancelRequest (a driver's query timeout).
		{"own_cancel_request", func(t *testing.T, route, app string) error {
			conn := e.connect(t, route, app, nil)
			done := make(chan error, 1)
			go func() { done <- castExec(context.Background(), conn, acquire("sc_own"), "") }()
			e.waitSyncRep(t, app)
			if err := conn.CancelRequest(ctxT(t)); err != nil {
				t.Fatal(err)
			}
			err := <-done
			e.usable(t, conn)
			return err
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, route := range castRoutes {
				t.Run(route, func(t *testing.T) {
					app := "sc_" + tc.name + "_" + route
					err := tc.run(t, route, app)
					if !e.warned(app) {
						t.Fatalf("no WARNING from SyncRepWaitForLSN reached the client (%s): the case did not cancel a wait for the standby", route)
					}
					if route == "direct" {
						// PostgreSQL's own answer, which a direct client
						// gets (docs/failover.md): success, with the
						// WARNING.
						if err != nil {
							t.Fatalf("directly: %v, want PostgreSQL's success with a WARNING", err)
						}
						return
					}
					if got := pgtest.SQLState(err); got != want {
						t.Fatalf("through the proxy: %v (SQLSTATE %q), want %s: a commit the synchronous standby did not confirm is no acknowledgement", err, got, want)
					}
				})
			}
		})
	}
}

type syncCancelEnv struct {
	c      *pgtest.Cluster
	db     string
	proxy  *testProxy
	renew  fence.Lease // sc_w's lease of job sc_renew, taken while the standby confirmed
	gated  fence.Lease // and of sc_gated
	killer *pgx.Conn   // a session of sc_w, the cases' role: the canceller

	mu      sync.Mutex
	notices map[string][]*pgconn.Notice // by application_name
}

// warned reports whether app's connection was sent PostgreSQL's WARNING
// that a commit's wait for the synchronous standby was cancelled, with
// what the proxy recognises it by (severity, SQLSTATE, routine).
func (e *syncCancelEnv) warned(app string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, n := range e.notices[app] {
		if n.SeverityUnlocalized == "WARNING" && n.Code == "01000" && n.Routine == "SyncRepWaitForLSN" &&
			strings.HasPrefix(n.Message, "canceling wait for synchronous replication") {
			return true
		}
	}
	return false
}

func newSyncCancelEnv(t *testing.T) *syncCancelEnv {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := pgtest.Start(ctx, pgtest.Options{Replica: true, Settings: map[string]string{"synchronous_standby_names": "'*'"}})
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	db, err := c.CreateDatabase(ctx, "synccancel")
	if err != nil {
		t.Fatal(err)
	}
	e := &syncCancelEnv{c: c, db: db, notices: map[string][]*pgconn.Notice{}}
	admin, err := c.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	if err := migrations.Apply(ctx, admin); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if _, err := admin.Exec(ctx, `
create role sc_w login; grant pgfence_worker to sc_w;
create table results (job_key text primary key, payload text not null, token bigint not null);
grant select, insert, update on results to sc_w;
insert into results values ('sc_gated', 'seed', 0);
select fence.protect('results');
select fence.set_failover_mode('sync');`); err != nil {
		t.Fatal(err)
	}
	w := e.connectPgx(t, "direct", "sc_setup")
	if e.renew, err = fence.Acquire(ctx, w, "sc_renew", "h", time.Hour); err != nil {
		t.Fatal(err)
	}
	if e.gated, err = fence.Acquire(ctx, w, "sc_gated", "h", time.Hour); err != nil {
		t.Fatal(err)
	}
	// The gated generation's first write, while the standby confirms: from
	// migration 027 on, a first write in failover_mode sync waits for the
	// standby to confirm the takeover (FN017 without it), and this case is
	// about the commit's own wait.
	if _, err := w.Exec(ctx, fmt.Sprintf(`begin;
select set_config('fence.job_key', 'sc_gated', true), set_config('fence.epoch', '%d', true),
       set_config('fence.token', '%d', true), set_config('fence.step', 'setup', true);
update results set payload = 'setup' where job_key = 'sc_gated';
commit`, e.gated.Epoch, e.gated.Token)); err != nil {
		t.Fatal(err)
	}
	// From now on nothing confirms a commit.
	if err := c.DetachReplica(ctx); err != nil {
		t.Fatal(err)
	}
	e.killer = e.connectPgx(t, "direct", "sc_killer")
	dsn := c.Primary.DSN("postgres")
	gate, err := NewFence(FenceConfig{Primary: dsn}, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(gate.Close)
	e.proxy = startProxy(t, Config{Primary: dsn, Interceptor: gate})
	return e
}

// roleDefault gives sc_w, the cases' role, a default setting for the
// connections it opens from now on, until the case ends (committed
// locally: nothing confirms a commit here).
func (e *syncCancelEnv) roleDefault(t *testing.T, name, value string) {
	t.Helper()
	ctx := ctxT(t)
	if _, err := e.killer.Exec(ctx, fmt.Sprintf("set synchronous_commit = local; alter role sc_w set %s = %s", name, value)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := e.killer.Exec(context.Background(), "set synchronous_commit = local; alter role sc_w reset "+name); err != nil {
			t.Error(err)
		}
	})
}

func (e *syncCancelEnv) connConfig(t *testing.T, route, app string, l *fence.Lease) *pgconn.Config {
	t.Helper()
	host := e.c.Primary.Addr()
	if route == "proxy" {
		host = e.proxy.addr.String()
	}
	cfg, err := pgconn.ParseConfig(fmt.Sprintf("postgres://sc_w@%s/%s?sslmode=disable&application_name=%s", host, e.db, url.QueryEscape(app)))
	if err != nil {
		t.Fatal(err)
	}
	if l != nil {
		cfg.RuntimeParams["options"] = pgoptions(*l)
	}
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.notices[app] = append(e.notices[app], n)
	}
	return cfg
}

func (e *syncCancelEnv) connect(t *testing.T, route, app string, l *fence.Lease) *pgconn.PgConn {
	t.Helper()
	return connectConfig(t, e.connConfig(t, route, app, l))
}

func (e *syncCancelEnv) connectPgx(t *testing.T, route, app string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig("")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Config = *e.connConfig(t, route, app, nil)
	return connectPgx(t, cfg)
}

// waitSyncRep returns once the backend of application_name app waits for
// the synchronous standby (its commit stands locally from then on).
func (e *syncCancelEnv) waitSyncRep(t *testing.T, app string) {
	t.Helper()
	ctx := ctxT(t)
	err := pgtest.Poll(ctx, func() (bool, error) {
		var n int
		err := e.killer.QueryRow(ctx, "select count(*) from pg_stat_activity where application_name = $1 and wait_event = 'SyncRep'", app).Scan(&n)
		return n > 0, err
	})
	if err != nil {
		t.Fatalf("waiting for %s's commit to wait for the standby: %v", app, err)
	}
}

// cancelWait waits for app's commit to wait for the standby, then cancels
// it with pg_cancel_backend from another session of the same role.
func (e *syncCancelEnv) cancelWait(t *testing.T, app string) {
	t.Helper()
	e.waitSyncRep(t, app)
	var ok bool
	if err := e.killer.QueryRow(ctxT(t), "select bool_and(pg_cancel_backend(pid)) from pg_stat_activity where application_name = $1 and wait_event = 'SyncRep'", app).Scan(&ok); err != nil || !ok {
		t.Fatalf("pg_cancel_backend of %s: %v %v", app, ok, err)
	}
}

// usable checks that conn answers a query after the case (it got its
// ReadyForQuery, and is idle).
func (e *syncCancelEnv) usable(t *testing.T, conn *pgconn.PgConn) {
	t.Helper()
	res, err := conn.Exec(ctxT(t), "select 'still here'").ReadAll()
	if err != nil || len(res) != 1 || len(res[0].Rows) != 1 || !strings.Contains(string(res[0].Rows[0][0]), "still here") {
		t.Fatalf("the connection after the case: %v %v", res, err)
	}
	if st := conn.TxStatus(); st != 'I' {
		t.Fatalf("the connection after the case is in transaction status %q, want idle", st)
	}
}
