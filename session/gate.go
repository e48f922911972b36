package session

import "github.com/pgfence/pgfence/fence"

// Digester is the part of the payload digest (fence.Digest) the session
// needs: ROLLBACK TO SAVEPOINT drops the statements made since the
// savepoint.
type Digester interface {
	Mark() int
	Rollback(mark int)
}

// Gate is the write-gate state of the current transaction, filled in by the
// proxy. It is reset when the transaction ends, and restored by ROLLBACK TO
// SAVEPOINT to what it was when the savepoint was made (the gate's row lock
// taken inside a rolled-back savepoint is released by the server too); the
// Digest is kept but rolled back to the savepoint's mark.
type Gate struct {
	Gated  bool // the fence check has run in this transaction
	Replay bool // a receipt exists: the transaction's writes run but it never commits
	// Tentative: not gated, but a fenced statement ran that may have
	// written a protected table where the proxy cannot see (a DO block,
	// a function, a write to a table with triggers or rules): the
	// backstop fenced it and marked the transaction, and the commit runs
	// the receipt step that writes a receipt if it did
	// (fence.commit_if_written).
	Tentative bool
	Gen       fence.Generation // the generation checked (or, tentative, presented)
	Digest    Digester         // accumulates the transaction's write statements; nil until gated or tentative
}

// Due reports whether the transaction's commit needs a receipt step.
func (g *Gate) Due() bool { return g.Gated || g.Tentative }

// Gate returns the current transaction's gate state for the proxy to read
// and fill. The pointer stays valid for the State's lifetime; its contents
// are reset at the end of each transaction.
func (s *State) Gate() *Gate { return &s.gate }
