package proxy

import (
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
)

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
