package proxy

import (
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
	"go.uber.org/zap"
)

// The gate's server side: every server message, matched to the request it
// answers (its tag), is applied to the session state (settings,
// transaction, prepared statements, the gate, the digest), and the
// answers to the gate's own steps become what the client sees: hidden,
// or the step's error standing for the client's statement.

func (h *fenceSession) ServerMessage(s *Session, msg []byte, req *Request) (Verdict, error) {
	if msg[0] == 'N' {
		// A notice comes with no request (req nil); it is raised by the
		// one at the head of the queue.
		if n, ok := syncRepCancelled(msg); ok {
			return h.syncRepNotice(s, msg, req, n) // fence_syncrep.go
		}
	}
	if req != nil {
		if h.unconfirmed != nil {
			v, err := h.serverMessage(s, msg, req)
			if err != nil {
				return v, err
			}
			return h.afterSyncRep(s, msg, req, v), nil
		}
	}
	return h.serverMessage(s, msg, req)
}

func (h *fenceSession) serverMessage(s *Session, msg []byte, req *Request) (Verdict, error) {
	if req == nil {
		if msg[0] == 'S' {
			h.mu.Lock()
			h.paramStatus(s, msg)
			h.mu.Unlock()
			return Forward, nil
		}
		// Notices raised by the gate's own statements stay hidden.
		if msg[0] == 'N' {
			if head := s.head(); head != nil {
				if t, ok := head.Tag.(*tag); ok && h.hidden(t) {
					return Drop, nil
				}
			}
		}
		return Forward, nil
	}
	t, _ := req.Tag.(*tag)
	if t == nil {
		return Forward, nil
	}
	switch msg[0] {
	case 'G':
		h.idle.copyWait.Store(true) // the server waits for the client's data
		select {
		case h.copyStarted <- struct{}{}:
		default:
		}
	case 'C', 'E', 'Z':
		h.idle.copyWait.Store(false)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if msg[0] == 'Z' {
		if v := h.idle.fenceCall.Load(); v != 0 && t.seq >= v && msg[headerLen] == 'I' {
			h.idle.fenceCall.CompareAndSwap(v, 0)
		}
		if msg[headerLen] == 'I' && t.seq > h.portalsEnded {
			h.portalsEnded = t.seq // every portal bound before is gone (prunePortals)
		}
		if err := h.st.TxStatus(msg[headerLen]); err != nil && t.step != stepRollback {
			s.Logger().Debug("session state resynchronised", zap.Error(err))
		}
		if t.kind == 'Q' {
			// A simple Query drops the unnamed statement (PostgreSQL's
			// exec_simple_query), the gate's own queries too.
			h.be.stmts.CloseStatement("")
		}
		if t.seq > h.be.text.knownSeq {
			h.be.text.knownSeq = t.seq // every ParameterStatus before it is in
		}
		if t.shownAfter {
			h.errShown = false
		}
		if t.hideReady || !req.Visible {
			return Drop, nil
		}
		h.errShown = false
		return Forward, nil
	}
	if msg[0] == 'E' {
		return h.onError(s, msg, t)
	}
	switch t.kind {
	case 'Q':
		return h.queryResponse(s, msg, t)
	case 'P':
		if msg[0] == '1' && t.step == stepClient {
			h.be.stmts.Parse(t.name, t.res, t.oids)
			if t.raw != nil {
				if p, ok := h.be.stmts.Statement(t.name); ok {
					p.Raw = t.raw // the version read routing copies (route.go)
				}
			}
		}
	case 'B':
		if msg[0] == '2' && t.step == stepClient {
			h.st.Bind(t.portal, t.name)
		}
	case 'C':
		if msg[0] == '3' && t.step == stepClient {
			if t.closeOf == 'S' {
				h.be.stmts.CloseStatement(t.name)
			} else {
				h.be.stmts.ClosePortal(t.name)
			}
		}
	case 'E':
		return h.executeResponse(s, msg, t)
	}
	if t.step != stepClient {
		return Drop, nil
	}
	return Forward, nil
}

// hidden reports whether the current responses of t belong to a gate step
// the client must not see.
func (h *fenceSession) hidden(t *tag) bool {
	if t.kind == 'Q' {
		return t.cur < len(t.segs) && t.segs[t.cur].step != stepClient
	}
	return t.step != stepClient
}

func (h *fenceSession) queryResponse(s gateConn, msg []byte, t *tag) (Verdict, error) {
	sg := seg{step: stepClient}
	if t.cur < len(t.segs) {
		sg = t.segs[t.cur]
	}
	switch msg[0] {
	case 'C':
		t.cur++
		h.timeStep(t, sg.step)
		return h.complete(s, sg, msg, nil)
	case 'I':
		t.cur++
		if sg.step != stepClient {
			return Drop, nil // awaitCommit's empty query
		}
		return Forward, nil
	case 'D':
		if sg.step == stepGate {
			h.gateResult(sg.gen, msg)
		} else if sg.step == stepReceipt {
			h.receiptResult(msg)
			t.receiptRow = true
		} else if sg.step.routing() {
			h.routeRow(s, sg, msg) // route.go
		}
	case 'G':
		if t.copyIn != nil {
			select {
			case t.copyIn <- struct{}{}:
			default: // more COPYs started than planned: unreachable
			}
		}
	}
	if sg.step != stepClient {
		return Drop, nil
	}
	return Forward, nil
}

func (h *fenceSession) executeResponse(s gateConn, msg []byte, t *tag) (Verdict, error) {
	switch msg[0] {
	case 'G':
		if t.started != nil {
			close(t.started) // the COPY has started: a Sync now is ignored (copyExec)
			t.started = nil
		}
	case 's':
		// PortalSuspended: the Execute returned as many rows as it was
		// allowed. A write (INSERT … RETURNING, a writable CTE) has run
		// whole all the same, and may commit without the portal ever
		// completing: it joins the digest now, once (round 22, AQ-M2).
		if cp := t.cp; t.step == stepClient && cp != nil && cp.stmt != nil && !cp.digested {
			cp.digested = true
			plan.Completed(h.planSession(), cp.stmt, cp)
		}
	case 'C':
		h.timeStep(t, t.step)
		sg := seg{step: t.step, gen: t.gen, beforeCommit: t.beforeCommit}
		if t.step == stepClient && t.cp != nil {
			sg.stmt = t.cp.stmt
		}
		return h.complete(s, sg, msg, t.cp)
	case 'D':
		switch t.step {
		case stepGate:
			h.gateResult(t.gen, msg)
		case stepReceipt:
			h.receiptResult(msg)
			t.receiptRow = true
		case stepSettings:
			h.applySettings(s, msg, t)
		case stepTxID:
			h.txID = rowValue(msg)
		}
	}
	if t.step != stepClient {
		return Drop, nil
	}
	return Forward, nil
}

// complete handles the CommandComplete of a segment.
func (h *fenceSession) complete(s gateConn, sg seg, msg []byte, cp *clientPortal) (Verdict, error) {
	switch sg.step {
	case stepClient:
		if sg.stmt != nil {
			h.applyClient(sg.stmt, msg, cp)
			if sg.stmt.Kind == rewrite.Commit && h.errShown {
				// The receipt step failed before this COMMIT, which
				// therefore rolled back: the client already has the
				// step's error (or, for a replay, its COMMIT and NOTICE).
				return Drop, nil
			}
		}
		return Forward, nil
	case stepBegin:
		h.st.Begin()
	case stepReceipt:
		// Counted by its row ('committed'; commit_if_written says 'none'
		// when nothing was written).
	case stepCommitWrapped:
		if commandTag(msg) == "ROLLBACK" {
			h.st.Rollback(false)
		} else {
			h.st.Commit(false)
		}
	case stepRollback:
		h.st.Rollback(false)
	}
	return Drop, nil
}

// onError handles an ErrorResponse: it fails the session state and decides
// what the client sees. The client sees at most one error per
// ReadyForQuery: a gate step's error stands for the statement it guards,
// and the errors that follow it (the aborted transaction refusing the rest)
// are hidden.
func (h *fenceSession) onError(s gateConn, msg []byte, t *tag) (Verdict, error) {
	st := t.step
	var sg seg
	at := 0
	if t.kind == 'Q' {
		sg = seg{step: stepClient}
		if t.cur < len(t.segs) {
			sg = t.segs[t.cur]
			at = t.cur + 1
		}
		t.cur = len(t.segs) // the server skips the rest of the query
		st = sg.step
		t.stepFailed = st == stepGate || st == stepReceipt || st == stepSavepoint
	} else {
		sg = seg{step: st, gen: t.gen, beforeCommit: t.beforeCommit, stmt: t.about}
		if st == stepClient && t.cp != nil {
			sg.stmt = t.cp.stmt
		}
	}
	if st == stepReceipt && t.receiptRow {
		// The receipt step answered (fence.commit returned its row) and
		// then the transaction failed: at its end, where the last
		// statement of a query reports what COMMIT raised (a deferred
		// trigger's error) before its own CommandComplete. That is not
		// the receipt's answer: fence.commit raises its replay before
		// any row, and a transaction whose receipt step wrote its
		// receipt replays nothing. An FN00R there is anyone's code
		// (round 25, BB-H1: the owner's deferred trigger, reached
		// through a column default, answered a rolled-back write as a
		// replay): the client gets the error as PostgreSQL sent it.
		st, sg = stepClient, seg{step: stepClient}
		t.stepFailed, t.afterReceipt = false, true
	}
	if st.routing() {
		return Drop, nil // a routing query's failure is the router's business (route.go)
	}
	if st == stepReplayed {
		// What a replay took away could not be set again: the session
		// ends rather than write under a step the proxy does not know
		// (restoreReplayed).
		var e pgproto3.ErrorResponse
		if err := e.Decode(msg[headerLen:]); err != nil {
			e.Code = "XX000"
		}
		s.endWith(errRestoreFailed(&e))
		return Drop, nil
	}
	h.timeStep(t, st)
	var committed []session.Setting
	if st == stepReceipt {
		// What a replay's client believes its session has, as far as the
		// proxy saw it (fence_replay.go).
		committed, _ = h.st.CommitDiff()
	}
	// A transaction the gate let through ('ok', not a replay) replays
	// nothing: an FN00R a statement of it meets is anyone's code (read
	// before Fail, which forgets the transaction's gate).
	g := h.st.Gate()
	gatedOK := g.Gated && !g.Replay
	h.st.Fail()
	if st == stepPrepare {
		s.Logger().Warn("cannot prepare the gate's statements", zap.ByteString("error", msg))
	}
	if h.errShown || st == stepRollback || st == stepRestore {
		return Drop, nil
	}
	var e pgproto3.ErrorResponse
	if err := e.Decode(msg[headerLen:]); err != nil {
		h.errShown = true
		if st == stepClient {
			return Forward, nil
		}
		s.WriteClient(msg)
		return Drop, nil
	}
	forged := false
	if e.Code == fence.CodeReplay && st == stepClient && (t.afterReceipt || gatedOK) {
		// Not pgfence's: fence.commit raises its replay before its row,
		// and the database's replay guard fires only at the COMMIT of a
		// transaction whose gate found a receipt, or that the backstop
		// fenced where the proxy could not see (one before any gate, or
		// in a replaying transaction, may be the guard's: round 27,
		// BH-M1, a known limit). Said as what it is, so that no
		// client takes it for a replay (round 26, BE-1: the owner's
		// deferred trigger, at a COMMIT AND CHAIN, forged the proxy's
		// own answer to one), and not followed as one (BE-2).
		forged = true
		e.Code = "P0001"
		e.Message = "pgfence: not a replay: code other than pgfence's raised SQLSTATE FN00R in a transaction that replays nothing: " + e.Message
		h.logRefusal(s, &e, sg.stmt, "forged replay")
	}
	if e.Code == fence.CodeReplay && !t.afterReceipt {
		// A replay, whatever said it — the proxy's receipt step, a replay
		// guard failing a COMMIT or the end of an implicit transaction —
		// rolls back a transaction whose first attempt committed, and
		// what it left for fence.step with it: replayStep before the
		// client's next request (restoreReplayed). Round 7 (attacker N):
		// a replayed COMMIT AND CHAIN, answered with an error, and an
		// implicit transaction of a batch ended by a Query in it, which
		// the database's guard answered, left the step from before the
		// transaction, and the next write was applied twice.
		h.replayPending.Store(true)
		h.replaySeq.Store(t.seq)
	}
	if st == stepReceipt && e.Code == fence.CodeReplay {
		h.f.Stats.Replayed.Add(1)
		gen := sg.gen // the generation the receipt step ran with
		if gen.JobKey == "" {
			gen = h.st.Gate().Gen
		}
		commit := t.about
		if t.kind == 'Q' {
			commit = replayedCommit(t.segs[at:])
		}
		if le, lost := replayLosesSession(commit, &e); lost {
			// The proxy cannot leave the session as the client's
			// COMMIT (or its implicit transaction's end) would have:
			// answered as PostgreSQL answers a replay, with an error,
			// the transaction rolled back.
			h.errShown = true
			s.WriteClient(encode(nil, le))
			h.logRefusal(s, &e, nil, "replayed")
			return Drop, nil
		}
		if sg.beforeCommit || commit != nil {
			// The client's COMMIT is answered as committed (an
			// implicit transaction's too).
			s.WriteClient(encode(nil, &pgproto3.CommandComplete{CommandTag: []byte("COMMIT")}))
		}
		s.WriteClient(encode(nil, &pgproto3.NoticeResponse{Severity: "NOTICE", SeverityUnlocalized: "NOTICE", Code: fence.CodeReplay,
			Message: replayNotice(gen, &e), Detail: e.Detail, Hint: replayHint(&e)}))
		h.logRefusal(s, &e, nil, "replayed") // fence_log.go
		// The rest of the batch is skipped; its errors stay hidden. A
		// query's statements after the COMMIT are run again (awaitCommit).
		h.errShown = true
		t.replayAt = at
		// Set again before the client's next request (restoreReplayed;
		// replayPending is set above, for every FN00R).
		h.replaySettings = committed
		h.replayAnswered.Store(true)
		if t.kind == 'E' {
			h.replayedSeq = t.seq // the batch's next statements (replayedBatch)
		}
		return Drop, nil
	}
	h.errShown = true
	setup := st != stepRaise && h.setupError(s, &e) // fence_log.go
	if strings.HasPrefix(e.Code, "FN") {
		h.f.Stats.Refused.Add(1)
		h.f.Stats.Codes.Add(e.Code) // metrics: refusals by SQLSTATE
	}
	if strings.HasPrefix(e.Code, "FN") || st == stepRaise {
		h.logRefusal(s, &e, sg.stmt, "refused")
	}
	switch st {
	case stepClient:
		if !setup && !forged && (len(t.inserts) == 0 || e.Position == 0) {
			return Forward, nil
		}
		e.Position = t.inserts.ClientPosition(e.Position)
	default:
		// A gate step's PL/pgSQL context names pgfence's internals, not
		// anything of the client's.
		e.Where = ""
	}
	s.WriteClient(encode(nil, &e))
	return Drop, nil
}

// applyClient applies a client statement the server completed.
func (h *fenceSession) applyClient(st *rewrite.Stmt, msg []byte, cp *clientPortal) {
	ctag := commandTag(msg)
	var bound plan.Bound
	if cp != nil {
		bound = cp
	}
	if cp == nil || !cp.digested { // a suspended portal's is recorded
		plan.Completed(h.planSession(), st, bound) // tentative, digest
	}
	var pf session.ParamFunc
	if cp != nil {
		pf = paramFunc(cp, h.be.text.codec)
	}
	if err := h.st.Apply(st, ctag, pf); err != nil {
		h.f.log.Debug("session state could not follow a statement", zap.Error(err))
	}
}

// receiptResult counts a receipt step's answer.
func (h *fenceSession) receiptResult(msg []byte) {
	if rowValue(msg) == "committed" {
		h.f.Stats.Committed.Add(1)
	}
}

// gateResult records the gate's answer ('ok' or 'replay').
func (h *fenceSession) gateResult(gen fence.Generation, msg []byte) {
	plan.Gated(h.st, gen, rowValue(msg) == "replay")
	h.f.Stats.Gated.Add(1)
}

// commandTag returns a CommandComplete's tag.
func commandTag(msg []byte) string {
	b := msg[headerLen:]
	if n := len(b); n > 0 && b[n-1] == 0 {
		b = b[:n-1]
	}
	return string(b)
}

// rowValue returns the first column of a DataRow as text.
func rowValue(msg []byte) string {
	b := msg[headerLen:]
	if len(b) < 6 {
		return ""
	}
	n := int32(binary.BigEndian.Uint32(b[2:6]))
	if n < 0 || int(n) > len(b)-6 {
		return ""
	}
	return string(b[6 : 6+n])
}

// replayUncompared is what fence.receipt_answer's FN00R says when the
// first commit's digest is of another kind than the retry's (the
// backstop's backstop-v1 against the proxy's v1): the payloads were not
// compared.
const replayUncompared = "could not be compared"

// replayNotice is the NOTICE's message for e, the receipt step's FN00R:
// the same payload, or one that could not be compared with the first
// commit's (a retry across paths is still answered as a replay).
func replayNotice(gen fence.Generation, e *pgproto3.ErrorResponse) string {
	if strings.Contains(e.Message, replayUncompared) {
		return fmt.Sprintf("pgfence: idempotent replay: job %q epoch %d token %d step %q was already committed; its payload could not be compared with this one (the first commit's digest is of another kind); nothing was applied twice",
			gen.JobKey, gen.Epoch, gen.Token, gen.Step)
	}
	return fmt.Sprintf("pgfence: idempotent replay: job %q epoch %d token %d step %q was already committed with the same payload; nothing was applied twice",
		gen.JobKey, gen.Epoch, gen.Token, gen.Step)
}

// replayHint is the NOTICE's hint for e: none for the same payload (as
// before), the database's for one that could not be compared.
func replayHint(e *pgproto3.ErrorResponse) string {
	if strings.Contains(e.Message, replayUncompared) {
		return "treat this as success only if this is a retry of that commit; a different result needs a new step"
	}
	return ""
}
