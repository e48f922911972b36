package proxy

import (
	"encoding/binary"
	"time"

	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
)

// Executing the gate's plans: sending the client's messages and the gate's
// steps upstream, tagged (send), and waiting where a step depends on an
// answer: every wait point is then (parking the client side on the
// event loop; blocking, for a Handler off the loop that wraps the gate),
// through settle, barrier and wait where
// nothing of the message is done yet, settleThen and barrierThen where
// the rest of the work is the continuation. The plans come from rewrite/plan; the
// answers are interpreted in fence_server.go.

// send passes a message upstream through the queue with its tag; visible
// requests' responses reach the client.
func (h *fenceSession) send(s gateConn, msg []byte, t *tag, visible bool) error {
	switch msg[0] {
	case 'P', 'B', 'E', 'D', 'C', 'H':
		if !h.inBatch {
			// A batch starts: what it binds comes from the server's
			// answers to everything before it, or from the batch itself.
			clear(h.batchStmts)
			h.stmtWait = h.last
			h.batchNo++
		}
		h.inBatch = true
	case 'S':
		h.inBatch = false
	}
	h.seq++
	if t != nil {
		t.seq = h.seq
		if t.step == stepReceipt || t.kind == 'Q' && segsReceipt(t.segs) {
			h.commitOut.Store(true) // the client's next request waits for it (fence_client.go)
		}
	}
	copyFrom := msg[0] == 'Q' && visible && t != nil && segsCopyFrom(t.segs)
	if copyFrom {
		select {
		case <-h.copyStarted: // an earlier query's
		default:
		}
	}
	r, err := s.inject(msg, t, visible)
	if err != nil {
		return err
	}
	if r != nil {
		h.last = r
		if copyFrom {
			h.copyFromReq = r
		}
		if (msg[0] == 'Q' || msg[0] == 'F') && h.inBatch && visible && h.tail == nil {
			// A client's Query or FunctionCall inside an extended batch
			// ends its implicit transaction, which the database's replay
			// guard may answer with FN00R, rolling back what it set,
			// fence.step among it; PostgreSQL then runs the batch's next
			// messages in a new implicit transaction, under the step
			// from before (round 8, O-H4: a write after it was applied
			// twice). The batch's next message waits for its answer, and
			// after a replay the rest of the batch is refused
			// (replayedBatch). Only such a batch waits.
			h.tail = &pendingTail{commit: r, from: h.seq - 1, ended: true}
		}
	}
	if visible && t != nil && h.noteSent(s, t) {
		if h.protects() && !copyFrom {
			// (A COPY FROM waits for the client's data, so nothing may
			// wait for its answer before its CopyDone: clientMessage
			// sets this at the CopyDone or CopyFail instead.)
			// It may write a protected row the proxy cannot see (a
			// view's function, a trigger) and end the transaction: a
			// replay (FN00R, the database's guard) would roll back what
			// the transaction set, fence.step among it, and a request
			// pipelined after it would run under the step from before
			// (round 8, O-H3). The client's next request waits for its
			// answer, as after a receipt step; a client that waits for
			// each answer never waits.
			h.commitOut.Store(true)
		}
		h.codeRan(s, t.seq)
		if t.kind == 'E' && t.cp != nil {
			// Its own code cannot close the portal it runs in (PostgreSQL
			// refuses to drop an active portal): it is still this one.
			t.cp.seq = t.seq
		}
	}
	return nil
}

// codeRan records that the request seq, just sent on the upstream in use,
// may run code of the client's that the proxy cannot see into, which can
// close and open portals (SQL CLOSE and OPEN of a refcursor), replace
// named prepared statements (EXECUTE 'DEALLOCATE ...', 'PREPARE ...') and
// change the session's settings and role (set_config, EXECUTE 'SET
// ROLE ...'). From then on the proxy's knowledge of those on that
// connection is void until it learns them again: the portals bound before
// are judged as unknown (portalLive), the replica's statement copies are
// closed and copied again before use (routeMsg), and the primary's
// session is read back before a read may go to the replica
// (sessionKnown). Issue 30, round 5, attacker K's H1, H2, M2.
func (h *fenceSession) codeRan(s gateConn, seq uint64) {
	h.portalsTouched = seq
	if s.readRouter() == nil {
		return
	}
	if s.OnReplica() {
		h.rt.replicaCode = seq
	} else {
		h.rt.primaryCode = seq
	}
}

// settle waits until every request sent so far that changes the session
// state (tracked parameters, the transaction, prepared statements, the
// gate) has been answered, so the state the server goroutine keeps is what
// the next statement will run with. A client's plain reads and writes in
// flight are not waited for: the common path costs no round trip. On the
// loop it returns ErrWait (see wait): call it only before anything of the
// message is done; settleThen where something is.
func (h *fenceSession) settle(s gateConn) error {
	if err := h.wait(s, h.stateReq); err != nil {
		return err
	}
	h.stateReq = nil
	return nil
}

// settled reports whether the session state is settled already and, if
// so, forgets the request it was waiting for, as settleThen does before
// its continuation: a caller goes on at once, without building one.
func (h *fenceSession) settled() bool {
	if h.unsettled() {
		return false
	}
	h.stateReq = nil
	return true
}

// settleThen runs k once the session state is settled (settle), on the
// loop too (then).
func (h *fenceSession) settleThen(s gateConn, k func() error) error {
	return h.answeredThen(s, h.stateReq, k)
}

// answeredThen runs k once r has been answered (then), and with it every
// state-changing request sent before r: settleThen and barrierThen.
func (h *fenceSession) answeredThen(s gateConn, r *Request, k func() error) error {
	return h.then(s, &until{r: r}, func() error {
		h.stateReq = nil
		return k()
	})
}

// unsettled reports whether a state-changing request is unanswered.
func (h *fenceSession) unsettled() bool {
	if h.stateReq == nil {
		return false
	}
	select {
	case <-h.stateReq.Done():
		return false
	default:
		return true
	}
}

// markState records that the request just sent changes the session state.
func (h *fenceSession) markState() { h.stateReq = h.last }

// barrier waits until every request sent so far has been answered. As
// settle, it returns ErrWait on the loop.
func (h *fenceSession) barrier(s gateConn) error {
	if err := h.wait(s, h.last); err != nil {
		return err
	}
	h.stateReq = nil
	return nil
}

// barrierThen runs k once every request sent so far has been answered,
// on the loop too (then).
func (h *fenceSession) barrierThen(s gateConn, k func() error) error {
	return h.answeredThen(s, h.last, k)
}

// wait waits until r has been answered. On the loop, where it must not
// block, it parks the client side and returns ErrWait: the message is
// handled again, from the start, once r is answered. So it may be called
// only before anything of the message is done (nothing sent, nothing
// changed that handling it again would change twice).
func (h *fenceSession) wait(s gateConn, r *Request) error {
	if answered(r) {
		return nil // without an until, which escapes to parkClient
	}
	return h.then(s, &until{r: r}, nil)
}

// until is what a wait point waits for: r's answer, or (with copyIn) the
// start of a wrapped COPY FROM, whichever comes first.
type until struct {
	r       *Request
	copyIn  <-chan struct{}
	started bool // copyIn fired (after poll or block reported true)
}

// poll reports, without blocking, whether what u waits for has happened.
func (u *until) poll() bool {
	if u.copyIn != nil {
		select {
		case <-u.copyIn:
			u.started = true
			return true
		default:
		}
	}
	if u.r == nil {
		return true
	}
	select {
	case <-u.r.Done():
	default:
		return false
	}
	if u.copyIn != nil {
		select {
		case <-u.copyIn: // started and already finished
			u.started = true
		default:
		}
	}
	return true
}

// block waits until what u waits for has happened, or the session ends.
func (u *until) block(s gateConn) error {
	select {
	case <-u.copyIn: // nil when not waited for: never ready
		u.started = true
		return nil
	case <-u.r.Done():
	case <-s.ending():
		return errSessionClosing
	}
	u.poll()
	return nil
}

// then runs k once what u waits for has happened: at once if it has;
// otherwise it flushes what is buffered for the server (with a Flush
// inside an extended-protocol batch, so the server sends what it has for
// the batch so far) and, on the loop, parks the client side with k
// (gateConn.parkClient), and the loop runs k on its thread when the
// server side has answered; off the loop (a Handler that is not a
// LoopClient wrapping the gate: deliverOff), it blocks until then. k
// nil: on the loop, handle the message again (ErrWait); off it, nothing
// more to do. Every wait point of the gate is written once, with then.
func (h *fenceSession) then(s gateConn, u *until, k func() error) error {
	if !u.poll() {
		if h.inBatch {
			// A Flush makes the server send what it has for the batch
			// (an error is sent only at a Flush or Sync); a server in
			// COPY ignores it.
			if _, err := s.Inject([]byte{'H', 0, 0, 0, 4}, nil); err != nil {
				return err
			}
		}
		if err := s.FlushServer(); err != nil {
			return err
		}
		if s.OnLoop() {
			return s.parkClient(u.poll, k)
		}
		if err := u.block(s); err != nil {
			return err
		}
	}
	if k == nil {
		return nil
	}
	return k()
}

// runQuery executes the plan of a simple query the gate rewrites (or, in
// a failed transaction, sends as it is). It runs with the session state
// settled.
func (h *fenceSession) runQuery(s gateConn, sql string, res *rewrite.Result, q *plan.Query) error {
	if q.Action == plan.AsIs {
		// The server refuses everything but ROLLBACK; nothing to gate.
		return h.send(s, h.qmsg(sql), &tag{kind: 'Q', segs: clientSegs(res)}, true)
	}
	if q.Unfenced {
		h.f.Stats.Unfenced.Add(1)
	}
	var text, version string
	var inserts plan.Insertions
	var sum []byte
	h.mu.Lock()
	if q.Ending == plan.LoneCommit {
		sum, version = plan.Resolve(q.Steps[0].Digest, h.st, res.Stmts) // the text is the client's
	} else {
		text, inserts = q.Text(sql, h.st, res.Stmts)
	}
	h.mu.Unlock()
	defer h.markState()
	t := &tag{kind: 'Q', segs: querySegs(q.Steps, res.Stmts), inserts: inserts}
	h.copyDigested = q.CopyDigested
	h.copyReceipt = q.CopyReceipt
	h.copiesLeft = countKind(res, rewrite.CopyFrom)
	h.copyQuery = t
	if q.CopyReceipt != nil {
		t.copyIn = make(chan struct{}, h.copiesLeft)
	}
	t.sent = time.Now() // metrics: step latency
	switch q.Ending {
	case plan.LoneCommit:
		// The receipt as the gate's named statement (execNamed), a Sync
		// whose ReadyForQuery is hidden, then the client's COMMIT.
		r := &q.Steps[0]
		if err := h.execNamed(s, plan.ReceiptStatement(r.Gated), plan.CommitArgs(r.Gen, sum, version),
			&tag{kind: 'E', step: stepReceipt, gen: r.Gen, beforeCommit: true, sent: time.Now()}); err != nil {
			return err
		}
		if err := h.send(s, []byte{'S', 0, 0, 0, 4}, &tag{kind: 'S', step: stepReceipt, hideReady: true}, false); err != nil {
			return err
		}
		return h.send(s, h.qmsg(sql), &tag{kind: 'Q', segs: []seg{{step: stepClient, stmt: res.Stmts[0]}}}, true)
	case plan.Restore, plan.AwaitCommit, plan.AfterCopy:
		t.hideReady = true
	}
	if err := h.send(s, h.qmsg(text), t, true); err != nil {
		return err
	}
	// Where the plan waits (AwaitCommit, AfterCopy), what follows the
	// wait marks the state again (on the loop it runs after this returns).
	switch q.Ending {
	case plan.Restore:
		return h.sendRestore(s)
	case plan.AwaitCommit:
		return h.awaitCommit(s, t, res)
	case plan.AfterCopy:
		return h.awaitCopy(s, t)
	}
	return nil
}

// querySegs are the segments of a rewritten query's tag: one per step.
func querySegs(steps []plan.Step, stmts []*rewrite.Stmt) []seg {
	segs := make([]seg, len(steps))
	for i, ps := range steps {
		sg := seg{step: stepOf(ps.Kind), gen: ps.Gen, beforeCommit: ps.BeforeCommit}
		switch ps.Kind {
		case plan.Client, plan.Gate, plan.Raise:
			if ps.Stmt >= 0 {
				sg.stmt = stmts[ps.Stmt]
			}
		}
		segs[i] = sg
	}
	return segs
}

// stepOf is the segment step of a planned step.
func stepOf(k plan.Kind) step {
	switch k {
	case plan.Begin:
		return stepBegin
	case plan.Gate:
		return stepGate
	case plan.Savepoint:
		return stepSavepoint
	case plan.Receipt:
		return stepReceipt
	case plan.Raise:
		return stepRaise
	}
	return stepClient
}

// awaitCommit ends a client's query whose gated COMMIT had statements
// after it (or chained), once the query is answered. If the receipt step
// failed, the COMMIT and everything after it was skipped and the
// transaction is aborted: ROLLBACK ends it (the client has the step's
// error). After a replay (the client has COMMIT and the replay NOTICE)
// replayTail ends it, and tells the client why the statements after the
// COMMIT did not run. Otherwise the
// transaction is as the client's statements left it (committed and maybe
// a new one begun, or failed by a statement of the client's before the
// COMMIT), and an empty query gives the client the ReadyForQuery that
// says so. On the loop the client side is parked meanwhile (then).
func (h *fenceSession) awaitCommit(s gateConn, t *tag, res *rewrite.Result) error {
	return h.barrierThen(s, func() error {
		h.mu.Lock()
		failed, replayAt := t.stepFailed, t.replayAt
		h.mu.Unlock()
		if failed && replayAt > 0 {
			if commit := replayedCommit(t.segs[replayAt:]); commit != nil {
				return h.replayTail(s, res, commit)
			}
		}
		defer h.markState()
		if failed {
			return h.sendRollback(s)
		}
		return h.send(s, h.qmsg(""), &tag{kind: 'Q', segs: []seg{{step: stepRestore}}}, true)
	})
}

// replayedCommit is the client's COMMIT that a replayed receipt step
// stood for: the client statement right after the step (segs begins
// after it), if it is a COMMIT.
func replayedCommit(segs []seg) *rewrite.Stmt {
	for _, sg := range segs {
		if sg.step != stepClient {
			continue
		}
		if sg.stmt != nil && sg.stmt.Kind == rewrite.Commit {
			return sg.stmt
		}
		return nil
	}
	return nil
}

// replayTail ends a query whose gated COMMIT was answered by a replay:
// the server skipped the COMMIT and what follows it, and the transaction
// is aborted. A hidden ROLLBACK ends it (a replayed COMMIT AND CHAIN never
// gets here: replayLosesSession). Statements after the COMMIT are not run: after the
// first attempt's COMMIT they ran with what its transaction left to the
// session (its SETs, fence.step among them; temporary tables; WITH HOLD
// cursors), which the ROLLBACK took away, so run now they could do what
// the first attempt did not, a write under another step included (round
// 3, attacker G's H1: applied twice). The client is told instead, with an
// error for them (errReplayTail), whose ReadyForQuery is its own.
func (h *fenceSession) replayTail(s gateConn, res *rewrite.Result, commit *rewrite.Stmt) error {
	tail := false
	for i, st := range res.Stmts {
		if st == commit {
			tail = i+1 < len(res.Stmts)
			break
		}
	}
	if err := h.endReplayed(s); err != nil { // fence_replay.go
		return err
	}
	if !tail {
		// Nothing after the COMMIT (it chained): an empty query's
		// ReadyForQuery is the client's.
		return h.send(s, h.qmsg(""), &tag{kind: 'Q', segs: []seg{{step: stepRestore}}}, true)
	}
	return h.refuseQuery(s, errReplayTail())
}

// sendRollback sends a ROLLBACK whose ReadyForQuery is the one the client
// sees: after a successful commit it is a no-op (its warning is hidden);
// after a failed gate step it ends the failed transaction, so the client
// is idle and usable as the protocol promised.
func (h *fenceSession) sendRollback(s gateConn) error {
	return h.send(s, h.qmsg("ROLLBACK"), &tag{kind: 'Q', step: stepRollback, segs: []seg{{step: stepRollback}}}, true)
}

// sendRestore sends, after a client's query or batch whose COMMIT had the
// receipt step in a savepoint before it, the query that ends the
// transaction only if that step failed (plan.RestoreSQL). Its
// ReadyForQuery is the one the client sees.
func (h *fenceSession) sendRestore(s gateConn) error {
	return h.send(s, h.qmsg(plan.RestoreSQL), &tag{kind: 'Q', step: stepRollback, segs: []seg{{step: stepRestore}, {step: stepRollback}}}, true)
}

// refuseQuery answers a query with err without running any of it.
func (h *fenceSession) refuseQuery(s gateConn, err error) error {
	return h.send(s, h.qmsg(plan.RaiseSQL(plan.AsSessionError(err))), &tag{kind: 'Q', segs: []seg{{step: stepRaise}}}, true)
}

func queryMsg(dst []byte, sql string) []byte {
	dst = append(dst, 'Q', 0, 0, 0, 0)
	dst = append(dst, sql...)
	dst = append(dst, 0)
	binary.BigEndian.PutUint32(dst[1:5], uint32(len(dst)-1))
	return dst
}
