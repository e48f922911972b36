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
		{"SELECT abalance FROM pgbench_accounts WHERE aid = 81234;", "select abalance from pgbench_accounts where aid = 0;", true},
		{"select x FROM T1 where s = 'it''s' and n = 1.5e3", "select x from t1 where s = '' and n = 0.0", true},
		{`SELECT "Mixed Case", "a""b" FROM "T" WHERE v = $1`, `SELECT "Mixed Case", "a""b" from "T" where v = $1`[:0] + `select "Mixed Case", "a""b" from "T" where v = $1`, true},
		{"SELECT 1 -- it's a comment\n, 2", "select 0 -- it's a comment\n, 0", true},
		{"SELECT n'x', u&'x', xb'1'", "select n'', u&'', xb''", true},
		{"SELECT b'0101'", "", false},
		{"SELECT X'ff'", "", false},
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
		{"SELECT 1 --\r, 'a\n' AS b", "select 0 --\r, '' as b", true},
		{"SELECT 2147483648, .5, a1.5, 1e-3", "select 0.0, .0, a1.0, 0.0", true},
		{"SELECT 0x1F", "", false},
		{"SELECT 1..2", "", false},
		{"SELECT $1a", "", false},
		{`SELECT U&"x" FROM t`, "", false},
		{"SELECT 1\v", "", false},
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
	c := NewClassifier(nil)
	a := mustClassify(t, c, "SELECT abalance FROM pgbench_accounts WHERE aid = 1")
	b := mustClassify(t, c, "select abalance from pgbench_accounts where aid = 987654")
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
		x := mustClassify(t, c, pair[0])
		y := mustClassify(t, c, pair[1])
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
			i = quotedEnd(sql, i) + 1
			b = append(b, "'zz'"...)
		case c == '"':
			j := quotedEnd(sql, i)
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

// quotedEnd is the index of the quote that closes the quoted token (a
// string or an identifier, its quote doubled inside) opening at sql[i], or
// len(sql) when none does.
func quotedEnd(sql string, i int) int {
	q := sql[i]
	j := i + 1
	for j < len(sql) && !(sql[j] == q && (j+1 >= len(sql) || sql[j+1] != q)) {
		if sql[j] == q {
			j++
		}
		j++
	}
	return j
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
	c := NewClassifier(nil)
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
	x, _, _ := c.ClassifyShared("SET search_path = 'a'")
	y, shared, _ := c.ClassifyShared("SET search_path = 'b'")
	if x == y || shared {
		t.Error("SETs outside the fence namespace must never share a parse")
	}
}

// TestFenceSetShapes: "BEGIN; SET LOCAL fence.step = '...'", new in every
// transaction, is parsed once per shape; each text still gets its own
// value and statement text, exactly as a parse of its own would give.
func TestFenceSetShapes(t *testing.T) {
	c := NewClassifier(nil)
	first := "BEGIN; SET LOCAL fence.step = 's1'"
	if _, shared, err := c.ClassifyShared(first); err != nil || shared {
		t.Fatalf("first text: shared %v, err %v", shared, err)
	}
	for _, sql := range []string{
		"BEGIN; SET LOCAL fence.step = 'step-2 of ''the'' night'",
		"BEGIN; SET LOCAL fence.step = ''",
		"BEGIN; set local FENCE.STEP = 'x';",
	} {
		got, shared, err := c.ClassifyShared(sql)
		if err != nil {
			t.Fatal(err)
		}
		want, err := Classify(sql)
		if err != nil {
			t.Fatal(err)
		}
		if k1, _ := ShapeKey(first); k1 == mustShape(t, sql) && !shared {
			t.Errorf("%q: parsed again, want the shape of %q", sql, first)
		}
		sameSetResult(t, sql, got, want)
	}
	// Not shared: another namespace, a number, two literals, a statement
	// other than BEGIN before the SET.
	for _, pair := range [][2]string{
		{"SET LOCAL search_path = 'a'", "SET LOCAL search_path = 'B'"},
		{"SET fence.token = 5", "SET fence.token = 05"},
		{"SET fence.step = 'a'; SET fence.token = '1'", "SET fence.step = 'b'; SET fence.token = '2'"},
		{"SELECT 1; SET fence.step = 'a'", "SELECT 1; SET fence.step = 'b'"},
		{"BEGIN ISOLATION LEVEL SERIALIZABLE; SET LOCAL fence.step = 'a'", "BEGIN ISOLATION LEVEL SERIALIZABLE; SET LOCAL fence.step = 'b'"},
	} {
		c.ClassifyShared(pair[0])
		got, shared, err := c.ClassifyShared(pair[1])
		if err != nil || shared {
			t.Errorf("%q after %q: shared %v, err %v; want its own parse", pair[1], pair[0], shared, err)
			continue
		}
		want, _ := Classify(pair[1])
		sameSetResult(t, pair[1], got, want)
	}
}

func mustShape(t *testing.T, sql string) string {
	t.Helper()
	k, ok := ShapeKey(sql)
	if !ok {
		t.Fatalf("no shape for %q", sql)
	}
	return k
}

// sameSetResult fails unless got classifies sql as want does, in every
// field a SET or BEGIN carries.
func sameSetResult(t *testing.T, sql string, got, want *Result) {
	t.Helper()
	if len(got.Stmts) != len(want.Stmts) {
		t.Fatalf("%q: %d statements, want %d", sql, len(got.Stmts), len(want.Stmts))
	}
	for i, w := range want.Stmts {
		g := got.Stmts[i]
		if g.SQL != w.SQL || g.Offset != w.Offset || g.Kind != w.Kind || g.Name != w.Name ||
			!slices.Equal(g.GUCs, w.GUCs) || g.Isolation != w.Isolation || g.ReadOnly != w.ReadOnly ||
			g.Writes() != w.Writes() || g.PrimaryOnlyFuncs != w.PrimaryOnlyFuncs || g.CallsFence != w.CallsFence {
			t.Fatalf("%q statement %d: got %+v, want %+v", sql, i+1, g, w)
		}
	}
}

// checkFenceSetShape (FuzzClassify): when sql may serve its shape as a
// fence SET, a literal-mutated twin built from it classifies exactly as
// the twin's own parse.
func checkFenceSetShape(t *testing.T, sql string, res *Result) {
	g, ok := fenceSetShape(sql, res)
	if !ok {
		return
	}
	for _, other := range []string{mutateLiterals(sql), sql} {
		k1, _ := ShapeKey(sql)
		if k2, ok := ShapeKey(other); !ok || k2 != k1 {
			continue
		}
		got := g.apply(other)
		if got == nil {
			continue
		}
		want, err := Classify(other)
		if err != nil {
			t.Fatalf("%q classified through the shape of %q, but does not parse: %v", other, sql, err)
		}
		sameSetResult(t, other, got, want)
	}
}

// A text that does not parse and has a literal in it (so it has a shape)
// is an error, not a panic (a session's simple Query "SELEC 'x'" once
// ended in one).
func TestClassifySharedParseError(t *testing.T) {
	c := NewClassifier(nil)
	for i := 0; i < 2; i++ {
		if _, _, err := c.ClassifyShared("SELEC 'x'"); err == nil {
			t.Fatal("SELEC 'x' classified")
		}
	}
}
