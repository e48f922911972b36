package proxy

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	pg_query "github.com/pganalyze/pg_query_go/v6"

	"github.com/pgfence/pgfence/internal/ownsql"
	"github.com/pgfence/pgfence/rewrite/plan"
)

// TestOwnSQLQualified parses every text the proxy sends on its own
// behalf (ownTexts) and fails on any name PostgreSQL would look up on the
// search_path: a function, an operator (including those IN, LIKE, BETWEEN,
// IS DISTINCT FROM and JOIN … USING stand for), a type, or a relation that
// is not one of the statement's own CTEs. The pinned search_path of the
// control connections would resolve them in pg_catalog alone; the
// qualified text is what holds on a client's session, where the client
// sets the path.
func TestOwnSQLQualified(t *testing.T) {
	if len(ownTexts) < 20 {
		t.Fatalf("only %d own texts registered", len(ownTexts))
	}
	for _, o := range ownTexts {
		t.Run(o.name, func(t *testing.T) {
			if bad := unqualified(t, o.sql); len(bad) > 0 {
				t.Fatalf("%s names without a schema: %s\n%s", o.name, strings.Join(bad, ", "), o.sql)
			}
		})
	}
}

// TestOwnSQLQualifiedCatches checks that unqualified finds what it must.
func TestOwnSQLQualifiedCatches(t *testing.T) {
	for _, q := range []string{
		"SELECT now()",
		"SELECT 1 WHERE 'a' = 'b'",
		"SELECT 'a'::text",
		"SELECT 1 FROM pg_class",
		"SELECT 1 WHERE 1 IN (1, 2)",
		"SELECT 1 WHERE 'a' LIKE 'b'",
		"SELECT 1 WHERE 1 BETWEEN 0 AND 2",
		"SELECT 1 WHERE 1 IS DISTINCT FROM 2",
		"SELECT 1 FROM pg_catalog.pg_class AS a JOIN pg_catalog.pg_class AS b USING (oid)",
		"SELECT 1 WHERE 1 = ANY (SELECT 1)",
		"SELECT 1 WHERE 1 OPERATOR(pg_catalog.=) ANY (SELECT 1 WHERE 'a' || 'b' IS NULL)",
		"SELECT -'1'::pg_catalog.int8",
		"SELECT count(*) FROM pg_catalog.pg_class",
	} {
		if bad := unqualified(t, q); len(bad) == 0 {
			t.Errorf("%s: nothing found", q)
		}
	}
	for _, q := range []string{
		"SELECT pg_catalog.now() AT TIME ZONE 'UTC'",
		"WITH x(a) AS (SELECT 1) SELECT x.a FROM x WHERE x.a OPERATOR(pg_catalog.=) '1'::pg_catalog.int4",
		"SELECT coalesce(NULL, 1), EXISTS (SELECT), CASE WHEN true THEN 1 END, NULL IS NULL, true AND NOT false",
		"SELECT 1::bigint, true::boolean",
	} {
		if bad := unqualified(t, q); len(bad) > 0 {
			t.Errorf("%s: found %v", q, bad)
		}
	}
}

// unqualified lists the names in sql that PostgreSQL looks up on the
// search_path.
func unqualified(t *testing.T, sql string) []string {
	t.Helper()
	js, err := pg_query.ParseToJSON(sql)
	if err != nil {
		t.Fatalf("parse %q: %v", sql, err)
	}
	var tree any
	if err := json.Unmarshal([]byte(js), &tree); err != nil {
		t.Fatal(err)
	}
	ctes := map[string]bool{}
	collect(tree, func(k string, v map[string]any) {
		if k == "CommonTableExpr" {
			if n, ok := v["ctename"].(string); ok {
				ctes[n] = true
			}
		}
	})
	var bad []string
	collect(tree, func(k string, v map[string]any) {
		switch k {
		case "FuncCall":
			if n := names(v["funcname"]); len(n) != 2 {
				bad = append(bad, "function "+strings.Join(n, "."))
			}
		case "A_Expr":
			if n := names(v["name"]); len(n) != 2 {
				bad = append(bad, fmt.Sprintf("operator %s (%v)", strings.Join(n, "."), v["kind"]))
			}
		case "SubLink":
			if n := names(v["operName"]); v["operName"] != nil && len(n) != 2 {
				bad = append(bad, "operator "+strings.Join(n, ".")+" of a subquery")
			}
		case "typeName":
			if n := names(v["names"]); len(n) != 2 {
				bad = append(bad, "type "+strings.Join(n, "."))
			}
		case "RangeVar":
			if s, _ := v["schemaname"].(string); s == "" && !ctes[fmt.Sprint(v["relname"])] {
				bad = append(bad, fmt.Sprintf("relation %v", v["relname"]))
			}
		case "JoinExpr":
			if v["usingClause"] != nil {
				bad = append(bad, "JOIN … USING")
			}
		}
	})
	return bad
}

// collect calls f for every object under a key in a decoded JSON tree.
func collect(n any, f func(key string, v map[string]any)) {
	switch n := n.(type) {
	case map[string]any:
		for k, v := range n {
			if m, ok := v.(map[string]any); ok {
				f(k, m)
			}
			collect(v, f)
		}
	case []any:
		for _, v := range n {
			collect(v, f)
		}
	}
}

// names reads a list of String nodes.
func names(v any) []string {
	l, _ := v.([]any)
	var out []string
	for _, e := range l {
		if m, ok := e.(map[string]any); ok {
			if s, ok := m["String"].(map[string]any); ok {
				out = append(out, fmt.Sprint(s["sval"]))
			}
		}
	}
	return out
}

// TestOwnDrivenByNamesNothing: a text that every_text does not drive
// (ownDrivenBy) names nothing a trapped database can reach: no function,
// operator, type or relation at all, or only pg_catalog's, qualified
// (no role but a superuser creates objects in pg_catalog, and a
// qualified name never searches pg_temp).
func TestOwnDrivenByNamesNothing(t *testing.T) {
	for _, o := range ownTexts {
		if o.drivenBy == "" || o.where == onControl {
			continue
		}
		for _, n := range outsideCatalog(t, o.sql) {
			t.Errorf("%s (driven by %s) names %s: %s", o.name, o.drivenBy, n, o.sql)
		}
	}
}

// outsideCatalog lists the functions, operators, types and relations sql
// names that are not pg_catalog's, qualified.
func outsideCatalog(t *testing.T, sql string) []string {
	t.Helper()
	js, err := pg_query.ParseToJSON(sql)
	if err != nil {
		t.Fatalf("parse %q: %v", sql, err)
	}
	var tree any
	if err := json.Unmarshal([]byte(js), &tree); err != nil {
		t.Fatal(err)
	}
	var bad []string
	check := func(kind string, n []string) {
		if len(n) != 2 || n[0] != "pg_catalog" {
			bad = append(bad, kind+" "+strings.Join(n, "."))
		}
	}
	collect(tree, func(k string, v map[string]any) {
		switch k {
		case "FuncCall":
			check("function", names(v["funcname"]))
		case "A_Expr":
			check("operator", names(v["name"]))
		case "typeName":
			check("type", names(v["names"]))
		case "RangeVar":
			if s, _ := v["schemaname"].(string); s != "pg_catalog" {
				bad = append(bad, fmt.Sprintf("relation %v.%v", v["schemaname"], v["relname"]))
			}
		}
	})
	return bad
}

// TestOwnTemplates: every template's instance contains what identifies it
// in a statement log, and every text of the gate's steps is registered.
func TestOwnTemplates(t *testing.T) {
	for _, o := range ownTexts {
		if !strings.Contains(o.sql, o.match) {
			t.Errorf("%s: %q does not contain its match %q", o.name, o.sql, o.match)
		}
	}
	var sqls []string
	for _, o := range ownTexts {
		sqls = append(sqls, o.sql)
	}
	for _, s := range plan.Statements {
		if !slices.Contains(sqls, s.SQL) {
			t.Errorf("the gate's statement %s is not registered", s.Name)
		}
	}
	for _, s := range []string{showIsolation, heldCursorsQuery, plan.RestoreSQL, settingsSQL, insertLSNQuery, ownsql.CheckSQL, fencesSQL, protectedQuery, readSetQuery, readSetHashQuery, catalogModeQuery, writeLSNQuery, replayQuery, listenSQL, DefaultAuthQuery} {
		if !slices.Contains(sqls, s) {
			t.Errorf("not registered: %s", s)
		}
	}
}

// TestControlTargetSessionAttrs (issue 31): a primary DSN that lists every
// node of a cluster with target_session_attrs=read-write — how the proxy
// follows a promotion — must give control connections (the catalog
// watcher, the watchdog, the auth lookup) the primary, although their
// pinned default_transaction_read_only makes every server answer SHOW
// transaction_read_only with on; read-only, in a replica's DSN, must still
// pick a standby.
func TestControlTargetSessionAttrs(t *testing.T) {
	for _, tc := range []struct {
		attrs    string
		recovery string
	}{{"read-write", "f"}, {"read-only", "t"}} {
		t.Run(tc.attrs, func(t *testing.T) {
			// The node that does not match is listed first.
			first, second := cluster.Replica, cluster.Primary
			if tc.recovery == "t" {
				first, second = second, first
			}
			base, err := pgconn.ParseConfig(fmt.Sprintf("host=%s,%s port=%d,%d user=postgres dbname=postgres sslmode=disable target_session_attrs=%s",
				first.Host, second.Host, first.Port, second.Port, tc.attrs))
			if err != nil {
				t.Fatal(err)
			}
			c := connectConfig(t, controlConfig(base, "", "pgfence target check"))
			res := c.ExecParams(ctxT(t), "SELECT pg_catalog.pg_is_in_recovery()::pg_catalog.text, pg_catalog.current_setting('default_transaction_read_only')", nil, nil, nil, nil).Read()
			if res.Err != nil || len(res.Rows) != 1 {
				t.Fatalf("read: %v", res.Err)
			}
			if got := string(res.Rows[0][0]); !strings.HasPrefix(got, tc.recovery) {
				t.Fatalf("target_session_attrs=%s: the control connection reached a server with pg_is_in_recovery %s", tc.attrs, got)
			}
			if ro := string(res.Rows[0][1]); ro != "on" {
				t.Fatalf("default_transaction_read_only %q on a control connection, want on (pinned)", ro)
			}
		})
	}
}
