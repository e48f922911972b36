package rewrite

import "testing"

// TestGrammarVersions: the constructs PostgreSQL 16 and 17 made syntax of
// are recorded with the version that reads them so, and an older server
// reads the statement as one that calls functions it cannot see (or
// resolves a type on the search path).
func TestGrammarVersions(t *testing.T) {
	for _, c := range []struct {
		sql          string
		calls, types int
	}{
		{"SELECT 1", 0, 0},
		{"SELECT json_scalar('a')", 17, 0},
		{"SELECT json_serialize('a')", 17, 0},
		{"SELECT json('a')", 17, 0},
		{"SELECT json_query('a', 'b'), json_value('a', 'b'), json_exists('a', 'b')", 17, 0},
		{"SELECT * FROM json_table('{}', '$' COLUMNS (a int PATH '$'))", 17, 0},
		{"SELECT merge_action()", 17, 0},
		{"SELECT json_array(1, 2)", 16, 0},
		{"SELECT json_object()", 16, 0},
		{"SELECT json_object('a' : 1)", 16, 0},
		{"SELECT json_arrayagg(x) FROM t", 16, 0},
		{"SELECT x IS JSON FROM t", 16, 0},
		{"SELECT (SELECT json_scalar('a'))", 17, 0},
		{"SELECT '{}'::json", 0, 16},
		{"SELECT CAST(x AS json[]) FROM t", 0, 16},
		{"SELECT '{}'::jsonb", 0, 0},
	} {
		res, err := Classify(c.sql)
		if err != nil {
			t.Fatalf("%s: %v", c.sql, err)
		}
		st := res.Stmts[0]
		if st.GrammarCalls != c.calls || st.GrammarTypes != c.types {
			t.Errorf("%s: calls %d types %d, want %d %d", c.sql, st.GrammarCalls, st.GrammarTypes, c.calls, c.types)
		}
		if old := st.ForServer(15); c.calls > 15 && (!old.Opaque || old == st) {
			t.Errorf("%s: on 15 not opaque", c.sql)
		}
		if old := st.ForServer(15); c.types > 15 && !old.CatalogExprs {
			t.Errorf("%s: on 15 resolves no type through the catalog", c.sql)
		}
		if st.ForServer(17) != st {
			t.Errorf("%s: on 17 read otherwise than classified", c.sql)
		}
	}
}
