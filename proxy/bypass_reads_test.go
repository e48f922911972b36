package proxy

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestBypass/reads and TestBypass/reads_tracked: reads after a takeover
// that try to see the previous generation on a lagging replica, phrased
// every way the classifier might miss: views, views over views,
// materialized views, functions, COPY, CTEs and subqueries, partitions,
// row-security policies, names the proxy has not seen, views redefined
// through the proxy and directly, a shadowing schema, read-only
// transactions, cursors, the extended protocol. The replica has replayed
// A's result and then paused; B took over with synchronous_commit off (the
// takeover's position must cover its unwritten commit record) and wrote
// its own result. Every read either is refused with FN007 (policy
// pending) or returns B's result, never A's.
//
// reads runs against a database without the DDL event trigger (every read
// is protected there), reads_tracked against one with it (the proxy keeps
// the set of relations that reach protected data, and must keep it
// current).
func init() {
	registerBypass("reads", func(t *testing.T) { testBypassReads(t, false) })
	registerBypass("reads_tracked", func(t *testing.T) { testBypassReads(t, true) })
}

// ddlTriggerSQL installs the event trigger that makes a database's
// catalog tracked (ddlTrigger), unless the fence schema has it already.
const ddlTriggerSQL = `
CREATE OR REPLACE FUNCTION public.pgfence_test_catalog_changed() RETURNS event_trigger LANGUAGE plpgsql
  AS $$ BEGIN PERFORM pg_notify('pgfence_protected', tg_tag); END $$;
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_event_trigger WHERE evtname = '` + ddlTrigger + `') THEN
    CREATE EVENT TRIGGER ` + ddlTrigger + ` ON ddl_command_end EXECUTE FUNCTION public.pgfence_test_catalog_changed();
  END IF;
END $$;
ALTER EVENT TRIGGER ` + ddlTrigger + ` ENABLE ALWAYS;
`

// noDDLTriggerSQL makes a database untracked, whatever the fence schema
// installs.
const noDDLTriggerSQL = "DROP EVENT TRIGGER IF EXISTS " + ddlTrigger + ";"

// readsSchema is the class's database: the protected results table (of
// fenceSchema), and every way to reach it by another name.
const readsSchema = fenceSchema + `
CREATE VIEW v_results AS SELECT job_key, payload, token FROM results;
CREATE VIEW v_v AS SELECT * FROM v_results;
CREATE MATERIALIZED VIEW mv_results AS SELECT * FROM v_v;
CREATE VIEW later AS SELECT payload FROM results;
CREATE FUNCTION f_results() RETURNS SETOF results LANGUAGE sql STABLE AS 'SELECT * FROM results';
CREATE FUNCTION f_payload(k text) RETURNS text LANGUAGE plpgsql STABLE
  AS $$ BEGIN RETURN (SELECT payload FROM results WHERE job_key = k); END $$;
CREATE VIEW v_func AS SELECT * FROM f_results();
CREATE FUNCTION f_max() RETURNS text LANGUAGE sql STABLE AS 'SELECT max(payload) FROM results';
CREATE VIEW v_scalar AS SELECT f_max() AS payload;
CREATE VIEW v_xml AS SELECT query_to_xml('SELECT payload FROM results', false, false, '')::text AS payload;
CREATE VIEW v_safe AS SELECT note AS payload FROM audit;
CREATE VIEW v_audit AS SELECT note AS payload FROM audit;
CREATE TABLE pres (job_key text, payload text, token bigint) PARTITION BY LIST (job_key);
CREATE TABLE pres_job PARTITION OF pres FOR VALUES IN ('job');
SELECT fence.protect('pres'); -- the whole tree (issue 17): a write naming pres_job is protected too
CREATE TABLE rls (id int);
ALTER TABLE rls ENABLE ROW LEVEL SECURITY;
CREATE POLICY rls_p ON rls USING (EXISTS (SELECT FROM results));
CREATE SCHEMA other;
INSERT INTO audit (note) VALUES ('n');
`

// readsCase is one attempt: a query through a reader, and what must come
// back: FN007 (code), or B's payload as the first column of the first row.
type readsCase struct {
	name   string
	reader func(t *testing.T) *pgconn.PgConn
	sql    string
	code   string // the SQLSTATE expected; "" for B's payload
	copy   bool   // sql is COPY ... TO STDOUT
}

func testBypassReads(t *testing.T, tracked bool) {
	ctx := ctxT(t)
	e := newRouteEnvMode(t, tracked, readsSchema) // the catalog is loaded now
	db := e.db
	direct := e.direct(t)

	if cat := catalogOf(t, e.gate, db); cat.tracked.Load() != tracked {
		t.Fatalf("catalog tracked=%v, want %v", cat.tracked.Load(), tracked)
	}
	// After the proxy read the catalog: a view it does not know, a
	// schema's view that shadows a safe name, a safe view redefined
	// directly and one through the proxy, to read the protected table.
	for _, q := range []string{
		"CREATE VIEW v_new AS SELECT payload FROM results",
		"CREATE VIEW other.audit AS SELECT payload AS note FROM results",
		"CREATE OR REPLACE VIEW v_audit AS SELECT payload FROM results",
	} {
		execOK(t, direct, q)
	}
	ddl := e.reader(t, nil)
	mustExec(t, ddl, "CREATE OR REPLACE VIEW v_safe AS SELECT payload FROM results")

	// A's generation is on the replica; then replay stops and B takes
	// over with its commit record unwritten.
	a := e.acquire(t, "job", "a", time.Minute)
	if _, err := e.worker(t, &a).Exec(ctx, upsert, "job", "A", a.Token); err != nil {
		t.Fatalf("A's commit: %v", err)
	}
	execOK(t, direct, "REFRESH MATERIALIZED VIEW mv_results")
	if err := cluster.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	pauseReplay(t)
	b := readsAsyncTakeover(t, direct, a)
	e.waitTakeover(t, e.gate, "job", b.Token)
	if _, err := e.worker(t, &b).Exec(ctx, upsert, "job", "B", b.Token); err != nil {
		t.Fatalf("B's commit: %v", err)
	}
	cat := catalogOf(t, e.gate, db)
	seen := cat.ddlSeen.Load()
	execOK(t, direct, "REFRESH MATERIALIZED VIEW mv_results")
	if tracked {
		// Every DDL has been heard of and the set read again since (or
		// the cases could pass while it is dropped, all reads protected).
		if err := pgtest.Poll(ctx, func() (bool, error) {
			return cat.ddlSeen.Load() > seen && cat.reads.Load() != nil, nil
		}); err != nil {
			t.Fatalf("the catalog was not read again after the DDL: %v", err)
		}
	}
	// The replica still has A's generation: what a stale read would return.
	rconn, err := cluster.Replica.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer rconn.Close(context.Background())
	var onReplica string
	if err := rconn.QueryRow(ctx, "SELECT payload FROM results WHERE job_key = 'job'").Scan(&onReplica); err != nil || onReplica != "A" {
		t.Fatalf("replica shows %q (%v), want A's result (replay paused)", onReplica, err)
	}

	var toast string // the protected table's TOAST relation, read directly
	if err := direct.QueryRow(ctx, "SELECT reltoastrelid::regclass::text FROM pg_class WHERE oid = 'results'::regclass").Scan(&toast); err != nil {
		t.Fatal(err)
	}
	gen := func(policy string) func(t *testing.T) *pgconn.PgConn {
		return func(t *testing.T) *pgconn.PgConn {
			return e.reader(t, nil, opts("job", b.Token, "-c fence.read_policy="+policy, "-c fence.read_wait=50ms")...)
		}
	}
	nometa := func(policy string, extra ...string) func(t *testing.T) *pgconn.PgConn {
		return func(t *testing.T) *pgconn.PgConn {
			return e.reader(t, nil, append([]string{"-c fence.read_policy=" + policy, "-c fence.read_wait=50ms"}, extra...)...)
		}
	}
	pending := fence.CodePending
	cases := []readsCase{
		{name: "view_pending", reader: gen("pending"), sql: "SELECT payload FROM v_results WHERE job_key = 'job'", code: pending},
		{name: "view_over_view_no_metadata", reader: nometa("primary"), sql: "SELECT payload, pg_is_in_recovery() FROM v_v WHERE job_key = 'job'"},
		{name: "view_over_view_no_metadata_pending", reader: nometa("pending"), sql: "SELECT payload FROM v_v", code: pending},
		{name: "materialized_view_pending", reader: gen("pending"), sql: "SELECT payload FROM mv_results", code: pending},
		{name: "materialized_view_wait", reader: nometa("wait"), sql: "SELECT payload, pg_is_in_recovery() FROM mv_results"},
		{name: "copy_query_over_view_pending", reader: gen("pending"), sql: "COPY (SELECT payload FROM v_v) TO STDOUT", code: pending, copy: true},
		{name: "copy_query_over_view_no_metadata", reader: nometa("primary"), sql: "COPY (SELECT payload FROM v_v) TO STDOUT", copy: true},
		{name: "copy_view_pending", reader: gen("pending"), sql: "COPY v_results TO STDOUT", code: pending, copy: true},
		{name: "copy_view_primary", reader: gen("primary"), sql: "COPY v_results TO STDOUT", code: "42809", copy: true}, // as direct: "cannot copy from view"
		{name: "sql_function", reader: gen("pending"), sql: "SELECT payload, pg_is_in_recovery() FROM f_results()"},
		{name: "plpgsql_function_no_metadata", reader: nometa("pending"), sql: "SELECT f_payload('job'), pg_is_in_recovery()"},
		{name: "view_calling_function", reader: gen("pending"), sql: "SELECT payload FROM v_func", code: pending},
		{name: "view_calling_scalar_function", reader: gen("pending"), sql: "SELECT payload FROM v_scalar", code: pending},
		{name: "view_running_sql", reader: nometa("pending"), sql: "SELECT payload FROM v_xml", code: pending},
		{name: "toast_table", reader: gen("pending"), sql: "SELECT count(*) FROM " + toast, code: pending},
		{name: "cte_shadowing_table", reader: gen("pending"), sql: "WITH results AS (SELECT * FROM results) SELECT payload FROM results", code: pending},
		{name: "cte_later_sibling", reader: nometa("pending"), sql: "WITH x AS (SELECT payload FROM later), later AS (SELECT 'z'::text AS payload) SELECT payload FROM x", code: pending},
		{name: "deep_subquery", reader: gen("pending"), sql: "SELECT (SELECT payload FROM (SELECT * FROM (SELECT * FROM v_v) a) b LIMIT 1)", code: pending},
		{name: "values_subquery", reader: gen("pending"), sql: "VALUES ((SELECT payload FROM v_results LIMIT 1))", code: pending},
		{name: "table_statement", reader: gen("pending"), sql: "TABLE v_results", code: pending},
		{name: "second_statement", reader: gen("pending"), sql: "SELECT 1; SELECT payload FROM v_results", code: pending},
		{name: "view_created_after_load", reader: nometa("pending"), sql: "SELECT payload FROM v_new", code: pending},
		{name: "view_redefined_directly", reader: gen("pending"), sql: "SELECT payload FROM v_audit", code: pending},
		{name: "unqualified_name_shadowed", reader: nometa("pending", "-c search_path=other,public"), sql: "SELECT note FROM audit", code: pending},
		{name: "partition_parent", reader: gen("pending"), sql: "SELECT payload FROM pres", code: pending},
		{name: "row_security_policy", reader: gen("pending"), sql: "SELECT count(*) FROM rls", code: pending},
		{name: "read_only_transaction", reader: gen("pending"), sql: "BEGIN READ ONLY; SELECT payload FROM v_safe; COMMIT", code: pending},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			readsCheck(t, c.reader(t), c)
		})
	}

	t.Run("view_redefined_through_proxy", func(t *testing.T) {
		// The session that replaced v_safe reads it next: the proxy
		// re-reads the catalog first, and v_safe now reads results.
		mustExec(t, ddl, "SET fence.read_policy = 'pending'")
		readsCheck(t, ddl, readsCase{sql: "SELECT payload FROM v_safe", code: pending})
	})
	t.Run("declare_with_hold", func(t *testing.T) {
		// A cursor declared outside a transaction lives where FETCH runs.
		r := nometa("primary")(t)
		mustExec(t, r, "DECLARE c CURSOR WITH HOLD FOR SELECT payload FROM v_results WHERE job_key = 'job'")
		readsCheck(t, r, readsCase{sql: "FETCH ALL FROM c"})
	})
	t.Run("extended_protocol", func(t *testing.T) {
		for _, policy := range []string{"pending", "primary"} {
			w := readsPgx(t, e, opts("job", b.Token, "-c fence.read_policy="+policy)...)
			var payload string
			var rec bool
			if err := w.QueryRow(ctx, "SELECT payload, pg_is_in_recovery() FROM v_results WHERE job_key = $1", "job").Scan(&payload, &rec); err != nil {
				t.Fatalf("%s: %v", policy, err)
			}
			if payload != "B" || rec {
				t.Fatalf("%s: read %q from replica=%v, want B's result from the primary", policy, payload, rec)
			}
		}
	})
	t.Run("extended_read_only_transaction", func(t *testing.T) {
		w := readsPgx(t, e)
		tx, err := w.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		var payload string
		var rec bool
		if err := tx.QueryRow(ctx, "SELECT payload, pg_is_in_recovery() FROM v_v WHERE job_key = $1", "job").Scan(&payload, &rec); err != nil {
			t.Fatal(err)
		}
		if payload != "B" || rec {
			t.Fatalf("read %q from replica=%v, want B's result from the primary", payload, rec)
		}
	})
	t.Run("extended_read_only_transaction_pending", func(t *testing.T) {
		w := readsPgx(t, e, opts("job", b.Token, "-c fence.read_policy=pending")...)
		_, err := w.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
		wantCode(t, err, pending)
	})

	// Nothing the attempts did changed B's result or the fence.
	var payload string
	var token, maxIssued int64
	if err := direct.QueryRow(ctx, "SELECT r.payload, r.token, f.max_issued_token FROM results r, fence.fences f WHERE r.job_key = 'job' AND f.job_key = 'job'").Scan(&payload, &token, &maxIssued); err != nil {
		t.Fatal(err)
	}
	if payload != "B" || token != b.Token || maxIssued != b.Token {
		t.Fatalf("after the attempts: result %q token %d, fence at %d; want B's (%d)", payload, token, maxIssued, b.Token)
	}
}

// readsAsyncTakeover ends old's lease and acquires job for b in one
// transaction committed with synchronous_commit off: its commit record may
// be unwritten when the notification arrives.
func readsAsyncTakeover(t *testing.T, direct *pgx.Conn, old fence.Lease) fence.Lease {
	t.Helper()
	ctx := ctxT(t)
	tx := beginOK(t, direct)
	defer tx.Rollback(ctx)
	l := fence.Lease{JobKey: old.JobKey}
	for _, q := range []string{"SET LOCAL synchronous_commit = off", fmt.Sprintf("SELECT fence.release('%s', %d)", old.JobKey, old.Token)} {
		execOK(t, tx, q)
	}
	if err := tx.QueryRow(ctx, "SELECT epoch, token FROM fence.acquire($1, 'b', interval '1 minute')", old.JobKey).Scan(&l.Epoch, &l.Token); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return l
}

// readsCheck runs c.sql on r and asserts its outcome: c.code, or B's
// payload (never A's), from the primary when the query says where it ran.
func readsCheck(t *testing.T, r *pgconn.PgConn, c readsCase) {
	t.Helper()
	ctx := ctxT(t)
	var rows [][]string
	var err error
	if c.copy {
		var buf bytes.Buffer
		_, err = r.CopyTo(ctx, &buf, c.sql)
		for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
			if line != "" {
				rows = append(rows, strings.Split(line, "\t"))
			}
		}
	} else {
		var res []*pgconn.Result
		res, err = r.Exec(ctx, c.sql).ReadAll()
		for _, rr := range res {
			for _, row := range rr.Rows {
				var vals []string
				for _, v := range row {
					vals = append(vals, string(v))
				}
				rows = append(rows, vals)
			}
		}
	}
	for _, row := range rows {
		for _, v := range row {
			if v == "A" {
				t.Fatalf("%s: returned A's result %v: the previous generation", c.sql, row)
			}
		}
	}
	if c.code != "" {
		if len(rows) > 0 {
			t.Fatalf("%s: returned %v, want SQLSTATE %s and no rows", c.sql, rows, c.code)
		}
		wantCode(t, err, c.code)
		// The session is usable after the refusal.
		if _, err := r.Exec(ctx, "SELECT 1").ReadAll(); err != nil {
			t.Fatalf("session unusable after %s: %v", c.code, err)
		}
		return
	}
	if err != nil {
		t.Fatalf("%s: %v", c.sql, err)
	}
	if len(rows) == 0 || rows[0][0] != "B" {
		t.Fatalf("%s: returned %v, want B's result", c.sql, rows)
	}
	if last := rows[0][len(rows[0])-1]; len(rows[0]) > 1 && last != "f" {
		t.Fatalf("%s: answered by the replica (pg_is_in_recovery %s), which has not replayed the takeover", c.sql, last)
	}
}

// readsPgx is a pgx connection (extended protocol) through the proxy.
func readsPgx(t *testing.T, e *routeEnv, opts ...string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig(e.proxy.dsn(e.db))
	if err != nil {
		t.Fatal(err)
	}
	if len(opts) > 0 {
		cfg.RuntimeParams["options"] = strings.Join(opts, " ")
	}
	return connectPgx(t, cfg)
}
