package proxy

import (
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
)

// A retry whose receipt step answers a replay (FN00R): the client's COMMIT
// is answered as committed, with the replay NOTICE, and nothing of the
// transaction is applied twice. But the server skips what follows the
// failed step: in a simple Query the statements after the COMMIT, in an
// extended-protocol batch everything up to the Sync. Straight to
// PostgreSQL those would have run after the COMMIT, so the proxy runs
// them: the transaction (aborted by the replay) ends as the COMMIT would
// have ended it (ROLLBACK, or ROLLBACK AND CHAIN for COMMIT AND CHAIN),
// and what followed the COMMIT goes on, gated like anything else. For a
// simple Query that is awaitCommit and replayTail (fence_exec.go); for a
// batch, replayedBatch, before the first message after the COMMIT's
// Execute (the client's messages after it are held until the COMMIT is
// answered: one round trip, only in a batch that goes on after a gated
// COMMIT).

// pendingTail is a client's Execute of a COMMIT with a receipt step before
// it, in a batch that has not reached its Sync.
type pendingTail struct {
	commit *Request // the COMMIT's Execute
	from   uint64   // fenceSession.seq before the receipt step was sent
	chain  bool     // COMMIT AND CHAIN
}

// receiptBefore reports whether steps hold a receipt step before a
// client's COMMIT.
func receiptBefore(steps []plan.Step) bool {
	for _, s := range steps {
		if s.Kind == plan.Receipt && s.BeforeCommit {
			return true
		}
	}
	return false
}

// replayedBatch runs before a client message that follows, in the same
// batch, the Execute of a COMMIT with a receipt step before it. It waits
// for the COMMIT's answer (ErrWait on the loop: nothing done yet); if
// the receipt step answered a replay, the server is skipping to the
// Sync: a hidden Sync ends the skipped batch, a hidden ROLLBACK (AND
// CHAIN) the aborted transaction, and the client's message goes on as
// the first of a new batch, as it would have after the COMMIT.
func (h *fenceSession) replayedBatch(s gateConn) error {
	p := h.tail
	if err := h.wait(s, p.commit); err != nil {
		return err
	}
	h.tail = nil
	h.mu.Lock()
	replayed := h.replayedSeq > p.from
	h.mu.Unlock()
	if !replayed {
		return nil
	}
	h.commitReq = nil
	h.batch.Committed() // nothing to restore: the ROLLBACK ends it
	sync, _ := (&pgproto3.Sync{}).Encode(nil)
	if err := h.send(s, sync, &tag{kind: 'S', hideReady: true}, false); err != nil {
		return err
	}
	if err := h.endReplayed(s, p.chain); err != nil {
		return err
	}
	h.mu.Lock()
	h.errShown = false // what follows is the client's own
	h.mu.Unlock()
	return nil
}

// endReplayed ends, hidden, the transaction a replayed receipt step
// aborted, as the client's COMMIT would have: ROLLBACK, or ROLLBACK AND
// CHAIN (a new transaction with the same characteristics) for COMMIT AND
// CHAIN. The session state follows it as a client statement.
func (h *fenceSession) endReplayed(s gateConn, chain bool) error {
	end := "ROLLBACK"
	if chain {
		end = "ROLLBACK AND CHAIN"
	}
	res, err := h.f.classifier.ClassifyWith(end, rewrite.Options{})
	if err != nil || len(res.Stmts) != 1 {
		return h.sendRollback(s) // unreachable: the text is the gate's own
	}
	if err := h.send(s, h.qmsg(end), &tag{kind: 'Q', segs: clientSegs(res), hideReady: true}, false); err != nil {
		return err
	}
	h.markState()
	return nil
}
