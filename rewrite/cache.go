package rewrite

import (
	"strings"
	"unicode/utf8"

	"github.com/pgfence/pgfence/internal/lru"
)

// Classifier classifies statements through LRU caches shared by all
// sessions, bounded together by the bytes their entries cost (an
// lru.Pool, which the plan cache may share; cachecost.go), and is safe
// for concurrent use:
//
//   - by the exact statement text (parse errors are cached too);
//   - by the statement's shape — its text with every numeric and string
//     literal replaced by a placeholder and unquoted words lowercased — for
//     single reads without session effects (see shareable). Clients that
//     put values into the text instead of parameters (pgbench -S, ORMs
//     without prepared statements, psql users) send a new text for every
//     query, and a parse costs more than relaying the query does
//     (docs/proxy.md, Performance). Literals cannot change what such a
//     statement is (its kind, the relations it reads, its locking, its
//     function calls), so one parse serves every query of the shape.
//     Texts whose shape the scanner cannot be sure of (dollar quotes,
//     block comments, backslashes in strings, set_config calls) are never
//     shared.
type Classifier struct {
	pool    *lru.Pool
	cache   *lru.Cache[string, entry]
	shapes  *lru.Cache[string, *Result]
	wshapes *lru.Cache[string, *Result] // writes, for ClassifyShared only
	gshapes *lru.Cache[string, gshape]  // fence SETs, for ClassifyShared only (see fenceSetShape)
}

// gshape is a cached text whose only literal is the value its last
// statement, a SET of a fence parameter, assigns.
type gshape struct {
	text string
	res  *Result
	lit  span // the literal in text
}

type entry struct {
	res *Result
	err error
}

// DefaultCacheMemory is the bound of a Classifier's caches made without a
// pool of their own.
const DefaultCacheMemory = 64 << 20

// NewClassifier returns a Classifier caching in p (nil: a pool of its own,
// of DefaultCacheMemory). A statement whose entry would cost more than
// the pool's bound is classified and not cached.
func NewClassifier(p *lru.Pool) *Classifier {
	if p == nil {
		p = lru.NewPool(DefaultCacheMemory)
	}
	return &Classifier{pool: p, cache: lru.New[string, entry](p), shapes: lru.New[string, *Result](p),
		wshapes: lru.New[string, *Result](p), gshapes: lru.New[string, gshape](p)}
}

// Classify returns the cached classification of sql, classifying and
// caching it on a miss. The returned Result is shared: do not modify it.
// A Result found by shape comes from another text of that shape: its
// Stmt.SQL is that text (its Offset is the same, as no literal precedes a
// statement's start); only reads without session effects are shared, and
// for those only the structural fields matter (none may write: no digest
// takes their text).
func (c *Classifier) Classify(sql string) (*Result, error) {
	if e, ok := c.cache.Get(sql); ok {
		return e.res, e.err
	}
	key, keyed, literals := shapeKey(sql)
	if keyed && literals {
		if res, ok := c.shapes.Get(key); ok {
			return res, nil
		}
	}
	res, err := Classify(sql)
	if keyed && literals && err == nil && shareable(res) {
		c.shapes.Add(key, res, entryCost(len(key)+len(sql), res, nil))
		return res, nil
	}
	c.cache.Add(sql, entry{res: res, err: err}, entryCost(len(sql), res, err))
	return res, err
}

// ClassifyWith is Classify under the session settings o. Settings that
// do not change how sql reads (see Options.Affects) share Classify's cache.
func (c *Classifier) ClassifyWith(sql string, o Options) (*Result, error) {
	if !o.Affects(sql) {
		return c.Classify(sql)
	}
	key := o.key() + sql
	if e, ok := c.cache.Get(key); ok {
		return e.res, e.err
	}
	res, err := ClassifyWith(sql, o)
	c.cache.Add(key, entry{res: res, err: err}, entryCost(len(key)+len(sql), res, err))
	return res, err
}

// ClassifySharedWith is ClassifyShared under the session settings o. A
// text whose reading o changes is never shared (its shape has a
// backslash, which shapes refuse anyway).
func (c *Classifier) ClassifySharedWith(sql string, o Options) (*Result, bool, error) {
	if o.Affects(sql) {
		res, err := c.ClassifyWith(sql, o)
		return res, false, err
	}
	return c.ClassifyShared(sql)
}

// ClassifyShared is Classify that also shares one parse among single
// writes that differ only in literals (an UPDATE with inlined values, say),
// reporting shared when the Result may come from another text. A shared
// write's structure (kind, write targets, relations read, function calls)
// is right for sql, but its Stmt.SQL and Canonical() are another text's:
// a caller that needs the statement's own text — for a payload digest —
// must classify it with Classify.
func (c *Classifier) ClassifyShared(sql string) (res *Result, shared bool, err error) {
	if e, ok := c.cache.Get(sql); ok {
		return e.res, false, e.err
	}
	key, keyed, literals := shapeKey(sql)
	if !keyed || !literals {
		res, err := c.Classify(sql)
		return res, false, err
	}
	if res, ok := c.shapes.Get(key); ok {
		return res, false, nil
	}
	if res, ok := c.wshapes.Get(key); ok {
		return res, true, nil
	}
	if g, ok := c.gshapes.Get(key); ok {
		if res := g.apply(sql); res != nil {
			return res, true, nil
		}
	}
	res, err = Classify(sql)
	switch {
	case err == nil && shareable(res):
		c.shapes.Add(key, res, entryCost(len(key)+len(sql), res, nil))
	case err == nil && shareableWrite(res):
		c.wshapes.Add(key, res, entryCost(len(key)+len(sql), res, nil))
	default:
		if err != nil {
			c.cache.Add(sql, entry{res: res, err: err}, entryCost(len(sql), res, err))
		} else if g, ok := fenceSetShape(sql, res); ok {
			c.gshapes.Add(key, g, entryCost(len(key)+len(sql), res, nil))
		} else {
			c.cache.Add(sql, entry{res: res, err: err}, entryCost(len(sql), res, err))
		}
	}
	return res, false, err
}

// fenceSetShape reports whether sql, classified as res, may serve
// ClassifyShared for every text of its shape with its literal put in:
// "SET [LOCAL] fence.x = '...'", alone or after BEGIN (what a worker sends
// at the start of every transaction, with a new fence.step each time, so
// each text is new). Its only literal is a string literal, inside the last
// statement, a SET of a parameter in the fence namespace whose value
// PostgreSQL takes as written (a placeholder parameter: no list quoting),
// and the statements before it are BEGIN.
func fenceSetShape(sql string, res *Result) (gshape, bool) {
	var spans []span
	if _, ok, _ := scanShape(sql, &spans); !ok || len(spans) != 1 || !spans[0].str || len(res.Stmts) == 0 {
		return gshape{}, false
	}
	last := res.Stmts[len(res.Stmts)-1]
	for _, st := range res.Stmts[:len(res.Stmts)-1] {
		if st.Kind != Begin || st.Isolation != "" || st.ReadOnly || st.ReadWrite || st.Deferrable {
			return gshape{}, false
		}
	}
	lit := spans[0]
	if lit.start < last.Offset || !plainSet(last) || last.GUCs[0].Value != unquote(sql[lit.start:lit.end]) {
		return gshape{}, false
	}
	return gshape{text: sql, res: res, lit: lit}, true
}

// plainSet reports whether st is exactly what classifySet makes of
// SET [LOCAL] fence.x = '...' and nothing else.
func plainSet(st *Stmt) bool {
	if st.Kind != Set || len(st.GUCs) != 1 || !strings.HasPrefix(st.Name, "fence.") {
		return false
	}
	g := st.GUCs[0]
	return g.Op == GUCSet && g.Name == st.Name && g.NArgs == 1 && !g.Func &&
		!st.All && !st.Chain && st.WriteTargets == nil && st.ReadRelations == nil &&
		!st.Opaque && !st.LockingRead && !st.CallsFence && !st.PrimaryOnlyFuncs && !st.UnknownGUCWrite &&
		st.Params == 0 && st.Inner == nil && st.Executes == "" && !st.Explain
}

// unquote decodes a standard string literal: the quotes go, and each
// doubled quote inside becomes one.
func unquote(lit string) string {
	return strings.ReplaceAll(lit[1:len(lit)-1], "''", "'")
}

// apply returns the Result for sql, a text of g's shape: g's statements
// with sql's own text and value for the last one. It returns nil when
// sql differs from g's text anywhere but in the last statement (the
// statements before it must be byte for byte the same).
func (g gshape) apply(sql string) *Result {
	last := g.res.Stmts[len(g.res.Stmts)-1]
	var spans []span
	if _, ok, _ := scanShape(sql, &spans); !ok || len(spans) != 1 || !spans[0].str ||
		len(sql) < last.Offset || sql[:last.Offset] != g.text[:last.Offset] {
		return nil
	}
	lit := spans[0]
	// The statement's own text: the literal changes length, what follows
	// it (a semicolon, blanks) does not.
	i := strings.Index(g.text[last.Offset:], last.SQL)
	if i < 0 || lit.start < last.Offset {
		return nil
	}
	start := last.Offset + i
	end := len(sql) - (len(g.text) - (start + len(last.SQL)))
	if end < start || lit.end > end {
		return nil
	}
	gu := last.GUCs[0]
	gu.Value = unquote(sql[lit.start:lit.end])
	st := &Stmt{SQL: sql[start:end], Offset: last.Offset, Kind: Set, Name: last.Name, GUCs: []GUC{gu}}
	res := &Result{Stmts: append(append(make([]*Stmt, 0, len(g.res.Stmts)), g.res.Stmts[:len(g.res.Stmts)-1]...), st)}
	return res
}

// Len returns the number of cached query strings and shapes.
func (c *Classifier) Len() int {
	return c.cache.Len() + c.shapes.Len() + c.wshapes.Len() + c.gshapes.Len()
}

// Pool returns the pool the Classifier caches in: its bytes, evictions
// and the statements it did not cache.
func (c *Classifier) Pool() *lru.Pool { return c.pool }

// plainSingle returns res's statement when res is one statement without
// session effects — it sets no GUC, calls nothing in schema fence and is
// not an EXECUTE, a PREPARE or an EXPLAIN — and nil otherwise.
func plainSingle(res *Result) *Stmt {
	if len(res.Stmts) != 1 {
		return nil
	}
	st := res.Stmts[0]
	if len(st.GUCs) > 0 || st.UnknownGUCWrite || st.CallsFence || st.Inner != nil || st.Executes != "" || st.Explain {
		return nil
	}
	return st
}

// shareable reports whether res may serve every text of its shape: one
// plain read (SELECT, VALUES, TABLE, DECLARE CURSOR) without session
// effects.
func shareable(res *Result) bool {
	st := plainSingle(res)
	// Not a read that may write (a function it calls), whose text a
	// receipt digests (round 23, AV-M1: a shared SELECT f(1) gave
	// SELECT f(2) the first text's digest item).
	return st != nil && st.Kind == Read && !st.MayWrite()
}

// shareableWrite reports whether res may serve ClassifyShared for every
// text of its shape: one INSERT, UPDATE, DELETE or MERGE (or SELECT INTO)
// without session effects.
func shareableWrite(res *Result) bool {
	st := plainSingle(res)
	return st != nil && st.Kind == Write
}

// ShapeKey returns sql's shape: sql with every literal replaced by a
// canonical literal of the same kind — a string's body emptied (”, b”,
// x”, n”, u&”), an integer that PostgreSQL reads as an int4 by 0, any
// other number by 0.0 — and unquoted text lowercased; quoted identifiers,
// $n parameters, line comments and whitespace are kept as they are. The
// shape is itself SQL that PostgreSQL's lexer reads token for token as it
// reads sql, literal values aside, so two texts of one shape are read
// alike (TestShapeLexesAsText checks this against libpg_query's lexer).
// ok is false when the text is not valid UTF-8 or has something the
// scanner does not model exactly (dollar quoting, block comments, a
// backslash anywhere, E” strings, U&"" identifiers, a number or a
// parameter run into letters, an unterminated literal, a control
// character other than tab, newline, carriage return and form feed) or
// calls set_config, whose literal arguments name a GUC.
func ShapeKey(sql string) (key string, ok bool) {
	key, ok, _ = shapeKey(sql)
	return key, ok
}

// shapeKey is ShapeKey, also reporting whether sql has a literal. A text
// without one is its own shape: the Classifier caches it by its text, as a
// hot statement (a prepared one, typically) is looked up without building
// a key.
func shapeKey(sql string) (key string, ok, literals bool) {
	return scanShape(sql, nil)
}

// span is a literal's place in a text: [start, end), quotes included;
// str marks a string literal (a numeric one otherwise).
type span struct {
	start, end int
	str        bool
}

// scanShape is shapeKey, also appending every literal's span to spans when
// spans is not nil.
//
// It follows PostgreSQL's scan.l where a token's end is decided: a "--"
// comment runs up to a newline or a carriage return ({non_newline} is
// [^\n\r]); a string literal runs to the quote that is not doubled
// (standard_conforming_strings on: a text with a backslash is refused, so
// off makes no difference); a prefix (n, u&) starts a literal only where
// it does not continue a word, and e, b and x are refused (an escape
// string; a bit string, in which a doubled quote is two); a number is {decinteger}, {numeric} or {real}, and anything
// that runs on from it into a word or another dot is refused (PostgreSQL
// versions differ there: junk, hexadecimal, underscores, "1..2"). What
// the scanner does not end a token at, it copies, so any other byte — a
// space of any kind, an operator, a letter — is compared as it is.
func scanShape(sql string, spans *[]span) (key string, ok, literals bool) {
	if !utf8.ValidString(sql) {
		return "", false, false
	}
	b := make([]byte, 0, len(sql))
	n := len(sql)
	// word reports whether the key so far ends inside a word: the next
	// letter or digit continues it.
	word := func() bool { return len(b) > 0 && identByte(b[len(b)-1]) }
	// prefix reports whether the key ends with the literal prefix p
	// starting a token.
	prefix := func(p string) bool {
		k := len(b) - len(p)
		return k >= 0 && string(b[k:]) == p && (k == 0 || !identByte(b[k-1]))
	}
	for i := 0; i < n; {
		c := sql[i]
		switch {
		case c == '\'':
			if prefix("e") || prefix("b") || prefix("x") {
				// E'...': an escape string; B'...', X'...': a quote
				// doubled inside ends them, and a string continuing one
				// on the next line is read the same way.
				return "", false, false
			}
			j, closed := closingQuote(sql, i)
			if !closed || strings.IndexByte(sql[i:j], '\\') >= 0 {
				return "", false, false // unterminated, or a backslash: standard_conforming_strings off would make it an escape
			}
			b = append(b, "''"...)
			literals = true
			if spans != nil {
				*spans = append(*spans, span{start: i, end: j + 1, str: true})
			}
			i = j + 1
		case c == '"':
			if prefix("u&") {
				return "", false, false // U&"..." UESCAPE '.': the identifier depends on a literal
			}
			j, closed := closingQuote(sql, i)
			if !closed {
				return "", false, false
			}
			b = append(b, sql[i:j+1]...)
			i = j + 1
		case c == '$':
			if i+1 >= n || !isDigit(sql[i+1]) || word() {
				return "", false, false // dollar quote, or $ inside a word
			}
			j := i + 1
			for j < n && isDigit(sql[j]) {
				j++
			}
			if j < n && (identByte(lowerByte(sql[j])) || sql[j] == '.') {
				return "", false, false // $1abc: junk after a parameter
			}
			b = append(b, sql[i:j]...)
			i = j
		case c == '-' && i+1 < n && sql[i+1] == '-':
			j := i + 2
			for j < n && sql[j] != '\n' && sql[j] != '\r' {
				if sql[j] < 0x20 && sql[j] != '\t' && sql[j] != '\f' {
					return "", false, false
				}
				j++
			}
			b = append(b, sql[i:j]...)
			i = j
		case c == '/' && i+1 < n && sql[i+1] == '*', c == '\\':
			return "", false, false
		case c == '.' && i+1 < n && isDigit(sql[i+1]) && len(b) > 0 && b[len(b)-1] == '.':
			return "", false, false // "..": DOT_DOT, then a number
		case isDigit(c) && !word(), c == '.' && i+1 < n && isDigit(sql[i+1]):
			j, float, ok := scanNumber(sql, i)
			if !ok {
				return "", false, false
			}
			switch {
			case c == '.':
				b = append(b, ".0"...) // after a word's digit, 0.0 would run into it
			case float:
				b = append(b, "0.0"...)
			default:
				b = append(b, '0')
			}
			literals = true
			if spans != nil {
				*spans = append(*spans, span{start: i, end: j})
			}
			i = j
		case c >= 'A' && c <= 'Z':
			b = append(b, c+'a'-'A')
			i++
		case c < 0x20 && c != '\t' && c != '\n' && c != '\r' && c != '\f', c == 0x7f:
			return "", false, false // not whitespace to every PostgreSQL (\v is since 16)
		default:
			b = append(b, c)
			i++
		}
	}
	key = string(b)
	if strings.Contains(key, "set_config") {
		return "", false, false
	}
	return key, true, literals
}

// scanNumber reads the number starting at sql[i] (a digit, or a dot
// before one) as PostgreSQL's lexer does: {decinteger} (an int4 when it
// fits, float otherwise), {numeric} or {real} (float). ok is false where
// versions of PostgreSQL read the text differently or as an error: the
// number runs on into a letter, a digit's underscore, a $ or another dot
// (junk, 0x1F, 1_000, 1..2, 1.2.3), or an exponent has no digits.
func scanNumber(sql string, i int) (end int, float, ok bool) {
	n := len(sql)
	j := i
	for j < n && isDigit(sql[j]) {
		j++
	}
	digits := sql[i:j]
	if j < n && sql[j] == '.' {
		if j+1 < n && sql[j+1] == '.' {
			return 0, false, false
		}
		float = true
		j++
		for j < n && isDigit(sql[j]) {
			j++
		}
	}
	if j < n && (sql[j] == 'e' || sql[j] == 'E') {
		float = true
		k := j + 1
		if k < n && (sql[k] == '+' || sql[k] == '-') {
			k++
		}
		if k >= n || !isDigit(sql[k]) {
			return 0, false, false
		}
		for k < n && isDigit(sql[k]) {
			k++
		}
		j = k
	}
	if j < n && (identByte(lowerByte(sql[j])) || sql[j] == '.') {
		return 0, false, false
	}
	if !float && !fitsInt4(digits) {
		float = true
	}
	return j, float, true
}

// fitsInt4 reports whether the decimal digits d are at most 2^31-1, which
// PostgreSQL's lexer reads as an integer constant (a float one otherwise).
func fitsInt4(d string) bool {
	d = strings.TrimLeft(d, "0")
	const max = "2147483647"
	return len(d) < len(max) || len(d) == len(max) && d <= max
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func lowerByte(c byte) byte {
	if c >= 'A' && c <= 'Z' {
		return c + 'a' - 'A'
	}
	return c
}

// closingQuote finds the quote that closes the quoted string literal or
// identifier opening at sql[i] (a ' or a "), passing over the quote
// doubled inside it; closed is false when nothing closes it.
func closingQuote(sql string, i int) (j int, closed bool) {
	q := sql[i]
	for j = i + 1; j < len(sql); j++ {
		if sql[j] != q {
			continue
		}
		if j+1 < len(sql) && sql[j+1] == q {
			j++ // a doubled quote stands for one
			continue
		}
		return j, true
	}
	return 0, false
}

// identByte reports whether c can continue an identifier (a letter
// lowercased by ShapeKey, a digit, _, $ or a byte of a multi-byte
// character).
func identByte(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_' || c == '$' || c >= 0x80
}
