package fence_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// syncRepBlocked runs f in a goroutine and returns once backend pid, the
// one f runs on, waits for the synchronous standby (pg_stat_activity's
// wait_event SyncRep, as conn sees it): its commit is not acknowledged
// before the standby has it. It fails t when f returns first (the commit
// was acknowledged without the standby) or no wait comes within a
// minute. f's error arrives on the channel once the standby is back.
func syncRepBlocked(t *testing.T, conn *pgx.Conn, pid uint32, what string, f func() error) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f() }()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := pgtest.Poll(ctx, func() (bool, error) {
		select {
		case err := <-done:
			return false, fmt.Errorf("it returned (error %v) without waiting for the synchronous standby", err)
		default:
		}
		var waiting bool
		err := conn.QueryRow(ctx, "select exists (select 1 from pg_stat_activity where pid = $1 and wait_event = 'SyncRep')", pid).Scan(&waiting)
		return waiting, err
	})
	if err != nil {
		t.Fatalf("%s with the synchronous standby stopped: %v", what, err)
	}
	return done
}

func backendPID(t *testing.T, conn *pgx.Conn) uint32 {
	t.Helper()
	var pid uint32
	if err := conn.QueryRow(ctxT(t), "select pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	return pid
}

// noStandbyOnNewPrimary clears synchronous_standby_names on a promoted
// primary that has no standby, as Patroni does.
func (e *failoverEnv) noStandbyOnNewPrimary() {
	e.t.Helper()
	admin := e.connect("", nil)
	for _, sql := range []string{"alter system set synchronous_standby_names = ''", "select pg_reload_conf()"} {
		if _, err := admin.Exec(ctxT(e.t), sql); err != nil {
			e.t.Fatal(err)
		}
	}
}

// TestSyncModeNewEraWaitsForStandby (round 11, U-H3): in failover_mode
// sync, an administrator's fence.new_era committed with
// synchronous_commit = off was acknowledged at once (fence.durable raised
// it to local only), lost in a failover to the synchronous standby, and
// the failover, lossless, made every generation it had voided valid
// again. Now its commit waits for the standby, and after the standby is
// promoted the voided generation stays void.
func TestSyncModeNewEraWaitsForStandby(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, map[string]string{"synchronous_standby_names": "'*'"})
	ctx := ctxT(t)
	admin := e.connect("", nil)
	if _, err := admin.Exec(ctx, "select fence.set_failover_mode('sync')"); err != nil {
		t.Fatal(err)
	}
	a := e.acquire("wa", "j")
	if err := e.write("wa", a, "a"); err != nil {
		t.Fatalf("A's write: %v", err)
	}
	if err := e.c.Replica.Stop(); err != nil { // the standby falls behind
		t.Fatal(err)
	}
	repair := e.connect("", nil)
	if _, err := repair.Exec(ctx, "set synchronous_commit = off"); err != nil {
		t.Fatal(err)
	}
	done := syncRepBlocked(t, admin, backendPID(t, repair), "fence.new_era under synchronous_commit = off", func() error {
		_, err := repair.Exec(ctx, "select fence.new_era('restored from backup X')")
		return err
	})
	if err := e.c.Replica.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("new_era: %v", err)
	}
	if err := e.c.Failover(ctx); err != nil {
		t.Fatal(err)
	}
	e.noStandbyOnNewPrimary()
	if err := e.write("wa", a, "zombie"); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("A, voided by the acknowledged new era, writes after the promotion: %v, want FN015", err)
	}
	var lossless bool
	var reason string
	if err := e.connect("", nil).QueryRow(ctx, "select lossless, reason from fence.current_era()").Scan(&lossless, &reason); err != nil {
		t.Fatal(err)
	}
	if !lossless {
		t.Fatalf("the promotion of the synchronous standby began a lossy era (%s), want lossless", reason)
	}
}

// TestSyncModeLeaseCallsWaitForStandby (round 11, U-H3): in
// failover_mode sync every call that writes what a failover must keep
// commits only once the synchronous standby has it, whatever the session
// set synchronous_commit to (off, local): acquire, renew, release,
// retire, set_failover_mode, and a server's first transaction, which
// settles its era. remote_write is raised to on (the standby's flush).
func TestSyncModeLeaseCallsWaitForStandby(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, map[string]string{"synchronous_standby_names": "'*'"})
	ctx := ctxT(t)
	admin := e.connect("", nil)
	if _, err := admin.Exec(ctx, "select fence.set_failover_mode('sync')"); err != nil {
		t.Fatal(err)
	}
	lr, ll, lt := e.acquire("wa", "renew"), e.acquire("wa", "release"), e.acquire("wa", "retire")
	{
		w := e.connect("wa", nil)
		tx, err := w.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var sc string
		if _, err := tx.Exec(ctx, "set local synchronous_commit = remote_write"); err != nil {
			t.Fatal(err)
		}
		if _, err := fence.Renew(ctx, tx, "renew", lr.Token, time.Minute); err != nil {
			t.Fatal(err)
		}
		if err := tx.QueryRow(ctx, "show synchronous_commit").Scan(&sc); err != nil {
			t.Fatal(err)
		}
		tx.Rollback(ctx)
		if sc != "on" {
			t.Fatalf("synchronous_commit after a renewal under remote_write in sync mode: %q, want on", sc)
		}
	}
	type call struct {
		name, user, setting string
		f                   func(conn *pgx.Conn) error
	}
	// Phases with one notifier each: a commit that notifies (retire,
	// acquire) takes the notification queue's lock and holds it while it
	// waits for the standby, so a second would wait for that lock instead.
	phases := [][]call{{
		{"renew", "wa", "local", func(c *pgx.Conn) error { _, err := fence.Renew(ctx, c, "renew", lr.Token, time.Minute); return err }},
		{"release", "wa", "off", func(c *pgx.Conn) error { return fence.Release(ctx, c, "release", ll.Token) }},
		{"retire", "wa", "local", func(c *pgx.Conn) error {
			return fence.Retire(ctx, c, "retire", fence.RetireOptions{Token: lt.Token})
		}},
		{"set_failover_mode", "", "off", func(c *pgx.Conn) error {
			_, err := c.Exec(ctx, "select fence.set_failover_mode('sync')")
			return err
		}},
	}, {
		{"acquire", "wb", "off", func(c *pgx.Conn) error { _, err := fence.Acquire(ctx, c, "acquire", "wb", time.Minute); return err }},
	}}
	for _, calls := range phases {
		if err := e.c.Replica.Stop(); err != nil {
			t.Fatal(err)
		}
		var dones []<-chan error
		for _, c := range calls {
			conn := e.connect(c.user, nil)
			if _, err := conn.Exec(ctx, "set synchronous_commit = "+c.setting); err != nil {
				t.Fatal(err)
			}
			f := c.f
			dones = append(dones, syncRepBlocked(t, admin, backendPID(t, conn), c.name+" under synchronous_commit = "+c.setting, func() error { return f(conn) }))
		}
		if err := e.c.Replica.Start(ctx); err != nil {
			t.Fatal(err)
		}
		for i, d := range dones {
			if err := <-d; err != nil {
				t.Fatalf("%s: %v", calls[i].name, err)
			}
		}
	}
	// A server's first transaction settles its era (a restart: a new
	// postmaster), and what it writes is kept too.
	if err := e.c.Replica.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := e.c.Primary.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	w := e.connect("wa", nil)
	if _, err := w.Exec(ctx, "set synchronous_commit = off"); err != nil {
		t.Fatal(err)
	}
	done := syncRepBlocked(t, e.connect("", nil), backendPID(t, w), "the era's first transaction (fence.current_era) under synchronous_commit = off", func() error {
		_, err := w.Exec(ctx, "select fence.current_era()")
		return err
	})
	if err := e.c.Replica.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("current_era: %v", err)
	}
}

// restoreAsPrimary starts n, a base backup AddNode made (not started), as
// a point-in-time restore: recovery.signal (not standby.signal), a
// restore_command, the settings in conf, and no synchronous standby. It
// waits until recovery has ended (a new timeline) and makes n the
// cluster's primary.
func (e *failoverEnv) restoreAsPrimary(n *pgtest.Node, conf map[string]string) {
	e.t.Helper()
	ctx := ctxT(e.t)
	if err := n.RemoveFile("standby.signal"); err != nil {
		e.t.Fatal(err)
	}
	if err := n.WriteFile("recovery.signal", nil); err != nil {
		e.t.Fatal(err)
	}
	conf["restore_command"] = "'false'"
	conf["synchronous_standby_names"] = "''"
	if err := n.SetConf(conf); err != nil {
		e.t.Fatal(err)
	}
	if err := n.Start(ctx); err != nil {
		e.t.Fatal(err)
	}
	conn, err := n.Connect(ctx, "postgres")
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close(ctx)
	if err := pgtest.Poll(ctx, func() (bool, error) {
		var rec bool
		err := conn.QueryRow(ctx, "select pg_is_in_recovery()").Scan(&rec)
		return !rec, err
	}); err != nil {
		e.t.Fatal(err)
	}
	e.c.UsePrimary(n)
}

// TestPointInTimeRestoreInSyncModeIsLossy (round 11, U-H2): in
// failover_mode sync, a base backup restored with point-in-time recovery
// ends on a new timeline with the same system identifier, which the era
// took for a lossless promotion: the holder superseded by a takeover
// after the backup committed on the restored copy. A restore is never
// lossless: with a recovery target (recovery_target = 'immediate', from a
// backup that carries a standby's primary_conninfo, as the attacker's),
// or archive recovery to the end of the WAL with no standby's
// configuration. Only a streaming standby's promotion at the end of what
// it received is (TestFailoverSync, TestSyncModeNewEraWaitsForStandby).
func TestPointInTimeRestoreInSyncModeIsLossy(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, map[string]string{"synchronous_standby_names": "'*'"})
	ctx := ctxT(t)
	if _, err := e.connect("", nil).Exec(ctx, "select fence.set_failover_mode('sync')"); err != nil {
		t.Fatal(err)
	}
	a := e.acquire("wa", "j")
	if err := e.write("wa", a, "a"); err != nil {
		t.Fatalf("A's write: %v", err)
	}
	// Two base backups of this moment: one taken as a standby's (-R:
	// standby.signal and primary_conninfo), one plain.
	targeted, err := e.c.AddNode(ctx, "pitr", pgtest.Options{}, true, false)
	if err != nil {
		t.Fatal(err)
	}
	toEnd, err := e.c.AddNode(ctx, "archive", pgtest.Options{}, false, false)
	if err != nil {
		t.Fatal(err)
	}
	e.expire("j")
	b := e.acquire("wb", "j") // acknowledged: the synchronous standby has it; the backups do not
	if err := e.c.Primary.Kill(); err != nil {
		t.Fatal(err)
	}
	for _, r := range []struct {
		name string
		n    *pgtest.Node
		conf map[string]string
	}{
		{"a restore to a recovery target (immediate)", targeted, map[string]string{"recovery_target": "'immediate'", "recovery_target_action": "'promote'"}},
		{"archive recovery to the end of the WAL", toEnd, map[string]string{}},
	} {
		if e.c.Primary != nil {
			e.c.Primary.Kill()
		}
		e.restoreAsPrimary(r.n, r.conf)
		var tl int
		var lossless bool
		var reason string
		if err := e.connect("", nil).QueryRow(ctx, "select timeline, lossless, reason from fence.current_era()").Scan(&tl, &lossless, &reason); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: timeline %d, lossless %v, reason %q", r.name, tl, lossless, reason)
		if tl < 2 || lossless {
			t.Errorf("%s: era on timeline %d lossless %v (%s), want a lossy era on a new timeline", r.name, tl, lossless, reason)
		}
		if err := e.write("wa", a, "zombie"); fence.Code(err) != fence.CodeFailover {
			t.Errorf("%s: A, superseded after the backup, writes on the restored copy: %v, want FN015", r.name, err)
		}
		if code := fence.Code(e.write("wb", b, "b")); code != fence.CodeFailover && code != fence.CodeNotOwner {
			t.Errorf("%s: B, whose takeover the restore lost, writes: %s, want FN015 or FN011", r.name, code)
		}
		if got := e.payload("j"); got != "a" {
			t.Errorf("%s: the result is %q, want the backup's", r.name, got)
		}
	}
}

// TestEraRolledBackAcquiresOneFloor (round 11, U-L1): a new primary's
// first acquires that roll back settle its era on one floor: each drew a
// token (nextval) above the pending floor, and the next attempt once drew
// a fresh floor above that (about 2^38 higher each time). Sessions with
// different TimeZone and DateStyle settings share it: the server's key
// no longer depends on how a session prints the postmaster's start time.
func TestEraRolledBackAcquiresOneFloor(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, nil)
	ctx := ctxT(t)
	e.acquire("wa", "j")
	if err := e.c.Failover(ctx); err != nil {
		t.Fatal(err)
	}
	admin := e.connect("", nil)
	styles := []string{"set timezone = 'UTC'; set datestyle = 'ISO, MDY'",
		"set timezone = 'Asia/Kolkata'; set datestyle = 'SQL, DMY'",
		"set timezone = 'America/St_Johns'; set datestyle = 'Postgres, YMD'",
		"set timezone = 'UTC'; set datestyle = 'German'",
		"set timezone = 'Pacific/Chatham'; set intervalstyle = 'sql_standard'; set datestyle = 'ISO, DMY'"}
	var keys []int64
	for _, s := range styles[:2] {
		c := e.connect("", nil)
		var k int64
		if _, err := c.Exec(ctx, s); err != nil {
			t.Fatal(err)
		}
		if err := c.QueryRow(ctx, "select fence.era_server_key()").Scan(&k); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, k)
	}
	if keys[0] != keys[1] {
		t.Errorf("one server's key under two sessions' TimeZone and DateStyle: %v, want one key", keys)
	}
	var floors []int64
	for _, s := range styles {
		w := e.connect("wa", nil)
		if _, err := w.Exec(ctx, s); err != nil {
			t.Fatal(err)
		}
		tx, err := w.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var tok int64
		if err := tx.QueryRow(ctx, "select token from fence.acquire('j', 'wa', '1 minute')").Scan(&tok); err != nil {
			t.Fatalf("acquire: %v", err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		var f int64
		if err := admin.QueryRow(ctx, "select last_value from fence.era_pending_seq").Scan(&f); err != nil {
			t.Fatal(err)
		}
		floors = append(floors, f)
	}
	for _, f := range floors[1:] {
		if f != floors[0] {
			t.Fatalf("the pending floors after %d rolled-back first acquires: %v, want one floor", len(floors), floors)
		}
	}
	l := e.acquire("wa", "j")
	var floor int64
	if err := admin.QueryRow(ctx, "select token_floor from fence.eras order by era desc limit 1").Scan(&floor); err != nil {
		t.Fatal(err)
	}
	if floor != floors[0] || l.Token <= floor {
		t.Fatalf("the era's floor %d (token %d), want the pending floor %d and a token above it", floor, l.Token, floors[0])
	}
}
