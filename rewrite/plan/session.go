package plan

import (
	"encoding/hex"
	"strings"

	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/session"
)

// Session is what the planner knows of a session.
type Session struct {
	// State is the session state, settled: every earlier request that
	// changes it (its settings, its transaction, its prepared
	// statements, the gate) has been answered. The planner only reads
	// it.
	State *session.State
	// Tables answers for the database's protected tables.
	Tables Tables
}

// Tables is what the planner asks of the database's protected tables,
// answered for the session's search_path and prepared statements (the
// proxy answers from its catalog; ProtectedWrite is the usual answer to
// the first question).
type Tables interface {
	// ProtectedWrite reports whether st may write a protected table the
	// gate can see: one it names, or one the prepared statement it
	// executes names.
	ProtectedWrite(st *rewrite.Stmt) bool
	// MayWriteUnseen reports whether st may write a protected table
	// where the gate cannot see: a DO block, a procedure, a function
	// call, a write to a table whose triggers or rules may write one.
	// In a fenced session such a statement makes the transaction
	// tentative (session.Gate.Tentative).
	MayWriteUnseen(st *rewrite.Stmt) bool
	// ProtectedTable names the first protected table st writes, for a
	// refusal's message ("" when it names none itself).
	ProtectedTable(st *rewrite.Stmt) string
}

// ProtectedWrite reports whether st may write a table of p, with the
// session's search_path, directly or through the prepared statement it
// executes.
func ProtectedWrite(p *rewrite.Protected, ss *session.State, st *rewrite.Stmt) bool {
	if st == nil || p.Len() == 0 {
		return false
	}
	sp := ss.SearchPath()
	if len(p.ProtectedWrites(st, sp)) > 0 {
		return true
	}
	if st.Executes != "" {
		if ps, ok := ss.Statements().Statement(st.Executes); ok && ps.Stmt != nil {
			return len(p.ProtectedWrites(ps.Stmt, sp)) > 0
		}
	}
	return false
}

// MayNeedGate reports whether a statement could need the gate's attention
// with the session state as it will be: a write, a commit, or something
// that may run a prepared or opaque write. Only for such statements must
// the session state be settled before planning.
func MayNeedGate(stmts ...*rewrite.Stmt) bool {
	for _, st := range stmts {
		switch {
		case st.Writes(), Opaque(st):
			return true
		}
		switch st.Kind {
		case rewrite.Commit, rewrite.PrepareTransaction, rewrite.CopyFrom, rewrite.Execute:
			return true
		}
	}
	return false
}

// ChangesState reports whether statements change what the gate decides
// from: tracked settings, the transaction, prepared statements.
func ChangesState(stmts ...*rewrite.Stmt) bool {
	for _, st := range stmts {
		if len(st.GUCs) > 0 || st.UnknownGUCWrite {
			return true
		}
		switch st.Kind {
		case rewrite.Read, rewrite.Write, rewrite.Other, rewrite.CopyTo, rewrite.CopyFrom, rewrite.Listen, rewrite.Unlisten, rewrite.Notify:
		default:
			return true
		}
	}
	return false
}

// Opaque reports whether st can run SQL the gate cannot see.
func Opaque(st *rewrite.Stmt) bool {
	return st.Opaque || st.Kind == rewrite.Do || st.Kind == rewrite.Call || st.Executes != ""
}

// fenced reports whether the session has a fence generation now, or the
// query sets a fence setting (its statements may then run fenced).
func fenced(ss *session.State, stmts []*rewrite.Stmt) bool {
	if _, ok := ss.Generation(); ok {
		return true
	}
	for _, st := range stmts {
		for _, g := range st.GUCs {
			if strings.HasPrefix(g.Name, "fence.") || g.Op == rewrite.GUCResetAll {
				return true
			}
		}
	}
	return false
}

// clientDigest decodes a fence.payload_digest value: the client's own
// digest, when it set one.
func clientDigest(v string, set bool) ([]byte, bool) {
	if !set || v == "" {
		return nil, false
	}
	b, err := hex.DecodeString(v)
	return b, err == nil
}
