package rewrite

import (
	"errors"
	"reflect"
	"sync"
	"testing"
)

func TestClassifyEmpty(t *testing.T) {
	for _, sql := range []string{"", " ", ";", "-- only a comment", "/* c */ ;"} {
		res, err := Classify(sql)
		if err != nil {
			t.Fatalf("Classify(%q): %v", sql, err)
		}
		if len(res.Stmts) != 0 {
			t.Errorf("Classify(%q): got %d statements, want 0", sql, len(res.Stmts))
		}
	}
}

func TestClassifyParseError(t *testing.T) {
	_, err := Classify("SELEC 1")
	var pe *ParseError
	if !errors.As(err, &pe) {
		t.Fatalf("got error %v, want *ParseError", err)
	}
}

func TestStmtText(t *testing.T) {
	res, err := Classify("  SELECT 1 ;\n INSERT INTO t VALUES ('a;b')  ; DELETE FROM u")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"SELECT 1", "INSERT INTO t VALUES ('a;b')", "DELETE FROM u"}
	for i, s := range res.Stmts {
		if s.SQL != want[i] {
			t.Errorf("statement %d: got SQL %q, want %q", i, s.SQL, want[i])
		}
	}
}

// TestCanonicalIgnoresSpelling: whitespace, comments, keyword case and
// needless quoting must not change the digest's canonical SQL, and real
// differences must.
func TestCanonicalIgnoresSpelling(t *testing.T) {
	same := [][]string{
		{
			"INSERT INTO results (job, token) VALUES ('a', $1)",
			"insert   into \"results\"(job,token)\n values ( 'a' , $1 ) -- trailing",
			"/* lead */ INSERT INTO RESULTS (\"job\", TOKEN) VALUES ('a', $1)",
		},
		{
			"UPDATE public.results SET v = $1 WHERE id = $2",
			"update \"public\".\"results\" set v=$1 where id=$2",
		},
	}
	for _, group := range same {
		want := canon(t, group[0])
		for _, sql := range group[1:] {
			if got := canon(t, sql); got != want {
				t.Errorf("canonical of %q: got %q, want %q", sql, got, want)
			}
		}
	}
	differ := [][2]string{
		{"INSERT INTO results VALUES (1)", "INSERT INTO results VALUES (2)"},
		{"INSERT INTO results VALUES (1)", `INSERT INTO "Results" VALUES (1)`},
		{"UPDATE t SET v = $1", "UPDATE t SET v = $2"},
	}
	for _, d := range differ {
		if a, b := canon(t, d[0]), canon(t, d[1]); a == b {
			t.Errorf("canonical of %q and %q: got both %q, want different", d[0], d[1], a)
		}
	}
}

func canon(t *testing.T, sql string) string {
	t.Helper()
	res, err := Classify(sql)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Stmts) != 1 {
		t.Fatalf("%q: got %d statements, want 1", sql, len(res.Stmts))
	}
	s := res.Stmts[0]
	c := s.Canonical()
	if s.canon != nil && s.canon.err != nil {
		t.Fatalf("deparse %q: %v", sql, s.canon.err)
	}
	return c
}

func TestCanonicalConcurrent(t *testing.T) {
	res, err := Classify("INSERT INTO results VALUES ($1)")
	if err != nil {
		t.Fatal(err)
	}
	s := res.Stmts[0]
	var wg sync.WaitGroup
	got := make([]string, 8)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i] = s.Canonical()
		}()
	}
	wg.Wait()
	for i, g := range got {
		if g != "INSERT INTO results VALUES ($1)" {
			t.Errorf("goroutine %d: got %q", i, g)
		}
	}
}

// mustClassify is c.Classify(sql), which must succeed.
func mustClassify(t *testing.T, c *Classifier, sql string) *Result {
	t.Helper()
	r, err := c.Classify(sql)
	if err != nil {
		t.Fatalf("Classify(%q): %v", sql, err)
	}
	return r
}

func TestClassifierCaches(t *testing.T) {
	c := NewClassifier(nil)
	a1 := mustClassify(t, c, "SELECT 1")
	a2, _ := c.Classify("SELECT 1")
	if a1 != a2 {
		t.Errorf("second Classify of the same text: got a new *Result, want the cached one")
	}
	_, e1 := c.Classify("SELEC 1")
	_, e2 := c.Classify("SELEC 1")
	if e1 == nil || e1 != e2 {
		t.Errorf("parse error: got %v then %v, want the same cached error", e1, e2)
	}
	if c.Len() != 2 {
		t.Errorf("Len: got %d, want 2", c.Len())
	}
}

func TestClassifierCachedAllocs(t *testing.T) {
	c := NewClassifier(nil)
	sql := "INSERT INTO results (job, token) VALUES ($1, $2)"
	c.Classify(sql)
	allocs := testing.AllocsPerRun(1000, func() { c.Classify(sql) })
	if allocs != 0 {
		t.Errorf("cached Classify: got %v allocations, want 0", allocs)
	}
}

func TestParseSearchPath(t *testing.T) {
	tests := []struct {
		in   string
		want []string
	}{
		{`"$user", public`, []string{"$user", "public"}},
		{`public`, []string{"public"}},
		{`App,  Public `, []string{"app", "public"}},
		{`"My Schema", "a""b", x`, []string{"My Schema", `a"b`, "x"}},
		{``, []string{}},
		{`""`, []string{}},
		{`a,,b`, []string{"a"}},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			if got := ParseSearchPath(tt.in); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("ParseSearchPath(%q): got %q, want %q", tt.in, got, tt.want)
			}
		})
	}
}

func TestQuoteIdentifier(t *testing.T) {
	tests := map[string]string{
		"public": "public", "$user": `"$user"`, "My Schema": `"My Schema"`, "select": `"select"`,
		"name": "name", "a1_b": "a1_b", "1a": `"1a"`, `a"b`: `"a""b"`, "": `""`,
	}
	for in, want := range tests {
		if got := QuoteIdentifier(in); got != want {
			t.Errorf("QuoteIdentifier(%q): got %s, want %s", in, got, want)
		}
	}
}

func TestProtectedMatches(t *testing.T) {
	p := NewProtected([]RelName{{"public", "results"}, {"app", "Results"}, {"alice", "ledger"}})
	tests := []struct {
		name string
		rel  RelName
		path []string
		want bool
	}{
		{"qualified exact", RelName{"public", "results"}, nil, true},
		{"qualified other schema", RelName{"other", "results"}, nil, false},
		{"qualified case differs", RelName{"app", "results"}, nil, false},
		{"quoted case", RelName{"app", "Results"}, []string{"public"}, true},
		{"unqualified on path", RelName{"", "results"}, []string{"alice", "public"}, true},
		{"unqualified not on path", RelName{"", "results"}, []string{"app"}, false},
		{"unqualified case on path", RelName{"", "Results"}, []string{"app"}, true},
		{"unknown path matches any schema", RelName{"", "ledger"}, nil, true},
		{"empty path", RelName{"", "results"}, []string{}, false},
		{"unexpanded $user fails closed", RelName{"", "ledger"}, []string{"$user", "public"}, true},
		{"expanded user", RelName{"", "ledger"}, []string{"alice", "public"}, true},
		{"expanded other user", RelName{"", "ledger"}, []string{"bob", "public"}, false},
		{"unprotected", RelName{"", "jobs"}, nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := p.Matches(tt.rel, tt.path); got != tt.want {
				t.Errorf("Matches(%v, %q): got %v, want %v", tt.rel, tt.path, got, tt.want)
			}
		})
	}
	var nilP *Protected
	if nilP.Matches(RelName{"public", "results"}, nil) {
		t.Errorf("nil Protected: got match, want none")
	}
}

// TestCanonicalDoesNotDeparseNonWrites: the C deparser crashes on some
// trees the parser accepts (COMMIT PREPARED with an empty GID); Canonical must only
// deparse writes.
func TestCanonicalDoesNotDeparseNonWrites(t *testing.T) {
	for _, sql := range []string{"COMMIT PREPARED ''", "ROLLBACK PREPARED ''", "PREPARE TRANSACTION ''"} {
		res, err := Classify(sql)
		if err != nil {
			t.Fatal(err)
		}
		if got := res.Stmts[0].Canonical(); got != sql {
			t.Errorf("Canonical(%q): got %q, want the text itself", sql, got)
		}
	}
}
