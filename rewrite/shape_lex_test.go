package rewrite

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	pg_query "github.com/pganalyze/pg_query_go/v6"
)

// The shape cache's soundness rests on one property: a text's shape is
// itself SQL that PostgreSQL's lexer reads token for token as it reads the
// text, literal values aside. Then two texts of one shape are read alike
// (each as the shape is). These tests check the property against
// libpg_query's lexer (pg_query.Scan, PostgreSQL's own scan.l): issue 30,
// attack round B, H1 — a "--" comment that PostgreSQL ends at "\r" and the
// scanner did not hid a COMMIT in a cached read's shape.

// lexTok is a token as the property compares it: its kind, and its text
// (lowercased outside quotes) unless it is a literal, whose value a shape
// replaces.
type lexTok struct {
	kind pg_query.Token
	text string
}

func lexTokens(sql string) ([]lexTok, error) {
	res, err := pg_query.Scan(sql)
	if err != nil {
		return nil, err
	}
	out := make([]lexTok, 0, len(res.Tokens))
	for _, tk := range res.Tokens {
		lt := lexTok{kind: tk.Token}
		switch tk.Token {
		case pg_query.Token_SCONST, pg_query.Token_USCONST, pg_query.Token_BCONST, pg_query.Token_XCONST,
			pg_query.Token_ICONST, pg_query.Token_FCONST:
		default:
			lt.text = sql[tk.Start:tk.End]
			if !strings.HasPrefix(lt.text, `"`) {
				lt.text = strings.ToLower(lt.text)
			}
		}
		out = append(out, lt)
	}
	return out, nil
}

// checkShapeLexes fails t unless sql's shape, when it has one, lexes as
// sql does.
func checkShapeLexes(t *testing.T, sql string) {
	t.Helper()
	key, ok := ShapeKey(sql)
	if !ok {
		return
	}
	a, errA := lexTokens(sql)
	b, errB := lexTokens(key)
	if (errA == nil) != (errB == nil) {
		t.Fatalf("%q and its shape %q: lexer errors %v and %v", sql, key, errA, errB)
	}
	if !slices.Equal(a, b) {
		t.Fatalf("%q and its shape %q lex differently:\n  %v\n  %v", sql, key, a, b)
	}
}

var shapeLexSeeds = []string{
	// The attack (H1) and its relatives: comments end at \n and \r only.
	"SELECT 1 --\r, 'a\n' AS b, ' --'\n",
	"SELECT 1 --\r, 'a\n' ; COMMIT ; SELECT ' --'\n",
	"--\r SELECT 'x\n' ; COMMIT ; SELECT ' --'\r\n",
	"SELECT 3 --\f\r, 'a\n' AS b, ' --'\n",
	"SELECT 3 --\v, 'a\n' AS b, ' --'\n",
	"SELECT 1 --\x0b\n, 2",
	"SELECT 1 +--\r2",
	"SELECT 1 <-- x\n 2",
	// Strings: doubled quotes, continuation over a newline (or \r, or a
	// comment), prefixes, and prefixes that continue a word.
	"SELECT 'it''s', '', ''''",
	"SELECT 'a'\n'b', 'a'\r'b', 'a' -- c\n'b', 'a'  'b'",
	"SELECT b'0101', B'1', x'ff', X'1F', n'x', N'y', u&'x', U&'d\\0061t'",
	"SELECT xb'01', ab'x', zn'x', fu&'x'",
	"SELECT date '2020-01-01', int4 '1', pg_catalog.text 'x'",
	"SELECT U&'d!0061t' UESCAPE '!'",
	"SELECT U&\"d!0061t\" UESCAPE '!' FROM t",
	"SELECT e'x', E'\\'', 1e'x', ae'x'",
	// Numbers: int4 or not, floats, exponents, leading dots, junk.
	"SELECT 1, 2147483647, 2147483648, 007, 99999999999999999999",
	"SELECT 1.5, 1., .5, 1e5, 1.5e-3, 1E+3, .5e3, a1.5, t.5",
	"SELECT 1..2, 1.2.3, 0x1F, 0o17, 0b101, 1_000, 123abc, 1e, 1e+, 1.e3",
	"SELECT $1, $12, $1a, $1.5, a$1, $$x$$, $tag$x$tag$",
	"SELECT 1 FROM t LIMIT 10 OFFSET 20",
	"SELECT x FROM t ORDER BY 1, 2",
	// Identifiers.
	`SELECT "Mixed", "a""b", "", "x`,
	"SELECT Ünïcode, café FROM Tbl",
	// Other bytes.
	"SELECT\t1\f,\r\n2",
	"SELECT 1 /* c */",
	"SELECT 1 \\ 2",
	"SELECT '{}'::jsonb ? 'k', 1 ?| 2, ?",
	"SELECT 1\x00",
	"SELECT 1\x01, 'a\x01'",
	"SELECT 'unterminated",
	"SELECT 1 ; COMMIT ; SELECT 2",
}

// TestShapeLexesAsText: every seed, every golden statement.
func TestShapeLexesAsText(t *testing.T) {
	for _, sql := range shapeLexSeeds {
		checkShapeLexes(t, sql)
	}
	files, _ := filepath.Glob(filepath.Join(goldenDir, "*.sql"))
	for _, file := range files {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(data), "\n") {
			checkShapeLexes(t, line)
		}
	}
}

// TestShapeSeparatesAttack: the attack's read and its COMMIT are of
// different shapes.
func TestShapeSeparatesAttack(t *testing.T) {
	for _, pair := range [][2]string{
		{"SELECT 1 --\r, 'a\n' AS b, ' --'\n", "SELECT 1 --\r, 'a\n' ; COMMIT ; SELECT ' --'\n"},
		{"SELECT x FROM t WHERE a = 1", "SELECT x FROM t WHERE a = '1'"},
		{"SELECT x FROM t WHERE a = 1", "SELECT x FROM t WHERE a = 1.5"},
		{"SELECT x FROM t WHERE a = 1", "SELECT x FROM t WHERE a = 2147483648"},
		{"SELECT x FROM t WHERE a = b'1'", "SELECT x FROM t WHERE a = x'1'"},
	} {
		k1, ok1 := ShapeKey(pair[0])
		k2, ok2 := ShapeKey(pair[1])
		if ok1 && ok2 && k1 == k2 {
			t.Errorf("%q and %q share the shape %q", pair[0], pair[1], k1)
		}
	}
}

// FuzzShapeLexes: the property for any text.
func FuzzShapeLexes(f *testing.F) {
	for _, sql := range shapeLexSeeds {
		f.Add(sql)
	}
	f.Fuzz(func(t *testing.T, sql string) {
		if strings.IndexByte(sql, 0) >= 0 {
			return // not a query text (the protocol's strings end at NUL)
		}
		checkShapeLexes(t, sql)
	})
}
