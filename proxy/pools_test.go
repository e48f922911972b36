package proxy

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/pool"
)

// TestServerConnectionLimits: default_pool_size, max_db_connections,
// max_user_connections and query_wait_timeout (package pool) against real
// PostgreSQL, session mode: a client over a limit waits, after it has
// authenticated, until a session of its pool ends; PostgreSQL never has
// more of the pool's backends than the limit; a client that waits
// query_wait_timeout gets 53300 naming the limit; SHOW POOLS shows the
// waiting client; a reload applies to a client already waiting.
func TestServerConnectionLimits(t *testing.T) {
	ctx := ctxT(t)
	db := cluster.NewDatabase(t)
	obs, err := cluster.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer obs.Close(context.Background())
	for _, r := range []string{"pool_u1", "pool_u2"} {
		obs.Exec(ctx, "CREATE ROLE "+r+" LOGIN") // the roles are the cluster's: made once
	}
	cfg := withConsole(Config{PoolSize: 2, QueryWaitTimeout: time.Minute,
		Primary: cluster.Primary.DSN("postgres"), Auth: AuthTrust, Poller: testPoller}) // whole: Reload takes it
	p := startProxy(t, cfg)
	adm := mustConsole(t, p, "admin")
	dsn := func(user string) string {
		return fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable&application_name=pooltest", user, p.addr.Port, db)
	}
	connect := func(user string) (*pgconn.PgConn, error) { return pgconn.Connect(ctxT(t), dsn(user)) }
	mustConnect := func(user string) *pgconn.PgConn {
		t.Helper()
		c, err := connect(user)
		if err != nil {
			t.Fatalf("connect as %s: %v", user, err)
		}
		return c
	}
	// backends counts the pool's backends PostgreSQL has (the clients'
	// application_name is pooltest).
	backends := func(user string) int {
		t.Helper()
		var n int
		if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND usename = $2 AND application_name = 'pooltest'", db, user).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// waitingFor waits until n clients of user wait for a server
	// connection (the proxy's own count: observation, not a sleep).
	waitingFor := func(user string, n int) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			got := 0
			for _, s := range p.srv.pools.Stats() {
				if s.Key == (pool.Key{Database: db, User: user}) {
					got = s.Waiting
				}
			}
			if got == n {
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Fatalf("%d clients of %s never waited: %+v", n, user, p.srv.pools.Stats())
	}
	type result struct {
		c   *pgconn.PgConn
		err error
	}
	connectAsync := func(user string) chan result {
		ch := make(chan result, 1)
		go func() { c, err := connect(user); ch <- result{c, err} }()
		return ch
	}

	t.Run("default_pool_size", func(t *testing.T) {
		a, b := mustConnect("pool_u1"), mustConnect("pool_u1")
		third := connectAsync("pool_u1")
		waitingFor("pool_u1", 1)
		if n := backends("pool_u1"); n != 2 {
			t.Fatalf("PostgreSQL has %d backends of the pool, want default_pool_size 2", n)
		}
		var row map[string]string
		for _, r := range table(t, adm, "SHOW POOLS") {
			if r["database"] == db && r["user"] == "pool_u1" {
				row = r
			}
		}
		if row == nil || row["cl_waiting"] != "1" || row["sv_active"] != "2" || (row["maxwait"] == "0" && row["maxwait_us"] == "0") {
			t.Fatalf("SHOW POOLS while a client waits: %v", row)
		}
		for _, r := range table(t, adm, "SHOW DATABASES") {
			if r["name"] == db && r["pool_size"] != "2" {
				t.Fatalf("SHOW DATABASES pool_size %q, want default_pool_size 2", r["pool_size"])
			}
		}
		// Another user's pool is not held back.
		mustConnect("pool_u2").Close(ctx)
		a.Close(ctx)
		r := <-third
		if r.err != nil {
			t.Fatalf("the waiting client, after a session ended: %v", r.err)
		}
		if err := r.c.Exec(ctx, "SELECT 1").Close(); err != nil {
			t.Fatal(err)
		}
		if n := backends("pool_u1"); n > 2 {
			t.Fatalf("PostgreSQL has %d backends of the pool, over default_pool_size 2", n)
		}
		r.c.Close(ctx)
		b.Close(ctx)
	})

	t.Run("query_wait_timeout", func(t *testing.T) {
		next := cfg
		next.QueryWaitTimeout = 200 * time.Millisecond
		if _, err := p.srv.Reload(next); err != nil {
			t.Fatal(err)
		}
		a, b := mustConnect("pool_u1"), mustConnect("pool_u1")
		defer a.Close(ctx)
		defer b.Close(ctx)
		start := time.Now()
		_, err := connect("pool_u1")
		if got := pgtest.SQLState(err); got != "53300" || !strings.Contains(err.Error(), "default_pool_size") || !strings.Contains(err.Error(), "query_wait_timeout") {
			t.Fatalf("a client over default_pool_size after query_wait_timeout: %v (SQLSTATE %q), want 53300 naming both", err, got)
		}
		if time.Since(start) < 200*time.Millisecond {
			t.Fatalf("refused after %v, before query_wait_timeout", time.Since(start))
		}
		if p.srv.pools.Totals().Timeouts == 0 {
			t.Fatal("the timeout is not counted")
		}
		if _, err := p.srv.Reload(cfg); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("reload_lets_a_waiting_client_in", func(t *testing.T) {
		a, b := mustConnect("pool_u1"), mustConnect("pool_u1")
		defer a.Close(ctx)
		defer b.Close(ctx)
		third := connectAsync("pool_u1")
		waitingFor("pool_u1", 1)
		next := cfg
		next.PoolSize = 3
		rep, err := p.srv.Reload(next)
		if err != nil || !strings.Contains(strings.Join(rep.Applied, " "), "default_pool_size") {
			t.Fatalf("reload: %v %+v", err, rep)
		}
		// The reload alone lets it in (round 25, BC-L1: it waited for
		// the next session's end, and timed out without one).
		r := <-third
		if r.err != nil {
			t.Fatalf("the waiting client after the pool grew: %v", r.err)
		}
		r.c.Close(ctx)
		if _, err := p.srv.Reload(cfg); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("disable_applies_to_a_waiting_client", func(t *testing.T) {
		a, b := mustConnect("pool_u1"), mustConnect("pool_u1")
		defer b.Close(ctx)
		third := connectAsync("pool_u1")
		waitingFor("pool_u1", 1)
		if _, err := adm.Exec(ctx, "DISABLE "+db); err != nil {
			t.Fatal(err)
		}
		defer adm.Exec(ctx, "ENABLE "+db)
		a.Close(ctx)
		if r := <-third; r.err == nil {
			r.c.Close(ctx)
			t.Fatal("a client that waited through DISABLE got a session")
		}
	})

	t.Run("console_set_lets_a_waiting_client_in", func(t *testing.T) {
		a, b := mustConnect("pool_u1"), mustConnect("pool_u1")
		defer a.Close(ctx)
		defer b.Close(ctx)
		third := connectAsync("pool_u1")
		waitingFor("pool_u1", 1)
		if _, err := adm.Exec(ctx, "SET default_pool_size = 3"); err != nil {
			t.Fatal(err)
		}
		r := <-third
		if r.err != nil {
			t.Fatalf("the waiting client after SET default_pool_size: %v", r.err)
		}
		r.c.Close(ctx)
		found := false
		for _, row := range table(t, adm, "SHOW CONFIG") {
			if row["key"] == "default_pool_size" {
				found = row["value"] == "3"
			}
		}
		if !found {
			t.Fatalf("SHOW CONFIG has no default_pool_size 3: %v", table(t, adm, "SHOW CONFIG"))
		}
		if _, err := adm.Exec(ctx, "SET default_pool_size = -1"); err == nil {
			t.Fatal("SET default_pool_size = -1 accepted")
		}
		if _, err := p.srv.Reload(cfg); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("max_db_and_user_connections", func(t *testing.T) {
		next := cfg
		next.PoolSize, next.MaxDBConnections = 0, 2
		if _, err := p.srv.Reload(next); err != nil {
			t.Fatal(err)
		}
		a, b := mustConnect("pool_u1"), mustConnect("pool_u2")
		third := connectAsync("pool_u2") // the database is full, whoever asks
		waitingFor("pool_u2", 1)
		a.Close(ctx)
		if r := <-third; r.err != nil {
			t.Fatalf("max_db_connections: %v", r.err)
		} else {
			r.c.Close(ctx)
		}
		b.Close(ctx)

		next.MaxDBConnections, next.MaxUserConnections = 0, 1
		if _, err := p.srv.Reload(next); err != nil {
			t.Fatal(err)
		}
		a = mustConnect("pool_u1")
		b = mustConnect("pool_u2") // another user
		fourth := connectAsync("pool_u1")
		waitingFor("pool_u1", 1)
		a.Close(ctx)
		if r := <-fourth; r.err != nil {
			t.Fatalf("max_user_connections: %v", r.err)
		} else {
			r.c.Close(ctx)
		}
		b.Close(ctx)
		if _, err := p.srv.Reload(cfg); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("shutdown_ends_a_wait", func(t *testing.T) {
		q := startProxy(t, Config{PoolSize: 1})
		c, err := pgconn.Connect(ctx, q.dsn(db))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(ctx)
		ch := make(chan error, 1)
		go func() {
			c2, err := pgconn.Connect(ctxT(t), q.dsn(db))
			if err == nil {
				c2.Close(context.Background())
			}
			ch <- err
		}()
		deadline := time.Now().Add(10 * time.Second)
		for len(q.srv.pools.Stats()) == 0 || q.srv.pools.Stats()[0].Waiting != 1 {
			if time.Now().After(deadline) {
				t.Fatal("the second client never waited")
			}
			time.Sleep(5 * time.Millisecond)
		}
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		go q.srv.Shutdown(sctx)
		if err := <-ch; err == nil {
			t.Fatal("a client waiting through a shutdown got in")
		}
	})
}

// TestServerReuse: server_reuse (pools.go) against real PostgreSQL. A
// gated session whose client leaves with Terminate, idle, leaves its
// backend, reset with DISCARD ALL, to the next client with exactly the
// same database, user and startup parameters: that client gets the same
// backend (a warm one) and none of what the first one left on it
// (settings, fence metadata, prepared statements, temporary tables,
// advisory locks, LISTEN). A backend left in a transaction, or killed
// while parked, is never handed on; a client with other startup
// parameters gets another backend, the parked one closed when the pool
// needs its place; server_idle_timeout closes it; Shutdown too.
func TestServerReuse(t *testing.T) {
	ctx := ctxT(t)
	db := cluster.NewDatabase(t)
	obs, err := cluster.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer obs.Close(context.Background())
	obs.Exec(ctx, "CREATE ROLE reuse_u LOGIN") // the roles are the cluster's: made once
	p := startProxy(t, withConsole(Config{PoolSize: 2, ServerReuse: true, ServerIdleTimeout: time.Hour, Interceptor: newGate(t)}))
	adm := mustConsole(t, p, "admin")
	dsn := func(app string) string {
		return fmt.Sprintf("postgres://reuse_u@127.0.0.1:%d/%s?sslmode=disable&application_name=%s", p.addr.Port, db, app)
	}
	connect := func(app string) *pgconn.PgConn {
		t.Helper()
		c, err := pgconn.Connect(ctxT(t), dsn(app))
		if err != nil {
			t.Fatalf("connect (%s): %v", app, err)
		}
		return c
	}
	value := func(c *pgconn.PgConn, q string) string {
		t.Helper()
		res := c.ExecParams(ctxT(t), q, nil, nil, nil, nil).Read()
		if res.Err != nil {
			t.Fatalf("%s: %v", q, res.Err)
		}
		if len(res.Rows) != 1 {
			t.Fatalf("%s: %d rows", q, len(res.Rows))
		}
		return string(res.Rows[0][0])
	}
	exec := func(c *pgconn.PgConn, q string) {
		t.Helper()
		if _, err := c.Exec(ctxT(t), q).ReadAll(); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	// parked waits until the pool has n backends parked (observation).
	parked := func(n int) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			idle := 0
			for _, s := range p.srv.pools.Stats() {
				idle += s.Idle
			}
			if idle == n {
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Fatalf("never %d backends parked: %+v", n, p.srv.pools.Stats())
	}
	// gone waits until PostgreSQL has no backend pid (observation).
	gone := func(pid string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			var n int
			if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1::int", pid).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n == 0 {
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Fatalf("backend %s still there", pid)
	}
	backends := func() int {
		t.Helper()
		var n int
		if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND usename = 'reuse_u'", db).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	a := connect("reuse")
	pidA := value(a, "SELECT pg_backend_pid()::text")
	exec(a, `SET search_path = pg_catalog; SET statement_timeout = '7s'; SET fence.job_key = 'a-job';
SELECT set_config('fence.step', 'a-step', false); PREPARE a_stmt AS SELECT 1; CREATE TEMP TABLE a_tmp (x int);
SELECT pg_advisory_lock(4242); LISTEN a_channel; DECLARE a_cur CURSOR WITH HOLD FOR SELECT 1`)
	if err := a.Close(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	parked(1)

	t.Run("warm_backend_reset", func(t *testing.T) {
		b := connect("reuse")
		defer b.Close(context.Background())
		if pid := value(b, "SELECT pg_backend_pid()::text"); pid != pidA {
			t.Fatalf("B is on backend %s, want A's parked %s", pid, pidA)
		}
		if got := b.ParameterStatus("application_name"); got != "reuse" {
			t.Fatalf("B's application_name ParameterStatus %q", got)
		}
		for q, want := range map[string]string{
			"SHOW search_path":       `"$user", public`,
			"SHOW statement_timeout": "0",
			"SELECT coalesce(current_setting('fence.job_key', true), '')":                                "",
			"SELECT coalesce(current_setting('fence.step', true), '')":                                   "",
			"SELECT count(*)::text FROM pg_prepared_statements":                                          "0",
			"SELECT count(*)::text FROM pg_cursors WHERE name = 'a_cur'":                                 "0",
			"SELECT coalesce(to_regclass('pg_temp.a_tmp')::text, '')":                                    "",
			"SELECT count(*)::text FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()": "0",
			"SELECT count(*)::text FROM pg_listening_channels()":                                         "0",
		} {
			if got := value(b, q); got != want {
				t.Errorf("%s on the reused backend: %q, want %q", q, got, want)
			}
		}
	})
	parked(1)

	t.Run("other_startup_parameters_get_another_backend", func(t *testing.T) {
		c := connect("reuse-other")
		defer c.Close(context.Background())
		if pid := value(c, "SELECT pg_backend_pid()::text"); pid == pidA {
			t.Fatal("a client with another application_name got the parked backend")
		}
		// The pool is full (the parked backend and C's): D, with other
		// parameters again, gets the parked one's place, which is closed.
		d := connect("reuse-third")
		defer d.Close(context.Background())
		gone(pidA)
		if n := backends(); n > 2 {
			t.Fatalf("%d backends for a pool of 2", n)
		}
	})
	parked(2) // C's and D's

	t.Run("left_in_a_transaction_is_not_reused", func(t *testing.T) {
		p.srv.pools.CloseIdle()
		e := connect("reuse-tx")
		pid := value(e, "SELECT pg_backend_pid()::text")
		exec(e, "BEGIN; SELECT 1")
		e.Close(ctxT(t))
		gone(pid)
		parked(0)
	})

	t.Run("killed_while_parked", func(t *testing.T) {
		f := connect("reuse-kill")
		pid := value(f, "SELECT pg_backend_pid()::text")
		f.Close(ctxT(t))
		parked(1)
		if _, err := obs.Exec(ctx, "SELECT pg_terminate_backend($1::int)", pid); err != nil {
			t.Fatal(err)
		}
		gone(pid)
		g := connect("reuse-kill")
		defer g.Close(context.Background())
		if got := value(g, "SELECT pg_backend_pid()::text"); got == pid {
			t.Fatal("got the killed backend")
		}
		if got := value(g, "SELECT 42::text"); got != "42" {
			t.Fatalf("a fresh backend instead of the killed one answered %q", got)
		}
	})
	parked(1)

	// Round 28, BK-H1: a client handed a backend parked before its role
	// lost CONNECT got a session PostgreSQL now refuses.
	t.Run("revoke_connect", func(t *testing.T) {
		f := connect("reuse-revoke")
		f.Close(ctxT(t))
		parked(2)
		if _, err := obs.Exec(ctx, "REVOKE CONNECT ON DATABASE "+db+" FROM PUBLIC"); err != nil {
			t.Fatal(err)
		}
		_, err := pgconn.Connect(ctxT(t), dsn("reuse-revoke"))
		if _, gerr := obs.Exec(ctx, "GRANT CONNECT ON DATABASE "+db+" TO PUBLIC"); gerr != nil {
			t.Fatal(gerr)
		}
		if got := pgtest.SQLState(err); got != "42501" {
			t.Fatalf("a client whose role lost CONNECT, with a backend parked for it: %v (SQLSTATE %q), want PostgreSQL's 42501", err, got)
		}
		parked(1)
	})

	// Round 28, BK-H3: a role renamed, and a new one made with its name,
	// was handed the old role's parked backend.
	t.Run("role_renamed", func(t *testing.T) {
		obs.Exec(ctx, "CREATE ROLE reuse_r LOGIN")
		r := fmt.Sprintf("postgres://reuse_r@127.0.0.1:%d/%s?sslmode=disable&application_name=reuse-r", p.addr.Port, db)
		c1, err := pgconn.Connect(ctxT(t), r)
		if err != nil {
			t.Fatal(err)
		}
		c1.Close(ctxT(t))
		parked(2)
		if _, err := obs.Exec(ctx, "ALTER ROLE reuse_r RENAME TO reuse_r_old; CREATE ROLE reuse_r LOGIN"); err != nil {
			t.Fatal(err)
		}
		defer obs.Exec(context.Background(), "DROP ROLE reuse_r; ALTER ROLE reuse_r_old RENAME TO reuse_r")
		c2, err := pgconn.Connect(ctxT(t), r)
		if err != nil {
			t.Fatal(err)
		}
		defer c2.Close(context.Background())
		if got := value(c2, "SELECT session_user::text"); got != "reuse_r" {
			t.Fatalf("the new role reuse_r runs as %q", got)
		}
		parked(1)
	})

	// The check names the client's role in a literal: a name with a
	// quote and a backslash still gets its own parked backend.
	t.Run("quoted_role_name", func(t *testing.T) {
		obs.Exec(ctx, `CREATE ROLE "reuse'q\" LOGIN`)
		r := fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable&application_name=reuse-q", url.PathEscape(`reuse'q\`), p.addr.Port, db)
		c1, err := pgconn.Connect(ctxT(t), r)
		if err != nil {
			t.Fatal(err)
		}
		pid := value(c1, "SELECT pg_backend_pid()::text")
		c1.Close(ctxT(t))
		parked(3)
		c2, err := pgconn.Connect(ctxT(t), r)
		if err != nil {
			t.Fatal(err)
		}
		if got := value(c2, "SELECT pg_backend_pid()::text"); got != pid {
			t.Fatalf("the role %q got backend %s, want its parked %s", `reuse'q\`, got, pid)
		}
		c2.Close(ctxT(t))
		parked(3)
	})

	// A superuser's backend is never handed on (round 28, BK-H2: it
	// keeps, past DISCARD ALL, that its user was one), and RECONNECT
	// closes the parked ones (BK-M1).
	t.Run("superuser_and_reconnect", func(t *testing.T) {
		su, err := pgconn.Connect(ctxT(t), fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable&application_name=reuse-su", p.addr.Port, db))
		if err != nil {
			t.Fatal(err)
		}
		pid := value(su, "SELECT pg_backend_pid()::text")
		su.Close(ctxT(t))
		gone(pid)
		parked(3) // reuse_u's, the new reuse_r's and reuse'q\'s
		if _, err := adm.Exec(ctx, "RECONNECT "+db); err != nil {
			t.Fatal(err)
		}
		parked(0)
		f := connect("reuse-after-reconnect")
		f.Close(ctxT(t))
		parked(1)
	})

	t.Run("server_idle_timeout", func(t *testing.T) {
		old := p.srv.live()
		nl := *old
		nl.poolLimits.IdleTimeout = time.Millisecond
		p.srv.ops.live.Store(&nl)
		defer p.srv.ops.live.Store(old)
		parked(0) // the expiry runs every second
	})

	t.Run("off", func(t *testing.T) {
		old := p.srv.live()
		nl := *old
		nl.serverReuse = false
		p.srv.ops.live.Store(&nl)
		defer p.srv.ops.live.Store(old)
		h := connect("reuse-off")
		pid := value(h, "SELECT pg_backend_pid()::text")
		h.Close(ctxT(t))
		gone(pid)
		parked(0)
	})

	t.Run("shutdown_closes_parked", func(t *testing.T) {
		i := connect("reuse-shut")
		pid := value(i, "SELECT pg_backend_pid()::text")
		i.Close(ctxT(t))
		parked(1)
		sctx, cancel := context.WithTimeout(ctxT(t), 10*time.Second)
		defer cancel()
		if err := p.srv.Shutdown(sctx); err != nil {
			t.Fatal(err)
		}
		gone(pid)
	})
}
