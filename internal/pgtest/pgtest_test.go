package pgtest_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgfence/pgfence/internal/pgtest"
)

var cluster *pgtest.Cluster

func TestMain(m *testing.M) {
	os.Exit(pgtest.Run(m, pgtest.Options{Replica: true}, func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, "CREATE TABLE marker (v int); INSERT INTO marker VALUES (42)")
		return err
	}, &cluster))
}

func TestDatabaseClonedFromTemplate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := cluster.Primary.MustConnect(t, cluster.NewDatabase(t))
	var v int
	if err := conn.QueryRow(ctx, "SELECT v FROM marker").Scan(&v); err != nil {
		t.Fatal(err)
	}
	if v != 42 {
		t.Fatalf("got %d, want 42", v)
	}
	if _, err := conn.Exec(ctx, "INSERT INTO marker VALUES (1)"); err != nil {
		t.Fatal(err)
	}
}

// TestBlocked: Blocked returns while its call waits for a lock the test
// holds, and the call's outcome arrives once the lock is let go.
func TestBlocked(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	holder, waiter := cluster.Primary.MustConnect(t, db), cluster.Primary.MustConnect(t, db)
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock(7)"); err != nil {
		t.Fatal(err)
	}
	done := pgtest.Blocked(t, holder, waiter.PgConn().PID(), func() (int, error) {
		var v int
		err := waiter.QueryRow(ctx, "SELECT 7 FROM (SELECT pg_advisory_lock(7)) l").Scan(&v)
		return v, err
	})
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_unlock(7)"); err != nil {
		t.Fatal(err)
	}
	if o := <-done; o.Err != nil || o.Val != 7 {
		t.Fatalf("the blocked call: got %d, %v; want 7", o.Val, o.Err)
	}
}

func TestReplicaPauseResume(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	p := cluster.Primary.MustConnect(t, db)
	r := cluster.Replica.MustConnect(t, db)
	var inRecovery bool
	if err := r.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil || !inRecovery {
		t.Fatalf("replica in recovery: got %v (%v), want true", inRecovery, err)
	}

	if err := cluster.PauseReplay(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Exec(ctx, "UPDATE marker SET v = 43"); err != nil {
		t.Fatal(err)
	}
	lsn, err := cluster.CurrentLSN(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var v int
	if err := r.QueryRow(ctx, "SELECT v FROM marker").Scan(&v); err != nil {
		t.Fatal(err)
	}
	if v != 42 {
		t.Fatalf("paused replica shows %d, want 42", v)
	}
	if err := cluster.ResumeReplay(ctx); err != nil {
		t.Fatal(err)
	}
	if err := cluster.WaitReplayed(ctx, lsn); err != nil {
		t.Fatal(err)
	}
	if err := r.QueryRow(ctx, "SELECT v FROM marker").Scan(&v); err != nil {
		t.Fatal(err)
	}
	if v != 43 {
		t.Fatalf("resumed replica shows %d, want 43", v)
	}
}

func TestFindBinDir(t *testing.T) {
	dir, err := pgtest.FindBinDir()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir + "/postgres"); err != nil {
		t.Fatalf("bin dir %s: %v", dir, err)
	}
	t.Setenv("PGFENCE_PG_BINDIR", t.TempDir())
	if _, err := pgtest.FindBinDir(); err == nil {
		t.Fatal("got nil error for an empty PGFENCE_PG_BINDIR, want ErrNoServer")
	}
}

// TestCloseRemovesEverything starts a second cluster, closes it and checks
// that its processes and files are gone.
func TestCloseRemovesEverything(t *testing.T) {
	ctx := context.Background()
	c, err := pgtest.Start(ctx, pgtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	dir := c.Primary.DataDir
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if c.Primary.Running() {
		t.Fatal("primary still running after Close")
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("data dir %s still exists after Close (stat err %v)", dir, err)
	}
}

// TestCrashLeavesNothing runs a child process that starts a cluster and
// panics without closing it; the reaper must stop the server and remove
// the directory.
func TestCrashLeavesNothing(t *testing.T) {
	if os.Getenv("PGTEST_CRASH_CHILD") == "1" {
		c, err := pgtest.Start(context.Background(), pgtest.Options{})
		if err != nil {
			t.Fatal(err)
		}
		os.Stdout.WriteString("DATADIR=" + c.Primary.DataDir + "\n")
		panic("deliberate crash with a running cluster")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashLeavesNothing$")
	cmd.Env = append(os.Environ(), "PGTEST_CRASH_CHILD=1")
	out, _ := cmd.CombinedOutput()
	m := regexp.MustCompile(`DATADIR=(\S+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("child printed no data dir:\n%s", out)
	}
	dir := string(m[1])
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := pgtest.Poll(ctx, func() (bool, error) {
		_, err := os.Stat(filepath.Dir(dir))
		return os.IsNotExist(err), nil
	})
	if err != nil {
		t.Fatalf("cluster dir %s still exists after the owning process crashed", filepath.Dir(dir))
	}
	procs, _ := exec.Command("pgrep", "-f", "postgres -D "+dir).Output()
	if len(procs) > 0 {
		t.Fatalf("postgres still running for %s: pids %s", dir, procs)
	}
}
