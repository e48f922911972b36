package proxy

import (
	"context"
	"fmt"
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
		// The next decision applies it: the end of another pool's session.
		mustConnect("pool_u2").Close(ctx)
		r := <-third
		if r.err != nil {
			t.Fatalf("the waiting client after the pool grew: %v", r.err)
		}
		r.c.Close(ctx)
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
