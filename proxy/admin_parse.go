package proxy

import (
	"strings"
)

// The console's grammar is PgBouncer's (src/admin.c): a command is a word
// and an optional argument word, `SHOW CLIENTS`, `PAUSE mydb`, or
// `SET key = value` (`=` or `TO`; the value a word or a 'string'). A word
// is letters, digits and _, or a "double-quoted" name ("" inside is a
// quote); a keyword matches in any case, a name is kept as written. A
// trailing ; is optional. pgfence also takes several commands in one
// Query, separated by ; (PgBouncer takes one).

// adminStmt is one parsed console command.
type adminStmt struct {
	text string // as sent, for errors
	verb string // upper case: SHOW, PAUSE, SET, ...
	arg  string // the argument word, unquoted ("" when none)
	// argWord is arg upper-cased when it was an unquoted word (a
	// keyword such as CLIENTS), "" for a quoted name.
	argWord string
	// arg2 is a third word, as pgfence's SHOW FENCES db takes.
	arg2 string
	// SET only: the key (lower case when unquoted) and the value.
	key, value string
}

// splitAdmin splits a Query's text into statements at the semicolons
// outside quotes; empty statements are dropped.
func splitAdmin(sql string) []string {
	var out []string
	var quote byte
	start := 0
	for i := 0; i < len(sql); i++ {
		c := sql[i]
		switch {
		case quote != 0:
			if c == quote {
				quote = 0 // a doubled quote reopens at once: "" and '' work
			}
		case c == '"' || c == '\'':
			quote = c
		case c == ';':
			if st := strings.TrimSpace(sql[start:i]); st != "" {
				out = append(out, st)
			}
			start = i + 1
		}
	}
	if st := strings.TrimSpace(sql[start:]); st != "" {
		out = append(out, st)
	}
	return out
}

// adminLexer reads the tokens of one statement.
type adminLexer struct {
	s   string
	pos int
}

// token kinds
const (
	tokEnd = iota
	tokWord
	tokQuoted // "name"
	tokString // 'string'
	tokEquals
	tokBad
)

func isWordByte(c byte) bool {
	return c == '_' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
}

func (l *adminLexer) next() (kind int, val string) {
	for l.pos < len(l.s) && strings.IndexByte(" \t\n\r", l.s[l.pos]) >= 0 {
		l.pos++
	}
	if l.pos >= len(l.s) {
		return tokEnd, ""
	}
	c := l.s[l.pos]
	switch {
	case c == '=':
		l.pos++
		return tokEquals, "="
	case c == '"' || c == '\'':
		var b strings.Builder
		for i := l.pos + 1; i < len(l.s); i++ {
			if l.s[i] != c {
				b.WriteByte(l.s[i])
				continue
			}
			if i+1 < len(l.s) && l.s[i+1] == c {
				b.WriteByte(c)
				i++
				continue
			}
			l.pos = i + 1
			if c == '"' {
				if b.Len() == 0 {
					return tokBad, ""
				}
				return tokQuoted, b.String()
			}
			return tokString, b.String()
		}
		return tokBad, ""
	case isWordByte(c):
		start := l.pos
		for l.pos < len(l.s) && isWordByte(l.s[l.pos]) {
			l.pos++
		}
		return tokWord, l.s[start:l.pos]
	}
	return tokBad, ""
}

// parseAdmin parses one statement; ok is false for a syntax error.
func parseAdmin(text string) (st adminStmt, ok bool) {
	st.text = text
	l := &adminLexer{s: text}
	k, v := l.next()
	if k != tokWord && k != tokQuoted {
		return st, false
	}
	st.verb = strings.ToUpper(v)
	if st.verb == "SET" && k == tokWord {
		return parseSet(st, l)
	}
	switch k, v = l.next(); k {
	case tokEnd:
		return st, true
	case tokWord:
		st.arg, st.argWord = v, strings.ToUpper(v)
	case tokQuoted:
		st.arg = v
	default:
		return st, false
	}
	// A database named as a client's startup names it: cut to 63 bytes,
	// or DISABLE, PAUSE, KILL of a longer name would hold no session
	// (round 19, attacker AL's L1).
	if len(st.arg) > maxIdentLen {
		st.arg = st.arg[:maxIdentLen]
	}
	switch k, v = l.next(); k {
	case tokEnd:
		return st, true
	case tokWord, tokQuoted:
		st.arg2 = v
	default:
		return st, false
	}
	if k, _ := l.next(); k != tokEnd {
		return st, false
	}
	return st, true
}

func parseSet(st adminStmt, l *adminLexer) (adminStmt, bool) {
	k, v := l.next()
	switch k {
	case tokWord:
		st.key = strings.ToLower(v)
	case tokQuoted:
		st.key = v
	default:
		return st, false
	}
	k, v = l.next()
	if k != tokEquals && !(k == tokWord && strings.EqualFold(v, "to")) {
		return st, false
	}
	k, v = l.next()
	if k != tokWord && k != tokQuoted && k != tokString {
		return st, false
	}
	st.value = v
	if k, _ := l.next(); k != tokEnd {
		return st, false
	}
	return st, true
}
