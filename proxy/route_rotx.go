package proxy

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/session"
)

// A read-only transaction on the replica (issue 30, attacker D's H1).
//
// A BEGIN READ ONLY transaction is judged once, when its first request is
// routed, and then stays on the replica: it cannot move to the primary
// half-way. What a later statement of it needs can grow: the proxy sees a
// takeover, the reader sets fence.job_key/token or fence.min_lsn (SET
// LOCAL, set_config). So every later request is judged again, against
// the snapshot it will read from:
//
//   - rt.ro.snap, the replica's replay position observed before the
//     transaction's first request was sent, is a lower bound of every
//     snapshot taken in the transaction (replay only moves forward). A
//     request whose requirement is within it is sent as it is: no round
//     trip, no wait.
//   - A request needing more may still be answerable at READ COMMITTED,
//     where each statement takes a new snapshot: only when each of its
//     statements is a plain read (no FETCH or MOVE of a cursor opened
//     earlier, no function that could read one: a cursor keeps the
//     snapshot of its DECLARE) and the transaction's isolation, asked of
//     the server (SHOW transaction_isolation: a utility statement no
//     client object can answer for), is READ COMMITTED. Then it waits, as
//     fence.read_policy says and bounded by fence.read_wait (pending: not
//     at all), for the replica to replay what it needs.
//   - Otherwise — REPEATABLE READ (SERIALIZABLE is refused on a standby),
//     a cursor, an extended-protocol Execute (its portal's snapshot was
//     taken at Bind), an opaque statement, or the wait ran out — it is
//     refused with FN007, on the replica, so the transaction is aborted
//     like any failed statement.
//
// A WITH HOLD cursor declared in such a transaction outlives it on the
// replica connection with its snapshot: a later transaction's FETCH could
// read it. rt.holdFloor keeps a lower bound of those snapshots (the
// declaring transaction's snap) whenever a request may have declared one
// (a DECLARE whose text says HOLD, or code the proxy cannot see into), and
// statements that may read a cursor are judged against it too.

// roTxState is the read-only transaction open on the replica.
type roTxState struct {
	snap LSN // replay observed before its first request was sent
}

// beginOnReplica records the start of a read-only transaction whose first
// request is about to be sent to r.
func (h *fenceSession) beginOnReplica(r *replica, stmts []*rewrite.Stmt) {
	h.rt.ro = roTxState{snap: LSN(r.replay.Load())}
	h.noteHold(stmts, false)
}

// neutralStmt reports whether st reads nothing and runs no code of the
// database's: it needs no generation.
func neutralStmt(st *rewrite.Stmt) bool {
	switch st.Kind {
	case rewrite.Begin, rewrite.Savepoint, rewrite.Release, rewrite.RollbackTo, rewrite.Rollback,
		rewrite.Commit, rewrite.Set, rewrite.Reset:
		return len(st.Builtins) == 0 && !st.Opaque && !st.UnknownGUCWrite
	}
	return false
}

// freshRead reports whether st, at READ COMMITTED, reads only from the
// snapshot it takes itself: a plain read (or a statement reading nothing),
// that fetches from no cursor and calls nothing that could.
func freshRead(st *rewrite.Stmt) bool {
	if neutralStmt(st) {
		return true
	}
	return (st.Kind == rewrite.Read || st.Kind == rewrite.CopyTo) && !st.LockingRead && !st.CallsFence &&
		!st.PrimaryOnlyFuncs && !st.Opaque && !st.UserCalls && st.Executes == ""
}

// readsCursor reports whether st may read from a cursor opened earlier
// (FETCH, MOVE, a function, EXECUTE, text the proxy could not read).
func readsCursor(st *rewrite.Stmt) bool { return st == nil || !freshRead(st) }

// noteHold lowers rt.holdFloor to the transaction's snapshot bound when
// stmts may declare a WITH HOLD cursor (unknown: the text was not read).
func (h *fenceSession) noteHold(stmts []*rewrite.Stmt, unknown bool) {
	may := unknown
	for _, st := range stmts {
		switch {
		case declares(st) && strings.Contains(strings.ToUpper(st.SQL), "HOLD"):
			may = true // a keyword: no quoting or escape can spell it otherwise
		case st.Opaque || st.UserCalls || st.Executes != "" || st.Kind == rewrite.Execute ||
			st.Kind == rewrite.Call || st.Kind == rewrite.Do:
			may = true // code the proxy cannot see may DECLARE ... WITH HOLD
		}
	}
	if may && (h.rt.holdFloor == 0 || h.rt.ro.snap < h.rt.holdFloor) {
		h.rt.holdFloor = h.rt.ro.snap
	}
}

// txVals are the settings a request's statements read with: the session's,
// raised by the fence.* settings the request itself makes before it reads
// (SET LOCAL fence.token = ...; SELECT ... in one Query).
func (h *fenceSession) txVals(stmts []*rewrite.Stmt) (cur, next readVals, changed bool) {
	cur = h.readVals()
	next = cur
	for _, st := range stmts {
		for _, g := range st.GUCs {
			if g.Op != rewrite.GUCSet || g.Unknown || g.NameParam != 0 || g.ValueParam != 0 {
				continue
			}
			var f *string
			switch g.Name {
			case session.JobKey:
				f = &next.job
			case session.Epoch:
				f = &next.epoch
			case session.Token:
				f = &next.token
			case session.MinLSN:
				f = &next.minLSN
			case session.ReadPolicy:
				f = &next.policy
			case session.ReadWait:
				f = &next.wait
			}
			if f != nil && *f != g.Value {
				*f, changed = g.Value, true
			}
		}
	}
	return cur, next, changed
}

// txRequire is what a request in the read-only transaction needs: the
// stricter of its requirement under the session's settings and under the
// settings it makes itself.
func (h *fenceSession) txRequire(stmts []*rewrite.Stmt) (req requirement, protected bool, v readVals) {
	cur, next, changed := h.txVals(stmts)
	// The request is judged by what it reads itself: plain reads as an
	// autocommit read would be (SELECT 1 reads nothing protected, whatever
	// the snapshot); anything else (a cursor's DECLARE, what the
	// classifier cannot call a plain read) as the transaction was, able
	// to read anything.
	kind := autoRead
	for _, st := range stmts {
		if !neutralStmt(st) && (!plainRead(st) || declares(st)) {
			kind = roTx
		}
	}
	req, protected, _ = h.requireWith(stmts, kind, cur)
	if !changed {
		return req, protected, cur
	}
	r2, p2, _ := h.requireWith(stmts, kind, next)
	if !protected {
		return r2, p2, next
	}
	if p2 {
		if r2.lsn > req.lsn {
			req.lsn, req.what = r2.lsn, r2.what
		}
		if r2.check && !req.check {
			req.job, req.epoch, req.token, req.check = r2.job, r2.epoch, r2.token, true
		}
		req.blind = req.blind || r2.blind
	}
	return req, true, next
}

// routeInTx sends a client Query inside the read-only transaction open on
// the replica, or refuses it (FN007) when the snapshot it would read from
// may be older than what it needs. Client side.
func (h *fenceSession) routeInTx(s gateConn, msg []byte, res *rewrite.Result, stmts []*rewrite.Stmt) error {
	r := s.replicaOpen()
	if r == nil {
		return h.sendClient(s, msg, res)
	}
	// Statements after the transaction's end (COMMIT; SELECT ...) run
	// outside it: their snapshots are taken after this point, so they are
	// judged by the replay position then, like a READ COMMITTED read.
	inside, after := stmts, []*rewrite.Stmt(nil)
	for i, st := range stmts {
		if (st.Kind == rewrite.Commit || st.Kind == rewrite.Rollback) && !st.Chain {
			inside, after = stmts[:i+1], stmts[i+1:]
			break
		}
	}
	// In a failed transaction the server refuses all but the end, unless
	// a statement brings it back (inReplicaTx splits the query after it).
	failed := h.tx() == session.Failed && revives(inside) < 0
	neutral, fresh, cursor := res != nil, res != nil, res == nil
	for _, st := range inside {
		neutral = neutral && (failed || neutralStmt(st))
		fresh = fresh && freshRead(st)
		cursor = cursor || readsCursor(st)
	}
	afterNeutral, afterFresh := true, true
	for _, st := range after {
		afterNeutral = afterNeutral && neutralStmt(st)
		afterFresh = afterFresh && freshRead(st)
	}
	if !afterNeutral {
		if !neutral {
			req, protected, _ := h.txRequire(inside)
			if protected && (req.blind || req.check || req.lsn > h.txBound(cursor)) {
				return h.refuseInTx(s, r, req, "the transaction's snapshot, or a cursor's, was taken before")
			}
		}
		req, protected, v := h.txRequire(after)
		if !protected {
			return h.sendInTx(s, r, msg, res, stmts)
		}
		if !afterFresh {
			return h.refuseInTx(s, r, req, "a cursor's snapshot may have been taken before")
		}
		return h.waitInTx(s, r, after, stmts, msg, res, v)
	}
	if neutral {
		return h.sendInTx(s, r, msg, res, stmts)
	}
	req, protected, v := h.txRequire(stmts)
	if !protected {
		return h.sendInTx(s, r, msg, res, stmts)
	}
	if !req.blind && !req.check && req.lsn <= h.txBound(cursor) {
		return h.sendInTx(s, r, msg, res, stmts)
	}
	if !fresh {
		return h.refuseInTx(s, r, req, "the transaction's snapshot, or a cursor's, was taken before")
	}
	return h.txIsolation(s, func(readCommitted bool) error {
		if !readCommitted {
			return h.refuseInTx(s, r, req, "the transaction's snapshot (REPEATABLE READ) was taken before")
		}
		return h.waitInTx(s, r, stmts, stmts, msg, res, v)
	})
}

// txBound is the replay position every snapshot a request may read from
// has: the transaction's first, or a held cursor's older one.
func (h *fenceSession) txBound(cursor bool) LSN {
	b := h.rt.ro.snap
	if cursor && h.rt.holdFloor != 0 && h.rt.holdFloor < b {
		b = h.rt.holdFloor
	}
	return b
}

// sendInTx sends a request of the transaction to the replica.
func (h *fenceSession) sendInTx(s gateConn, r *replica, msg []byte, res *rewrite.Result, stmts []*rewrite.Stmt) error {
	h.noteHold(stmts, res == nil)
	// A request that ends the transaction and begins another: the new
	// one's snapshots are taken after this point.
	ended := false
	for _, st := range stmts {
		switch {
		case (st.Kind == rewrite.Commit || st.Kind == rewrite.Rollback) && !st.Chain:
			ended = true
		case st.Kind == rewrite.Begin && ended:
			h.rt.ro.snap = LSN(r.replay.Load())
		}
	}
	return h.sendClient(s, msg, res)
}

// showIsolation asks the transaction's isolation level: a utility
// statement, which takes no snapshot and resolves no name on the path.
const showIsolation = "SHOW transaction_isolation"

// txIsolation asks the replica, inside the client's transaction, whether
// it runs at READ COMMITTED, and runs k with the answer.
func (h *fenceSession) txIsolation(s gateConn, k func(readCommitted bool) error) error {
	h.mu.Lock()
	h.rt.row = ""
	h.mu.Unlock()
	s.startRouted(false)
	if err := h.send(s, queryMsg(nil, showIsolation), &tag{kind: 'Q', segs: []seg{{step: stepFenceCheck}}}, false); err != nil {
		s.stopRouted()
		return err
	}
	return s.routeThen(h.last, func(retry bool) error {
		if retry {
			return &ProtocolError{Code: "08006", Msg: "pgfence: the replica serving this read-only transaction failed; reconnect and retry"}
		}
		h.mu.Lock()
		row := h.rt.row
		h.mu.Unlock()
		return k(row == "read committed")
	})
}

// waitInTx waits, as the read policy says, for the replica to replay what
// a READ COMMITTED request needs, then sends it; else refuses it.
func (h *fenceSession) waitInTx(s gateConn, r *replica, judged, stmts []*rewrite.Stmt, msg []byte, res *rewrite.Result, v readVals) error {
	rs := s.readRouter()
	wait := DefaultReadWait
	if d, err := session.ParseDuration(v.wait); v.wait != "" && err == nil {
		wait = d
	}
	if strings.EqualFold(v.policy, "pending") {
		wait = 0
	}
	deadline := time.Now().Add(wait)
	waiting := false
	stop := func() {
		if waiting {
			waiting = false
			rs.stats.Waiting.Add(-1)
		}
	}
	var step func() error
	step = func() error {
		req, protected, _ := h.txRequire(judged)
		if !protected || !req.blind && !req.check && LSN(r.replay.Load()) >= req.lsn {
			stop()
			return h.sendInTx(s, r, msg, res, stmts)
		}
		if !time.Now().Before(deadline) {
			stop()
			return h.refuseInTx(s, r, req, "the replica has not replayed it")
		}
		if !waiting {
			waiting = true
			rs.stats.Waits.Add(1)
			rs.stats.Waiting.Add(1)
		}
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		ending := s.ending()
		go func() {
			select {
			case <-ending:
			case <-ctx.Done():
			}
			cancel()
		}()
		return s.offClient(func() error {
			_, err := r.refresh(ctx)
			return err
		}, func(error) error {
			cancel()
			return step()
		}, stop, true)
	}
	return step()
}

// refuseInTx answers FN007 inside the transaction: the refusal runs on the
// replica, so the transaction is aborted there as after any error.
func (h *fenceSession) refuseInTx(s gateConn, r *replica, req requirement, why string) error {
	return h.refuseQuery(s, h.txPending(s, r, req, why))
}

func (h *fenceSession) txPending(gc gateConn, r *replica, req requirement, why string) *fence.Error {
	s := ""
	if req.blind {
		s = "; the proxy's takeover watcher is reconnecting"
	}
	if req.check {
		s += fmt.Sprintf("; the takeover of job %q token %d has not been read on the primary yet", req.job, req.token)
	}
	gc.readRouter().stats.Pending.Add(1)
	return &fence.Error{Code: fence.CodePending,
		Message: fmt.Sprintf("pgfence: generation pending in this read-only transaction: it needs %s (WAL position %s); %s (replica %s replayed %s when the transaction began, %s now)%s",
			req.what, req.lsn, why, r.addr, h.rt.ro.snap, LSN(r.replay.Load()), s),
		Hint: "a read-only transaction on a replica cannot move to the primary: end it and read again (a new transaction is routed afresh); present fence.job_key/fence.token or fence.min_lsn before the transaction's first statement"}
}

// txReadRefusal judges an extended-protocol Execute (st its statement,
// nil when unknown) or a FunctionCall inside the read-only transaction on
// the replica: its portal's snapshot was taken at its Bind, at the latest,
// so it is judged against the transaction's first (and a held cursor's)
// and refused with FN007 when it needs more. Nothing here waits.
func (h *fenceSession) txReadRefusal(s gateConn, st *rewrite.Stmt) *fence.Error {
	if s.readRouter() == nil || !s.OnReplica() || h.tx() == session.Idle {
		return nil
	}
	r := s.replicaOpen()
	if r == nil {
		return nil
	}
	var stmts []*rewrite.Stmt
	if st != nil {
		stmts = []*rewrite.Stmt{st}
		if neutralStmt(st) {
			return nil
		}
	}
	req, protected, _ := h.requireWith(stmts, roTx, h.readVals())
	if !protected || !req.blind && !req.check && req.lsn <= h.txBound(readsCursor(st)) {
		h.noteHold(stmts, st == nil)
		return nil
	}
	return h.txPending(s, r, req, "the transaction's snapshot, or its portal's, was taken before")
}
