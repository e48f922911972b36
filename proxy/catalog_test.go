package proxy

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// catalogProxy is a gated proxy with the replica configured whose
// catalog log lines are observed.
func catalogProxy(t *testing.T) (*testProxy, *Fence, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	log := zap.New(zapcore.NewTee(zaptest.NewLogger(t).Core(), core))
	gate := newGateWith(t, FenceConfig{}, log)
	p := startProxyLog(t, Config{Interceptor: gate, Replicas: []string{cluster.Replica.DSN("postgres")},
		ReplicaPoll: 10 * time.Millisecond, ReplicaMaxLag: time.Minute}, log)
	return p, gate, logs
}

// backends counts the backends connected to db on node (the caller's
// own excepted).
func backends(t *testing.T, node *pgtest.Node, db string) int {
	t.Helper()
	ctx := ctxT(t)
	c, err := node.Connect(ctx, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	var n int
	if err := c.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()", db).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitOnlyIn waits until neither node has a client backend outside db (the
// caller's own excepted): the proxy, serving only db, keeps no control
// connection anywhere else (its replica pollers included).
func waitOnlyIn(t *testing.T, db string) {
	t.Helper()
	elsewhere := func(node *pgtest.Node) (n int, who string) {
		ctx := ctxT(t)
		c, err := node.Connect(ctx, "postgres")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(ctx)
		if err := c.QueryRow(ctx, `SELECT count(*), coalesce(string_agg(datname || ':' || application_name, ', '), '')
			FROM pg_stat_activity WHERE backend_type = 'client backend' AND datname <> $1 AND pid <> pg_backend_pid()`, db).Scan(&n, &who); err != nil {
			t.Fatal(err)
		}
		return n, who
	}
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		p, _ := elsewhere(cluster.Primary)
		r, _ := elsewhere(cluster.Replica)
		return p == 0 && r == 0, nil
	}); err != nil {
		_, p := elsewhere(cluster.Primary)
		_, r := elsewhere(cluster.Replica)
		t.Fatalf("connections outside %s: primary [%s], replica [%s]", db, p, r)
	}
}

// waitNoBackends waits until neither the primary nor the replica has a
// backend in db.
func waitNoBackends(t *testing.T, db string) {
	t.Helper()
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		return backends(t, cluster.Primary, db) == 0 && backends(t, cluster.Replica, db) == 0, nil
	}); err != nil {
		t.Fatalf("the proxy keeps connections in %s, which has no client session: primary %d, replica %d",
			db, backends(t, cluster.Primary, db), backends(t, cluster.Replica, db))
	}
}

func execOn(t *testing.T, c *pgconn.PgConn, sql string) {
	t.Helper()
	if _, err := c.Exec(ctxT(t), sql).ReadAll(); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// TestCatalogWatcherFollowsSessions: the proxy holds connections in a
// database only while it has client sessions there, so DROP DATABASE,
// CREATE DATABASE ... TEMPLATE and ALTER DATABASE ... RENAME work, through
// the proxy and directly, while it serves other databases.
func TestCatalogWatcherFollowsSessions(t *testing.T) {
	p, gate, logs := catalogProxy(t)
	ctx := ctxT(t)
	x, y := cluster.NewDatabase(t), cluster.NewDatabase(t)
	sy := connect(t, p.dsn(y)) // the proxy serves y throughout
	waitHealthy(t, p)

	sx := connect(t, p.dsn(x))
	mustWhere(t, sx, "SELECT 1, pg_is_in_recovery()", true) // a replica connection too
	c, err := cluster.Primary.Connect(ctx, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	var watchers int
	if err := c.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = $2", x, watcherAppName).Scan(&watchers); err != nil || watchers != 1 {
		t.Fatalf("got %d catalog watchers in %s (%v), want 1 while it has a session", watchers, x, err)
	}
	sx.Close(ctx)
	waitNoBackends(t, x)
	c.Close(ctx)
	waitOnlyIn(t, y)
	if c, err = cluster.Primary.Connect(ctx, "postgres"); err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	if gate.cats.lookup(x) != nil {
		t.Fatalf("a catalog of %s outlives its sessions", x)
	}

	// Through the proxy, from y: rename, copy as a template, drop.
	x2, z := x+"_renamed", x+"_copy"
	execOn(t, sy, fmt.Sprintf("ALTER DATABASE %q RENAME TO %q", x, x2))
	t.Cleanup(func() { cluster.DropDatabase(context.Background(), x2) })
	execOn(t, sy, fmt.Sprintf("CREATE DATABASE %q TEMPLATE %q", z, x2))
	t.Cleanup(func() { cluster.DropDatabase(context.Background(), z) })
	// The renamed database is served under its new name.
	s2 := connect(t, p.dsn(x2))
	execOn(t, s2, "SELECT count(*) FROM fence.fences")
	s2.Close(ctx)
	waitNoBackends(t, x2)
	execOn(t, sy, fmt.Sprintf("DROP DATABASE %q", z))

	// Directly, while the proxy serves y.
	if _, err := c.Exec(ctx, fmt.Sprintf("DROP DATABASE %q", x2)); err != nil {
		t.Fatalf("DROP DATABASE directly: %v", err)
	}
	// (sy is on the primary for good: "CREATE DATABASE ... TEMPLATE"
	// reads as a temporary object to the router, which fails closed.)
	mustWhere(t, connect(t, p.dsn(y)), "SELECT 1, pg_is_in_recovery()", true)
	for _, e := range logs.All() {
		if e.Level >= zapcore.WarnLevel && e.LoggerName == "catalog" {
			t.Errorf("catalog warning: %s %v", e.Message, e.ContextMap())
		}
	}
}

// TestCatalogWatcherDatabaseDropped: a database dropped under its watcher
// (WITH (FORCE)) is logged once and never reconnected to; a database of
// the same name created again is watched afresh.
func TestCatalogWatcherDatabaseDropped(t *testing.T) {
	p, gate, logs := catalogProxy(t)
	ctx := ctxT(t)
	x, y := cluster.NewDatabase(t), cluster.NewDatabase(t)
	sy := connect(t, p.dsn(y))
	sx := connect(t, p.dsn(x))
	execOn(t, sx, "SELECT 1")
	// A session still holds the catalog when its database goes.
	cat, err := gate.cats.get(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	execOn(t, sy, fmt.Sprintf("DROP DATABASE %q WITH (FORCE)", x))
	select {
	case <-cat.done:
	case <-ctx.Done():
		t.Fatal("the watcher of a dropped database keeps running")
	}
	gone := logs.FilterLoggerName("catalog").FilterMessageSnippet("no longer exists").Len()
	retries := logs.FilterLoggerName("catalog").FilterMessageSnippet("reconnect").Len()
	if gone != 1 || retries != 0 {
		t.Fatalf("logged %d 'no longer exists' and %d reconnection lines, want 1 and 0", gone, retries)
	}
	if _, err := sx.Exec(ctx, "SELECT 1").ReadAll(); err == nil {
		t.Fatal("the session of a dropped database still answers")
	}
	gate.cats.release(cat)

	// The same name again: a new catalog, loaded from the new database.
	execOn(t, sy, fmt.Sprintf("CREATE DATABASE %q", x))
	s := connect(t, p.dsn(x))
	execOn(t, s, "SELECT 1")
	if c := gate.cats.lookup(x); c == nil || c == cat || c.gone.Load() {
		t.Fatal("the re-created database has no fresh catalog")
	}
	s.Close(ctx)
	waitNoBackends(t, x)
}

// TestCatalogWatcherRefusedSession: a session refused after its catalog
// was loaded (a malformed fence parameter) gives it back.
func TestCatalogWatcherRefusedSession(t *testing.T) {
	p, gate, _ := catalogProxy(t)
	x := cluster.NewDatabase(t)
	cfg, err := pgconn.ParseConfig(p.dsn(x))
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["options"] = "-c fence.token=abc"
	if c, err := pgconn.ConnectConfig(ctxT(t), cfg); err == nil {
		c.Close(context.Background())
		t.Fatal("a malformed fence.token was accepted")
	}
	waitNoBackends(t, x)
	if gate.cats.lookup(x) != nil {
		t.Fatal("a refused session left its catalog behind")
	}
}

// TestCatalogWatcherRestartFloor: a takeover made while no session (and so
// no watcher) was in the database is covered by the next watcher's floor:
// readers without metadata need it, readers of that generation check the
// replica's fence row.
func TestCatalogWatcherRestartFloor(t *testing.T) {
	e := newRouteEnv(t)
	ctx := ctxT(t)
	a := e.acquire(t, "job", "a", time.Minute)
	w := e.worker(t, &a)
	execOK(t, w, upsert, "job", "A", a.Token)
	w.Close(ctx)
	// The environment's own session keeps the watcher; a fresh proxy
	// without one shows the restart.
	p, gate, _ := catalogProxy(t)
	s := connect(t, p.dsn(e.db))
	execOn(t, s, "SELECT 1")
	s.Close(ctx)
	waitNoCatalog := func() {
		if err := pgtest.Poll(ctx, func() (bool, error) { return gate.cats.lookup(e.db) == nil, nil }); err != nil {
			t.Fatal(err)
		}
	}
	waitNoCatalog()
	if err := cluster.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	pauseReplay(t)
	b := e.takeover(t, "job", "b", a) // nobody of p hears of it

	keep := connect(t, p.dsn(e.db))
	waitHealthy(t, p)
	cat := catalogOf(t, gate, e.db)
	if _, ok := cat.tk.lookup("job"); ok {
		t.Fatal("the new watcher knows the takeover: the test is wrong")
	}
	// Until the new proxy's poller has seen the primary's era on the
	// replica, every read goes to the primary (era.go), and a pending
	// reader is answered there instead of refused: wait for it (the
	// era's row was replayed before the pause).
	waitEraShown(t, p, cat)
	pend := func(o ...string) *pgconn.PgConn {
		return e.reader(t, p, append([]string{"-c fence.read_policy=pending"}, o...)...)
	}
	_, _, err := where(t, pend(), readResult)
	wantCode(t, err, fence.CodePending)
	_, _, err = where(t, pend(opts("job", b.Token)...), readResult)
	wantCode(t, err, fence.CodePending)
	mustWhere(t, keep, readResult, false)
	resumeAndCatchUp(t)
	waitReplicaRead(t, keep, readResult)
}
