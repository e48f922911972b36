package rewrite

import "slices"

// Comparing two readings of one text. The proxy reads a client's text
// with the session's client_encoding and standard_conforming_strings as
// it knows them; while a statement that may change them unseen is in
// flight, it reads later text at once only when every reading the
// settings allow classifies alike (SameClass), and otherwise waits for
// the server to tell it the settings.

// SameClass reports whether a and b classify a query alike: the same
// statements at the same places, each of the same kind, writing and
// reading the same relations, with the same flags, names, settings
// changes and parameters. Only what does not decide anything may differ:
// the literals' values (the canonical text a digest is made of).
func SameClass(a, b *Result) bool {
	if a == nil || b == nil {
		return a == b
	}
	return slices.EqualFunc(a.Stmts, b.Stmts, sameStmt)
}

func sameStmt(a, b *Stmt) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.SQL == b.SQL && a.Offset == b.Offset && a.Kind == b.Kind && a.Name == b.Name &&
		a.All == b.All && a.Chain == b.Chain && a.ReadOnly == b.ReadOnly && a.ReadWrite == b.ReadWrite &&
		a.Isolation == b.Isolation && a.Deferrable == b.Deferrable &&
		slices.Equal(a.WriteTargets, b.WriteTargets) && slices.Equal(a.ReadRelations, b.ReadRelations) &&
		a.Opaque == b.Opaque && a.LockingRead == b.LockingRead && a.CallsFence == b.CallsFence &&
		a.PrimaryOnlyFuncs == b.PrimaryOnlyFuncs && a.SessionLocal == b.SessionLocal && a.UnknownGUCWrite == b.UnknownGUCWrite && a.Temp == b.Temp &&
		slices.Equal(a.GUCs, b.GUCs) && slices.Equal(a.Builtins, b.Builtins) && a.Params == b.Params &&
		a.GrammarCalls == b.GrammarCalls && a.GrammarTypes == b.GrammarTypes &&
		sameStmt(a.Inner, b.Inner) && a.Executes == b.Executes && a.Explain == b.Explain && a.Analyze == b.Analyze
}

// ASCIINames reports whether every name and value r's classification
// holds — relations, the objects statements name, settings and the
// values they are given — is ASCII. Two client encodings that read a
// text's ASCII bytes alike (clientenc.SameASCII) then classify it alike:
// they differ only in its other characters, which decide nothing.
func (r *Result) ASCIINames() bool {
	for _, st := range r.Stmts {
		if !st.asciiNames() {
			return false
		}
	}
	return true
}

func (s *Stmt) asciiNames() bool {
	if s == nil {
		return true
	}
	rels := func(list []RelName) bool {
		for _, r := range list {
			if !isASCII(r.Schema) || !isASCII(r.Name) {
				return false
			}
		}
		return true
	}
	if !isASCII(s.Name) || !isASCII(s.Executes) || !isASCII(s.Isolation) || !rels(s.WriteTargets) || !rels(s.ReadRelations) {
		return false
	}
	for _, g := range s.GUCs {
		if !isASCII(g.Name) || !isASCII(g.Value) {
			return false
		}
	}
	return s.Inner.asciiNames()
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}
