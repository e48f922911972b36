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

// eraEnv is newEnv with two worker roles of its own.
func eraEnv(t *testing.T) (e *env, r1, r2 string) {
	t.Helper()
	e = newEnv(t)
	r1, r2 = e.role("w1"), e.role("w2")
	for _, r := range []string{r1, r2} {
		e.exec(fmt.Sprintf("create role %s login in role pgfence_worker; grant select, insert, update on results to %[1]s", pgx.Identifier{r}.Sanitize()))
	}
	return e, r1, r2
}

// writeAs upserts job's result as role under generation g, straight to
// PostgreSQL (the backstop), with payload as the step.
func (e *env) writeAs(role string, g fence.Lease, payload string) error {
	e.t.Helper()
	cfg, err := pgx.ParseConfig(cluster.Primary.DSN(e.db))
	if err != nil {
		e.t.Fatal(err)
	}
	cfg.User = role
	cfg.RuntimeParams["options"] = fmt.Sprintf("-c fence.job_key=%s -c fence.epoch=%d -c fence.token=%d -c fence.step=%s", g.JobKey, g.Epoch, g.Token, payload)
	conn, err := pgx.ConnectConfig(ctxT(e.t), cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctxT(e.t), upsertSQL, g.JobKey, payload, g.Token)
	return err
}

// TestNewEra (round 9, Q-H2, Q-L1, issue 31): fence.new_era, an
// administrator's, voids every generation issued before it on every path
// (the fast path of a write too), renew, release and retire refuse a void
// generation with FN015, whoever presents it, a void lease does not hold
// the job, and the numbers move above everything issued before.
func TestNewEra(t *testing.T) {
	t.Parallel()
	e, r1, r2 := eraEnv(t)
	ctx := ctxT(t)
	w1, w2 := e.connectAs(r1), e.connectAs(r2)
	l, err := fence.Acquire(ctx, w1, "j", "h1", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.writeAs(r1, l, "before"); err != nil {
		t.Fatalf("write before the new era: %v", err)
	}
	if _, err := w1.Exec(ctx, "select fence.new_era('a worker')"); pgtest.SQLState(err) != "42501" {
		t.Fatalf("a worker starts a new era: %v, want 42501", err)
	}
	e.exec("select fence.new_era('restored from a backup')")
	if err := e.writeAs(r1, l, "after"); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("write under a generation from before the new era: %v, want FN015", err)
	}
	if _, err := fence.Renew(ctx, w1, "j", l.Token, time.Minute); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("renewal: %v, want FN015", err)
	}
	// Another role presenting the void token (a holder whose takeover the
	// new era lost holds no fence row here): FN015, which pgfence run
	// answers by acquiring again, not FN001.
	if _, err := fence.Renew(ctx, w2, "j", l.Token, time.Minute); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("another role's renewal with the void token: %v, want FN015", err)
	}
	if err := fence.Release(ctx, w1, "j", l.Token); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("release: %v, want FN015", err)
	}
	if err := fence.Retire(ctx, w1, "j", fence.RetireOptions{Token: l.Token}); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("retire: %v, want FN015", err)
	}
	e.wantCount(t, 0, "select count(*) from fence.fences where retired_at is not null")
	l2, err := fence.Acquire(ctx, w2, "j", "h2", time.Minute)
	if err != nil {
		t.Fatalf("acquire after the new era (the void lease does not hold the job): %v", err)
	}
	if l2.Token <= l.Token {
		t.Fatalf("token %d after the new era is not above %d, issued before", l2.Token, l.Token)
	}
	if err := e.writeAs(r2, l2, "new"); err != nil {
		t.Fatalf("write under the new generation: %v", err)
	}
	if err := fence.Retire(ctx, w2, "j", fence.RetireOptions{Token: l2.Token}); err != nil {
		t.Fatalf("retire under the new generation: %v", err)
	}
}

// TestEraSettleRefusesPrepare (round 9, Q-M1): the first transaction of a
// server's era writes the era's check (and may make the era) under a lock
// every acquire and every job's first write waits for; it cannot be
// prepared, so no session keeps that lock past its own end, and a login
// without a fence role cannot start it with fence.current_era.
func TestEraSettleRefusesPrepare(t *testing.T) {
	t.Parallel()
	e, r1, _ := eraEnv(t)
	ctx := ctxT(t)
	plain := e.role("plain")
	e.exec(fmt.Sprintf("create role %s login", plain))
	// A restarted postmaster has no check of its own yet.
	e.exec("delete from fence.era_checks")
	w1 := e.connectAs(r1)
	tx := begin(t, w1, pgx.ReadCommitted)
	if _, err := tx.Exec(ctx, "select * from fence.current_era()"); err != nil {
		t.Fatal(err)
	}
	_, err := tx.Exec(ctx, "prepare transaction 'era-hostage'")
	if err == nil {
		e.exec("rollback prepared 'era-hostage'")
		t.Fatal("the era's settling transaction was prepared")
	}
	e.wantCount(t, 0, "select count(*) from pg_prepared_xacts where gid = 'era-hostage'")
	if _, err := e.connectAs(plain).Exec(ctx, "select * from fence.current_era()"); pgtest.SQLState(err) != "42501" {
		t.Fatalf("a login without a fence role reads the era: %v, want 42501", err)
	}
}

// TestEraSettleRepeatableRead (round 9, Q-L2): a REPEATABLE READ
// transaction whose snapshot predates the era's row, made meanwhile by
// another session, is told to retry (40001), not a raw 23505, and moves
// no sequence back.
func TestEraSettleRepeatableRead(t *testing.T) {
	t.Parallel()
	e, r1, r2 := eraEnv(t)
	ctx := ctxT(t)
	// This server's history has no era yet (as after a promotion).
	e.exec("delete from fence.era_checks")
	e.exec("update fence.eras set timeline = timeline + 1000")
	x := begin(t, e.connectAs(r1), pgx.RepeatableRead)
	if _, err := x.Exec(ctx, "select 1"); err != nil {
		t.Fatal(err)
	}
	y, err := fence.Acquire(ctx, e.connectAs(r2), "k", "y", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	_, err = x.Exec(ctx, "select * from fence.acquire('j', 'x', '1 minute')")
	if pgtest.SQLState(err) != "40001" {
		t.Fatalf("acquire in a snapshot older than the era: %v, want 40001", err)
	}
	z, err := fence.Acquire(ctx, e.connectAs(r2), "m", "z", time.Minute)
	if err != nil {
		t.Fatalf("acquire after the refused one: %v", err)
	}
	if z.Token <= y.Token || z.Epoch <= y.Epoch {
		t.Fatalf("generation (%d, %d) after (%d, %d): a sequence went back", z.Epoch, z.Token, y.Epoch, y.Token)
	}
}
