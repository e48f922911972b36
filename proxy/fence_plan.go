package proxy

import (
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
)

// protectedWrite reports whether st may write a protected table. Callers
// hold h.mu.
func (h *fenceSession) protectedWrite(st *rewrite.Stmt) bool {
	return plan.ProtectedWrite(h.cat.prot.Load(), h.st, st)
}

// maybeWrite reports whether st may write a protected table where the
// gate cannot see (it is not one of protectedWrite's): a DO block, a
// procedure, a function call, a write to a table whose triggers or rules
// may write one, or a write to a table the catalog does not list yet. In
// a fenced session such a statement makes the transaction tentative
// (session.Gate.Tentative). Callers hold h.mu.
//
// It asks whether the database has the fence schema, not whether the
// catalog lists a protected table: a table protected since the catalog
// was read (by any route, migration 010) already has its backstop, which
// fences the write and marks the transaction; commit_if_written then
// writes the receipt, and answers a retry as the gate answers a replay.
// A database without the schema pays nothing.
func (h *fenceSession) maybeWrite(st *rewrite.Stmt) bool {
	if st == nil || !h.cat.schema.Load() {
		return false
	}
	// A COPY FROM into another table is left out: a trigger of that table
	// writing a protected one is fenced and receipted by the backstop
	// itself (backstop-v1), and wrapping every COPY of a fenced session
	// would move its data off the event loop.
	return st.Kind != rewrite.CopyFrom && (st.Writes() || plan.Opaque(st))
}

// planTables answers the planner's questions about the protected tables
// from the session's catalog (plan.Tables). Callers hold h.mu.
type planTables fenceSession

func (t *planTables) ProtectedWrite(st *rewrite.Stmt) bool {
	return (*fenceSession)(t).protectedWrite(st)
}

func (t *planTables) MayWriteUnseen(st *rewrite.Stmt) bool {
	return (*fenceSession)(t).maybeWrite(st)
}

func (t *planTables) ProtectedTable(st *rewrite.Stmt) string {
	if rels := t.cat.prot.Load().ProtectedWrites(st, t.st.SearchPath()); len(rels) > 0 {
		return rels[0].String()
	}
	return ""
}

// planSession is what the planner knows of the session. Callers hold
// h.mu, with the session state settled.
func (h *fenceSession) planSession() plan.Session {
	return plan.Session{State: h.st, Tables: (*planTables)(h)}
}
