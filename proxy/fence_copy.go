package proxy

import (
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
)

// COPY FROM through the gate. A COPY in a transaction that owes a receipt
// has its data digested as it streams (copyData). A protected COPY FROM in
// a simple query outside a transaction runs in a transaction the plan
// opens (plan.AfterCopy): the receipt can only follow the data, so the
// client side waits for the COPY to start (awaitCopy), and after the last
// CopyDone sends the receipt and COMMIT as queries of their own
// (finishCopy).

// copyData follows the client's CopyData into the digest of a gated COPY.
func (h *fenceSession) copyData(msg []byte) {
	if h.copyDigested {
		body := msg[headerLen:]
		h.copyDigest(func(d *fence.Digest) { d.CopyData(body) })
	}
}

// copyDone handles the client's CopyDone or CopyFail: the end of a COPY's
// data, after which a wrapped COPY's transaction gets its receipt.
func (h *fenceSession) copyDone(s gateConn, msg []byte) (Verdict, error) {
	h.copyExec = nil // a Sync after this ends the batch (copySync)
	if h.copiesLeft > 0 {
		h.copiesLeft--
	}
	if h.copyDigested {
		h.copyDigested = h.copiesLeft > 0 // the query's next COPY too
		h.copyDigest((*fence.Digest).EndCopy)
	}
	if err := s.ForwardMessage(msg); err != nil {
		return Drop, err
	}
	t := h.copyReceipt
	if t == nil {
		return Drop, nil
	}
	finish := func() error {
		h.copyReceipt, h.copyDigested = nil, false
		return h.finishCopy(s, t)
	}
	if h.copiesLeft > 0 {
		// The query has another COPY FROM: the receipt waits for it,
		// unless the query ends first (an error).
		return Drop, h.nextCopy(s, func(started bool) error {
			if started {
				return nil
			}
			return finish()
		})
	}
	return Drop, finish()
}

// awaitCopy waits until the server either starts a wrapped COPY FROM or
// answers the whole query without starting it (the gate, or a statement
// before the COPY, failed). In the second case the client gets no
// CopyInResponse and will send no CopyDone, so the receipt step that
// waits for it must not: the wrapped transaction, failed and holding the
// fence row lock if the gate took it, is rolled back at once, and that
// ROLLBACK's ReadyForQuery answers the client's query (the query's own
// was hidden). A client that sends its COPY data without waiting for
// CopyInResponse is fine too: the server ignores CopyData and CopyDone
// outside COPY. On the loop the client side is parked meanwhile (then).
func (h *fenceSession) awaitCopy(s gateConn, t *tag) error {
	u := &until{r: h.last, copyIn: t.copyIn}
	return h.then(s, u, func() error {
		if u.started {
			return nil
		}
		h.copyReceipt, h.copyDigested = nil, false
		defer h.markState()
		return h.sendRollback(s)
	})
}

// copyDigest applies f to the digest a gated COPY's data goes into: the
// wrapped batch's (extended protocol, outside a transaction), else the
// transaction's.
func (h *fenceSession) copyDigest(f func(*fence.Digest)) {
	if d := h.batch.CopyDigest(); d != nil {
		f(d)
		return
	}
	h.mu.Lock()
	if d, ok := h.st.Gate().Digest.(*fence.Digest); ok {
		f(d)
	}
	h.mu.Unlock()
}

// nextCopy runs k, after a CopyDone, once the server starts the query's
// next COPY FROM (true) or answers the whole query (false).
func (h *fenceSession) nextCopy(s gateConn, k func(started bool) error) error {
	u := &until{r: h.last, copyIn: h.copyQuery.copyIn}
	return h.then(s, u, func() error { return k(u.started) })
}

// countKind counts the statements of kind k.
func countKind(res *rewrite.Result, k rewrite.Kind) int {
	n := 0
	for _, st := range res.Stmts {
		if st.Kind == k {
			n++
		}
	}
	return n
}

// finishCopy ends a wrapped transaction whose receipt step could not be
// spliced into the query text (COPY FROM: the digest covers its data). It
// waits for the COPY to complete so the digest is whole.
func (h *fenceSession) finishCopy(s gateConn, receipt *plan.Step) error {
	return h.barrierThen(s, func() error {
		h.mu.Lock()
		sum, version := plan.Resolve(receipt.Digest, h.st, nil)
		h.mu.Unlock()
		t := &tag{kind: 'Q', segs: []seg{{step: stepReceipt, gen: receipt.Gen}}, hideReady: true, sent: time.Now()}
		if err := h.send(s, h.qmsg(plan.StepSQL(receipt, sum, version)), t, false); err != nil {
			return err
		}
		defer h.markState()
		return h.sendWrappedCommit(s)
	})
}

// sendWrappedCommit sends COMMIT as a query of its own, whose ReadyForQuery is
// the one the client sees: it commits the wrapped transaction, or ends it
// when a gate step failed.
func (h *fenceSession) sendWrappedCommit(s gateConn) error {
	return h.send(s, h.qmsg("COMMIT"), &tag{kind: 'Q', segs: []seg{{step: stepCommitWrapped}}}, true)
}
