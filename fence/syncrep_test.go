package fence_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestSyncRepCancelNotAcknowledged (round 11, attacker U's H1): in
// failover_mode sync, a lease function whose commit's wait for the
// synchronous standby was cancelled (pg_cancel_backend by another session
// of the same role; PostgreSQL answers success with a WARNING) fails with
// FN016 on a connection whose configuration fence.WatchSyncRep set up,
// and on a pool whose connections it set up: the standby did not confirm
// it, so a failover may lose it. The standby's WAL receiver is stopped
// after the set-up, so every commit waits until it is cancelled.
func TestSyncRepCancelNotAcknowledged(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, map[string]string{"synchronous_standby_names": "'*'"})
	ctx := ctxT(t)
	if _, err := e.connect("", nil).Exec(ctx, "select fence.set_failover_mode('sync')"); err != nil {
		t.Fatal(err)
	}
	held := e.acquire("wa", "sc_renew")
	if err := e.c.DetachReplica(ctx); err != nil {
		t.Fatal(err)
	}
	killer := e.connect("wa", nil)
	watched := func(app string) *pgx.ConnConfig {
		cfg, err := pgx.ParseConfig(e.c.Primary.DSN(e.db))
		if err != nil {
			t.Fatal(err)
		}
		cfg.User = "wa"
		cfg.RuntimeParams["application_name"] = app
		fence.WatchSyncRep(&cfg.Config)
		return cfg
	}
	conn := func(app string) *pgx.Conn {
		c, err := pgx.ConnectConfig(ctx, watched(app))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close(context.Background()) })
		return c
	}
	pool := func(app string) *pgxpool.Pool {
		pc, err := pgxpool.ParseConfig("")
		if err != nil {
			t.Fatal(err)
		}
		pc.ConnConfig = watched(app)
		p, err := pgxpool.NewWithConfig(ctx, pc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p
	}
	// cancelled runs f, cancels its commit's wait for the standby once
	// its backend waits there, and returns f's error.
	cancelled := func(app string, f func() error) error {
		done := make(chan error, 1)
		go func() { done <- f() }()
		err := pgtest.Poll(ctx, func() (bool, error) {
			var n int
			err := killer.QueryRow(ctx, "select count(pg_cancel_backend(pid)) from pg_stat_activity where application_name = $1 and wait_event = 'SyncRep'", app).Scan(&n)
			return n > 0, err
		})
		if err != nil {
			t.Fatalf("%s: waiting for the commit to wait for the standby: %v", app, err)
		}
		return <-done
	}
	for _, c := range []struct {
		name string
		f    func(app string) error
	}{
		{"acquire", func(app string) error {
			_, err := fence.Acquire(ctx, conn(app), "sc_acquire", "h", time.Minute)
			return err
		}},
		{"acquire_pool", func(app string) error {
			_, err := fence.Acquire(ctx, pool(app), "sc_pool", "h", time.Minute)
			return err
		}},
		{"renew", func(app string) error {
			_, err := fence.Renew(ctx, conn(app), held.JobKey, held.Token, time.Minute)
			return err
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			app := "sc_" + c.name
			if err := cancelled(app, func() error { return c.f(app) }); fence.Code(err) != fence.CodeUnconfirmed {
				t.Fatalf("%s with its wait for the standby cancelled: %v, want %s", c.name, err, fence.CodeUnconfirmed)
			}
		})
	}
}
