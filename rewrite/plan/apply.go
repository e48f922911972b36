package plan

import (
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/session"
)

// What the server's answers mean for the plans to come. The proxy's
// server side calls these as the answers arrive (holding the session
// state as it does to change it), and the golden plans' model of the
// server does too, so both keep the gate's state alike.

// Gated records the gate's answer for gen: the transaction is gated, and
// with replay a receipt exists for the generation (its writes run but it
// never commits).
func Gated(ss *session.State, gen fence.Generation, replay bool) {
	g := ss.Gate()
	g.Gated, g.Gen, g.Replay = true, gen, replay
	if g.Digest == nil {
		g.Digest = &fence.Digest{}
	}
}

// Completed records what the server completing st means for the gate, to
// be called before the session state applies st (session.State.Apply): in
// a fenced session, a statement that may have written a protected table
// where the gate cannot see makes the transaction tentative; in a
// transaction that owes a receipt, a statement that may write joins its
// digest, with its parameters (bound: nil for a simple query).
func Completed(ss Session, st *rewrite.Stmt, bound Bound) {
	g := ss.State.Gate()
	if !g.Due() && ss.Tables.MayWriteUnseen(st) {
		if gen, ok := sessionGeneration(ss.State); ok {
			g.Tentative, g.Gen = true, gen
			if g.Digest == nil {
				g.Digest = &fence.Digest{}
			}
		}
	}
	if g.Due() && Digested(st) {
		if d, ok := g.Digest.(*fence.Digest); ok {
			var params []fence.Param
			if bound != nil {
				params = bound.DigestParams()
			}
			d.Statement(DigestText(st, Prepared(ss.State)), params)
		}
	}
}
