package proxy

import (
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
)

// The gate's client side: what becomes of each client message. A simple
// Query is classified, planned (rewrite/plan) and executed (fence_exec.go);
// the extended protocol's messages are in fence_extended.go, COPY data in
// fence_copy.go.

// ClientMessage decides what becomes of each client message (Handler).
func (h *fenceSession) ClientMessage(s *Session, msg []byte) (Verdict, error) {
	v, err := h.clientMessage(s, msg)
	if err != ErrWait {
		h.resynced = false // done with this message (or parked in it)
		h.restoreSent = false
	}
	return v, err
}

func (h *fenceSession) clientMessage(s *Session, msg []byte) (Verdict, error) {
	if asksWork(msg) {
		h.idle.clientMsgs.Add(1)
	}
	switch msg[0] {
	case 'P', 'B', 'E', 'D', 'C':
		h.idle.openBatch.Store(true)
	case 'S', 'H', 'Q', 'F':
		h.idle.openBatch.Store(false)
	}
	if (msg[0] == 'c' || msg[0] == 'f') && h.protects() {
		// The end of a COPY FROM's data: the request that follows waits
		// for the COPY's answer, as after any request that may write
		// (fence_exec.go, send).
		h.commitOut.Store(true)
	}
	if h.commitOut.Load() && !h.inBatch && startsRequest(msg[0]) {
		// A request that may end in a replay was sent (a gated COMMIT, any
		// request that may write or run code in a database with protected
		// tables, the end of a COPY's data: fence_exec.go, send): the
		// client's next request waits until it is answered, so that
		// nothing of it reaches the server before
		// the proxy knows whether the COMMIT was a replay, and has put the
		// session back as the first attempt's COMMIT left it
		// (restoreReplayed) or answered it as PostgreSQL does (round 5,
		// J-H1: a batch pipelined after the COMMIT ran before the
		// settings were set again, under the step from before the
		// transaction, and was applied twice). A client that waits for
		// each answer (nearly all) never waits here.
		if err := h.barrier(s); err != nil {
			return Drop, err // ErrWait on the loop: nothing done yet
		}
		h.commitOut.Store(false)
	}
	if h.replayPending.Load() && !h.inBatch {
		if err := h.restoreReplayed(s); err != nil {
			return Drop, err // ErrWait on the loop: nothing done yet
		}
	}
	if !h.inBatch && startsRequest(msg[0]) && !h.replayPending.Load() && h.txUnseen && answered(h.last) {
		h.mu.Lock()
		idle := h.st.Tx() == session.Idle
		h.mu.Unlock()
		if idle {
			h.txUnseen = false // a new transaction: nothing of it ran yet
		}
	}
	if h.tail != nil {
		switch msg[0] {
		case 'P', 'B', 'E', 'D', 'C', 'Q', 'F':
			// The batch goes on after a gated COMMIT (fence_replay.go).
			if err := h.replayedBatch(s); err != nil {
				return Drop, err // ErrWait on the loop: nothing done yet
			}
		}
	}
	if msg[0] != 'Q' && s.readRouter() != nil { // read routing: upstream and named statements (route.go)
		if err := h.routeMsg(s, msg); err != nil {
			return Drop, err
		}
	}
	switch msg[0] {
	case 'Q':
		if h.inBatch && h.batch.MayEnd() {
			// A Query inside an extended batch ends its implicit
			// transaction: the receipt is bound to it (captureTx).
			if err := h.captureTx(s); err != nil {
				return Drop, err
			}
		}
		return Drop, h.query(s, msg)
	case 'P':
		return h.parse(s, msg) // fence_extended.go
	case 'B':
		return h.bind(s, msg)
	case 'E':
		return Drop, h.execute(s, msg)
	case 'S':
		if fwd, err := h.syncInCopy(s); err != nil {
			return Drop, err
		} else if fwd {
			return Drop, s.ForwardIgnored(msg)
		}
		return Drop, h.sync(s, msg)
	case 'C', 'D':
		return h.closeOrDescribe(s, msg)
	case 'F':
		if s.OnReplica() {
			// A function call may change the session's settings unseen
			// (replstate.go); in a transaction on the replica only the
			// replica's would change.
			return Drop, h.refuseQuery(s, errReplicaState())
		}
		if e := h.noFenceSchemaCall(msg); e != nil { // fence_plan.go
			return Drop, h.refuseQuery(s, e)
		}
		if userFunctionCall(msg) {
			if h.unsettled() {
				if err := h.settle(s); err != nil {
					return Drop, err // ErrWait on the loop: nothing done yet
				}
			}
			if e := h.fencedFunctionCall(); e != nil {
				return Drop, h.refuseQuery(s, e)
			}
		}
		if e := h.txReadRefusal(s, nil); e != nil { // route_rotx.go
			return Drop, h.refuseQuery(s, e)
		}
		if h.inBatch && h.batch.MayEnd() {
			// PostgreSQL commits the batch's implicit transaction after a
			// function call: the receipt is bound to it (captureTx).
			if err := h.captureTx(s); err != nil {
				return Drop, err
			}
		}
		return Drop, h.send(s, msg, &tag{kind: msg[0]}, true)
	case 'H':
		return Forward, nil
	case 'd':
		h.copyData(msg) // fence_copy.go
		return Forward, nil
	case 'c', 'f':
		return h.copyDone(s, msg)
	}
	return Forward, nil
}

// answered reports whether r (nil: nothing sent) has been answered.
func answered(r *Request) bool {
	if r == nil {
		return true
	}
	select {
	case <-r.Done():
		return true
	default:
		return false
	}
}

// asksWork reports whether a client message asks the server for
// something new, which restarts the gate's idle clock (fence_idle.go).
// Flush, Sync, Describe, Close and empty COPY data do not: a client that
// holds a fence row and sends only those is as silent as one that sends
// nothing, and a keepalive of them must not pin the row (issue 30).
func asksWork(msg []byte) bool {
	switch msg[0] {
	case 'H', 'S', 'D', 'C':
		return false
	case 'd':
		return len(msg) > 5
	}
	return true
}

// closeWhat names the object a Close or Describe of type typ refers to.
func closeWhat(typ byte) string {
	if typ == 'S' {
		return "prepared statement"
	}
	return "portal"
}

// query handles a simple Query: it classifies it, plans it (rewrite/plan)
// and executes the plan.
func (h *fenceSession) query(s gateConn, msg []byte) error {
	sql, opts, err := h.decodeText(s, msg[headerLen:len(msg)-1]) // fence_text.go
	if err != nil && !isTextError(err) {
		return err // ErrWait on the loop: nothing done yet
	}
	if err != nil {
		if h.strict(true) {
			return h.refuseQuery(s, textError(err))
		}
		return h.routeQuery(s, msg, nil) // the server refuses it too
	}
	res, shared, err := h.f.classifier.ClassifySharedWith(sql, opts)
	if err != nil || len(res.Stmts) == 0 {
		if err != nil && h.strict(false) {
			// Never forwarded unread on a fenced session: it could hide
			// a COMMIT or a write from the gate.
			return h.refuseQuery(s, textError(err))
		}
		if err == nil && res == nil {
			res = &rewrite.Result{}
		}
		if err != nil {
			res = nil // unread: never run in a transaction on the replica (replstate.go)
		}
		// The server reports the syntax error (or the empty query).
		return h.routeQuery(s, msg, res) // route.go
	}
	res = h.userCode(res)                                  // fence_usercode.go: built-ins the database overrides
	if err := h.awaitDigest(s, res.Stmts...); err != nil { // fence_extended.go
		return err // ErrWait on the loop: nothing done yet
	}
	if plan.MayNeedGate(res.Stmts...) {
		if h.unsettled() {
			if err := h.settle(s); err != nil {
				return err // ErrWait on the loop: nothing done yet
			}
		}
		if err := h.settleSettings(s); err != nil {
			return err
		}
	}
	// Settled: whether the transaction is gated is known.
	if shared && h.needsOwnText(res) {
		if res, err = h.f.classifier.ClassifyWith(sql, opts); err != nil {
			return h.routeQuery(s, msg, nil) // unreachable: its shape parsed
		}
		res = h.userCode(res)
	}
	h.mu.Lock()
	if e := h.noFenceSchema(res.Stmts...); e != nil { // fence_plan.go
		h.mu.Unlock()
		h.f.Stats.Classified.Add(int64(len(res.Stmts)))
		return h.probeQuery(s, sql, res, e)
	}
	q := h.f.plans.PlanQuery(h.planSession(), res.Stmts)
	probePrepare := q.Action == plan.PassThrough && h.prepareProbed(res.Stmts) // fence_plan.go
	h.mu.Unlock()
	h.f.Stats.Classified.Add(int64(len(res.Stmts)))
	if probePrepare {
		if res.Stmts[0].Kind != rewrite.PrepareTransaction {
			// The probe must run right before the PREPARE, after the
			// statements before it took their locks.
			return h.refuseQuery(s, &fence.Error{Code: fence.CodeUnsupported,
				Message: "PREPARE TRANSACTION must be a query of its own in a database with protected tables",
				Hint:    "send PREPARE TRANSACTION alone"})
		}
		return h.probeQueryWith(s, sql, res, prepareLockProbe)
	}
	switch q.Action {
	case plan.Refuse:
		return h.refuseQuery(s, q.Refusal)
	case plan.PassThrough:
		if err := h.routeQuery(s, msg, res); err != nil { // replica or primary: route.go
			return err
		}
		if plan.ChangesState(res.Stmts...) {
			h.markState()
		}
		return nil
	}
	if h.settled() {
		return h.gatedQuery(s, sql, res, &q)
	}
	qc := q // the continuation's own: q stays off the heap on the path that does not wait
	return h.settleThen(s, func() error { return h.gatedQuery(s, sql, res, &qc) })
}

// gatedQuery executes the plan of a query the gate rewrites, with the
// session state settled.
func (h *fenceSession) gatedQuery(s gateConn, sql string, res *rewrite.Result, q *plan.Query) error {
	if err := h.routeGated(s); err != nil { // route.go
		return err
	}
	if s.OnReplica() {
		// Inside the transaction open on the replica (replstate.go).
		if e := replicaGated(res.Stmts); e != nil {
			return h.refuseQuery(s, e)
		}
		h.rt.replicaState = true // its code may change the replica's session (route.go)
	}
	return h.runQuery(s, sql, res, q)
}

// commitsIn reports whether stmts commit a transaction, whose receipt's
// digest must have every write before it.
func commitsIn(stmts []*rewrite.Stmt) bool {
	for _, st := range stmts {
		if st.Kind == rewrite.Commit || st.Kind == rewrite.PrepareTransaction {
			return true
		}
	}
	return false
}

// needsOwnText reports whether a write classified from another text of
// its shape (rewrite.Classifier.ClassifyShared) must be classified from
// its own: when it may be digested — it writes a protected table, or the
// transaction may owe a receipt (mayOweReceipt) — the digest needs its
// own canonical text. Other writes need only the
// structure, which the shape shares.
func (h *fenceSession) needsOwnText(res *rewrite.Result) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	// A fenced session digests what may write (a write to another table
	// whose trigger writes a protected one makes its transaction
	// tentative): its own text, not the shape's first (round 23, AV-M1).
	if h.mayOweReceipt() {
		return true
	}
	for _, st := range res.Stmts {
		if h.protectedWrite(st) {
			return true
		}
	}
	return false
}

// strict reports whether text the gate cannot read must be refused rather
// than forwarded for the server to judge: on a fenced session (it has a
// generation, or its transaction is gated), and, for text invalid in the
// client's encoding (decoding: the server would refuse it too), in a
// database with protected tables.
func (h *fenceSession) strict(decoding bool) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.st.Generation(); ok || h.st.Gate().Gated {
		return true
	}
	return decoding && h.cat.prot.Load().Len() > 0
}

func clientSegs(res *rewrite.Result) []seg {
	if res == nil {
		return nil
	}
	segs := make([]seg, len(res.Stmts))
	for i, st := range res.Stmts {
		segs[i] = seg{step: stepClient, stmt: st}
	}
	return segs
}

// startsRequest reports whether a client message of type b, sent outside
// an extended-protocol batch, begins a request (a batch or a query).
func startsRequest(b byte) bool {
	switch b {
	case 'Q', 'F', 'P', 'B', 'E', 'D', 'C':
		return true
	}
	return false
}
