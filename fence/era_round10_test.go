package fence_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestFailoverRolledBackEraFloor (round 10, S-H1): setval is not
// transactional and streams to standbys. An administrator's fence.new_era
// that rolls back leaves its floor in fence.era_pending_seq and
// fence.token_seq, on the primary and on its standby. The old primary
// keeps issuing from that floor up; the standby, promoted, must not take
// the same floor for its era (it once reused the pending floor), or the
// lost branch's holder and the new primary's holder get one generation and
// the lost branch's holder commits on the new primary.
func TestFailoverRolledBackEraFloor(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, nil)
	ctx := ctxT(t)
	a := e.acquire("wa", "j")
	if err := e.write("wa", a, "a"); err != nil {
		t.Fatalf("A's write: %v", err)
	}
	admin := e.connect("", nil)
	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "select fence.new_era('rolled back')"); err != nil {
		t.Fatalf("new_era: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	e.replayedTo(e.c.Replica) // the setvals have reached the standby
	if err := e.c.DetachReplica(ctx); err != nil {
		t.Fatal(err)
	}
	lost := e.acquire("wa", "j") // on the branch that will be lost
	if err := e.c.Failover(ctx); err != nil {
		t.Fatal(err)
	}
	b := e.acquire("wb", "j")
	if b.Token == lost.Token {
		t.Fatalf("the promoted standby issued token %d again, which the lost branch issued (epochs %d and %d)", b.Token, lost.Epoch, b.Epoch)
	}
	if err := e.write("wb", b, "b"); err != nil {
		t.Fatalf("the new holder writes: %v", err)
	}
	// Refused: void (FN015), or unknown here (FN011: the promoted standby
	// never saw the generation issued), as in TestFailoverSameTimeline.
	if code := fence.Code(e.write("wa", lost, "zombie")); code != fence.CodeFailover && code != fence.CodeNotOwner {
		t.Fatalf("the lost branch's holder writes on the promoted standby: %s, want FN015 or FN011", code)
	}
	if got := e.payload("j"); got != "b" {
		t.Fatalf("the result is %q, want the new holder's", got)
	}
}

// TestEraRolledBackSettlesOnce: a settling transaction that rolls back on
// a new primary leaves its floor pending; the next one on the same server
// (postmaster and timeline) takes that floor again, so refused or failed
// first transactions do not push the numbers up by a random draw each.
func TestEraRolledBackSettlesOnce(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, nil)
	ctx := ctxT(t)
	e.acquire("wa", "j")
	if err := e.c.Failover(ctx); err != nil {
		t.Fatal(err)
	}
	admin := e.connect("", nil)
	var floors []int64
	for i := 0; i < 2; i++ {
		tx, err := admin.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var f int64
		if err := tx.QueryRow(ctx, "select fence.era_settle()").Scan(&f); err != nil {
			t.Fatalf("era_settle: %v", err)
		}
		floors = append(floors, f)
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
	}
	var f int64
	if err := admin.QueryRow(ctx, "select fence.era_settle()").Scan(&f); err != nil {
		t.Fatalf("era_settle: %v", err)
	}
	floors = append(floors, f)
	if floors[0] != floors[1] || floors[1] != floors[2] {
		t.Fatalf("the floors of three attempts at one era on one server: %v, want one floor", floors)
	}
}

// TestLogicalCopyOwnReceipt (round 10, S-H2 and S-M1): receipts restored
// into another cluster (pg_dump, pg_restore) keep the old cluster's
// backstop_xid, and the new cluster's xid counter passes through those
// ids again. A transaction whose id is an old receipt's is not that
// receipt's: the void holder whose transaction lands on one of its old
// receipts' ids is refused FN015 (not let through as if the receipt were
// its own), and another job's legitimate transaction landing on such an
// id commits (not FN009 for a job it never touched).
func TestLogicalCopyOwnReceipt(t *testing.T) {
	t.Parallel()
	e := newFailoverEnv(t, nil)
	ctx := ctxT(t)
	src := e.connect("", nil)
	// Push the source's xid counter well above what a restore consumes.
	if _, err := src.Exec(ctx, `do $$ begin for i in 1..3000 loop perform pg_current_xact_id(); commit; end loop; end $$`); err != nil {
		t.Fatal(err)
	}
	a := e.acquire("wa", "j")
	for _, step := range []string{"s1", "s2"} {
		if err := e.write("wa", a, step); err != nil {
			t.Fatalf("A's write %s: %v", step, err)
		}
		// A gap between the receipts' ids, for the copy's transactions.
		if _, err := src.Exec(ctx, `do $$ begin for i in 1..200 loop perform pg_current_xact_id(); commit; end loop; end $$`); err != nil {
			t.Fatal(err)
		}
	}
	xidOf := func(step string) int64 {
		var x int64
		if err := src.QueryRow(ctx, "select backstop_xid::text::bigint from fence.receipts where job_key = 'j' and step = $1", step).Scan(&x); err != nil {
			t.Fatal(err)
		}
		return x
	}
	x1, x2 := xidOf("s1"), xidOf("s2")

	dir := t.TempDir()
	roles, archive := filepath.Join(dir, "roles.sql"), filepath.Join(dir, "db.dump")
	if _, stderr, err := e.c.Client(e.c.Primary.Host, e.c.Primary.Port, "", "pg_dumpall", "--roles-only", "-f", roles); err != nil {
		t.Fatalf("pg_dumpall: %v\n%s", err, stderr)
	}
	if _, stderr, err := e.c.Client(e.c.Primary.Host, e.c.Primary.Port, "", "pg_dump", "-Fc", "-f", archive, "-d", e.db); err != nil {
		t.Fatalf("pg_dump: %v\n%s", err, stderr)
	}
	target, err := pgtest.Start(ctx, pgtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { target.Close() })
	if _, stderr, err := target.Client(target.Primary.Host, target.Primary.Port, "", "psql", "-X", "-q", "-d", "postgres", "-f", roles); err != nil {
		t.Fatalf("psql -f roles: %v\n%s", err, stderr)
	}
	if _, stderr, err := target.Client(target.Primary.Host, target.Primary.Port, "", "createdb", "-T", "template0", e.db); err != nil {
		t.Fatalf("createdb: %v\n%s", err, stderr)
	}
	if _, stderr, err := target.Client(target.Primary.Host, target.Primary.Port, "", "pg_restore", "--exit-on-error", "-d", e.db, archive); err != nil {
		t.Fatalf("pg_restore: %v\n%s", err, stderr)
	}
	e.c = target
	// The new cluster's era: A's generation is void.
	if err := e.write("wa", a, "control"); fence.Code(err) != fence.CodeFailover {
		t.Fatalf("A writes on the copy: %v, want FN015", err)
	}
	b := e.acquire("wb", "k")
	if err := e.write("wb", b, "k0"); err != nil {
		t.Fatalf("job k's first write: %v", err)
	}
	admin := e.connect("", nil)
	// landOn burns xids until the next transaction's id is x, and fails t
	// if the counter is already past it.
	landOn := func(x int64) {
		t.Helper()
		var next int64
		if err := admin.QueryRow(ctx, `select pg_current_xact_id()::text::bigint`).Scan(&next); err != nil {
			t.Fatal(err)
		}
		if next >= x {
			t.Fatalf("the copy's xid counter (%d) is past the receipt's id %d", next, x)
		}
		if _, err := admin.Exec(ctx, fmt.Sprintf(`do $$ begin loop exit when pg_current_xact_id()::text::bigint >= %d; commit; end loop; end $$`, x-1)); err != nil {
			t.Fatal(err)
		}
	}
	write := func(user string, g fence.Lease, step, payload string, x int64) error {
		t.Helper()
		conn := e.connectStep(user, &g, step)
		landOn(x)
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(context.Background())
		var got int64
		if err := tx.QueryRow(ctx, "select pg_current_xact_id()::text::bigint").Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != x {
			t.Fatalf("the transaction's id is %d, want %d (another transaction took an id)", got, x)
		}
		if _, err := tx.Exec(ctx, "update results set payload = $2, token = $3 where job_key = $1", g.JobKey, payload, g.Token); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	// S-M1: job k's legitimate work on an old receipt's id.
	if err := write("wb", b, "s", "k legit", x1); err != nil {
		t.Errorf("job k's write with the id of an old receipt of job j: %v, want it to commit", err)
	}
	// S-H2: the void holder on its own old receipt's id and step: the
	// receipt is not its transaction's, so the step is a replay of one
	// that committed (FN00R, as without the id) or the era refuses it;
	// nothing commits.
	if err := write("wa", a, "s2", "zombie", x2); fence.Code(err) != fence.CodeFailover && fence.Code(err) != fence.CodeReplay {
		t.Fatalf("A writes on the copy with its old receipt's id: %v, want FN015 or FN00R", err)
	}
	var p string
	if err := admin.QueryRow(ctx, "select payload from results where job_key = 'j'").Scan(&p); err != nil {
		t.Fatal(err)
	}
	if p != "s2" {
		t.Fatalf("job j's result on the copy is %q, want the restored one", p)
	}
}
