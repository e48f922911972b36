package proxy

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/rewrite"
)

// TestFailoverFollow (issue 31, item 3): a proxy whose primary DSN lists
// both nodes (target_session_attrs=read-write) follows a promotion
// without a restart. Sessions that were on the old primary end with an
// error that has a SQLSTATE, and a gated transaction open then commits
// nothing; new sessions reach the new primary; the gate's control
// connections reconnect there: the catalog watcher (a table protected
// after the failover is gated; a takeover after it is seen on
// pgfence_takeover) and the watchdog (a gated transaction left idle after
// the failover is ended with FN012).
func TestFailoverFollow(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := pgtest.Start(ctx, pgtest.Options{Replica: true})
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	db, err := c.CreateDatabase(ctx, "follow")
	if err != nil {
		t.Fatal(err)
	}
	old, err := c.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close(context.Background())
	if err := migrations.Apply(ctx, old); err != nil {
		t.Fatal(err)
	}
	if _, err := old.Exec(ctx, `
create role fw login; create role fw2 login; grant pgfence_worker to fw, fw2;
create table results (job_key text primary key, payload text not null, token bigint not null);
create table later (job_key text primary key, payload text not null);
grant select, insert, update on results, later to fw, fw2;
select fence.protect('results');`); err != nil {
		t.Fatal(err)
	}
	oldPort, newPort := c.Primary.Port, c.Replica.Port
	dsn := fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%d,%d user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write", oldPort, newPort)
	const idle = 3 * time.Second
	gate, err := NewFence(FenceConfig{Primary: dsn, GateIdleTimeout: idle}, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(gate.Close)
	p := startProxy(t, Config{Primary: dsn, Interceptor: gate})
	session := func(role string, l *fence.Lease) *pgconn.PgConn {
		t.Helper()
		cfg, err := pgconn.ParseConfig(fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", role, p.addr, db))
		if err != nil {
			t.Fatal(err)
		}
		if l != nil {
			cfg.RuntimeParams["options"] = pgoptions(*l)
		}
		return connectConfig(t, cfg)
	}
	acquire := func(role, job string) fence.Lease {
		t.Helper()
		cfg, err := pgx.ParseConfig(fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", role, p.addr, db))
		if err != nil {
			t.Fatal(err)
		}
		l, err := fence.Acquire(ctxT(t), connectPgx(t, cfg), job, role, time.Minute)
		if err != nil {
			t.Fatalf("acquire %s as %s through the proxy: %v", job, role, err)
		}
		return l
	}
	wantPort := func(conn *pgconn.PgConn, port int) {
		t.Helper()
		wantValue(t, conn, "select inet_server_port()::text || ' ' || pg_is_in_recovery()::text", fmt.Sprintf("%d false", port))
	}

	before := acquire("fw", "j")
	if err := c.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	idleSession := session("fw", nil)
	wantPort(idleSession, oldPort)
	// A gated transaction open when the primary dies: written, not
	// committed.
	open := session("fw", &before)
	mustExec(t, open, "set fence.step = 'open'; begin; insert into results values ('j', 'open', 0)")
	if err := c.Failover(ctx); err != nil {
		t.Fatal(err)
	}
	admin, err := c.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())

	t.Run("old_sessions_end_with_an_error", func(t *testing.T) {
		for _, s := range []struct {
			name string
			conn *pgconn.PgConn
			sql  string
		}{{"open_gated_transaction", open, "commit"}, {"idle", idleSession, "select 1"}} {
			_, err := s.conn.Exec(ctxT(t), s.sql).ReadAll()
			if pgtest.SQLState(err) != "08006" || !strings.Contains(err.Error(), "connection to PostgreSQL was lost") {
				t.Errorf("%s: %s after the failover: %v, want the proxy's 08006 (connection lost)", s.name, s.sql, err)
			}
		}
		var n int
		if err := admin.QueryRow(ctxT(t), "select count(*) from results where payload = 'open'").Scan(&n); err != nil || n != 0 {
			t.Fatalf("the open gated transaction's row on the new primary: %d (%v), want none", n, err)
		}
	})
	t.Run("new_sessions_reach_the_new_primary", func(t *testing.T) {
		wantPort(session("fw", nil), newPort)
	})
	// Every generation from before is void (asynchronous failover mode);
	// a new acquire through the proxy works.
	l := acquire("fw", "j")
	t.Run("generation_from_before", func(t *testing.T) {
		_, err := session("fw", &before).Exec(ctxT(t), "set fence.step = 'late'; update results set payload = 'late'").ReadAll()
		wantCode(t, err, fence.CodeFailover)
	})
	t.Run("catalog_watcher", func(t *testing.T) {
		cat := catalogOf(t, gate, db)
		if _, err := admin.Exec(ctxT(t), "select fence.protect('later')"); err != nil {
			t.Fatal(err)
		}
		pollFind(t, "table later protected in the proxy's catalog", func() (bool, bool) {
			ok := cat.prot.Load().Matches(rewrite.RelName{Schema: "public", Name: "later"}, nil)
			return ok, ok
		})
		gated := gate.Stats.Gated.Load()
		mustExec(t, session("fw", &l), "set fence.step = 'later'; insert into later values ('j', 'after')")
		if gate.Stats.Gated.Load() == gated {
			t.Fatal("a write to a table protected after the failover was not gated by the proxy")
		}
		var version string
		if err := admin.QueryRow(ctxT(t), "select digest_version from fence.receipts where token = $1 and step = 'later'", l.Token).Scan(&version); err != nil || version != fence.DigestVersion {
			t.Fatalf("receipt of the write: %q (%v), want the proxy's commit step's (%s)", version, err, fence.DigestVersion)
		}
	})
	t.Run("takeover_listener", func(t *testing.T) {
		cat := catalogOf(t, gate, db)
		if _, err := admin.Exec(ctxT(t), "update fence.leases set expires_at = clock_timestamp() - interval '1 second' where job_key = 'j'"); err != nil {
			t.Fatal(err)
		}
		// Taken over directly: only pgfence_takeover tells the proxy.
		cfg, err := pgx.ParseConfig(c.Primary.DSN(db))
		if err != nil {
			t.Fatal(err)
		}
		cfg.User = "fw2"
		l2, err := fence.Acquire(ctxT(t), connectPgx(t, cfg), "j", "fw2", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		pollFind(t, "the takeover in the watcher's tracker", func() (bool, bool) {
			tk, ok := cat.tk.lookup("j")
			ok = ok && tk.token == l2.Token
			return ok, ok
		})
	})
	t.Run("watchdog", func(t *testing.T) {
		l3 := acquire("fw", "w")
		s := session("fw", &l3)
		mustExec(t, s, "set fence.step = 'w'; begin; insert into results values ('w', 'idle', 0)")
		pid := lastValue(t, s, "select pg_backend_pid()::text")
		// Silent past the bound: the watchdog ends the backend on its
		// control connection to the new primary, and tells the client.
		pollFind(t, "the idle gated transaction's backend ended", func() (bool, bool) {
			var n int
			if err := admin.QueryRow(ctxT(t), "select count(*) from pg_stat_activity where pid = $1::text::int", pid).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n == 0, n == 0
		})
		_, err := s.Exec(ctxT(t), "select 1").ReadAll()
		wantCode(t, err, fence.CodeGateTimeout)
		// Its control connection, opened after the failover, is on the
		// new primary (it ends the backend after ending the session: observe).
		pollFind(t, "the watchdog's control connection on the new primary", func() (bool, bool) {
			var n int
			if err := admin.QueryRow(ctxT(t), "select count(*) from pg_stat_activity where application_name = $1", watchdogAppName).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n == 1, n == 1
		})
	})
}
