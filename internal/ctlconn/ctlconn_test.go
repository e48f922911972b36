package ctlconn_test

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/ctlconn"
	"github.com/pgfence/pgfence/internal/pgtest"
)

var cluster *pgtest.Cluster

func TestMain(m *testing.M) {
	os.Exit(pgtest.Run(m, pgtest.Options{}, func(context.Context, *pgx.Conn) error { return nil }, &cluster))
}

// kept is a Conn on a test database, with the connect function its Do
// calls, the backend of its first call, and a direct connection to watch
// it from.
type kept struct {
	c        ctlconn.Conn[*pgx.Conn]
	dsn      string
	connects int
	first    uint32
	admin    *pgx.Conn
}

// newKept returns a kept connection after its first call.
func newKept(t *testing.T, ctx context.Context) *kept {
	t.Helper()
	db := cluster.NewDatabase(t)
	k := &kept{dsn: cluster.Primary.DSN(db), admin: cluster.Primary.MustConnect(t, db)}
	t.Cleanup(k.c.Close)
	var err error
	if k.first, _, err = k.pid(ctx); err != nil {
		t.Fatal(err)
	}
	return k
}

func (k *kept) connect(ctx context.Context) (*pgx.Conn, error) {
	k.connects++
	return pgx.Connect(ctx, k.dsn)
}

// pid runs one Do that reads the backend's PID, and counts its runs of f.
func (k *kept) pid(ctx context.Context) (pid uint32, runs int, err error) {
	err = k.c.Do(ctx, k.connect, func(c *pgx.Conn) error {
		runs++
		return c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid)
	})
	return pid, runs, err
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// TestConnKept: one connection serves call after call; a statement that
// fails with PostgreSQL's error (and a query with no row) leaves it in
// place and is not run again.
func TestConnKept(t *testing.T) {
	ctx := ctxT(t)
	k := newKept(t, ctx)
	for _, sql := range []string{"SELECT 1/0", "SELECT 1 WHERE false"} {
		runs := 0
		err := k.c.Do(ctx, k.connect, func(c *pgx.Conn) error {
			runs++
			var v int
			return c.QueryRow(ctx, sql).Scan(&v)
		})
		if err == nil || runs != 1 {
			t.Fatalf("%s: %d runs, %v; want 1 run and its error", sql, runs, err)
		}
	}
	if pid, _, err := k.pid(ctx); err != nil || pid != k.first {
		t.Fatalf("after the failed statements: backend %d, %v; want the kept %d", pid, err, k.first)
	}
	if k.connects != 1 {
		t.Fatalf("%d connections opened, want 1", k.connects)
	}
}

// TestConnReopened: a kept connection PostgreSQL has ended since its last
// use is replaced, and the call runs once more on the new one; a call
// that breaks a connection it has just opened is not run again.
func TestConnReopened(t *testing.T) {
	ctx := ctxT(t)
	k := newKept(t, ctx)
	var ended bool
	if err := k.admin.QueryRow(ctx, "SELECT pg_terminate_backend($1, 60000)", k.first).Scan(&ended); err != nil || !ended {
		t.Fatalf("terminate backend %d: %v, %v", k.first, ended, err)
	}
	if pid, runs, err := k.pid(ctx); err != nil || runs != 2 || pid == k.first {
		t.Fatalf("after the kept backend ended: backend %d, %d runs, %v; want a new one than %d, 2 runs", pid, runs, err, k.first)
	}

	// Broken on a connection just opened: returned as it is.
	k.c.Close()
	runs := 0
	err := k.c.Do(ctx, k.connect, func(c *pgx.Conn) error {
		runs++
		_, err := c.Exec(ctx, "SELECT pg_terminate_backend(pg_backend_pid())")
		return err
	})
	if err == nil || runs != 1 {
		t.Fatalf("a call that ends its own new backend: %d runs, %v; want 1 run and its error", runs, err)
	}
	if _, _, err := k.pid(ctx); err != nil {
		t.Fatalf("the next call: %v", err)
	}
	if k.connects != 4 {
		t.Fatalf("%d connections opened, want 4", k.connects)
	}
}

// TestConnConnectError: a connection that cannot be opened is the call's
// error, wrapped.
func TestConnConnectError(t *testing.T) {
	var c ctlconn.Conn[*pgx.Conn]
	refused := errors.New("refused")
	err := c.Do(ctxT(t), func(context.Context) (*pgx.Conn, error) { return nil, refused }, func(*pgx.Conn) error {
		t.Fatal("f ran without a connection")
		return nil
	})
	if !errors.Is(err, refused) || err.Error() != "connect: refused" {
		t.Fatalf("got %v, want connect: refused", err)
	}
}
