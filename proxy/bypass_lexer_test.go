package proxy

import (
	"testing"
)

// The gate's shape cache (rewrite/cache.go) lets one parse serve every
// text of a shape, a shape being the text with its literals replaced. Two
// texts of one shape must be read alike by PostgreSQL's lexer; where the
// shape scanner ends a token somewhere PostgreSQL does not, a text of a
// cached read's shape hides a COMMIT (issue 30, attack round B, H1: a
// "--" comment ends at "\r" too, as PostgreSQL's scan.l has it). The
// shape cache is the process's, so the read that fixes the shape may come
// from any session; here it is the same one.
func init() { registerBypass("lexer", bypassLexer) }

func bypassLexer(t *testing.T) {
	for _, c := range []struct {
		name        string
		prime, last string // prime: a read; last: of prime's shape under the old scanner, a COMMIT to PostgreSQL
	}{
		// The attacker's text: the comment ends at \r, the literal the
		// scanner saw runs from the quote after the \n to the one in the
		// last comment.
		{"comment_ends_at_cr", "SELECT 1 --\r, 'a\n' AS b, ' --'\n", "SELECT 1 --\r, 'a\n' ; COMMIT ; SELECT ' --'\n"},
		// The same with CR LF line ends and the comment at the start.
		{"comment_ends_at_cr_first", "--\r SELECT 'x\n' AS b, ' --'\r\n", "--\r SELECT 'x\n' ; COMMIT ; SELECT ' --'\r\n"},
		// A comment that ends at \r right before a literal.
		{"comment_cr_then_literal", "SELECT 2, --\r'\n' AS b, ' --' AS c\n", "SELECT 2, --\r'\n'; COMMIT; SELECT ' --' AS c\n"},
		// A form feed or a vertical tab does not end a comment (neither
		// does for PostgreSQL): the scanner must not end one there either;
		// the control case is a text that shapes like it and commits.
		{"comment_cr_after_formfeed", "SELECT 3 --\f\r, 'a\n' AS b, ' --'\n", "SELECT 3 --\f\r, 'a\n' ; COMMIT ; SELECT ' --'\n"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			conn := e.encConn(t, "UTF8")
			if err := rawExec(ctxT(t), conn, []byte(c.prime)); err != nil {
				t.Fatalf("%q: %v", c.prime, err)
			}
			e.wantGatedCommit(t, conn, "lexer", []byte(c.last))
		})
	}
}
