package rewrite

import (
	"slices"
	"testing"
)

// TestCatalogExprs: what read routing must ask the catalog about
// (Stmt.CatalogExprs, Stmt.Fields), and what it need not.
func TestCatalogExprs(t *testing.T) {
	for _, c := range []struct {
		sql     string
		catalog bool
		fields  []string
	}{
		{"SELECT 1", false, nil},
		{"SELECT now(), 'a', $1, NULL, true, 1.5, B'01'", false, nil},
		{"SELECT pg_is_in_recovery()", false, nil},
		{"SELECT 1::int, 2::bigint, '3'::numeric(4,1), true::boolean, now()::timestamp with time zone, '1 day'::interval", false, nil},
		{"SELECT CASE WHEN true THEN 1 ELSE 2 END, coalesce(NULL, 1), greatest(1, 2), ARRAY[1, 2], ROW(1, 2)", false, nil},
		{"SELECT 1 IS NULL, true IS NOT TRUE, NOT false AND true OR false", false, nil},
		{"SELECT count(*) OVER (ORDER BY 1) FROM generate_series(1, 3)", false, nil},
		{"SELECT EXISTS (SELECT 1), (SELECT 1), ARRAY(SELECT 1)", false, nil},
		{"SELECT x FROM (SELECT 1 AS x) s ORDER BY x", false, nil},
		{"WITH w AS (SELECT 1 AS x) SELECT x FROM w", false, nil},
		{"SELECT (ARRAY[1, 2])[1]", false, nil},
		{"SELECT payload FROM results WHERE job_key = 'job'", true, nil},
		{"SELECT 'job-a' @@@ ''", true, nil},
		{"SELECT 1 + 1", true, nil},
		{"SELECT 'job-a'::public.dpeek", true, nil},
		{"SELECT 'job-a'::dpeek", true, nil},
		{"SELECT 'a'::text", true, nil},
		{"SELECT CAST('a' AS text)", true, nil},
		{"SELECT 'a' IN ('a', 'b')", true, nil},
		{"SELECT 'a' LIKE 'a%'", true, nil},
		{"SELECT 1 BETWEEN 0 AND 2", true, nil},
		{"SELECT 1 IS DISTINCT FROM 2", true, nil},
		{"SELECT nullif(1, 2)", true, nil},
		{"SELECT CASE 1 WHEN 1 THEN 'a' END", true, nil},
		{"SELECT ROW(1, 2) < ROW(2, 3)", true, nil},
		{"SELECT 1 = ANY (SELECT 1)", true, nil},
		{"SELECT 1 IN (SELECT 1)", true, nil},
		{"SELECT x FROM (VALUES (1)) v(x) ORDER BY x USING <", true, nil},
		{"SELECT * FROM generate_series(1, 2) a(x) JOIN generate_series(1, 2) b(x) USING (x)", true, nil},
		{"SELECT * FROM generate_series(1, 2) a(x) NATURAL JOIN generate_series(1, 2) b(x)", true, nil},
		{"SELECT n.peekattr FROM notes n", true, []string{"peekattr"}},
		{"SELECT (n).peekattr FROM notes n", true, []string{"peekattr"}},
		{"SELECT (ROW(1)).peekany, (1).other", true, []string{"peekany", "other"}},
		{"SELECT public.notes.note FROM public.notes", true, []string{"note"}},
		{"SELECT n.* FROM notes n", false, nil},
		{"SELECT note FROM notes", false, nil},
		{"EXPLAIN VERBOSE SELECT 'job-a' @@@ ''", true, nil},
		{"EXPLAIN SELECT n.peekattr FROM notes n", true, []string{"peekattr"}},
		{"COPY (SELECT 'a' @@@ 'b') TO STDOUT", true, nil},
		{"SELECT 'a' COLLATE \"C\"", false, nil},
		{"SELECT JSON_OBJECT('a': 1)", true, nil}, // not known to the allowlist: fails safe
	} {
		res, err := Classify(c.sql)
		if err != nil {
			t.Fatalf("%s: %v", c.sql, err)
		}
		st := res.Stmts[0]
		if st.CatalogExprs != c.catalog || !slices.Equal(st.Fields, c.fields) {
			t.Errorf("%s: CatalogExprs %v Fields %q, want %v %q", c.sql, st.CatalogExprs, st.Fields, c.catalog, c.fields)
		}
	}
}

// TestExplainCalls: plain EXPLAIN plans its statement, and the planner
// runs the immutable functions it folds: a call is a call there (H4), but
// not a setting's change; EXPLAIN EXECUTE plans what it cannot see.
func TestExplainCalls(t *testing.T) {
	for _, c := range []struct {
		sql    string
		opaque bool
	}{
		{"EXPLAIN SELECT 1", false},
		{"EXPLAIN SELECT now(), lower('a')", false},
		{"EXPLAIN VERBOSE SELECT public.peek('job-a')", true},
		{"EXPLAIN (COSTS off) SELECT peek('job-a')", true},
		{"EXPLAIN SELECT * FROM results WHERE payload = peek('x')", true},
		{"EXPLAIN (VERBOSE) SELECT * FROM (SELECT peek('x')) s", true},
		{"EXPLAIN EXECUTE p", true},
		{"EXPLAIN (ANALYZE false) EXECUTE p(1)", true},
		{"EXPLAIN SELECT fence.gate('j', 1, 1)", true},
	} {
		res, err := Classify(c.sql)
		if err != nil {
			t.Fatalf("%s: %v", c.sql, err)
		}
		st := res.Stmts[0]
		if st.Opaque != c.opaque || st.Kind != Read || st.Writes() {
			t.Errorf("%s: Opaque %v Kind %s writes %v, want Opaque %v, a read", c.sql, st.Opaque, st.Kind, st.WriteTargets, c.opaque)
		}
	}
	res, err := Classify("EXPLAIN SELECT set_config('fence.token', '9', false)")
	if err != nil {
		t.Fatal(err)
	}
	if st := res.Stmts[0]; len(st.GUCs) != 0 || !st.PrimaryOnlyFuncs {
		t.Errorf("EXPLAIN of set_config: GUCs %v primary-only %v, want none (it does not run) and primary-only", st.GUCs, st.PrimaryOnlyFuncs)
	}
}
