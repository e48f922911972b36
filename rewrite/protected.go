package rewrite

import (
	"strings"
	"unicode/utf8"
)

// Protected is the set of protected tables (the rows of
// fence.protected_tables). The zero value and nil protect nothing. A
// Protected is immutable once built and safe for concurrent use; build a new
// one when the table list changes.
type Protected struct {
	exact  map[RelName]struct{}
	byName map[string][]string // table name -> schemas holding a protected table of that name
}

// NewProtected builds the set from schema-qualified table names. Entries
// without a schema are ignored: a protected table always has one.
func NewProtected(tables []RelName) *Protected {
	p := &Protected{exact: make(map[RelName]struct{}), byName: make(map[string][]string)}
	for _, t := range tables {
		if t.Schema == "" || t.Name == "" {
			continue
		}
		if _, dup := p.exact[t]; dup {
			continue
		}
		p.exact[t] = struct{}{}
		p.byName[t.Name] = append(p.byName[t.Name], t.Schema)
	}
	return p
}

// Len returns the number of protected tables.
func (p *Protected) Len() int {
	if p == nil {
		return 0
	}
	return len(p.exact)
}

// Matches reports whether a relation named in a statement may be a
// protected table.
//
// A schema-qualified name matches exactly. An unqualified name matches if a
// protected table of that name lives in any schema of the effective search
// path: searchPath as given (with "$user" already replaced by the user's
// name, see session.State.SearchPath) plus the implicitly searched
// pg_catalog. This is deliberately conservative (fail closed): it does not
// check whether a table of that name earlier on the path (a temporary table,
// say) would shadow the protected one, since the proxy cannot see the
// catalog. A nil searchPath means the path is unknown (for example set by
// ALTER ROLE ... SET search_path, which the proxy cannot observe): then any
// protected table of that name matches, in any schema, and so does an
// element still spelled "$user".
func (p *Protected) Matches(r RelName, searchPath []string) bool {
	if p == nil || len(p.exact) == 0 {
		return false
	}
	if r.Schema != "" {
		_, ok := p.exact[r]
		return ok
	}
	schemas := p.byName[r.Name]
	if len(schemas) == 0 {
		return false
	}
	if searchPath == nil {
		return true
	}
	for _, s := range schemas {
		if s == "pg_catalog" {
			return true
		}
		for _, e := range searchPath {
			if e == s || e == "$user" {
				return true
			}
		}
	}
	return false
}

// ProtectedWrites returns the statement's write targets that may be
// protected tables (see Matches). A SQL-level PREPARE writes nothing itself;
// its Inner statement is what a later EXECUTE runs, which the caller
// resolves through the session's prepared statements (Stmt.Executes).
func (p *Protected) ProtectedWrites(s *Stmt, searchPath []string) []RelName {
	var out []RelName
	for _, r := range s.WriteTargets {
		if p.Matches(r, searchPath) {
			out = append(out, r)
		}
	}
	return out
}

// ParseSearchPath splits a search_path value into schema names the way
// PostgreSQL's SplitIdentifierString does: elements separated by commas,
// surrounding whitespace ignored, double-quoted elements kept verbatim (with
// "" for a quote), unquoted ones lowercased. "$user" is returned as the
// literal string $user. A malformed value (PostgreSQL would have rejected it
// at SET time) yields the elements parsed before the error.
func ParseSearchPath(value string) []string {
	out := []string{}
	s := value
	i := 0
	skipSpace := func() {
		for i < len(s) && isSpace(s[i]) {
			i++
		}
	}
	skipSpace()
	if i == len(s) {
		return out // empty string: empty list
	}
	for {
		var name string
		if i < len(s) && s[i] == '"' {
			i++
			var b strings.Builder
			closed := false
			for i < len(s) {
				if s[i] == '"' {
					if i+1 < len(s) && s[i+1] == '"' {
						b.WriteByte('"')
						i += 2
						continue
					}
					i++
					closed = true
					break
				}
				b.WriteByte(s[i])
				i++
			}
			if !closed || b.Len() == 0 {
				return out
			}
			name = b.String()
		} else {
			start := i
			for i < len(s) && s[i] != ',' && !isSpace(s[i]) && s[i] != '"' {
				i++
			}
			if i == start {
				return out
			}
			name = LowerASCII(s[start:i])
		}
		name = truncateIdent(name)
		out = append(out, name)
		skipSpace()
		if i == len(s) {
			return out
		}
		if s[i] != ',' {
			return out
		}
		i++
		skipSpace()
	}
}

// LowerASCII lowercases ASCII letters only, as PostgreSQL folds case where
// it leaves other bytes alone: an unquoted identifier (downcase_identifier
// in a multi-byte encoding), a setting's name (guc_name_compare), a
// keyword compared with pg_strcasecmp.
func LowerASCII(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c >= 'A' && c <= 'Z' {
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b)
}

// truncateIdent cuts an identifier to NAMEDATALEN-1 (63) bytes on a UTF-8
// character boundary, as PostgreSQL's truncate_identifier does.
func truncateIdent(s string) string {
	if len(s) <= 63 {
		return s
	}
	n := 63
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'
}
