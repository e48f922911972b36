package proxy

import (
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
)

// A retry whose receipt step answers a replay (FN00R): the client's COMMIT
// is answered as committed, with the replay NOTICE, and nothing of the
// transaction is applied twice. But the server skips what follows the
// failed step: in a simple Query the statements after the COMMIT, in an
// extended-protocol batch everything up to the Sync, and the transaction
// is aborted. The proxy ends it (a hidden ROLLBACK, or ROLLBACK AND CHAIN
// for a COMMIT AND CHAIN nothing follows) and answers what followed the
// COMMIT with an error that says why it did not run (errReplayTail): run
// after the ROLLBACK, it would have run without what the first attempt's
// transaction left to the session (its SETs, fence.step among them), and
// could apply a write the first attempt applied under another step
// (round 3, attacker G's H1). Before, it was neither run nor answered
// (round 0, B-M6). For a simple Query that is awaitCommit and replayTail
// (fence_exec.go); for a batch, replayedBatch, before the first message
// after the COMMIT's Execute (the client's messages after it are held
// until the COMMIT is answered: one round trip, only in a batch that
// goes on after a gated COMMIT).

// errReplayTail answers the statements after a replayed COMMIT.
func errReplayTail() *fence.Error {
	return &fence.Error{Code: fence.CodeReplay,
		Message: "pgfence: the COMMIT before this statement was an idempotent replay (its transaction had already committed; nothing was applied twice), so the statements after it in the same request were not run: they would have run without what that transaction left to the session (its SET commands, temporary tables, WITH HOLD cursors)",
		Hint:    "send the statements that followed the COMMIT again, as a request of their own, after setting up the session as they need"}
}

// pendingTail is a client's Execute of a COMMIT with a receipt step before
// it, in a batch that has not reached its Sync.
type pendingTail struct {
	commit *Request // the COMMIT's Execute
	from   uint64   // fenceSession.seq before the receipt step was sent
	// ended: commit is a Query or FunctionCall inside the batch, which
	// ended its implicit transaction (endsInBatch).
	ended bool
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
// Sync: a hidden Sync ends the skipped batch, a hidden ROLLBACK the
// aborted transaction, and errReplayTail fails the rest of the client's
// batch, which the server then skips up to the client's Sync.
func (h *fenceSession) replayedBatch(s gateConn) error {
	p := h.tail
	if err := h.wait(s, p.commit); err != nil {
		return err
	}
	h.tail = nil
	if p.ended {
		if h.replaySeq.Load() <= p.from {
			return nil
		}
		// The server is not skipping (a Query's or FunctionCall's error
		// does not make it skip to Sync) and no transaction is open:
		// the rest of the batch is refused, skipped to the client's Sync.
		return h.raiseInBatch(s, errReplayTail())
	}
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
	if err := h.endReplayed(s); err != nil {
		return err
	}
	return h.raiseInBatch(s, errReplayTail())
}

// endReplayed ends, hidden, the transaction a replayed receipt step
// aborted: ROLLBACK (a replayed COMMIT AND CHAIN is answered with an
// error instead: replayLosesSession). The session state follows it as a
// client statement.
func (h *fenceSession) endReplayed(s gateConn) error {
	const end = "ROLLBACK"
	res, err := h.f.classifier.ClassifyWith(end, rewrite.Options{})
	if err != nil || len(res.Stmts) != 1 {
		return h.sendRollback(s) // unreachable: the text is the gate's own
	}
	// Its ReadyForQuery, hidden, ends what the replay's hidden errors
	// were (errShown): what follows is shown.
	if err := h.send(s, h.qmsg(end), &tag{kind: 'Q', segs: clientSegs(res), hideReady: true, shownAfter: true}, false); err != nil {
		return err
	}
	h.markState()
	return nil
}

// restoreReplayed runs before the client's first request after a replay:
// the client was told its COMMIT committed, so it goes on believing its
// session has what the transaction set, but the proxy rolled the
// transaction back, and that went with it. The tracked settings the
// proxy saw the transaction set (search_path, any tracked setting, not
// LOCAL) are set again; fence.step is set to replayStep whatever the
// proxy saw (round 3, H-H1: the step from before the transaction applied
// the next write a second time; round 6, L-H1 and L-H2: so did a step
// the proxy believed it knew). They are set, hidden, once everything
// before is answered (ErrWait on the loop: nothing done yet), outside an
// extended-protocol batch (a batch the server skips would skip them).
//
// They must be in effect at session level, outside any transaction that
// can still roll back: set inside one, its ROLLBACK (or ROLLBACK TO a
// savepoint made before) takes them away and the next write runs under
// the step from before the replay (round 8, O-H5: an extended-protocol
// COMMIT AND CHAIN answered as a replay leaves a failed transaction,
// which ROLLBACK AND CHAIN or ROLLBACK TO turned into an open one). So a
// failed transaction left by the replay is ended first (a hidden
// ROLLBACK: the client was told its transaction ended, committed or
// rolled back, so it believes none is open), and in an open one the
// settings are set but stay pending, set again before each request until
// they are set with the session idle.
//
// The statement either succeeds or the session ends (stepReplayed,
// onError): a failure the proxy ignored (a client's CancelRequest timed
// to hit it: round 8, O-H6) left the step from before the replay in
// effect while the proxy believed replayStep.
func (h *fenceSession) restoreReplayed(s gateConn) error {
	if err := h.barrier(s); err != nil {
		return err
	}
	h.mu.Lock()
	tx := h.st.Tx()
	h.mu.Unlock()
	if tx == session.Failed {
		if !h.replayAnswered.Load() {
			// An FN00R the client was shown as an error (a statement's,
			// not the receipt step's): its transaction is the client's
			// to end, and its COMMIT is answered ROLLBACK, as PostgreSQL
			// answers it. Ended by the proxy, the COMMIT of a
			// transaction that committed nothing was answered COMMIT
			// (round 25, BB-M1: the owner's column default raising a
			// forged FN00R). The settings are set once it has ended.
			return nil
		}
		if err := h.endReplayed(s); err != nil {
			return err
		}
		return h.barrier(s) // ErrWait on the loop: handled again once it ended
	}
	if tx != session.Idle && h.restoreSent {
		// Set once before this request already: in a transaction the
		// settings stay pending for the next request, not sent again
		// while this one waits (round 26, BE-2: a loop that never let
		// the request through).
		return nil
	}
	h.mu.Lock()
	settings := h.replaySettings
	if tx == session.Idle {
		h.replaySettings = nil
		h.replayPending.Store(false)
		h.replayAnswered.Store(false)
	}
	var b strings.Builder
	segs := make([]seg, 0, len(settings)+1)
	settings = append(slices.DeleteFunc(settings, func(st session.Setting) bool { return st.Name == "fence.step" }),
		session.Setting{Name: "fence.step", Value: replayStep})
	if h.txUnseen {
		// The replayed transaction ran code that may have set fence
		// settings unseen (a DO block switching job_key, epoch and
		// token): what it left for them is not known, and restoring
		// what the proxy saw put the write after it under another
		// generation than the first attempt's, applied twice (round 8,
		// O-H2). The generation is cleared: every write is refused
		// (FN008, fencing required) until the client sets it again.
		settings = append(slices.DeleteFunc(settings, func(st session.Setting) bool {
			return st.Name == "fence.job_key" || st.Name == "fence.epoch" || st.Name == "fence.token"
		}), session.Setting{Name: "fence.job_key", Value: ""})
		if tx == session.Idle {
			h.txUnseen = false
		}
	}
	for _, st := range settings {
		var err error
		if st.Default {
			err = h.st.Reset(st.Name, false)
		} else {
			err = h.st.Set(st.Name, st.Value, false)
		}
		if err != nil {
			continue
		}
		if b.Len() > 0 {
			b.WriteString("; ")
		}
		b.WriteString(restoreSettingSQL(st.Name, st.Value))
		segs = append(segs, seg{step: stepReplayed})
	}
	if restoreFault != nil {
		if sql := restoreFault(h.db); sql != "" {
			b.WriteString("; " + sql)
			segs = append(segs, seg{step: stepReplayed})
		}
	}
	h.mu.Unlock()
	if len(segs) == 0 {
		return nil
	}
	if err := h.send(s, h.qmsg(b.String()), &tag{kind: 'Q', segs: segs, hideReady: true}, false); err != nil {
		return err
	}
	h.restoreSent = tx != session.Idle
	h.markState()
	return nil
}

// restoreFault, set by tests only, adds a statement to restoreReplayed's
// for the database it names (a failure the tests cannot time otherwise).
var restoreFault func(db string) string

// errRestoreFailed ends a session whose settings could not be set again
// after a replay (restoreReplayed).
func errRestoreFailed(e *pgproto3.ErrorResponse) *ProtocolError {
	return &ProtocolError{Code: fence.CodeFencingRequired,
		Msg:  fmt.Sprintf("pgfence ended this session: after a replayed transaction it must set fence.step to %q (and the settings that transaction set), and that failed (%s: %s), so a later write could have run under the step from before the transaction and been applied twice", replayStep, e.Code, e.Message),
		Hint: "reconnect, set the session's fence settings (fence.step among them) as the first attempt had them, and go on with the work after the replayed transaction",
		Err:  fmt.Errorf("restore after a replay failed: %s", e.Code)}
}

// replayStep is fence.step after a replay (restoreReplayed): what the
// replayed transaction left for it is not known — a SET the proxy saw,
// but also code it cannot see (a trigger, a column default, a view, an
// operator: round 6, L-H1) or a value the server converted (L-H2) — and
// a later write under a step the proxy put back could be applied a second
// time. The backstop refuses every write under a step beginning with
// "pgfence:" (FN008, migration 018) until the client sets one, as its
// first attempt did.
const replayStep = "pgfence:replayed"

// restoreSettingSQL sets name to value for the session, as SET does.
func restoreSettingSQL(name, value string) string {
	return "SELECT pg_catalog.set_config(" + plan.Literal(name) + ", " + plan.Literal(value) + ", false)"
}

func init() {
	ownTemplate("settings a replayed transaction set, set again", onSession, restoreSettingSQL("fence.step", "s"), "SELECT pg_catalog.set_config(E'")
}

// replayLosesSession reports whether a replayed receipt step before the
// client's COMMIT (commit; nil for one the proxy put before an implicit
// transaction's end) leaves the session where the proxy cannot put it as
// that COMMIT would have left it, and the error that answers the COMMIT
// then: COMMIT AND CHAIN. What the proxy sets after a replay
// (restoreReplayed, fence.step's replayStep among it) would be set inside
// the chained transaction, which the client may roll back, and the
// settings with it (round 4, I-H2). The COMMIT is then answered as
// PostgreSQL answers a replay: an error, FN00R, the transaction rolled
// back and its settings with it, which the client knows from the error,
// as it would straight to PostgreSQL.
func replayLosesSession(commit *rewrite.Stmt, e *pgproto3.ErrorResponse) (*pgproto3.ErrorResponse, bool) {
	if commit == nil || !commit.Chain {
		return nil, false
	}
	return &pgproto3.ErrorResponse{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: fence.CodeReplay,
		Message: "pgfence: idempotent replay: this transaction had already committed (nothing was applied twice), but pgfence cannot put the session back as that COMMIT AND CHAIN left it, so it was rolled back as PostgreSQL does with a replay: the session's settings are as before it, and no transaction is open",
		Detail:  e.Detail,
		Hint:    "treat the transaction as committed and do not repeat its writes; set the session's settings (fence.step among them) again and begin the next transaction"}, true
}

// segsReceipt reports whether a query's segments hold a receipt step (a
// gated COMMIT, or the end of a gated implicit transaction).
func segsReceipt(segs []seg) bool {
	for _, sg := range segs {
		if sg.step == stepReceipt {
			return true
		}
	}
	return false
}
