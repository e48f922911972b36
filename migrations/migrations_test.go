package migrations_test

import (
	"context"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

var cluster *pgtest.Cluster

// The template stays empty: these tests migrate databases themselves.
func TestMain(m *testing.M) {
	os.Exit(pgtest.Run(m, pgtest.Options{}, nil, &cluster))
}

func schemaSummary(t *testing.T, ctx context.Context, db string) (tables, functions int) {
	t.Helper()
	conn, err := cluster.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	err = conn.QueryRow(ctx, `select
		(select count(*) from pg_tables where schemaname = 'fence'),
		(select count(*) from pg_proc p join pg_namespace n on n.oid = p.pronamespace where n.nspname = 'fence')`).Scan(&tables, &functions)
	if err != nil {
		t.Fatal(err)
	}
	return tables, functions
}

func TestApplyTwice(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	latest, err := migrations.Latest()
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		conn, err := cluster.Primary.Connect(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		if err := migrations.Apply(ctx, conn); err != nil {
			t.Fatalf("apply #%d: %v", i+1, err)
		}
		v, err := migrations.Current(ctx, conn)
		conn.Close(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if v != latest {
			t.Fatalf("after apply #%d: version %d, want %d", i+1, v, latest)
		}
	}
	tables, functions := schemaSummary(t, ctx, db)
	if tables != 20 { // 012 adds fence.read_shapes, 015 fence.consumers, 016 fence.consumer_grants, 019 fence.eras and fence.era_checks, 027 fence.confirmed_takeovers
		t.Errorf("fence tables: got %d, want 20", tables)
	}
	if functions < 15 {
		t.Errorf("fence functions: got %d, want at least 15", functions)
	}
}

// applyAtOnce runs migrations.Apply on each of dbs (the same database may
// be named more than once) at the same time, each on a connection of its
// own, and returns their errors in order.
func applyAtOnce(ctx context.Context, dbs ...string) []error {
	var wg sync.WaitGroup
	errs := make([]error, len(dbs))
	for i, db := range dbs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := cluster.Primary.Connect(ctx, db)
			if err != nil {
				errs[i] = err
				return
			}
			defer conn.Close(ctx)
			errs[i] = migrations.Apply(ctx, conn)
		}()
	}
	wg.Wait()
	return errs
}

func TestApplyConcurrently(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	for i, err := range applyAtOnce(ctx, db, db, db, db) {
		if err != nil {
			t.Errorf("migrator %d: %v", i, err)
		}
	}
	latest, _ := migrations.Latest()
	conn, err := cluster.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	v, err := migrations.Current(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	if v != latest {
		t.Fatalf("version %d, want %d", v, latest)
	}
	tables, _ := schemaSummary(t, ctx, db)
	if tables != 20 { // 012 adds fence.read_shapes, 015 fence.consumers, 016 fence.consumer_grants, 019 fence.eras and fence.era_checks, 027 fence.confirmed_takeovers
		t.Errorf("fence tables: got %d, want 20", tables)
	}
	// The protocol works after a concurrent migration.
	var token int64
	if err := conn.QueryRow(ctx, "select token from fence.acquire('job', 'w', '1 minute')").Scan(&token); err != nil {
		t.Fatalf("acquire after concurrent migrate: %v", err)
	}
}

// Two databases of one cluster migrating at once both create the
// cluster-wide roles; neither may fail.
func TestApplyConcurrentDatabases(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dbs := []string{cluster.NewDatabase(t), cluster.NewDatabase(t)}
	for i, err := range applyAtOnce(ctx, dbs...) {
		if err != nil {
			t.Errorf("database %s: %v", dbs[i], err)
		}
	}
}

// TestFunctionsPinTempLast: every function of schema fence that runs as
// its owner, or pins a search_path at all, lists pg_temp last in it, so a
// caller's temporary domain, table or view can never stand in for a type
// or relation the function names (migration 013). A later migration's
// CREATE OR REPLACE that brings back a path without pg_temp fails here.
func TestFunctionsPinTempLast(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	conn, err := cluster.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if err := migrations.Apply(ctx, conn); err != nil {
		t.Fatal(err)
	}
	// Functions made after the migrations too: fence.protect makes the
	// job-key check of a column name it has not seen.
	if _, err := conn.Exec(ctx, "create table tl (k int, fresh_key_column text); select fence.protect('tl', 'fresh_key_column')"); err != nil {
		t.Fatal(err)
	}
	rows, err := conn.Query(ctx, `
select p.oid::regprocedure::text, p.prosecdef, coalesce((select c from unnest(p.proconfig) c where c like 'search_path=%'), '')
  from pg_proc p where p.pronamespace = 'fence'::regnamespace order by 1`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var fn, path string
		var definer bool
		if err := rows.Scan(&fn, &definer, &path); err != nil {
			t.Fatal(err)
		}
		n++
		switch {
		case path == "" && definer:
			t.Errorf("%s is SECURITY DEFINER without a pinned search_path", fn)
		case path != "" && !strings.HasSuffix(strings.TrimSpace(path), "pg_temp"):
			t.Errorf("%s: %s, want pg_temp last", fn, path)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatal("no functions in schema fence")
	}
}

// TestHasEra (migration 021): any login may ask whether the server has an
// era's row (the proxy asks each replica, docs/reads.md "Replicas across a
// failover"), though fence.eras is not readable by public; the era is
// identified by its number, timeline and start, and the answer tells
// nothing else.
func TestHasEra(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	conn, err := cluster.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if err := migrations.Apply(ctx, conn); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "create role era_reader login; select fence.current_era()"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c, err := cluster.Primary.Connect(context.Background(), db)
		if err == nil {
			c.Exec(context.Background(), "drop owned by era_reader; drop role era_reader")
			c.Close(context.Background())
		}
	})
	var era, tl int32
	var began time.Time
	if err := conn.QueryRow(ctx, "select era, timeline, began_at from fence.current_era()").Scan(&era, &tl, &began); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(cluster.Primary.DSN(db))
	if err != nil {
		t.Fatal(err)
	}
	cfg.User = "era_reader"
	reader, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close(ctx)
	if _, err := reader.Exec(ctx, "select count(*) from fence.eras"); err == nil {
		t.Fatal("a plain login read fence.eras")
	}
	for _, c := range []struct {
		name    string
		era, tl int32
		began   time.Time
		want    bool
	}{
		{"current", era, tl, began, true},
		{"other_number", era + 1, tl, began, false},
		{"other_timeline", era, tl + 1, began, false},
		{"other_start", era, tl, began.Add(time.Microsecond), false},
	} {
		var got bool
		if err := reader.QueryRow(ctx, "select fence.has_era($1, $2, $3)", c.era, c.tl, c.began).Scan(&got); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got != c.want {
			t.Errorf("%s: fence.has_era = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestOwnReceiptTestsBindPostmaster (migration 023, round 10's S-H2): a
// receipt is this transaction's only if backstop_started is this
// postmaster's as well as backstop_xid this transaction's id, since a
// logical copy's new xids pass through restored receipts' ids. Every
// function of schema fence that compares backstop_xid with the current
// transaction's id compares backstop_started too: the ones migrations
// wrote, a job-key trigger function generated before 023 (rewritten by
// it), and one fence.protect generates after.
func TestOwnReceiptTestsBindPostmaster(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	conn, err := cluster.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if err := migrations.MigrateTo(ctx, conn, 22); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "create table before023 (k int, old_key_column text); select fence.protect('before023', 'old_key_column')"); err != nil {
		t.Fatal(err)
	}
	if err := migrations.Apply(ctx, conn); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "create table after023 (k int, new_key_column text); select fence.protect('after023', 'new_key_column')"); err != nil {
		t.Fatal(err)
	}
	rows, err := conn.Query(ctx, `
select p.oid::regprocedure::text, p.prosrc
  from pg_proc p where p.pronamespace = 'fence'::regnamespace and p.prosrc ~ 'backstop_xid' order by 1`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	xidTest := regexp.MustCompile(`backstop_xid\s*(=|is distinct from|is not distinct from)\s*(pg_catalog\.pg_current_xact_id|v_xid|p_xid)|r\.backstop_xid\s*=\s*pg_catalog\.pg_current_xact_id_if_assigned`)
	generated := 0
	for rows.Next() {
		var fn, src string
		if err := rows.Scan(&fn, &src); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(fn, "backstop_rows_") {
			generated++
		}
		for _, line := range strings.Split(src, "\n") {
			if xidTest.MatchString(line) && !strings.Contains(line, "backstop_started") {
				t.Errorf("%s takes a receipt as this transaction's by backstop_xid alone: %s", fn, strings.TrimSpace(line))
			}
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if generated != 2 {
		t.Fatalf("%d generated job-key functions, want 2 (one before 023, one after)", generated)
	}
}

// TestSyncStandbyCount: num_sync of synchronous_standby_names as
// fence.confirm_takeover counts it (migration 027): FIRST n (...), ANY n
// (...) and n (...) give n, a plain list or '*' one, empty none.
func TestSyncStandbyCount(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	conn := cluster.Primary.MustConnect(t, db)
	if err := migrations.Apply(ctx, conn); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		names string
		want  int
	}{
		{"", 0}, {"   ", 0}, {"*", 1}, {"s1", 1}, {"s1, s2", 1}, {`"node 2", s3`, 1},
		{"FIRST 2 (s1, s2, s3)", 2}, {"first 1 (s1)", 1}, {"ANY 2 (s1, s2, s3)", 2}, {"any 3 (a,b,c)", 3},
		{"2 (s1, s2)", 2}, {"  First  3(a, b, c)", 3}, {"10 (*)", 10},
	} {
		var got int
		if err := conn.QueryRow(ctx, "select fence.sync_standby_count($1)", c.names).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != c.want {
			t.Errorf("sync_standby_count(%q): got %d, want %d", c.names, got, c.want)
		}
	}
}

// TestFunctionsReadNoSessionSyntax (round 14, Z-M1, Z-L1): PL/pgSQL reads
// a function's string literals under the session's
// standard_conforming_strings, which any role may turn off: then '\s' is
// 's'. No function of schema fence has a backslash in a plain literal
// (an escape string, E'…', reads the same under either setting) unless it pins the
// setting itself; the job-key checks generated before the latest
// migration are rewritten by it, and those generated after are made
// from the rewritten template.
func TestFunctionsReadNoSessionSyntax(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := cluster.NewDatabase(t)
	conn, err := cluster.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	// A job-key check generated before the migration that rewrites them
	// (session_settings), whatever migrations come after it.
	if err := migrations.MigrateTo(ctx, conn, versionNamed(t, "session_settings")-1); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "create table tb (k int, old_key text); select fence.protect('tb', 'old_key')"); err != nil {
		t.Fatal(err)
	}
	if err := migrations.Apply(ctx, conn); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "create table ta (k int, new_key text); select fence.protect('ta', 'new_key')"); err != nil {
		t.Fatal(err)
	}
	rows, err := conn.Query(ctx, `
select p.oid::regprocedure::text, p.prosrc, coalesce('standard_conforming_strings=on' = any(p.proconfig), false)
  from pg_proc p where p.pronamespace = 'fence'::regnamespace order by 1`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	eLiteral := regexp.MustCompile(`(?i)\bE'(?:[^'\\]|\\.|'')*'`)
	n, generated := 0, 0
	for rows.Next() {
		var fn, src string
		var pinned bool
		if err := rows.Scan(&fn, &src, &pinned); err != nil {
			t.Fatal(err)
		}
		n++
		if strings.HasPrefix(fn, "fence.backstop_rows_") {
			generated++
		}
		if rest := eLiteral.ReplaceAllString(src, "E''"); strings.Contains(rest, `\`) && !pinned {
			i := strings.Index(rest, `\`)
			t.Errorf("%s has a backslash outside an E'' literal and does not pin standard_conforming_strings: …%s…", fn, rest[max(0, i-40):min(len(rest), i+40)])
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if n == 0 || generated != 2 {
		t.Fatalf("%d functions in schema fence, %d job-key checks, want some and 2", n, generated)
	}
}
