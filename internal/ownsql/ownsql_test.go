package ownsql

import (
	"strings"
	"testing"
)

// TestJudge: what Judge makes of CheckSQL's rows (the queries themselves
// run against PostgreSQL in proxy's TestBypass/control).
func TestJudge(t *testing.T) {
	schema := func(super, create, others string) []string {
		return []string{"s", "fence", "postgres", super, "", "f", "f", create, "", others}
	}
	table := func(name, super, kind, rls, cols string) []string {
		return []string{"r", name, "postgres", super, kind, rls, "f", "", cols, ""}
	}
	good := table("protected_tables", "t", "r", "f", "relid:2205,schema_name:25")
	for _, c := range []struct {
		name      string
		rows      Rows
		schema    bool
		untrusted string // a word of the problem; "" for trusted (or none)
	}{
		{"no schema", nil, false, ""},
		{"trusted", Rows{schema("t", "", ""), good}, true, ""},
		{"schema not a superuser's", Rows{schema("f", "", ""), good}, true, "owned by"},
		{"create granted", Rows{schema("t", "PUBLIC", ""), good}, true, "may create"},
		{"an object of someone else's", Rows{schema("t", "", "function gate (app)"), good}, true, "not a superuser's"},
		{"table missing", Rows{schema("t", "", "")}, true, "does not exist"},
		{"table not a superuser's", Rows{schema("t", "", ""), table("protected_tables", "f", "r", "f", "relid:2205")}, true, "owned by"},
		{"a view", Rows{schema("t", "", ""), table("protected_tables", "t", "v", "f", "relid:2205")}, true, "plain table"},
		{"row security", Rows{schema("t", "", ""), table("protected_tables", "t", "r", "t", "relid:2205")}, true, "row-level"},
		{"another type", Rows{schema("t", "", ""), table("protected_tables", "t", "r", "f", "relid:16999")}, true, "built-in type"},
		{"column missing", Rows{schema("t", "", ""), table("protected_tables", "t", "r", "f", "other:2205")}, true, "built-in type"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := Judge(c.rows, []Rel{ProtectedTables})
			if got.Schema != c.schema || got.Trusted() != (c.schema && c.untrusted == "") ||
				c.untrusted != "" && !strings.Contains(got.Problem, c.untrusted) || got.Untrusted() != (c.untrusted != "") {
				t.Fatalf("%+v (trusted %v, untrusted %v)", got, got.Trusted(), got.Untrusted())
			}
		})
	}
}

// TestPins: the read-only pins add to the others, and search_path is
// pg_catalog, pg_temp in both.
func TestPins(t *testing.T) {
	rw, ro := Pins(false), Pins(true)
	for _, p := range rw {
		if !strings.Contains(strings.Join(ro, "\n"), p) {
			t.Errorf("PinReadOnly lacks %s", p)
		}
	}
	for _, set := range [][]string{rw, ro} {
		found := false
		for _, p := range set {
			found = found || p == "search_path="+SearchPath
		}
		if !found {
			t.Errorf("no search_path pin in %v", set)
		}
	}
	if strings.Contains(strings.Join(rw, "\n"), "default_transaction_read_only") {
		t.Error("the CLI's connections (Pin) must be able to write")
	}
}
