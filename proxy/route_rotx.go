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
	snap LSN // replay observed before its first request was sent; oldestSnap after an import
}

// oldestSnap is the bound of a snapshot whose age the proxy does not know
// (SET TRANSACTION SNAPSHOT imports one exported at any time before, on
// the replica or by another session through any proxy): older than every
// takeover, so every read that needs one is refused (round 8, attacker
// P's H1). Not 0, which holdFloor reads as "no cursor".
const oldestSnap LSN = 1

// importsSnapshot reports whether st is SET TRANSACTION SNAPSHOT: the
// transaction then reads a snapshot exported at a time the proxy cannot
// tell.
func importsSnapshot(st *rewrite.Stmt) bool {
	return st.Kind == rewrite.Other && st.Name == "transaction snapshot"
}

// noteImport lowers the transaction's snapshot bound to oldestSnap when
// stmts import a snapshot: before they are judged, so the import and
// everything after it are judged as reading the oldest snapshot.
func (h *fenceSession) noteImport(stmts []*rewrite.Stmt) {
	for _, st := range stmts {
		if importsSnapshot(st) {
			h.rt.ro.snap = oldestSnap
		}
	}
}

// beginOnReplica records the start of a read-only transaction whose first
// request is about to be sent to r.
func (h *fenceSession) beginOnReplica(r *replica, stmts []*rewrite.Stmt) {
	h.rt.ro = roTxState{snap: LSN(r.replay.Load())}
	h.noteHold(stmts, false, h.rt.ro.snap)
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
// (FETCH, MOVE, a function, EXECUTE, text the proxy could not read), or
// run code that may: a read of a relation whose reads run the database's
// code (a view's function, a policy's, an index expression's:
// readSet.runsRelCode; every relation in an untracked database), or
// whose expressions do (readSet.runsCode). Round 8, attacker P's H2, H3.
// at: the replay position of the replica it runs on (catalogAt).
func (h *fenceSession) readsCursor(st *rewrite.Stmt, at LSN) bool {
	if st == nil || !freshRead(st) {
		return true
	}
	return h.relCode(st, at)
}

// relCode reports whether st reads a relation, or resolves an
// expression, that runs the database's code, on a replica that has
// replayed up to at: by the read set only if it has replayed the set's
// position (catalogAt), else yes.
func (h *fenceSession) relCode(st *rewrite.Stmt, at LSN) bool {
	if len(st.ReadRelations) == 0 && !st.CatalogExprs {
		return false
	}
	rd, _ := h.catalogAt(at)
	for _, rel := range st.ReadRelations {
		if rd.runsRelCode(rel) {
			return true
		}
	}
	return rd.runsCode(st)
}

// relSets is relCode for code that may change the session's state
// (readSet.setsRelCode; expressions by readSet.runsCode, as relCode).
func (h *fenceSession) relSets(st *rewrite.Stmt, at LSN) bool {
	if len(st.ReadRelations) == 0 && !st.CatalogExprs {
		return false
	}
	rd, _ := h.catalogAt(at)
	for _, rel := range st.ReadRelations {
		if rd.setsRelCode(rel) {
			return true
		}
	}
	return rd.runsCode(st)
}

// mayRunCode reports whether any of stmts may run code that reads or
// declares cursors.
func (h *fenceSession) mayRunCode(stmts []*rewrite.Stmt, at LSN) bool {
	for _, st := range stmts {
		if h.readsCursor(st, at) {
			return true
		}
	}
	return false
}

// noteHold lowers rt.holdFloor to the transaction's snapshot bound when
// stmts may declare a WITH HOLD cursor (unknown: the text was not read),
// run on a replica that has replayed up to at.
func (h *fenceSession) noteHold(stmts []*rewrite.Stmt, unknown bool, at LSN) {
	may := unknown
	for _, st := range stmts {
		switch {
		case declares(st) && strings.Contains(strings.ToUpper(st.SQL), "HOLD"):
			may = true // a keyword: no quoting or escape can spell it otherwise
		case st.Opaque || st.UserCalls || st.Executes != "" || st.Kind == rewrite.Execute ||
			st.Kind == rewrite.Call || st.Kind == rewrite.Do || h.relCode(st, at):
			may = true // code the proxy cannot see may DECLARE ... WITH HOLD
		}
	}
	if may {
		h.lowerHold(h.rt.ro.snap)
	}
}

// lowerHold lowers rt.holdFloor to snap.
func (h *fenceSession) lowerHold(snap LSN) {
	if h.rt.holdFloor == 0 || snap < h.rt.holdFloor {
		h.rt.holdFloor = snap
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

// txRequire is what a request in the read-only transaction on r needs: the
// stricter of its requirement under the session's settings and under the
// settings it makes itself, on the replica r as it has replayed now: a
// relation judged by a read set it has not replayed is judged as reaching
// anything (requireWith's behind).
func (h *fenceSession) txRequire(r *replica, stmts []*rewrite.Stmt) (req requirement, protected bool, v readVals) {
	at := LSN(r.replay.Load())
	eraOK := h.eraOK(r)
	if !eraOK {
		// Not on the primary's history as far as the proxy knows: its
		// position says nothing of the catalog either.
		at = 0
	}
	defer func() {
		// Positions mean something only on the primary's history
		// (era.go): on a replica that has not shown the primary's era (a
		// failover since the transaction began) no protected request is
		// judged by them.
		if protected && !eraOK {
			req.blind, req.noEra = true, true
		}
	}()
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
	req, protected = h.requireWith(stmts, kind, cur, at)
	if !changed {
		return req, protected, cur
	}
	r2, p2 := h.requireWith(stmts, kind, next, at)
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
		req.stale = req.stale || r2.stale
		req.behind = req.behind || r2.behind
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
	return h.freshInTx(s, stmts, res == nil, func() error { return h.routeInTxFresh(s, r, msg, res, stmts) })
}

// freshInTx runs k once the takeover tracker is current, when a request
// in the read-only transaction on the replica would be judged by it
// (anything but neutral statements; opaque: text the proxy cannot
// read): a request after a pause in reads finds it stale (freshWithin,
// lsn.go) and would be refused, so it waits, off the client, up to
// freshWithin for a marker when one can come soon. k judges what it
// finds then: still stale, the request is refused (FN007), as when the
// watcher reconnects.
func (h *fenceSession) freshInTx(s gateConn, stmts []*rewrite.Stmt, opaque bool, k func() error) error {
	if !h.freshWait(stmts, opaque) {
		return k()
	}
	return h.awaitFresh(s, k)
}

// awaitFresh waits, off the client, up to freshWithin for the takeover
// tracker to be current, then runs k.
func (h *fenceSession) awaitFresh(s gateConn, k func() error) error {
	tk := &h.cat.tk
	ctx, cancel := context.WithTimeout(context.Background(), freshWithin)
	ending := s.ending()
	return s.offClient(func() error {
		tk.waitFresh(ctx, ending)
		return nil
	}, func(error) error {
		cancel()
		return k()
	}, cancel, true)
}

// freshWait reports whether a request in the read-only transaction on the
// replica should wait for the takeover tracker (freshInTx).
func (h *fenceSession) freshWait(stmts []*rewrite.Stmt, opaque bool) bool {
	if h.cat.prot.Load().Len() == 0 || !h.cat.live.Load() {
		return false
	}
	judged := opaque
	for _, st := range stmts {
		judged = judged || !neutralStmt(st)
	}
	tk := &h.cat.tk
	now := time.Now()
	return judged && !tk.current(now) && tk.waitable(now)
}

// freshForExecute is freshInTx for an extended-protocol Execute in the
// read-only transaction on the replica (txReadRefusal judges it next):
// off the loop it waits and returns nil; on the loop it parks the client
// side (its error), and the Execute is handled again from the start once
// the wait is over, judged then as the tracker is, without waiting again.
func (h *fenceSession) freshForExecute(s gateConn, st *rewrite.Stmt) error {
	if h.rt.freshWaited {
		h.rt.freshWaited = false
		return nil
	}
	if s.readRouter() == nil || !s.OnReplica() || h.tx() == session.Idle {
		return nil
	}
	var stmts []*rewrite.Stmt
	if st != nil {
		stmts = []*rewrite.Stmt{st}
	}
	if !h.freshWait(stmts, st == nil) {
		return nil
	}
	return h.awaitFresh(s, func() error {
		if s.OnLoop() {
			h.rt.freshWaited = true
			return ErrWait
		}
		return nil
	})
}

// routeInTxFresh is routeInTx once the tracker has been waited for.
func (h *fenceSession) routeInTxFresh(s gateConn, r *replica, msg []byte, res *rewrite.Result, stmts []*rewrite.Stmt) error {
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
	h.noteImport(inside)
	// In a failed transaction the server refuses all but the end, unless
	// a statement brings it back (inReplicaTx splits the query after it).
	failed := h.tx() == session.Failed && revives(inside) < 0
	at := LSN(r.replay.Load())
	neutral, fresh, cursor := res != nil, res != nil, res == nil
	for _, st := range inside {
		neutral = neutral && (failed || neutralStmt(st))
		fresh = fresh && freshRead(st)
		cursor = cursor || h.readsCursor(st, at)
	}
	afterNeutral, afterFresh := true, true
	for _, st := range after {
		afterNeutral = afterNeutral && neutralStmt(st)
		afterFresh = afterFresh && freshRead(st)
	}
	if !afterNeutral {
		if !neutral {
			req, protected, _ := h.txRequire(r, inside)
			if protected && (req.blind || req.check || req.lsn > h.txBound(cursor)) {
				return h.refuseInTx(s, r, req, "the transaction's snapshot, or a cursor's, was taken before")
			}
		}
		req, protected, v := h.txRequire(r, after)
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
	req, protected, v := h.txRequire(r, stmts)
	if !protected {
		return h.sendInTx(s, r, msg, res, stmts)
	}
	if !req.blind && !req.check && req.lsn <= h.txBound(cursor) {
		return h.sendInTx(s, r, msg, res, stmts)
	}
	if !fresh {
		return h.refuseInTx(s, r, req, "the transaction's snapshot, or a cursor's, was taken before")
	}
	return h.txIsolation(s, func(readCommitted, cursors bool) error {
		if !readCommitted {
			return h.refuseInTx(s, r, req, "the transaction's snapshot (REPEATABLE READ) was taken before")
		}
		if cursors && cursor {
			// Code the request runs may FETCH from a cursor of the
			// session, opened before (round 8, attacker P's H2).
			return h.refuseInTx(s, r, req, "code the request runs may read a cursor opened before")
		}
		if !cursors {
			h.rt.holdFloor = 0 // the session holds no cursor at all
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
	at := LSN(r.replay.Load())
	h.noteHold(stmts, res == nil, at)
	if res == nil || h.sessionCode(stmts, at) {
		h.rt.replicaState = true // code may change the replica's session (route.go)
	}
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

// showIsolation asks the transaction's isolation level and whether the
// session has a cursor open (pg_cursors: SQL DECLARE, a named portal, a
// cursor code opened; a cursor keeps the snapshot it was opened with):
// every name qualified, nothing a client object can answer for. The
// query's own (unnamed) portal is not listed.
const showIsolation = `SELECT pg_catalog.current_setting('transaction_isolation')
  OPERATOR(pg_catalog.||) CASE WHEN EXISTS (SELECT FROM pg_catalog.pg_cursors) THEN ' cursors' ELSE '' END`

// heldCursorsQuery asks whether the session holds a WITH HOLD cursor.
const heldCursorsQuery = `SELECT EXISTS (SELECT FROM pg_catalog.pg_cursors AS c WHERE c.is_holdable)::pg_catalog.text`

// txIsolation asks the replica, inside the client's transaction, whether
// it runs at READ COMMITTED and whether the session has cursors, and runs
// k with the answers.
func (h *fenceSession) txIsolation(s gateConn, k func(readCommitted, cursors bool) error) error {
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
		level, cursors := strings.CutSuffix(row, " cursors")
		return k(level == "read committed", cursors)
	})
}

// heldKnown is called before a read is sent to the replica connection
// (an autocommit read, or the first request of a read-only transaction):
// when a WITH HOLD cursor may be open there with a snapshot older than
// the read needs (rt.holdFloor), and the read may run code that FETCHes
// it (an autocommit read of a relation that runs code; anything in a
// transaction), it asks the replica whether the session holds one
// (pg_cursors; one round trip, only then). None: the floor is cleared.
// Some: an autocommit read goes to the primary (k(false)); a transaction
// begins, its reads judged against the floor. Round 8, attacker P's H2
// and H3.
func (h *fenceSession) heldKnown(s gateConn, r *replica, stmts []*rewrite.Stmt, kind readKind, k func(ok bool) error) error {
	at := LSN(r.replay.Load())
	if h.rt.holdFloor == 0 || kind == autoRead && !h.mayRunCode(stmts, at) {
		return k(true)
	}
	if req, protected := h.require(stmts, kind, at); !protected || !req.blind && !req.check && req.lsn <= h.rt.holdFloor {
		return k(true)
	}
	h.mu.Lock()
	h.rt.row = ""
	h.mu.Unlock()
	s.startRouted(false)
	if err := h.send(s, queryMsg(nil, heldCursorsQuery), &tag{kind: 'Q', segs: []seg{{step: stepFenceCheck}}}, false); err != nil {
		s.stopRouted()
		return err
	}
	return s.routeThen(h.last, func(retry bool) error {
		if retry {
			h.mu.Lock()
			h.st.TxStatus('I')
			h.mu.Unlock()
			return k(false)
		}
		h.mu.Lock()
		row := h.rt.row
		h.mu.Unlock()
		if row == "false" {
			h.rt.holdFloor = 0
			return k(true)
		}
		return k(kind == roTx)
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
		req, protected, _ := h.txRequire(r, judged)
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
	switch {
	case req.noEra:
		s = "; the replica has not shown the primary's era (a failover since the transaction began)"
	case req.stale:
		s = "; the proxy's takeover notifications are held up (a flood of notifications, or a commit that has not finished), so it cannot tell which takeovers the request needs"
	case req.blind:
		s = "; the proxy's takeover watcher is reconnecting"
	}
	if req.check {
		s += fmt.Sprintf("; the takeover of job %q token %d has not been read on the primary yet", req.job, req.token)
	}
	if req.behind {
		s += fmt.Sprintf("; the replica has not replayed the catalog (WAL position %s) the proxy judges the relations read by, so it may still define them to read protected data", req.catalog)
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
		h.noteImport(stmts)
		if neutralStmt(st) {
			return nil
		}
	}
	at := LSN(r.replay.Load())
	req, protected := h.requireWith(stmts, roTx, h.readVals(), at)
	if code := h.readsCursor(st, at); !protected || !req.blind && !req.check && req.lsn <= h.txBound(code) {
		h.noteHold(stmts, st == nil, at)
		h.rt.replicaState = h.rt.replicaState || st == nil || h.sessionCode(stmts, at) // code may change the replica's session (route.go)
		return nil
	}
	return h.txPending(s, r, req, "the transaction's snapshot, or its portal's, was taken before")
}
