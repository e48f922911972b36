package proxy

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("current", bypassCurrent) }

// bypassCurrent: the protected set is always current (issue 19 §3).
// Whatever way a table joins fence.protected_tables — fence.protect, a
// direct INSERT, COPY, a data-only pg_restore of it, a full restore into
// an empty database, a restore of a whole cluster — the first transaction
// after it is fenced by it, through a proxy session that was open before
// the change and whose gate never hears of it: its watcher ignores
// pgfence_protected (catalogs.deaf), and each case checks that the
// catalog was not reloaded. An unfenced write is refused (FN008), a
// fenced one commits with exactly one receipt, its retry after a lost
// commit answer applies nothing (a replay), and a zombie cannot commit
// (FN001). Then the database's own refusals: the rows of
// fence.protected_tables cannot be removed or disabled behind
// fence.unprotect (FN010), and a row must name a protectable table.
// currentTriggers is the backstop's trigger count on a keyed table: the
// two statement triggers, the replay row trigger and (migration 011) the
// three job-key statement triggers.
const currentTriggers = 6

func bypassCurrent(t *testing.T) {
	t.Run("fence_protect", func(t *testing.T) {
		e := newCurrentEnv(t, cluster.Primary, "", "")
		currentExec(t, e.admin, "select fence.protect('cur_t', 'job_key')")
		e.check(t, true)
	})
	t.Run("direct_insert", func(t *testing.T) {
		e := newCurrentEnv(t, cluster.Primary, "", "")
		// Wrong names and owner: the catalog's replace them.
		currentExec(t, e.admin, "insert into fence.protected_tables (relid, schema_name, table_name, job_key_column, root, owner) "+
			"values ('cur_t', 'elsewhere', 'renamed', 'job_key', 'cur_t', 'pgfence_worker')")
		if n := currentCount(t, e.admin, "select count(*) from fence.protected_tables where relid = 'cur_t'::regclass "+
			"and schema_name = 'public' and table_name = 'cur_t' and owner = 'postgres'::regrole"); n != 1 {
			t.Fatalf("the row's names and owner are not the catalog's (%d rows)", n)
		}
		e.check(t, true)
	})
	t.Run("copy", func(t *testing.T) {
		e := newCurrentEnv(t, cluster.Primary, "", "")
		if _, err := e.admin.PgConn().CopyFrom(ctxT(t), strings.NewReader("public.cur_t\tpublic\tcur_t\tjob_key\tpublic.cur_t\tpostgres\n"),
			"copy fence.protected_tables (relid, schema_name, table_name, job_key_column, root, owner) from stdin"); err != nil {
			t.Fatal(err)
		}
		e.check(t, true)
	})
	t.Run("pg_restore_data_only", func(t *testing.T) {
		db := cluster.NewDatabase(t)
		role := currentSchema(t, cluster.Primary, db)
		admin := currentAdmin(t, cluster.Primary, db)
		currentExec(t, admin, "select fence.protect('cur_t', 'job_key')")
		archive := filepath.Join(t.TempDir(), "set.dump")
		currentTool(t, cluster.Primary, "pg_dump", "-Fc", "-a", "-t", "fence.protected_tables", "-d", db, "-f", archive)
		currentExec(t, admin, "select fence.unprotect('cur_t')")
		e := newCurrentEnv(t, cluster.Primary, db, role)
		currentTool(t, cluster.Primary, "pg_restore", "-a", "-d", db, archive)
		e.check(t, true)
	})
	t.Run("pg_restore_full_into_empty", func(t *testing.T) {
		archive, role := currentSource(t)
		db := currentEmptyDatabase(t, cluster.Primary, "cur_empty")
		e := newCurrentEnv(t, cluster.Primary, db, role)
		currentTool(t, cluster.Primary, "pg_restore", "-d", db, archive)
		e.check(t, false)
		t.Run("clean_over_it", func(t *testing.T) {
			// pg_restore --clean over the restored database, with the
			// proxy's sessions still in it: no error, and still fenced.
			currentTool(t, cluster.Primary, "pg_restore", "--clean", "-d", db, archive)
			if n := currentCount(t, e.admin, "select count(*) from pg_trigger where tgrelid = 'cur_t'::regclass and tgname like 'pgfence%'"); n != currentTriggers {
				t.Fatalf("cur_t has %d pgfence triggers after pg_restore --clean, want %d", n, currentTriggers)
			}
			before := e.state(t)
			if err := currentRun(t, e.unfenced, "update cur_t set n = n + 1 where k = 1"); pgtest.SQLState(err) != fence.CodeFencingRequired {
				t.Fatalf("unfenced write after pg_restore --clean: %v, want %s", err, fence.CodeFencingRequired)
			}
			e.unchanged(t, before)
		})
	})
	t.Run("schema_then_data_restore", func(t *testing.T) {
		// A restore in two steps: the schema (with every trigger), then
		// fence.protected_tables' data, whose rows find their tables
		// fenced already and leave them alone.
		archive, _ := currentSource(t)
		db := currentEmptyDatabase(t, cluster.Primary, "cur_twostep")
		currentTool(t, cluster.Primary, "pg_restore", "-s", "-d", db, archive)
		currentTool(t, cluster.Primary, "pg_restore", "-a", "-n", "fence", "-t", "protected_tables", "-d", db, archive)
		admin := currentAdmin(t, cluster.Primary, db)
		if n := currentCount(t, admin, "select count(*) from pg_trigger where tgrelid = 'cur_t'::regclass and tgname like 'pgfence%'"); n != currentTriggers {
			t.Fatalf("cur_t has %d pgfence triggers, want %d", n, currentTriggers)
		}
		if n := currentCount(t, admin, "select count(*) from fence.protected_tables"); n != 1 {
			t.Fatalf("%d protected tables, want 1", n)
		}
	})
	t.Run("no_fence_schema", func(t *testing.T) {
		// A database without the fence schema: nothing gets a gate or
		// receipt step (commit_if_written does not exist there). A fenced
		// session's writes and opaque statements are refused with FN014
		// (issue 30: they went as they were, unfenced; TestBypass/noschema),
		// its reads and DDL pass, and an unfenced session's writes pass.
		db := currentEmptyDatabase(t, cluster.Primary, "cur_noschema")
		gate, p := currentProxy(t, cluster.Primary, false)
		dsn := fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", p.addr, db)
		conn := connect(t, dsn)
		for _, step := range []struct{ sql, code string }{
			{"set fence.job_key = 'j'; set fence.epoch = 1; set fence.token = 1", ""},
			{"create table cur_x (k int)", ""},
			{"insert into cur_x values (1)", fence.CodeNotInstalled},
			{"begin; do $$ begin insert into cur_x values (2); end $$; update cur_x set k = k + 10; commit", fence.CodeNotInstalled},
			{"rollback", ""},
			{"select count(*) from cur_x", ""},
		} {
			if err := currentRun(t, conn, step.sql); pgtest.SQLState(err) != step.code {
				t.Fatalf("%s: %v, want SQLSTATE %q", step.sql, err, step.code)
			}
		}
		if err := currentRun(t, connect(t, dsn), "insert into cur_x values (3)"); err != nil {
			t.Fatalf("an unfenced session's write: %v", err)
		}
		if got := gate.Stats.Gated.Load() + gate.Stats.Committed.Load(); got != 0 {
			t.Fatalf("the gate gated %d times in a database without the fence schema", got)
		}
	})
	t.Run("pg_dumpall_cluster", currentCluster)
	t.Run("catalog_catches_up", currentCatchesUp)
	t.Run("catalog_refresh_after_restore", currentRefreshAfterRestore)
	t.Run("set_refuses", currentRefusals)
	t.Run("internal_paths", currentInternalPaths)
}

// currentSchema creates in db the role the sessions use (a worker) and
// cur_t, unprotected, with one row of job cur-job.
func currentSchema(t *testing.T, node *pgtest.Node, db string) string {
	t.Helper()
	admin := currentAdmin(t, node, db)
	prefix, _, _ := strings.Cut(db, "_")
	role := prefix + "_cworker"
	currentExec(t, admin, fmt.Sprintf(`
do $$ begin create role %[1]s login in role pgfence_worker; exception when duplicate_object then null; end $$;
create table cur_t (k int primary key, job_key text not null, n int not null default 0);
insert into cur_t values (1, 'cur-job', 0);
grant select, insert, update, delete on cur_t to %[1]s;`, pgx.Identifier{role}.Sanitize()))
	return role
}

// currentEnv is a database whose protected set is about to change and a
// proxy that has four sessions in it already, whose watcher ignores
// pgfence_protected.
type currentEnv struct {
	node  *pgtest.Node
	db    string
	role  string // the sessions' role
	admin *pgx.Conn
	gate  *Fence
	proxy *testProxy
	loads int64 // the catalog's loads when the sessions were open

	unfenced, fenced, retry, zombie *pgconn.PgConn
	notices                         []string // SQLSTATEs of the retry session's notices
}

// newCurrentEnv opens the sessions in db as role (when db is "": in a
// fresh database with cur_t, as its worker).
func newCurrentEnv(t *testing.T, node *pgtest.Node, db, role string) *currentEnv {
	t.Helper()
	if db == "" {
		db = cluster.NewDatabase(t)
		role = currentSchema(t, node, db)
	}
	e := &currentEnv{node: node, db: db, role: role, admin: currentAdmin(t, node, db)}
	e.gate, e.proxy = currentProxy(t, node, true)
	open := func(notices *[]string) *pgconn.PgConn {
		cfg, err := pgconn.ParseConfig(fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", role, e.proxy.addr, db))
		if err != nil {
			t.Fatal(err)
		}
		if notices != nil {
			cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { *notices = append(*notices, n.Code) }
		}
		return connectConfig(t, cfg)
	}
	e.unfenced, e.fenced, e.retry, e.zombie = open(nil), open(nil), open(&e.notices), open(nil)
	e.loads = e.catalog(t).loads.Load()
	return e
}

// currentProxy is a gated proxy in front of node; deaf: its watchers
// ignore pgfence_protected.
func currentProxy(t *testing.T, node *pgtest.Node, deaf bool) (*Fence, *testProxy) {
	t.Helper()
	gate, err := NewFence(FenceConfig{Primary: node.DSN("postgres")}, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	gate.cats.deaf.Store(deaf)
	t.Cleanup(gate.Close)
	return gate, startProxy(t, Config{Primary: node.DSN("postgres"), Interceptor: gate})
}

func (e *currentEnv) catalog(t *testing.T) *catalog {
	t.Helper()
	c := e.gate.cats.lookup(e.db)
	if c == nil {
		t.Fatalf("no catalog watcher for %s", e.db)
	}
	return c
}

// check runs the four attempts through the sessions opened before the
// change. replayNotice: the proxy knew the database has the fence schema
// (it had it when the sessions opened), so it ends the fenced
// transaction with commit_if_written and answers the retry as a replay
// (COMMIT and an FN00R NOTICE); else the retry's COMMIT fails with
// FN00R, the backstop's answer.
func (e *currentEnv) check(t *testing.T, replayNotice bool) {
	t.Helper()
	ctx := ctxT(t)
	if n := currentCount(t, e.admin, "select count(*) from pg_trigger where tgrelid = 'cur_t'::regclass and tgname like 'pgfence%'"); n != currentTriggers {
		t.Fatalf("cur_t has %d pgfence triggers after the change, want %d", n, currentTriggers)
	}
	// The generations, after the change (a restore brings the schema).
	w, err := pgx.Connect(ctx, fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", e.role, e.node.Addr(), e.db))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close(context.Background())
	stale, err := fence.Acquire(ctx, w, "cur-job", "a", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	currentExec(t, e.admin, "update fence.leases set expires_at = clock_timestamp() - interval '1 second' where job_key = 'cur-job'")
	cur, err := fence.Acquire(ctx, w, "cur-job", "b", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	set := func(c *pgconn.PgConn, l fence.Lease) {
		t.Helper()
		if err := currentRun(t, c, fmt.Sprintf("set fence.job_key = '%s'; set fence.epoch = %d; set fence.token = %d", l.JobKey, l.Epoch, l.Token)); err != nil {
			t.Fatal(err)
		}
	}
	set(e.fenced, cur)
	set(e.retry, cur)
	set(e.zombie, stale)

	t.Run("unfenced_write", func(t *testing.T) {
		before := e.state(t)
		for _, sql := range []string{"update cur_t set n = n + 1 where k = 1", "insert into cur_t values (9, 'cur-job', 0)",
			"do $$ begin delete from cur_t; end $$"} {
			if err := currentRun(t, e.unfenced, sql); pgtest.SQLState(err) != fence.CodeFencingRequired {
				t.Fatalf("%s: %v, want %s", sql, err, fence.CodeFencingRequired)
			}
		}
		e.unchanged(t, before)
	})
	tx := "set fence.step = 'current'; begin; update cur_t set n = n + 1 where k = 1; insert into cur_t values (2, 'cur-job', 0); commit"
	t.Run("fenced_write", func(t *testing.T) {
		if err := currentRun(t, e.fenced, tx); err != nil {
			t.Fatalf("fenced write: %v", err)
		}
		// The proxy's commit step writes it when it knew the schema, else
		// the backstop's mark.
		want := fence.BackstopDigestVersion
		if replayNotice {
			want = fence.DigestVersion
		}
		var n int
		var version string
		if err := e.admin.QueryRow(ctxT(t), `select count(*), coalesce(min(digest_version), '') from fence.receipts
			where job_key = 'cur-job' and epoch = $1 and token = $2 and step = 'current'`, cur.Epoch, cur.Token).Scan(&n, &version); err != nil {
			t.Fatal(err)
		}
		if n != 1 || version != want {
			t.Fatalf("%d receipts for the step (digest version %q), want 1 (%s)", n, version, want)
		}
		if n := currentCount(t, e.admin, "select count(*) from cur_t where (k = 1 and n = 1) or k = 2"); n != 2 {
			t.Fatalf("the fenced write's rows: %d of 2", n)
		}
	})
	t.Run("retry_after_lost_commit", func(t *testing.T) {
		before := e.state(t)
		err := currentRun(t, e.retry, tx)
		switch {
		case replayNotice && err != nil:
			t.Fatalf("retry: %v, want the replay's success", err)
		case replayNotice && !slices.Equal(e.notices, []string{fence.CodeReplay}):
			t.Fatalf("retry's notices %v, want one %s", e.notices, fence.CodeReplay)
		case !replayNotice && pgtest.SQLState(err) != fence.CodeReplay:
			t.Fatalf("retry: %v, want %s", err, fence.CodeReplay)
		}
		e.unchanged(t, before)
	})
	t.Run("zombie", func(t *testing.T) {
		before := e.state(t)
		for _, sql := range []string{"update cur_t set n = n + 100 where k = 1",
			"begin; insert into cur_t values (3, 'cur-job', 0); commit"} {
			if err := currentRun(t, e.zombie, sql); pgtest.SQLState(err) != fence.CodeStale {
				t.Fatalf("%s with the stale generation: %v, want %s", sql, err, fence.CodeStale)
			}
			if err := currentRun(t, e.zombie, "rollback"); err != nil {
				t.Fatal(err)
			}
		}
		e.unchanged(t, before)
	})
	t.Run("copy", func(t *testing.T) {
		// COPY FROM a table the catalog does not list is not wrapped
		// (maybeWrite leaves it on the event loop): the backstop fences
		// it, writes its receipt, and answers the retry itself.
		copyIn := func(c *pgconn.PgConn) error {
			_, err := c.CopyFrom(ctxT(t), strings.NewReader("10\tcur-job\t0\n"), "copy cur_t (k, job_key, n) from stdin")
			return err
		}
		before := e.state(t)
		if err := copyIn(e.unfenced); pgtest.SQLState(err) != fence.CodeFencingRequired {
			t.Fatalf("unfenced COPY: %v, want %s", err, fence.CodeFencingRequired)
		}
		if err := copyIn(e.zombie); pgtest.SQLState(err) != fence.CodeStale {
			t.Fatalf("zombie's COPY: %v, want %s", err, fence.CodeStale)
		}
		e.unchanged(t, before)
		for _, c := range []*pgconn.PgConn{e.fenced, e.retry} {
			if err := currentRun(t, c, "set fence.step = 'copy'"); err != nil {
				t.Fatal(err)
			}
		}
		if err := copyIn(e.fenced); err != nil {
			t.Fatalf("fenced COPY: %v", err)
		}
		if n := currentCount(t, e.admin, "select count(*) from fence.receipts where job_key = 'cur-job' and epoch = $1 and token = $2 and step = 'copy'",
			cur.Epoch, cur.Token); n != 1 {
			t.Fatalf("%d receipts for the COPY's step, want 1", n)
		}
		before = e.state(t)
		if err := copyIn(e.retry); pgtest.SQLState(err) != fence.CodeReplay {
			t.Fatalf("the COPY's retry: %v, want %s", err, fence.CodeReplay)
		}
		e.unchanged(t, before)
	})
	// All of it on the catalog read before the change.
	c := e.catalog(t)
	if got := c.loads.Load(); got != e.loads {
		t.Fatalf("the catalog was reloaded (%d loads, %d when the sessions opened): the case proves nothing", got, e.loads)
	}
	if n := c.prot.Load().Len(); n != 0 {
		t.Fatalf("the catalog lists %d protected tables: it was not stale", n)
	}
}

// state is what an attempt must not change, read on the direct
// connection.
func (e *currentEnv) state(t *testing.T) []string {
	t.Helper()
	rows, err := e.admin.Query(ctxT(t), `
select 'row ' || r::text from cur_t r
union all select 'receipt ' || concat_ws(' ', job_key, epoch, token, step, digest_version) from fence.receipts
union all select 'fence ' || f::text from fence.fences f
union all select 'protected ' || concat_ws(' ', relid, root, job_key_column) from fence.protected_tables
union all select 'trigger ' || concat_ws(' ', tgrelid::regclass, tgname, tgenabled) from pg_trigger where tgname like 'pgfence%'`)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(lines)
	return lines
}

func (e *currentEnv) unchanged(t *testing.T, before []string) {
	t.Helper()
	if after := e.state(t); !slices.Equal(before, after) {
		t.Fatalf("the attempt changed what it must not:\nbefore: %s\nafter:  %s", strings.Join(before, "\n        "), strings.Join(after, "\n        "))
	}
}

// currentSource is a custom-format dump of a database with cur_t
// protected (job-key column job_key), and its worker role.
func currentSource(t *testing.T) (archive, role string) {
	t.Helper()
	db := cluster.NewDatabase(t)
	role = currentSchema(t, cluster.Primary, db)
	currentExec(t, currentAdmin(t, cluster.Primary, db), "select fence.protect('cur_t', 'job_key')")
	archive = filepath.Join(t.TempDir(), "source.dump")
	currentTool(t, cluster.Primary, "pg_dump", "-Fc", "-d", db, "-f", archive)
	return archive, role
}

// currentEmptyDatabase creates a database from template0 (no fence
// schema), dropped when t ends.
func currentEmptyDatabase(t *testing.T, node *pgtest.Node, prefix string) string {
	t.Helper()
	name := fmt.Sprintf("%s_%d", prefix, time.Now().UnixNano())
	currentExec(t, currentAdmin(t, node, "postgres"), fmt.Sprintf("create database %s template template0", name))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if c, err := node.Connect(ctx, "postgres"); err == nil {
			c.Exec(ctx, fmt.Sprintf("drop database if exists %s with (force)", name))
			c.Close(ctx)
		}
	})
	return name
}

// currentCluster: pg_dumpall of a database with a protected table,
// restored with psql -f into a second, fresh cluster whose database of
// that name the proxy already has sessions in (created empty: pg_dumpall's
// CREATE DATABASE then fails, as its CREATE ROLE postgres always does,
// and psql goes on).
func currentCluster(t *testing.T) {
	ctx := ctxT(t)
	src := fmt.Sprintf("pgfence_cursrc_%d", time.Now().UnixNano())
	main := currentAdmin(t, cluster.Primary, "postgres")
	currentExec(t, main, fmt.Sprintf("create database %s template %s", src, pgtest.TemplateName))
	t.Cleanup(func() { cluster.DropDatabase(context.Background(), src) })
	role := currentSchema(t, cluster.Primary, src)
	currentExec(t, currentAdmin(t, cluster.Primary, src), "select fence.protect('cur_t', 'job_key')")
	// Only src: every other database is excluded by name (the package's
	// test databases, t<N>_..., by pattern: they come and go).
	rows, err := main.Query(ctx, "select datname from pg_database where datname <> $1 and datname !~ '^t[0-9]'", src)
	if err != nil {
		t.Fatal(err)
	}
	others, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"--exclude-database", "t[0-9]*"}
	for _, db := range others {
		args = append(args, "--exclude-database", db)
	}
	script := filepath.Join(t.TempDir(), "cluster.sql")
	currentTool(t, cluster.Primary, "pg_dumpall", append(args, "-f", script)...)

	target, err := pgtest.Start(ctx, pgtest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { target.Close() })
	currentExec(t, currentAdmin(t, target.Primary, "postgres"), fmt.Sprintf("create database %s template template0", src))
	// Its sessions' role: the worker arrives with the restore.
	e := newCurrentEnv(t, target.Primary, src, "postgres")
	_, stderr, err := target.Client(target.Primary.Host, target.Primary.Port, "", "psql", "-X", "-q", "-d", "postgres", "-f", script)
	if err != nil {
		t.Fatalf("psql -f of the cluster's dump: %v\n%s", err, stderr)
	}
	expected := regexp.MustCompile(`^psql:[^ ]+: ERROR:  (role "postgres"|database "` + src + `") already exists$`)
	for _, line := range strings.Split(strings.TrimSpace(stderr), "\n") {
		if line != "" && !expected.MatchString(line) {
			t.Fatalf("psql -f of the cluster's dump: unexpected message %q\n%s", line, stderr)
		}
	}
	e.check(t, false)
	t.Run("new_proxy", func(t *testing.T) {
		// A proxy started on the restored cluster knows the table.
		gate, p := currentProxy(t, target.Primary, false)
		conn := connect(t, fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", role, p.addr, src))
		before := e.state(t)
		if err := currentRun(t, conn, "update cur_t set n = n + 1"); pgtest.SQLState(err) != fence.CodeFencingRequired {
			t.Fatalf("unfenced write: %v, want %s", err, fence.CodeFencingRequired)
		}
		if gate.Stats.Unfenced.Load() != 1 {
			t.Fatalf("the new proxy did not refuse the write itself (Unfenced %d)", gate.Stats.Unfenced.Load())
		}
		e.unchanged(t, before)
	})
}

// currentCatchesUp: with the notification heard, the proxy's catalog
// follows a direct INSERT, and the gate refuses an unfenced write itself.
func currentCatchesUp(t *testing.T) {
	db := cluster.NewDatabase(t)
	role := currentSchema(t, cluster.Primary, db)
	admin := currentAdmin(t, cluster.Primary, db)
	gate, p := currentProxy(t, cluster.Primary, false)
	conn := connect(t, fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", role, p.addr, db))
	c := gate.cats.lookup(db)
	loads := c.loads.Load()
	currentExec(t, admin, "insert into fence.protected_tables (relid, schema_name, table_name, job_key_column, root, owner) "+
		"values ('cur_t', 'public', 'cur_t', 'job_key', 'cur_t', 'postgres')")
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return c.loads.Load() > loads && c.prot.Load().Len() == 1, nil }); err != nil {
		t.Fatalf("the catalog never listed the table (%d loads, %d before): %v", c.loads.Load(), loads, err)
	}
	if err := currentRun(t, conn, "update cur_t set n = n + 1"); pgtest.SQLState(err) != fence.CodeFencingRequired {
		t.Fatalf("unfenced write: %v, want %s", err, fence.CodeFencingRequired)
	}
	if gate.Stats.Unfenced.Load() != 1 {
		t.Fatalf("the proxy did not refuse the write itself (Unfenced %d)", gate.Stats.Unfenced.Load())
	}
}

// currentRefusals: the database refuses, on a superuser's direct
// connection, what would leave a table in fence.protected_tables
// unfenced, or a row that names nothing protectable; each changes
// nothing.
func currentRefusals(t *testing.T) {
	db := cluster.NewDatabase(t)
	currentSchema(t, cluster.Primary, db)
	admin := currentAdmin(t, cluster.Primary, db)
	currentExec(t, admin, `
select fence.protect('cur_t', 'job_key');
create table cur_other (k int primary key, job_key text, num int);
create view cur_view as select * from cur_other;
create table cur_tree (k int, job_key text) partition by list (k);
create table cur_tree_1 partition of cur_tree for values in (1);`)
	e := &currentEnv{db: db, admin: admin}
	row := func(rel, col string) string {
		return fmt.Sprintf("insert into fence.protected_tables (relid, schema_name, table_name, job_key_column, root, owner) "+
			"values (%s, 'public', 'x', %s, %[1]s, 'postgres')", rel, col)
	}
	for _, tc := range []struct{ name, sql, code string }{
		{"delete", "delete from fence.protected_tables", fence.CodeProtectionLocked},
		{"delete_in_function", "do $$ begin delete from fence.protected_tables where relid = 'cur_t'::regclass; end $$", fence.CodeProtectionLocked},
		{"update_relid", "update fence.protected_tables set relid = 'cur_other', root = 'cur_other'", fence.CodeProtectionLocked},
		{"update_job_key_column", "update fence.protected_tables set job_key_column = null", fence.CodeProtectionLocked},
		{"truncate", "truncate fence.protected_tables", fence.CodeProtectionLocked},
		{"disable_all", "alter table fence.protected_tables disable trigger all", fence.CodeProtectionLocked},
		{"disable_one", "alter table fence.protected_tables disable trigger pgfence_set_added", fence.CodeProtectionLocked},
		{"replica_only", "alter table fence.protected_tables enable replica trigger pgfence_set_removed", fence.CodeProtectionLocked},
		{"drop_trigger", "drop trigger pgfence_set_added on fence.protected_tables", fence.CodeProtectionLocked},
		{"rename_trigger", "alter trigger pgfence_set_refuse on fence.protected_tables rename to cur_x", fence.CodeProtectionLocked},
		{"replace_trigger", "create or replace trigger pgfence_set_removed before delete on fence.protected_tables for each row execute function suppress_redundant_updates_trigger()",
			fence.CodeProtectionLocked},
		{"drop_function", "drop function fence.set_refuse() cascade", fence.CodeProtectionLocked},
		{"no_such_table", row("99999::oid::regclass", "null"), "42P01"},
		{"view", row("'cur_view'", "null"), "42809"},
		{"fence_table", row("'fence.fences'", "null"), "42809"},
		{"no_such_column", row("'cur_other'", "'nope'"), "42703"},
		{"integer_column", row("'cur_other'", "'num'"), "42804"},
		{"partition_alone", row("'cur_tree_1'", "null"), "42809"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := e.state(t)
			if _, err := admin.Exec(ctxT(t), tc.sql); pgtest.SQLState(err) != tc.code {
				t.Fatalf("%s: %v, want %s", tc.sql, err, tc.code)
			}
			e.unchanged(t, before)
		})
	}
	t.Run("replica_role_insert", func(t *testing.T) {
		// session_replication_role = replica (a logical replication
		// apply, or a superuser) does not skip the triggers.
		currentExec(t, admin, "begin; set local session_replication_role = replica; "+row("'cur_other'", "'job_key'")+"; commit")
		if n := currentCount(t, admin, "select count(*) from pg_trigger where tgrelid = 'cur_other'::regclass and tgname like 'pgfence%'"); n != currentTriggers {
			t.Fatalf("cur_other has %d pgfence triggers, want %d", n, currentTriggers)
		}
	})
	t.Run("harmless_update", func(t *testing.T) {
		currentExec(t, admin, "update fence.protected_tables set protected_at = protected_at - interval '1 day'")
	})
}

// currentInternalPaths: pgfence's own ways of removing rows still work —
// fence.unprotect, DROP TABLE and DROP SCHEMA … CASCADE of a protected
// table (the DDL guard deletes its row), the guard's tree upkeep — and a
// COPY of a tree's rows, members first, protects the whole tree once.
func currentInternalPaths(t *testing.T) {
	db := cluster.NewDatabase(t)
	currentSchema(t, cluster.Primary, db)
	admin := currentAdmin(t, cluster.Primary, db)
	currentExec(t, admin, `
create table cur_tree (k int, job_key text) partition by list (k);
create table cur_tree_1 partition of cur_tree for values in (1);
create table cur_tree_2 partition of cur_tree for values in (2);
create schema cur_s;
create table cur_s.t (k int);`)
	if _, err := admin.PgConn().CopyFrom(ctxT(t), strings.NewReader(
		"public.cur_tree_1\tpublic\tcur_tree_1\t\\N\tpublic.cur_tree\tpostgres\n"+
			"public.cur_tree\tpublic\tcur_tree\t\\N\tpublic.cur_tree\tpostgres\n"+
			"cur_s.t\tcur_s\tt\t\\N\tcur_s.t\tpostgres\n"),
		"copy fence.protected_tables (relid, schema_name, table_name, job_key_column, root, owner) from stdin"); err != nil {
		t.Fatal(err)
	}
	// cur_tree_2 had no row: the root's row brought it in.
	if got := currentCount(t, admin, "select count(*) from fence.protected_tables where root = 'cur_tree'::regclass"); got != 3 {
		t.Fatalf("%d members of cur_tree protected, want 3", got)
	}
	if got := currentCount(t, admin, `select count(*) from pg_trigger where tgname like 'pgfence%'
		and tgrelid in ('cur_tree'::regclass, 'cur_tree_1'::regclass, 'cur_tree_2'::regclass)`); got != 2+3+3 {
		t.Fatalf("the tree has %d pgfence triggers, want 8", got)
	}
	for _, sql := range []string{
		"create table cur_tree_3 partition of cur_tree for values in (3)",
		"alter table cur_tree detach partition cur_tree_3",
		"drop table cur_tree_3",
		"select fence.unprotect('cur_tree')",
		"select fence.protect('cur_tree')",
		"drop schema cur_s cascade",
		"drop table cur_tree",
	} {
		currentExec(t, admin, sql)
	}
	if got := currentCount(t, admin, "select count(*) from fence.protected_tables"); got != 0 {
		t.Fatalf("%d rows left in fence.protected_tables, want 0", got)
	}
}

func currentAdmin(t *testing.T, node *pgtest.Node, db string) *pgx.Conn {
	t.Helper()
	c, err := node.Connect(ctxT(t), db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

func currentExec(t *testing.T, c *pgx.Conn, sql string) {
	t.Helper()
	if _, err := c.PgConn().Exec(ctxT(t), sql).ReadAll(); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func currentCount(t *testing.T, c *pgx.Conn, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := c.QueryRow(ctxT(t), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// currentRun sends sql as one simple query and returns its first error.
func currentRun(t *testing.T, c *pgconn.PgConn, sql string) error {
	t.Helper()
	_, err := c.Exec(ctxT(t), sql).ReadAll()
	return err
}

// currentTool runs a PostgreSQL client program of the server's version
// against node as postgres, failing t on an error or any message.
func currentTool(t *testing.T, node *pgtest.Node, prog string, args ...string) {
	t.Helper()
	_, stderr, err := cluster.Client(node.Host, node.Port, "", prog, args...)
	if err != nil || stderr != "" {
		t.Fatalf("%s %s: %v\n%s", prog, strings.Join(args, " "), err, stderr)
	}
}

// currentRefreshAfterRestore: a database restored whole under a proxy
// that already has a session in it notifies nobody (the restore creates
// its triggers after its data); the periodic refresh (CatalogRefresh)
// brings the proxy's view up to date, and from then on the proxy refuses
// the unfenced write itself. (Until then the backstop does:
// pg_restore_full_into_empty.)
func currentRefreshAfterRestore(t *testing.T) {
	archive, role := currentSource(t)
	db := currentEmptyDatabase(t, cluster.Primary, "cur_refresh")
	gate, err := NewFence(FenceConfig{Primary: cluster.Primary.DSN("postgres"), CatalogRefresh: 100 * time.Millisecond}, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(gate.Close)
	p := startProxy(t, Config{Primary: cluster.Primary.DSN("postgres"), Interceptor: gate})
	conn := connect(t, fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", role, p.addr, db))
	c := gate.cats.lookup(db)
	if c == nil || c.schema.Load() {
		t.Fatalf("catalog of the empty database: %v (schema %v)", c, c != nil && c.schema.Load())
	}
	currentTool(t, cluster.Primary, "pg_restore", "-d", db, archive)
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return c.schema.Load() && c.prot.Load().Len() > 0, nil }); err != nil {
		t.Fatalf("the catalog never listed the restored tables (%d loads): %v", c.loads.Load(), err)
	}
	if err := currentRun(t, conn, "update cur_t set n = n + 1"); pgtest.SQLState(err) != fence.CodeFencingRequired {
		t.Fatalf("unfenced write: %v, want %s", err, fence.CodeFencingRequired)
	}
	if gate.Stats.Unfenced.Load() != 1 {
		t.Fatalf("the proxy did not refuse the write itself (Unfenced %d)", gate.Stats.Unfenced.Load())
	}
}
