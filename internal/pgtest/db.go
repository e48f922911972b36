package pgtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// TemplateName is the database every test database is cloned from.
const TemplateName = "pgfence_template"

// Prepare sets up the template database (typically: apply migrations).
type Prepare func(ctx context.Context, conn *pgx.Conn) error

// PrepareTemplate creates the template database and runs prepare in it.
// Databases made by NewDatabase are cloned from it.
func (c *Cluster) PrepareTemplate(ctx context.Context, prepare Prepare) error {
	admin, err := c.Primary.Connect(ctx, "postgres")
	if err != nil {
		return fmt.Errorf("connect primary: %w", err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+TemplateName); err != nil {
		return fmt.Errorf("create template: %w", err)
	}
	if prepare != nil {
		conn, err := c.Primary.Connect(ctx, TemplateName)
		if err != nil {
			return fmt.Errorf("connect template: %w", err)
		}
		err = prepare(ctx, conn)
		conn.Close(ctx)
		if err != nil {
			return fmt.Errorf("prepare template: %w", err)
		}
	}
	if _, err := admin.Exec(ctx, "ALTER DATABASE "+TemplateName+" WITH is_template true"); err != nil {
		return fmt.Errorf("mark template: %w", err)
	}
	c.mu.Lock()
	c.template = TemplateName
	c.mu.Unlock()
	return nil
}

var unsafeName = regexp.MustCompile(`[^a-z0-9_]+`)

// CreateDatabase clones the template (or template0 when none was
// prepared) into a new database and returns its name. When the cluster has
// a replica, it returns once the replica has the database too.
func (c *Cluster) CreateDatabase(ctx context.Context, hint string) (string, error) {
	c.mu.Lock()
	c.dbSeq++
	name := fmt.Sprintf("t%d_%s", c.dbSeq, unsafeName.ReplaceAllString(strings.ToLower(hint), "_"))
	if len(name) > 60 {
		name = name[:60]
	}
	tmpl := c.template
	c.mu.Unlock()
	if tmpl == "" {
		tmpl = "template0"
	}
	admin, err := c.Primary.Connect(ctx, "postgres")
	if err != nil {
		return "", fmt.Errorf("connect primary: %w", err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, fmt.Sprintf("CREATE DATABASE %q TEMPLATE %q", name, tmpl)); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	if c.Replica != nil && c.Replica.Running() {
		if err := c.WaitReplicaCaughtUp(ctx); err != nil {
			return "", err
		}
	}
	return name, nil
}

// DropDatabase drops a database, disconnecting its sessions.
func (c *Cluster) DropDatabase(ctx context.Context, name string) error {
	if !c.Primary.Running() {
		return nil
	}
	admin, err := c.Primary.Connect(ctx, "postgres")
	if err != nil {
		return fmt.Errorf("connect primary: %w", err)
	}
	defer admin.Close(ctx)
	_, err = admin.Exec(ctx, fmt.Sprintf("DROP DATABASE IF EXISTS %q WITH (FORCE)", name))
	return err
}

// NewDatabase creates a fresh database for t, cloned from the template,
// and drops it when t ends. It returns the database name; use
// c.Primary.DSN(name) or c.Replica.DSN(name).
func (c *Cluster) NewDatabase(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	name, err := c.CreateDatabase(ctx, t.Name())
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := c.DropDatabase(ctx, name); err != nil {
			t.Logf("pgtest: drop %s: %v", name, err)
		}
	})
	return name
}

// NewDatabaseWith is NewDatabase with sql (a test's schema) run in the
// new database before it returns.
func (c *Cluster) NewDatabaseWith(t testing.TB, sql string) string {
	t.Helper()
	name := c.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := c.Primary.Connect(ctx, name)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql); err != nil {
		t.Fatalf("pgtest: schema of %s: %v", name, err)
	}
	return name
}

// MustConnect connects to db on the node for t, failing t when it cannot,
// and closes the connection when t ends.
func (n *Node) MustConnect(t testing.TB, db string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := n.Connect(ctx, db)
	if err != nil {
		t.Fatalf("pgtest: connect to %s on the %s: %v", db, n.Name, err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// WaitLockWait waits until backend pid waits for a heavyweight lock it
// has not been granted, as pg_locks and pg_stat_activity on conn (any
// connection to the same server) show it, failing t when it does not
// within a minute. An ordering test blocks one side on a lock and waits
// for it with this, never with a sleep.
func WaitLockWait(t testing.TB, conn *pgx.Conn, pid uint32) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := poll(ctx, func() (bool, error) { return lockWaiting(ctx, conn, pid) }); err != nil {
		t.Fatalf("pgtest: backend %d never waited for a lock: %v", pid, err)
	}
}

// lockWaiting reports whether backend pid waits for a heavyweight lock.
func lockWaiting(ctx context.Context, conn *pgx.Conn, pid uint32) (bool, error) {
	var waiting bool
	err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)
		WHERE l.pid = $1 AND NOT l.granted AND a.wait_event_type = 'Lock')`, pid).Scan(&waiting)
	return waiting, err
}

// Outcome is what a call started by Blocked returned.
type Outcome[T any] struct {
	Val T
	Err error
}

// Blocked runs f in a goroutine and returns once backend pid, the one f
// runs its statement on, waits for a lock (as WaitLockWait sees it on
// conn), failing t when f returns first or the wait does not come within
// a minute; f's outcome arrives on the channel when the test lets it go
// on. It is the first half of an ordering test: one side blocked on a
// lock the other holds.
func Blocked[T any](t testing.TB, conn *pgx.Conn, pid uint32, f func() (T, error)) <-chan Outcome[T] {
	t.Helper()
	done := make(chan Outcome[T], 1)
	go func() {
		v, err := f()
		done <- Outcome[T]{v, err}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := poll(ctx, func() (bool, error) {
		select {
		case o := <-done:
			return false, fmt.Errorf("the call returned first: %+v", o)
		default:
		}
		return lockWaiting(ctx, conn, pid)
	})
	if err != nil {
		t.Fatalf("pgtest: backend %d never waited for a lock: %v", pid, err)
	}
	return done
}

// SQLState is the SQLSTATE err carries, or "" when it carries none.
func SQLState(err error) string {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Code
	}
	return ""
}

// Run is the body of a package's TestMain: it starts a cluster, prepares
// the template, stores the cluster in *dst, runs the tests and closes the
// cluster. It returns the exit code. A cluster that cannot start fails the
// package; it never skips.
//
//	var cluster *pgtest.Cluster
//	func TestMain(m *testing.M) {
//		os.Exit(pgtest.Run(m, pgtest.Options{}, migrations.Prepare, &cluster))
//	}
func Run(m *testing.M, opts Options, prepare Prepare, dst **Cluster) int {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	c, err := Start(ctx, opts)
	if err == nil {
		err = c.PrepareTemplate(ctx, prepare)
	}
	cancel()
	if err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: %v\n", err)
		if c != nil {
			c.Close()
		}
		return 1
	}
	*dst = c
	defer c.Close()
	return m.Run()
}
