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
	if h.copyReceipt != nil && s.OnLoop() {
		return Drop, ErrWait // finishCopy waits for the COPY's end
	}
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
	if t := h.copyReceipt; t != nil {
		if h.copiesLeft > 0 {
			// The query has another COPY FROM: the receipt waits
			// for it, unless the query ends first (an error).
			started, err := h.nextCopy(s)
			if err != nil || started {
				return Drop, err
			}
		}
		h.copyReceipt, h.copyDigested = nil, false
		return Drop, h.finishCopy(s, t)
	}
	return Drop, nil
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
// outside COPY.
func (h *fenceSession) awaitCopy(s gateConn, t *tag) error {
	if err := s.FlushServer(); err != nil {
		return err
	}
	select {
	case <-t.copyIn:
		return nil
	case <-h.last.Done():
	case <-s.ending():
		return errSessionClosing
	}
	select {
	case <-t.copyIn:
		// Started and already finished: the client still sends CopyDone.
		return nil
	default:
	}
	h.copyReceipt, h.copyDigested = nil, false
	return h.sendRollback(s)
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

// nextCopy waits, after a CopyDone, until the server starts the query's
// next COPY FROM (true) or answers the whole query (false).
func (h *fenceSession) nextCopy(s gateConn) (bool, error) {
	if err := s.FlushServer(); err != nil {
		return false, err
	}
	t := h.copyQuery
	select {
	case <-t.copyIn:
		return true, nil
	case <-h.last.Done():
	case <-s.ending():
		return false, errSessionClosing
	}
	select {
	case <-t.copyIn:
		return true, nil
	default:
		return false, nil
	}
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
	if err := h.barrier(s); err != nil {
		return err
	}
	h.mu.Lock()
	sum, version := plan.Resolve(receipt.Digest, h.st, nil)
	h.mu.Unlock()
	t := &tag{kind: 'Q', segs: []seg{{step: stepReceipt, gen: receipt.Gen}}, hideReady: true, sent: time.Now()}
	if err := h.send(s, h.qmsg(plan.StepSQL(receipt, sum, version)), t, false); err != nil {
		return err
	}
	defer h.markState()
	return h.sendWrappedCommit(s)
}

// sendWrappedCommit sends COMMIT as a query of its own, whose ReadyForQuery is
// the one the client sees: it commits the wrapped transaction, or ends it
// when a gate step failed.
func (h *fenceSession) sendWrappedCommit(s gateConn) error {
	return h.send(s, h.qmsg("COMMIT"), &tag{kind: 'Q', segs: []seg{{step: stepCommitWrapped}}}, true)
}
