package proxy

import (
	"context"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// This file registers no class: it is the set-up the database-side
// classes of TestBypass (issue 17: partition, inheritance, owner, definer,
// receipt, ownership, consumer) attack. Each class gets a database of its
// own with a realistic cast:
//
//   - worker, worker2: LOGIN members of pgfence_worker that own no table;
//     worker holds job "job" (a stale and a current generation), worker2
//     a job of its own;
//   - owner: LOGIN, owns every table and schema app, not in
//     pgfence_bypass, and may EXECUTE fence.protect and fence.unprotect
//     (as a DBA might grant an application's owner); owner2, a role owner
//     belongs to (so that OWNER TO owner2 is possible);
//   - dba: LOGIN member of pgfence_bypass and of owner (its DDL is the
//     owner's);
//   - su: a superuser that is not in pgfence_bypass.
//
// The tables, all protected: res, partitioned by range, with partitions
// res_1 and res_2, res_2 itself partitioned into res_2a and res_2b;
// inh with the inheritance child inh_c; app.ledger, whose rows are scoped
// to their job_key. notes is unprotected.
type cast struct {
	db    string
	proxy *testProxy
	admin *pgx.Conn // superuser: set-up and the separate checks

	worker, worker2, owner, owner2, dba, su string

	stale, current fence.Lease // worker's generations of job "job"
	other          fence.Lease // worker2's generation of job "job2"
}

const castTables = `
create table res (k int primary key, job_key text not null, v text not null) partition by range (k);
create table res_1 partition of res for values from (0) to (100);
create table res_2 partition of res for values from (100) to (200) partition by range (k);
create table res_2a partition of res_2 for values from (100) to (150);
create table res_2b partition of res_2 for values from (150) to (200);
create table inh (k int not null, job_key text not null, v text not null);
create table inh_c (primary key (k)) inherits (inh);
create table app.ledger (k int primary key, job_key text not null, v text not null);
create table notes (id serial primary key, note text not null);
`

// newCast creates the database, the roles, the tables, the proxy and the
// generations.
func newCast(t *testing.T) *cast {
	t.Helper()
	ctx := ctxT(t)
	db := cluster.NewDatabase(t)
	prefix, _, _ := strings.Cut(db, "_")
	c := &cast{db: db,
		worker: prefix + "_worker", worker2: prefix + "_worker2", owner: prefix + "_owner", owner2: prefix + "_owner2",
		dba: prefix + "_dba", su: prefix + "_su"}
	admin, err := cluster.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close(context.Background()) })
	c.admin = admin
	id := func(s string) string { return pgx.Identifier{s}.Sanitize() }
	tables := "res, res_1, res_2, res_2a, res_2b, inh, inh_c, app.ledger, notes"
	c.exec(t, fmt.Sprintf(`
create role %[1]s login in role pgfence_worker;
create role %[2]s login in role pgfence_worker;
create role %[3]s login;
create role %[4]s nologin;
grant %[4]s to %[3]s;
create role %[5]s login in role pgfence_bypass, %[3]s;
create role %[6]s login superuser;
grant create on schema public to %[3]s;
create schema app authorization %[3]s;
grant execute on function fence.protect(regclass, text), fence.unprotect(regclass) to %[3]s;
set session authorization %[3]s;
%[7]s
grant usage on schema app to %[1]s, %[2]s, %[4]s;
grant select, insert, update, delete, truncate on %[8]s to %[1]s, %[2]s;
grant usage on sequence notes_id_seq to %[1]s, %[2]s;
reset session authorization;
select fence.protect('res'), fence.protect('inh'), fence.protect('app.ledger', 'job_key');
set session authorization %[5]s;
insert into res values (1, 'job', 'seed'), (120, 'job', 'seed'), (160, 'job', 'seed');
insert into inh values (1, 'job', 'seed');
insert into inh_c values (2, 'job', 'seed');
insert into app.ledger values (1, 'job', 'seed'), (2, 'job2', 'seed');
reset session authorization;
`, id(c.worker), id(c.worker2), id(c.owner), id(c.owner2), id(c.dba), id(c.su), castTables, tables))
	w := c.connectPgx(t, "direct", c.worker, nil)
	if c.stale, err = fence.Acquire(ctx, w, "job", "a", time.Minute); err != nil {
		t.Fatal(err)
	}
	c.exec(t, "update fence.leases set expires_at = clock_timestamp() - interval '1 second' where job_key = 'job'")
	if c.current, err = fence.Acquire(ctx, w, "job", "b", time.Minute); err != nil {
		t.Fatal(err)
	}
	if c.other, err = fence.Acquire(ctx, c.connectPgx(t, "direct", c.worker2, nil), "job2", "c", time.Minute); err != nil {
		t.Fatal(err)
	}
	c.proxy = startProxy(t, Config{Interceptor: newGate(t)})
	return c
}

func (c *cast) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	if _, err := c.admin.Exec(ctxT(t), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// routes are the two ways an attempt reaches PostgreSQL.
var castRoutes = []string{"direct", "proxy"}

// connConfig is a connection to the primary ("direct") or through the
// cast's proxy ("proxy") as role, carrying l's generation in the startup
// options (as PGOPTIONS would) when l is not nil.
func (c *cast) connConfig(t *testing.T, route, role string, l *fence.Lease) *pgconn.Config {
	t.Helper()
	host := cluster.Primary.Addr()
	if route == "proxy" {
		host = c.proxy.addr.String()
	}
	dsn := fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", url.PathEscape(role), host, c.db)
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	if l != nil {
		cfg.RuntimeParams["options"] = pgoptions(*l)
	}
	return cfg
}

func (c *cast) connect(t *testing.T, route, role string, l *fence.Lease) *pgconn.PgConn {
	t.Helper()
	conn, err := pgconn.ConnectConfig(ctxT(t), c.connConfig(t, route, role, l))
	return connected(t, conn, err, route+" as "+role)
}

func (c *cast) connectPgx(t *testing.T, route, role string, l *fence.Lease) *pgx.Conn {
	t.Helper()
	pc := c.connConfig(t, route, role, l)
	cfg, err := pgx.ParseConfig("")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Config = *pc
	return connectPgx(t, cfg)
}

// state is everything an attempt must not change, one line per fact, read
// on the cast's own superuser connection: every row of the protected
// tables (through their roots, so partitions and children too), the
// receipts, fences, leases, consumer watermarks and the roles consumers
// belong to, fence.settings and fence.consumer_grants, the protected tables and
// their pgfence triggers, and the tables, views and functions of the
// cast's schemas with their owners.
func (c *cast) state(t *testing.T) []string {
	t.Helper()
	rows, err := c.admin.Query(ctxT(t), `
select 'res ' || tableoid::regclass || ' ' || r::text from res r
union all select 'inh ' || tableoid::regclass || ' ' || r::text from inh r
union all select 'ledger ' || r::text from app.ledger r
union all select 'receipt ' || concat_ws(' ', job_key, epoch, token, step, encode(payload_digest, 'hex'), digest_version) from fence.receipts
union all select 'fence ' || f::text from fence.fences f
union all select 'lease ' || concat_ws(' ', job_key, holder, token, expires_at) from fence.leases
union all select 'watermark ' || w::text from fence.consumer_watermarks w
union all select 'consumer ' || concat_ws(' ', consumer, role) from fence.consumers
union all select 'setting ' || concat_ws(' ', name, value) from fence.settings
union all select 'consumer grant ' || concat_ws(' ', role, pattern) from fence.consumer_grants
union all select 'protected ' || concat_ws(' ', relid, root, schema_name, table_name, job_key_column, owner) from fence.protected_tables
union all select 'trigger ' || concat_ws(' ', tgrelid::regclass, tgname, tgenabled, tgfoid::regprocedure) from pg_trigger where not tgisinternal
union all select 'rule ' || concat_ws(' ', ev_class::regclass, rulename, ev_enabled) from pg_rewrite r join pg_class c on c.oid = r.ev_class where c.relkind <> 'v'
union all select 'relation ' || concat_ws(' ', c.oid::regclass, c.relkind, c.relowner::regrole, c.relpersistence) from pg_class c join pg_namespace n on n.oid = c.relnamespace where n.nspname in ('public', 'app') and c.relkind in ('r', 'p', 'v', 'f')
union all select 'inherits ' || concat_ws(' ', inhrelid::regclass, inhparent::regclass, inhdetachpending) from pg_inherits
union all select 'prepared ' || gid from pg_prepared_xacts where database = current_database()`)
	if err != nil {
		t.Fatalf("state: %v", err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("state: %v", err)
	}
	slices.Sort(lines)
	return lines
}

// unchanged fails t unless the state is before.
func (c *cast) unchanged(t *testing.T, before []string) {
	t.Helper()
	after := c.state(t)
	if slices.Equal(before, after) {
		return
	}
	var gone, added []string
	for _, l := range before {
		if !slices.Contains(after, l) {
			gone = append(gone, l)
		}
	}
	for _, l := range after {
		if !slices.Contains(before, l) {
			added = append(added, l)
		}
	}
	t.Fatalf("the attempt changed what it must not:\n  gone:  %s\n  added: %s", strings.Join(gone, "\n         "), strings.Join(added, "\n         "))
}

// attempt is one try at getting around the fence.
type attempt struct {
	role   string       // who connects
	lease  *fence.Lease // generation in the startup options; nil: none
	sql    string       // sent as one simple query
	copyIn string       // with sql a COPY … FROM STDIN: its data
	code   string       // the SQLSTATE it must fail with
	direct bool         // directly against PostgreSQL only (the proxy adds nothing to see)
}

// The SQLSTATEs the classes' attempts expect most.
const (
	castStale  = fence.CodeStale            // a stale generation
	castNoMeta = fence.CodeFencingRequired  // no fence metadata
	castLocked = fence.CodeProtectionLocked // DDL that would switch protection off
)

// castCase is one attempt of a class, run as the subtest name.
type castCase struct {
	name string
	a    attempt
}

// castAttempts are role's attempts, each a name and its sql, that must
// fail with code.
func castAttempts(role, code string, cases [][2]string) []castCase {
	out := make([]castCase, len(cases))
	for i, nc := range cases {
		out[i] = castCase{nc[0], attempt{role: role, sql: nc[1], code: code}}
	}
	return out
}

// tryEach runs each case as a subtest of t (try).
func (c *cast) tryEach(t *testing.T, cases []castCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { c.try(t, tc.a) })
	}
}

// try runs a by every route, asserting its SQLSTATE and, on the cast's own
// connection, that nothing changed.
func (c *cast) try(t *testing.T, a attempt) {
	t.Helper()
	for _, route := range castRoutes {
		if route == "proxy" && a.direct {
			continue
		}
		t.Run(route, func(t *testing.T) {
			before := c.state(t)
			conn := c.connect(t, route, a.role, a.lease)
			err := castExec(ctxT(t), conn, a.sql, a.copyIn)
			if got := pgtest.SQLState(err); got != a.code {
				t.Fatalf("%s as %s: got %v (SQLSTATE %q), want SQLSTATE %s", a.sql, a.role, err, got, a.code)
			}
			c.unchanged(t, before)
		})
	}
}

// castExec sends sql as one simple query (copyIn as the data of its COPY
// FROM STDIN) and returns the first error.
func castExec(ctx context.Context, conn *pgconn.PgConn, sql, copyIn string) error {
	if copyIn != "" {
		_, err := conn.CopyFrom(ctx, strings.NewReader(copyIn), sql)
		return err
	}
	_, err := conn.Exec(ctx, sql).ReadAll()
	return err
}

// as runs sql as role on a direct connection (set-up steps of a case).
func (c *cast) as(t *testing.T, role string, sql string) {
	t.Helper()
	if err := castExec(ctxT(t), c.connect(t, "direct", role, nil), sql, ""); err != nil {
		t.Fatalf("%s as %s: %v", sql, role, err)
	}
}

// refusedAs runs sql as role on a direct connection and fails t unless
// it is refused with code (a set-up step that a defence now stops earlier
// than the one the case is about: the case then goes on as someone the
// earlier defence lets through, so that both stay tested).
func (c *cast) refusedAs(t *testing.T, role, sql, code string) {
	t.Helper()
	err := castExec(ctxT(t), c.connect(t, "direct", role, nil), sql, "")
	if got := pgtest.SQLState(err); got != code {
		t.Fatalf("%s as %s: got %v (SQLSTATE %q), want SQLSTATE %s", sql, role, err, got, code)
	}
}

// currentWrites is a class's control: the worker holding the current
// generation runs sql(route) by every route, fence.step naming the route,
// and it must succeed, so that the class's refusals are the fence's and
// not a cast in which nobody can write.
func (c *cast) currentWrites(t *testing.T, sql func(route string) string) {
	t.Helper()
	for _, route := range castRoutes {
		conn := c.connect(t, route, c.worker, &c.current)
		if err := castExec(ctxT(t), conn, "set fence.step = '"+route+"'; "+sql(route), ""); err != nil {
			t.Fatalf("%s: current generation: %v", route, err)
		}
	}
}

// count runs a count query on the cast's own connection.
func (c *cast) count(t *testing.T, q string, args ...any) int {
	t.Helper()
	var n int
	if err := c.admin.QueryRow(ctxT(t), q, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return n
}

// protectedUnder fails t unless each of tables is in
// fence.protected_tables with root as its root.
func (c *cast) protectedUnder(t *testing.T, root string, tables ...string) {
	t.Helper()
	n := c.count(t, "select count(*) from fence.protected_tables where relid = any($1::text[]::regclass[]) and root = $2::text::regclass", tables, root)
	if n != len(tables) {
		t.Fatalf("%d of %v listed as protected under root %s, want all", n, tables, root)
	}
}
