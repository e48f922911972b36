package proxy

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/rewrite"
)

// TestBypass/rotx_catalog (issue 30, round 9, attacker R's H1): a read
// judged by the proxy's read set (the primary's catalog) on a replica
// that has not replayed the position that set was read at. A reader's
// BEGIN READ ONLY transaction began on the current replica; then replay
// paused, B took over and wrote, and the owner redefined the view v_y
// (over the protected results) to read audit, and replaced the policy of
// rnotes (which showed its row only while results held A's payload) with
// one that shows nothing. By the primary's catalog both are safe now; the
// replica still has the old definitions and A's result. Inside the
// transaction a read of either, at READ COMMITTED or REPEATABLE READ, in
// the simple or extended protocol, with or without B's generation, before
// a COMMIT in the same query, is refused (FN007) or answered without A's
// generation, never with it; autocommit reads go to the primary. After
// replay caught up the replica has the new definitions and serves them,
// in a transaction begun before (the catalog a statement reads is the
// replica's current one, whatever the transaction's snapshot).
//
// Only through the proxy: reading a replica is the proxy's routing.
func init() { registerBypass("rotx_catalog", testBypassRotxCatalog) }

// rocatReader is the login the policy cases read as (a superuser, the
// other readers' role, bypasses row security).
const rocatReader = "r9_reader"

const rocatSchema = readsSchema + `
CREATE VIEW v_y AS SELECT job_key, payload FROM results;
CREATE TABLE rnotes (id int, note text);
INSERT INTO rnotes VALUES (1, 'n1');
ALTER TABLE rnotes ENABLE ROW LEVEL SECURITY;
CREATE POLICY rn_p ON rnotes FOR SELECT USING (EXISTS (SELECT FROM results r WHERE r.job_key = 'job' AND r.payload = 'A'));
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '` + rocatReader + `') THEN
    CREATE ROLE ` + rocatReader + ` LOGIN;
  END IF;
END $$;
GRANT SELECT ON results, audit, v_y, rnotes TO ` + rocatReader + `;
GRANT USAGE ON SCHEMA fence TO ` + rocatReader + `;
`

type rocatCase struct {
	name  string
	rr    bool   // REPEATABLE READ
	as    bool   // as rocatReader (row security applies)
	gen   bool   // present B's generation (SET LOCAL) first
	sql   string // the attempt, inside the transaction
	proto string // "" simple, "params" extended
	late  bool   // after replay caught up
	code  string // FN007, or "" for an answer (checked for A's generation)
	want  string // with code "": a value the answer must hold
}

func testBypassRotxCatalog(t *testing.T) {
	ctx := ctxT(t)
	pending := fence.CodePending
	vy := "SELECT payload, pg_is_in_recovery() FROM v_y"
	rn := "SELECT note, pg_is_in_recovery() FROM rnotes"
	cases := []rocatCase{
		{name: "view_rc", sql: vy, code: pending},
		{name: "view_rr", rr: true, sql: vy, code: pending},
		{name: "view_rc_generation", gen: true, sql: vy, code: pending},
		{name: "view_rc_params", sql: vy, proto: "params", code: pending},
		{name: "view_then_commit", sql: vy + "; COMMIT; SELECT 1", code: pending},
		{name: "view_join_safe", sql: "SELECT v.payload, pg_is_in_recovery() FROM audit a, v_y v", code: pending},
		{name: "view_subquery", sql: "SELECT (SELECT max(payload) FROM v_y), pg_is_in_recovery()", code: pending},
		{name: "policy_rc", as: true, sql: rn, code: pending},
		{name: "policy_rr", as: true, rr: true, sql: rn, code: pending},
		{name: "policy_count", as: true, sql: "SELECT count(*)::text, pg_is_in_recovery() FROM rnotes", code: pending},
		{name: "policy_params", as: true, sql: rn, proto: "params", code: pending},
		// Once the transaction ends, the next read is routed afresh: the
		// primary serves it (the replica is behind the catalog).
		{name: "view_after_commit", sql: "COMMIT; " + vy, want: "n"},
		// After catch-up: the replica's catalog is the primary's.
		{name: "late_view_rc", late: true, sql: vy, want: "n"},
		{name: "late_view_rr", late: true, rr: true, sql: vy, want: "n"},
		{name: "late_policy_rc", late: true, as: true, sql: "SELECT count(*)::text, pg_is_in_recovery() FROM rnotes", want: "0"},
	}
	type open struct {
		c  rocatCase
		pc *pgconn.PgConn
	}
	var opened []*open
	var e *routeEnv
	readerAs := func(t *testing.T, as bool) *pgconn.PgConn {
		if !as {
			return e.reader(t, nil, "-c fence.read_wait=50ms")
		}
		cfg, err := pgconn.ParseConfig(e.proxy.dsn(e.db))
		if err != nil {
			t.Fatal(err)
		}
		cfg.User = rocatReader
		cfg.RuntimeParams["options"] = "-c fence.read_wait=50ms"
		return connectConfig(t, cfg)
	}
	sc := newReadsScene(t, true, rocatSchema, nil, func(sc *readsScene) {
		e = sc.e
		for _, c := range cases {
			o := &open{c: c}
			begin := "BEGIN READ ONLY"
			if c.rr {
				begin += " ISOLATION LEVEL REPEATABLE READ"
			}
			if err := pgtest.Poll(ctx, func() (bool, error) {
				o.pc = readerAs(t, c.as)
				if _, err := o.pc.Exec(ctx, begin).ReadAll(); err != nil {
					return false, err
				}
				// The transaction's first read, on the replica: v_y
				// still reads results, whose A it shows.
				vals, rep, err := where(t, o.pc, "SELECT payload, pg_is_in_recovery() FROM results WHERE job_key = 'job'")
				if err != nil {
					return false, err
				}
				if rep && vals[0] == "A" {
					return true, nil
				}
				o.pc.Close(ctx)
				return false, nil
			}); err != nil {
				t.Fatalf("%s: the transaction never began on the replica: %v", c.name, err)
			}
			opened = append(opened, o)
		}
	})
	// Replay is paused, B has taken over and written. The owner makes
	// v_y and rnotes safe by the primary's catalog.
	cat := catalogOf(t, e.gate, e.db)
	prev := cat.reads.Load().position()
	for _, q := range []string{
		"CREATE OR REPLACE VIEW v_y AS SELECT note AS job_key, note AS payload FROM audit",
		"DROP POLICY rn_p ON rnotes",
		"CREATE POLICY rn_p2 ON rnotes FOR SELECT USING (false)",
	} {
		execOK(t, sc.direct, q)
	}
	if err := pgtest.Poll(ctx, func() (bool, error) {
		rd := cat.reads.Load()
		return rd != nil && rd.position() > prev &&
			!rd.exposes(rewrite.RelName{Schema: "public", Name: "v_y"}) && !rd.exposes(rewrite.RelName{Schema: "public", Name: "rnotes"}), nil
	}); err != nil {
		t.Fatalf("the proxy never judged v_y and rnotes safe: %v", err)
	}
	attempt := func(t *testing.T, o *open) {
		c := o.c
		if c.gen {
			if _, err := o.pc.Exec(ctx, rotxGen(sc)).ReadAll(); err != nil {
				t.Fatalf("%s: %v", rotxGen(sc), err)
			}
		}
		var res []*pgconn.Result
		var err error
		if c.proto == "params" {
			r := o.pc.ExecParams(ctx, c.sql, nil, nil, nil, nil).Read()
			res, err = []*pgconn.Result{r}, r.Err
		} else {
			res, err = o.pc.Exec(ctx, c.sql).ReadAll()
		}
		var rows [][]string
		for _, r := range res {
			for _, row := range r.Rows {
				var vals []string
				for _, v := range row {
					vals = append(vals, string(v))
				}
				rows = append(rows, vals)
			}
		}
		for _, row := range rows {
			for _, v := range row {
				if v == "A" || v == "n1" {
					t.Fatalf("%s: returned %v: what only A's generation shows", c.sql, row)
				}
			}
		}
		if c.code != "" {
			wantCode(t, err, c.code)
			if _, err := o.pc.Exec(ctx, "ROLLBACK").ReadAll(); err != nil {
				t.Fatalf("ROLLBACK after %s: %v", c.code, err)
			}
			if _, err := o.pc.Exec(ctx, "SELECT 1").ReadAll(); err != nil {
				t.Fatalf("session unusable after %s: %v", c.code, err)
			}
			return
		}
		if err != nil {
			t.Fatalf("%s: %v", c.sql, err)
		}
		if len(rows) == 0 || rows[len(rows)-1][0] != c.want {
			t.Fatalf("%s: returned %v, want %q first", c.sql, rows, c.want)
		}
		if c.late && rows[len(rows)-1][1] != "t" {
			t.Fatalf("%s: returned %v, want it from the replica (it has replayed the catalog)", c.sql, rows)
		}
	}
	for _, late := range []bool{false, true} {
		if late {
			resumeAndCatchUp(t)
			waitProxyReplay(t, e.proxy)
		}
		for _, o := range opened {
			if o.c.late == late {
				t.Run(o.c.name, func(t *testing.T) { attempt(t, o) })
			}
		}
		if !late {
			// An autocommit read while the replica lags the catalog: the
			// primary serves it.
			t.Run("autocommit_lagging", func(t *testing.T) {
				vals, rep, err := where(t, readerAs(t, false), "SELECT payload, pg_is_in_recovery() FROM v_y")
				if err != nil || rep || len(vals) == 0 || vals[0] != "n" {
					t.Fatalf("v_y: %v replica=%v (%v), want audit's n from the primary", vals, rep, err)
				}
			})
		}
	}
	// Autocommit reads (a new session), after the attempts: the
	// replica is current; v_y reads audit there.
	t.Run("autocommit_current", func(t *testing.T) {
		vals, _, err := where(t, e.reader(t, nil), "SELECT payload, pg_is_in_recovery() FROM v_y")
		if err != nil || len(vals) == 0 || vals[0] != "n" {
			t.Fatalf("v_y: %v (%v), want audit's n", vals, err)
		}
	})
	sc.unchanged(t)
	_ = fmt.Sprint
	_ = strings.TrimSpace
	_ = context.Background
}
