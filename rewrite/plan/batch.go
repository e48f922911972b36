package plan

import (
	"encoding/hex"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/session"
)

// Batch plans the steps of the extended protocol, one message at a time:
// the proxy sees a batch (its messages up to a Sync) as it arrives, and a
// pipelining client does not wait for answers, so the plan of each
// Execute and of the Sync is made when it comes, from the session state
// and what the Batch followed of the batch so far.
//
// An implicit transaction (a batch outside a transaction block) that
// writes a protected table, or may write one unseen, is wrapped: its
// receipt goes right before its Sync, with a digest of the statements
// executed since its gate, their parameters and their COPY data, which
// the Batch keeps (PostgreSQL skips the receipt when anything before it
// failed, and the transaction rolls back). A COMMIT of a transaction
// that owes a receipt gets the receipt before it.
//
// The zero Batch is ready to use. It belongs to one session.
type Batch struct {
	wrapped bool
	gen     fence.Generation // wrapped: the generation gated (or presented, tentative)
	gated   bool             // wrapped: the gate ran in the batch; else it is tentative
	client  []byte           // wrapped: fence.payload_digest, when the client gives its own
	digest  fence.Digest     // wrapped: the statements executed since
	marks   map[string][]int // savepoints in the wrapped batch: digest marks
	// written: the portals already digested (a suspended portal runs
	// again), by the Bind that made each: a name bound again is another
	// portal (round 23, attacker AW's M2: a batch re-binding the unnamed
	// portal had its first statement's digest alone).
	written map[portalKey]bool
	// restore: a receipt went before the COMMIT of the client's own
	// transaction, in a savepoint: after the Sync, the restoring query.
	restore bool
	// bound: wrapped and gated, and the transaction's id is taken
	// because something that may end the transaction runs after the
	// gate: the receipt is bound to it (Step.TxBound).
	bound bool
}

// Exec is an Execute as the planner sees it.
type Exec struct {
	Stmt   *rewrite.Stmt // the portal's statement
	Portal string
	// Params resolves the portal's text parameters as the server reads
	// them, for a statement that changes settings (nil otherwise).
	Params session.ParamFunc
	// Bound gives the portal's parameters for the digest.
	Bound Bound
}

// portalKey names one portal: its name and the Bind that made it (its
// Bound, one per Bind).
type portalKey struct {
	name  string
	bound Bound
}

// Bound is a portal's bound parameters.
type Bound interface {
	DigestParams() []fence.Param
}

// ExecPlan is the plan of one Execute.
type ExecPlan struct {
	// Refusal: the Execute fails with it. It is raised before the
	// client's Execute, which still goes (the server skips it, and the
	// rest of the batch, after the error).
	Refusal *fence.Error
	// Decides: the statement is the gate's business, so the plan was
	// made from the settled session state and the Execute changes what
	// the gate decides from.
	Decides bool
	// Before are the steps before the client's Execute: Gate, or
	// Savepoint and Receipt, or Raise.
	Before []Step
	// CopyDigested: the statement is a COPY FROM whose data goes into
	// the digest (the batch's while it is wrapped, else the
	// transaction's).
	CopyDigested bool
	// Unfenced: a protected write refused for want of fence settings
	// (FN008).
	Unfenced bool
	// AwaitCommit: the Execute is the client's COMMIT with the receipt
	// in a savepoint before it; if the COMMIT is known to have
	// committed before the Sync, tell the Batch (Committed): nothing is
	// left to restore.
	AwaitCommit bool
	// CaptureTx: take the transaction's id (TxStatement) before the
	// client's Execute: it is a CALL or a DO after the gate of a wrapped
	// batch, which PostgreSQL runs non-atomically there, so a COMMIT
	// inside it ends the gated transaction and the rest of the batch
	// runs in another. The batch's receipt is bound to the id.
	CaptureTx bool
}

// Execute plans the Execute of in.Stmt (not nil) in session ss.
func (b *Batch) Execute(ss Session, in Exec) ExecPlan {
	var p ExecPlan
	st := ss.State
	s := in.Stmt
	if p.Refusal = checkStmt(st, s, in.Params); p.Refusal != nil {
		return p
	}
	g := st.Gate()
	need := ss.Tables.ProtectedWrite(s) && !g.Gated
	gen, fencedNow := sessionGeneration(st)
	tentative := !need && !g.Due() && fencedNow && ss.Tables.MayWriteUnseen(s) && !(b.wrapped && !b.gated)
	commit := g.Due() && s.Kind == rewrite.Commit
	prepareTx := g.Due() && s.Kind == rewrite.PrepareTransaction
	if b.wrapped && (s.Kind == rewrite.Begin || s.Kind == rewrite.Rollback) {
		// No receipt at the Sync: BEGIN makes the implicit transaction
		// the client's explicit one (the receipt waits for its COMMIT),
		// ROLLBACK ends it. (In a batch that already failed the server
		// skips both, and the receipt would be skipped too.)
		b.wrapped = false
	}
	if (s.Kind == rewrite.Call || s.Kind == rewrite.Do) && b.MayEnd() {
		p.CaptureTx = true
	}
	if !need && !tentative && !commit && !prepareTx {
		if b.wrapped {
			b.add(st, s, in) // the receipt at the Sync covers every write of the batch
		}
		return p
	}
	p.Decides = true
	failed := st.Tx() == session.Failed
	explicit := st.Tx() == session.InTx && st.Explicit()
	switch {
	case failed:
		// The server refuses it; nothing to gate. (In a batch an
		// earlier error already made the server skip to Sync, the
		// gate's steps with it: harmless.)
	case need && !fencedNow:
		p.Unfenced = true
		p.Before = []Step{{Kind: Raise, Stmt: 0, Err: fencingRequired(ss.Tables.ProtectedTable(s), st, overlay{})}}
	case need:
		if !explicit {
			// An implicit transaction (up to Sync): the receipt ends it
			// at the Sync, and PostgreSQL commits it only if nothing
			// before failed. One wrapped already (a statement before
			// made it tentative) keeps its digest: that statement ran in
			// it (round 23, attacker AW's M4) — unless something ended
			// that transaction since (bound: a Query, a FunctionCall, a
			// CALL), and this write starts the next.
			if !b.wrapped || b.bound {
				b.wrap(st, gen)
			}
			b.gated = true
		}
		p.Before = []Step{{Kind: Gate, Stmt: 0, Gen: gen}}
	case tentative:
		// May write a protected table unseen: the backstop fences it
		// and marks the transaction; an implicit one ends with the
		// receipt that writes a receipt if it did (commit_if_written),
		// an explicit one gets it at its COMMIT (the server side
		// records the transaction as tentative).
		if !explicit && !b.wrapped {
			b.wrap(st, gen)
		}
	case prepareTx:
		p.Before = []Step{{Kind: Raise, Stmt: 0, Err: prepareTransaction(g.Gen, "commit the transaction with COMMIT")}}
	case commit:
		// AND CHAIN: the transaction the COMMIT begins is the client's,
		// which a restoring query after the Sync would fail (round 4,
		// I-M2); a failed receipt skips the COMMIT AND CHAIN, and the
		// transaction is left failed, as after any failed statement.
		restore := explicit && !s.Chain
		if restore {
			// The receipt in a savepoint: after the Sync, the
			// transaction is ended only if the receipt failed.
			p.Before = append(p.Before, Step{Kind: Savepoint, Stmt: 0})
		}
		p.Before = append(p.Before, Step{Kind: Receipt, Stmt: 0, Gen: g.Gen, Gated: g.Gated, BeforeCommit: true, Digest: Digest{Source: FromSession}})
		// An implicit transaction (the client's COMMIT ends it, with
		// PostgreSQL's warning) rolls back by itself at the Sync when
		// the receipt fails.
		b.restore = restore
		p.AwaitCommit = restore
		b.wrapped = false
	}
	if b.wrapped {
		b.add(st, s, in)
	}
	if s.Kind == rewrite.CopyFrom && !failed && (g.Due() || need && fencedNow || tentative) {
		p.CopyDigested = true // up to CopyDone
	}
	return p
}

// wrap starts following an implicit transaction whose receipt goes before
// the Sync.
func (b *Batch) wrap(ss *session.State, gen fence.Generation) {
	*b = Batch{wrapped: true, gen: gen, restore: b.restore, marks: map[string][]int{}, written: map[portalKey]bool{}}
	if v, ok := ss.Get(session.PayloadDigest); ok && v != "" {
		b.client, _ = hex.DecodeString(v)
	}
}

// add follows an executed statement of the wrapped batch into its digest.
func (b *Batch) add(ss *session.State, st *rewrite.Stmt, in Exec) {
	switch st.Kind {
	case rewrite.Savepoint:
		b.marks[st.Name] = append(b.marks[st.Name], b.digest.Mark())
		return
	case rewrite.RollbackTo:
		if m := b.marks[st.Name]; len(m) > 0 {
			b.digest.Rollback(m[len(m)-1])
		}
		return
	}
	k := portalKey{in.Portal, in.Bound}
	if !Digested(st) || b.written[k] {
		return
	}
	b.written[k] = true
	b.digest.Statement(DigestText(st, Prepared(ss)), in.Bound.DigestParams())
}

// MayEnd is told that something that may end the implicit transaction
// comes next in the batch (a CALL or DO, a Query or FunctionCall message,
// which PostgreSQL ends the transaction after). It reports whether the
// caller must take the transaction's id (TxStatement) before it: the
// batch is wrapped and gated, and its receipt is not bound yet; from
// then on it is (Step.TxBound).
func (b *Batch) MayEnd() bool {
	if !b.wrapped || !b.gated || b.bound {
		return false
	}
	b.bound = true
	return true
}

// CopyDigest is the digest a COPY's data goes into while the batch is
// wrapped (nil otherwise: the transaction's).
func (b *Batch) CopyDigest() *fence.Digest {
	if !b.wrapped {
		return nil
	}
	return &b.digest
}

// Restoring reports whether a receipt went before the COMMIT of the
// client's transaction in this batch and the restoring query is still to
// follow the Sync.
func (b *Batch) Restoring() bool { return b.restore }

// Committed tells the Batch that the COMMIT of ExecPlan.AwaitCommit
// committed before the Sync: nothing is left to restore (and a
// transaction the client opens meanwhile must not be touched).
func (b *Batch) Committed() { b.restore = false }

// SyncPlan is the plan of a Sync.
type SyncPlan struct {
	// Receipt, when not nil, goes before the Sync: it ends the wrapped
	// implicit transaction.
	Receipt *Step
	// Restore: the Sync's ReadyForQuery is hidden, and RestoreSQL
	// follows it (its ReadyForQuery is the client's).
	Restore bool
}

// Sync plans the Sync ending the batch.
func (b *Batch) Sync() SyncPlan {
	var p SyncPlan
	if b.wrapped {
		b.wrapped = false
		d := Digest{Source: FromBatch, Sum: b.client, Version: ClientDigestVersion, Items: b.digest.Len()}
		if b.client == nil {
			d.Sum, d.Version = b.digest.Sum(), fence.DigestVersion
		}
		p.Receipt = &Step{Kind: Receipt, Stmt: -1, Gen: b.gen, Gated: b.gated, TxBound: b.bound, Digest: d}
		b.bound = false
	}
	if b.restore {
		b.restore = false
		p.Restore = true
	}
	return p
}
