package proxy

import (
	"bytes"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
)

// A commit the synchronous standby did not confirm is not acknowledged
// (round 11, attacker U's H1). In failover_mode sync a takeover
// (fence.acquire, and every lease function whose commit a failover must
// keep) is promised once the synchronous standby has it: the era a
// promotion starts keeps every generation current before it. But a
// cancel ends a commit's wait for the standby (the client's own
// CancelRequest, a driver's timeout, pg_cancel_backend by any session of
// the same role): the commit stands on the primary, and PostgreSQL
// answers success with only a WARNING. A failover then lost the takeover
// while the era was lossless, and the previous holder committed.
//
// So the proxy turns that WARNING into an error of the statement or
// transaction whose commit it ends: FN016, then ReadyForQuery as
// PostgreSQL sent it. Where the client's statement's CommandComplete is
// still to come (a simple Query's last statement, an explicit COMMIT)
// the error replaces it; where it was sent (an extended-protocol
// statement committed at its Sync, the proxy's own hidden COMMIT of a
// gated write) the error comes before the ReadyForQuery, as PostgreSQL
// sends a deferred constraint's error at a Sync. Every transaction, not
// only those the proxy sees call fence.*: a function of the client's own
// may call fence.acquire where the proxy cannot see it.
//
// The WARNING is recognised by where PostgreSQL raised it, which no
// translation changes and no SQL can forge: severity WARNING (the
// unlocalized field) from routine SyncRepWaitForLSN (file syncrep.c).
// Its English message is accepted too (a server that sends no routine):
// a client's own RAISE WARNING with those words only fails its own
// commit. PostgreSQL raises two WARNINGs there: SQLSTATE 01000 for a
// cancel, 57P01 for a termination (the connection then ends, so the
// client never has its ReadyForQuery either).

// syncRepMarkers pre-filter the NoticeResponses worth decoding.
var syncRepMarkers = [][]byte{[]byte("SyncRepWaitForLSN"), []byte("syncrep.c"), []byte("wait for synchronous replication")}

// syncRepCancelled reports whether msg, a NoticeResponse, says a commit's
// wait for the synchronous standby was cancelled, and returns it decoded.
func syncRepCancelled(msg []byte) (*pgproto3.NoticeResponse, bool) {
	found := false
	for _, m := range syncRepMarkers {
		if bytes.Contains(msg, m) {
			found = true
			break
		}
	}
	if !found {
		return nil, false
	}
	var n pgproto3.NoticeResponse
	if err := n.Decode(msg[headerLen:]); err != nil {
		return nil, false
	}
	sev := n.SeverityUnlocalized
	if sev == "" {
		sev = n.Severity
	}
	if sev != "WARNING" {
		return nil, false
	}
	return &n, fence.IsSyncRepCancel(sev, n.Routine, n.File, n.Message)
}

// unconfirmedError is what the client gets instead of its commit's
// success.
func unconfirmedError(n *pgproto3.NoticeResponse) []byte {
	return encode(nil, &pgproto3.ErrorResponse{
		Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: fence.CodeUnconfirmed,
		Message: "pgfence: the transaction committed on the primary, but its wait for the synchronous standby was cancelled: " +
			"the standby did not confirm it, and a failover may lose it (a lease taken, renewed, released or retired in it too)",
		Detail: "PostgreSQL: " + n.Message + " " + n.Detail,
		Hint: "do not act on what this transaction returned: acquire the lease again (or renew it) and go on with the generation that returns; " +
			"retry a fenced write under the same generation and step (a commit that stands is answered as a replay)",
	})
}

// syncRepNotice handles a NoticeResponse that says a commit's wait for
// the synchronous standby was cancelled. Server goroutine.
func (h *fenceSession) syncRepNotice(s *Session, msg []byte, req *Request, n *pgproto3.NoticeResponse) (Verdict, error) {
	v, err := h.serverMessage(s, msg, req)
	if err != nil {
		return v, err
	}
	h.f.Stats.Codes.Add(fence.CodeUnconfirmed)
	s.Logger().Warn("a commit's wait for the synchronous standby was cancelled: answered with FN016 instead of success",
		zap.Uint32("session", s.sessionID()), zap.String("user", h.user), zap.String("database", h.db),
		zap.String("sqlstate", n.Code), zap.String("message", n.Message))
	if req == nil {
		req = s.head()
	}
	var t *tag
	if req != nil {
		t, _ = req.Tag.(*tag)
	}
	if t != nil && (t.kind == 'Q' && (t.cur >= len(t.segs) || t.segs[t.cur].step == stepClient) ||
		t.kind == 'E' && t.step == stepClient) {
		// The client's statement's CommandComplete comes next: the
		// error stands in for it.
		h.unconfirmed = unconfirmedError(n)
		h.unconfirmedSeq = t.seq
		return v, nil
	}
	// PostgreSQL's WARNING, then the error, even when the notice came
	// from a step the client does not see (the gate's own COMMIT of a
	// gated write): the commit is the client's.
	s.WriteClient(msg)
	s.WriteClient(unconfirmedError(n))
	return Drop, nil
}

// afterSyncRep replaces, when a cancelled wait is pending, the client's
// CommandComplete with the error, or sends the error before the
// ReadyForQuery. v is what the gate decided for msg. Server goroutine.
func (h *fenceSession) afterSyncRep(s *Session, msg []byte, req *Request, v Verdict) Verdict {
	switch msg[0] {
	case 'C':
		t, _ := req.Tag.(*tag)
		if t == nil || t.seq != h.unconfirmedSeq {
			return v
		}
		if v == Forward {
			s.WriteClient(h.unconfirmed)
			v = Drop
		}
		h.unconfirmed = nil // a COMMIT dropped: the client has an error already
	case 'E':
		if v == Forward {
			h.unconfirmed = nil // the client is told of an error anyway
		}
	case 'Z':
		s.WriteClient(h.unconfirmed)
		h.unconfirmed = nil
	}
	return v
}
