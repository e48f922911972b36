package rewrite

import (
	"slices"
	"strings"
	"testing"
)

func TestShapeKey(t *testing.T) {
	tests := []struct {
		in, want string
		ok       bool
	}{
		{"SELECT abalance FROM pgbench_accounts WHERE aid = 81234;", "select abalance from pgbench_accounts where aid = ?;", true},
		{"select x FROM T1 where s = 'it''s' and n = 1.5e3", "select x from t1 where s = ? and n = ?e3", true},
		{`SELECT "Mixed Case", "a""b" FROM "T" WHERE v = $1`, `SELECT "Mixed Case", "a""b" from "T" where v = $1`[:0] + `select "Mixed Case", "a""b" from "T" where v = $1`, true},
		{"SELECT 1 -- it's a comment\n, 2", "select ? -- it's a comment\n, ?", true},
		{"SELECT b'0101', x'ff', n'x', u&'x'", "select b?, x?, n?, u&?", true},
		{"SELECT E'a\\'b'", "", false},
		{"SELECT e'x'", "", false},
		{"SELECT 'a\\b'", "", false},
		{"SELECT $$x$$", "", false},
		{"SELECT $tag$x$tag$", "", false},
		{"SELECT /* c */ 1", "", false},
		{"SELECT 'unterminated", "", false},
		{`SELECT "unterminated`, "", false},
		{"SELECT set_config('fence.token', '5', false)", "", false},
		{"SELECT pg_catalog.SET_CONFIG('search_path', 'x', false)", "", false},
		{"SELECT '\xff'", "", false},
	}
	for _, tc := range tests {
		got, ok := ShapeKey(tc.in)
		if ok != tc.ok || got != tc.want {
			t.Errorf("ShapeKey(%q) = %q, %v; want %q, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}

// TestClassifierSharesShapes: reads that differ only in literals are parsed
// once; anything whose literals could matter is classified from its own
// text.
func TestClassifierSharesShapes(t *testing.T) {
	c := NewClassifier(64)
	a, err := c.Classify("SELECT abalance FROM pgbench_accounts WHERE aid = 1")
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Classify("select abalance from pgbench_accounts where aid = 987654")
	if err != nil {
		t.Fatal(err)
	}
	if a != b {
		t.Error("two reads of one shape: got two parses, want the shared Result")
	}
	if got := b.Stmts[0].ReadRelations; !slices.Equal(got, []RelName{{Name: "pgbench_accounts"}}) {
		t.Errorf("shared Result reads %v", got)
	}
	for _, pair := range [][2]string{
		{"UPDATE results SET v = 1 WHERE k = 'a'", "UPDATE results SET v = 2 WHERE k = 'b'"},
		{"SET search_path = 'a'", "SET search_path = 'b'"},
		{"SET fence.token = '1'", "SET fence.token = '2'"},
		{"SELECT 1; SELECT 2", "SELECT 3; SELECT 4"},
		{"EXPLAIN SELECT 1", "EXPLAIN SELECT 2"},
		{"SELECT fence.acquire('a', 'b', 1)", "SELECT fence.acquire('c', 'd', 2)"},
		{"COPY t FROM '/a'", "COPY t FROM '/b'"},
	} {
		x, err := c.Classify(pair[0])
		if err != nil {
			t.Fatal(err)
		}
		y, err := c.Classify(pair[1])
		if err != nil {
			t.Fatal(err)
		}
		if x == y {
			t.Errorf("%q and %q share a Result; each must be classified from its own text", pair[0], pair[1])
		}
		if y.Stmts[0].SQL == x.Stmts[0].SQL {
			t.Errorf("%q classified with the text of %q", pair[1], pair[0])
		}
	}
	// The GUC value of a SET comes from its own text.
	res, _ := c.Classify("SET fence.token = '2'")
	if g := res.Stmts[0].GUCs; len(g) != 1 || g[0].Value != "2" {
		t.Errorf("SET fence.token = '2': GUCs %+v", g)
	}
}

// mutateLiterals replaces the value of every numeric and string literal in
// sql (which ShapeKey accepted and which has no comment): another text of
// the same shape.
func mutateLiterals(sql string) string {
	var b []byte
	for i := 0; i < len(sql); {
		c := sql[i]
		switch {
		case c == '\'':
			j := i + 1
			for j < len(sql) && !(sql[j] == '\'' && (j+1 >= len(sql) || sql[j+1] != '\'')) {
				if sql[j] == '\'' {
					j++
				}
				j++
			}
			b = append(b, "'zz'"...)
			i = j + 1
		case c == '"':
			j := i + 1
			for j < len(sql) && !(sql[j] == '"' && (j+1 >= len(sql) || sql[j+1] != '"')) {
				if sql[j] == '"' {
					j++
				}
				j++
			}
			b = append(b, sql[i:min(j+1, len(sql))]...)
			i = j + 1
		case c >= '0' && c <= '9' && (len(b) == 0 || !identByte(lower(b[len(b)-1]))):
			for i < len(sql) && (sql[i] >= '0' && sql[i] <= '9' || sql[i] == '.' || sql[i] == '_') {
				i++
			}
			b = append(b, "42"...)
		default:
			b = append(b, c)
			i++
		}
	}
	return string(b)
}

func lower(c byte) byte {
	if c >= 'A' && c <= 'Z' {
		return c + 'a' - 'A'
	}
	return c
}

// checkShapeShared is FuzzClassify's invariant for the shape cache: when a
// text's Result may be shared by its shape, another text of that shape
// classifies the same way (or fails to parse, which the server then
// reports itself).
func checkShapeShared(t *testing.T, sql string, res *Result) {
	key, ok := ShapeKey(sql)
	if !ok || !(shareable(res) || shareableWrite(res)) || strings.Contains(sql, "--") {
		return
	}
	other := mutateLiterals(sql)
	if k2, ok := ShapeKey(other); !ok || k2 != key {
		return // the mutation changed more than literals
	}
	res2, err := Classify(other)
	if err != nil {
		return
	}
	a, b := res.Stmts[0], res2.Stmts[0]
	if shareable(res2) != shareable(res) || shareableWrite(res2) != shareableWrite(res) ||
		a.Kind != b.Kind || !slices.Equal(a.ReadRelations, b.ReadRelations) || !slices.Equal(a.WriteTargets, b.WriteTargets) ||
		a.LockingRead != b.LockingRead || a.Opaque != b.Opaque || a.PrimaryOnlyFuncs != b.PrimaryOnlyFuncs ||
		a.Params != b.Params || a.Offset != b.Offset {
		t.Fatalf("%q and %q have one shape but classify differently: %+v vs %+v", sql, other, a, b)
	}
}

// TestClassifySharedWrites: writes that differ only in literals share one
// parse through ClassifyShared, flagged shared; Classify still parses
// each from its own text.
func TestClassifySharedWrites(t *testing.T) {
	c := NewClassifier(64)
	a, shared, err := c.ClassifyShared("UPDATE pgbench_accounts SET abalance = abalance + -4017 WHERE aid = 71833")
	if err != nil || shared {
		t.Fatalf("first write of a shape: shared %v, err %v", shared, err)
	}
	b, shared, err := c.ClassifyShared("UPDATE pgbench_accounts SET abalance = abalance + -12 WHERE aid = 5")
	if err != nil || !shared || a != b {
		t.Fatalf("second write of the shape: shared %v, same Result %v, err %v; want the first's, flagged shared", shared, a == b, err)
	}
	if got := b.Stmts[0].WriteTargets; !slices.Equal(got, []RelName{{Name: "pgbench_accounts"}}) {
		t.Errorf("shared write targets %v", got)
	}
	own, err := c.Classify("UPDATE pgbench_accounts SET abalance = abalance + -12 WHERE aid = 5")
	if err != nil || own == a || !strings.Contains(own.Stmts[0].Canonical(), "12") {
		t.Errorf("Classify of a shared write's text: got the shared Result or a wrong canonical text (%v)", err)
	}
	r1, _, _ := c.ClassifyShared("SELECT 1 FROM t WHERE k = 'a'")
	r2, shared, _ := c.ClassifyShared("SELECT 1 FROM t WHERE k = 'b'")
	if r1 != r2 || shared {
		t.Errorf("reads through ClassifyShared: same Result %v, shared %v; want the read shape, not flagged", r1 == r2, shared)
	}
	x, _, _ := c.ClassifyShared("SET fence.token = '1'")
	y, shared, _ := c.ClassifyShared("SET fence.token = '2'")
	if x == y || shared {
		t.Error("SET statements must never share a parse")
	}
}
