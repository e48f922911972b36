package proxy

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
)

// Read routing (DESIGN §6): the write gate's handler decides, for each
// simple Query, whether it may run on a replica, and whether the replica
// has replayed every takeover the read could depend on. The mechanism (a
// session's replica connection) is in replica.go; takeover and replay
// positions, and the Server's replica set that polls them, in lsn.go.
//
// What may go to a replica: a simple Query made only of plain reads
// (SELECT/VALUES/TABLE/COPY TO without locking clauses, without functions
// that need the primary or may write, without parameter changes), run in
// autocommit, and a transaction begun with BEGIN READ ONLY (it then stays
// on the replica until it ends; what follows its end in the same query is
// routed afresh, and nothing inside it may change the replica's session
// alone: replstate.go), unless it may run code that changes the
// session's state (a view's or a policy's function, a view calling
// set_config: runsSessionCode), which runs in the client's own session.
// Everything else, the extended protocol included, goes to the primary. A session that changed a parameter other
// than fence.* (SET, RESET, set_config) or created temporary objects is
// pinned to the primary until DISCARD ALL, since its replica connection
// would not have them; fence.read_replicas=off pins a session too.
//
// A protected read needs the replica to have replayed: the takeover of the
// session's own generation (fence.job_key, fence.token), fence.min_lsn,
// and, without fence metadata, every takeover the proxy has seen plus
// everything before its watcher started. When the proxy does not know the
// session's token (a takeover it has not been told of yet), the replica's
// own fence row decides. Otherwise fence.read_policy says what happens:
// primary, wait (up to fence.read_wait), or pending (FN007).
//
// In a database with protected tables a read is protected unless every
// relation it names is known not to reach protected data (readSet,
// fence_catalog.go, kept only in a database that notifies DDL; without it
// every read of a relation is protected): a read of a protected table, of
// a view, materialized view or table whose definition or policies reach
// one, of a name the proxy does not know, and every read-only transaction
// (it may read anything later). A read that names only safe relations
// still needs the replica to have replayed the catalog as the proxy read
// it.

// RouteStats count read-routing decisions.
type RouteStats struct {
	Replica     atomic.Int64 // queries sent to a replica
	Primary     atomic.Int64 // replica-eligible queries sent to the primary (behind, unhealthy, pinned)
	Waits       atomic.Int64 // reads that waited for a replica (policy wait)
	Waiting     atomic.Int64 // reads waiting right now
	Pending     atomic.Int64 // FN007 answers
	Retries     atomic.Int64 // routed reads retried on the primary after a replica failure
	FenceChecks atomic.Int64 // generation checks against a replica's fence row
	CommitLSN   atomic.Int64 // fence.commit_lsn reports sent
	// Stale: protected reads no replica served because the takeover
	// tracker was not known to be current (notifications held up).
	Stale atomic.Int64
}

// routeState is a fenceSession's routing state. Client goroutine, except
// row (written by a server goroutine under h.mu).
type routeState struct {
	pinned bool // a SET or temporary object made the primary session special
	// batchEnded: an extended-protocol batch on the replica has ended its
	// transaction; nothing more runs there before the Sync (replstate.go).
	batchEnded bool
	fenceTx    bool   // a fence.* function ran in the open transaction
	row        string // the answer of the last routing query
	stmts      stmtCopies
	// ro: the read-only transaction open on the replica (route_rotx.go).
	ro roTxState
	// holdFloor: a lower bound of the snapshots of the WITH HOLD cursors
	// that may be open on the replica connection; 0: none can be.
	holdFloor LSN
	// freshWaited: an Execute was parked waiting for the takeover tracker
	// and is being handled again: it is judged as the tracker is now
	// (freshForExecute).
	freshWaited bool
	// checked: what this session's fence-row checks found, by job (the
	// largest token the replica showed and its replay position then).
	// It runs in the client's own session, where the client's objects and
	// settings can change its answer: it decides this session's reads
	// only, never the database's takeover tracker.
	checked map[string]takeover
	// replicaCode and primaryCode: the seq of the last request that may
	// have run the client's code on that upstream (codeRan, fence_exec.go).
	replicaCode, primaryCode uint64
	// primaryCodeRan: code the proxy cannot see into has run on the
	// primary session at some time (sessionCode, noteSent). It may have set custom
	// settings (set_config('app.tenant', ...)), which nothing in SQL lists,
	// so the primary session can no longer be shown to be a new
	// connection's for code to run against: no read-only transaction
	// goes to the replica from then on (a later statement of it could run
	// such code there; round 11, attacker V's M1).
	primaryCodeRan bool
	// replicaState: a request that may have run the database's code
	// (mayRunCode) went to the replica connection since its session was
	// last known to be a new connection's: code may have changed its
	// settings or role for good (set_config(..., false) in a DO block or a
	// function; round 9, attacker R's M2), custom settings included,
	// which no query can list. The connection is closed before the next
	// routed read (replicaStateCheck).
	replicaState bool
}

// ParamCommitLSN is the ParameterStatus pgfence sends after a transaction
// that called a fence.* function (fence.acquire, fence.retire, ...) ends
// through it: the primary's WAL insert position after the commit, at or
// after the end of its commit record even with synchronous_commit off.
// Readers may pass it as fence.min_lsn.
const ParamCommitLSN = "fence.commit_lsn"

// readKind is what a query is for routing.
type readKind int

const (
	notRead  readKind = iota
	autoRead          // plain reads in autocommit
	roTx              // BEGIN READ ONLY ...
)

func plainRead(st *rewrite.Stmt) bool {
	return (st.Kind == rewrite.Read || st.Kind == rewrite.CopyTo) && !st.LockingRead && !st.CallsFence &&
		!st.PrimaryOnlyFuncs && !st.SessionLocal && !st.Opaque && len(st.GUCs) == 0 && !st.UnknownGUCWrite && st.Executes == "" &&
		!st.Analyze && !st.Temp
}

// declares reports whether st is DECLARE CURSOR: outside a transaction
// only WITH HOLD runs, and its cursor must live where FETCH will run (the
// primary).
func declares(st *rewrite.Stmt) bool { return st.Kind == rewrite.Read && st.Name != "" }

func classifyRead(stmts []*rewrite.Stmt) readKind {
	if len(stmts) == 0 {
		return notRead
	}
	if stmts[0].Kind == rewrite.Begin {
		if !stmts[0].ReadOnly {
			return notRead
		}
		for i, st := range stmts[1:] {
			switch st.Kind {
			case rewrite.Savepoint, rewrite.Release, rewrite.RollbackTo:
			case rewrite.Commit, rewrite.Rollback:
				if st.Chain || i+2 != len(stmts) {
					return notRead
				}
			default:
				if !plainRead(st) {
					return notRead
				}
			}
		}
		return roTx
	}
	for _, st := range stmts {
		if !plainRead(st) || declares(st) {
			return notRead
		}
	}
	return autoRead
}

// pins reports whether st leaves the primary session with state a replica
// connection would not have.
func pins(st *rewrite.Stmt) bool {
	if st.UnknownGUCWrite || st.Temp {
		return true
	}
	for _, g := range st.GUCs {
		if g.Unknown || !g.Local && !strings.HasPrefix(g.Name, "fence.") {
			return true
		}
	}
	if st.Kind == rewrite.Other && strings.Contains(strings.ToUpper(st.SQL), "TEMP") {
		return true
	}
	return false
}

// routeQuery sends a client Query that needs no gate: to the replica when
// it may, else to the primary. Client goroutine.
func (h *fenceSession) routeQuery(s gateConn, msg []byte, res *rewrite.Result) error {
	rs := s.readRouter()
	if rs == nil {
		return h.sendClient(s, msg, res)
	}
	var stmts []*rewrite.Stmt
	if res != nil {
		stmts = res.Stmts
	}
	onRep := s.OnReplica()
	if onRep {
		if s.outstanding() {
			if err := h.barrier(s); err != nil {
				return err
			}
		}
		if h.tx() != session.Idle {
			// The read-only transaction continues on the replica, up to
			// its end (replstate.go), each request judged against the
			// snapshots it may read (route_rotx.go).
			return h.inReplicaTx(s, msg, res, stmts)
		}
	}
	kind := classifyRead(stmts)
	if kind == notRead || h.rt.pinned || !h.replicaReads() {
		if onRep {
			s.usePrimary()
		}
		h.notePins(s, stmts)
		return h.sendClient(s, msg, res)
	}
	if !onRep && (s.outstanding() || h.tx() != session.Idle) {
		// Requests in flight on the primary (their transaction state is
		// unknown yet), or a transaction open there.
		rs.stats.Primary.Add(1)
		return h.sendClient(s, msg, res)
	}
	if h.runsSessionCode(stmts, anyReplay) {
		// The read may run code that changes the session's state: a
		// view's or a policy's function, a view that calls set_config.
		// What it does to custom settings (app.tenant) no query can
		// show or carry over, so it runs in the client's own session,
		// the primary's, where later reads and writes see it, as
		// straight to PostgreSQL (round 12, attacker X's M1; pgpool-II
		// sends a read calling a function not known to be read-only to
		// the primary too).
		rs.stats.Primary.Add(1)
		return h.toPrimary(s, msg, res)
	}
	if h.rt.primaryCodeRan && (kind == roTx || h.runsDBCode(stmts)) {
		// Code the proxy could not see into ran on the primary session
		// (sessionCode) and may have set custom settings there
		// (app.tenant), which no query can list: the database's code
		// this read runs, or a later statement of this read-only
		// transaction, would run on the replica session without them
		// (round 10, T-M1; round 11, attacker V's M1). On the primary it
		// runs as the client's session.
		rs.stats.Primary.Add(1)
		return h.toPrimary(s, msg, res)
	}
	if known, err := h.sessionKnown(s, onRep); err != nil {
		return err // ErrWait on the loop: nothing done yet
	} else if !known {
		rs.stats.Primary.Add(1)
		return h.toPrimary(s, msg, res)
	}
	// A replica that has not shown the primary's era is not picked in a
	// database with protected tables (era.go); eraOK asks its poller to
	// check.
	r := rs.pick(func(r *replica) bool { return h.cat.prot.Load().Len() == 0 || h.eraOK(r) })
	if rr := s.replicaInUse(); rr != nil {
		r = rr
	}
	if r == nil {
		rs.stats.Primary.Add(1)
		return h.toPrimary(s, msg, res)
	}
	// Each step may wait (parked on the loop): what follows it is its
	// continuation. msg stays whole in the client framer meanwhile.
	return h.replicaCurrent(s, r, stmts, kind, func(ok bool, err error) error {
		if err != nil {
			if pe, isPending := err.(*pendingError); isPending {
				rs.stats.Pending.Add(1)
				if err := s.usePrimary(); err != nil {
					return err
				}
				return h.refuseQuery(s, pe.e)
			}
			return err
		}
		if !ok {
			rs.stats.Primary.Add(1)
			return h.toPrimary(s, msg, res)
		}
		return s.useReplica(r, func(err error) error {
			if err != nil {
				rs.stats.Primary.Add(1)
				return h.toPrimary(s, msg, res)
			}
			if !h.replicaAgrees(s) {
				h.rt.pinned = true
				rs.stats.Primary.Add(1)
				return h.toPrimary(s, msg, res)
			}
			return h.replicaStateCheck(s, func(ok bool) error {
				if !ok {
					rs.stats.Primary.Add(1)
					return h.toPrimary(s, msg, res)
				}
				return h.heldKnown(s, r, stmts, kind, func(ok bool) error {
					if !ok {
						rs.stats.Primary.Add(1)
						return h.toPrimary(s, msg, res)
					}
					if h.runsSessionCode(stmts, LSN(r.replay.Load())) {
						// Judged above by the read set the primary has;
						// this replica has not replayed it, and its own
						// catalog may define what the read names
						// otherwise (catalogAt): every relation counts.
						rs.stats.Primary.Add(1)
						return h.toPrimary(s, msg, res)
					}
					// (So nothing sent from here changes the replica's
					// session: rt.replicaState stays as it was.)
					code := h.mayRunCode(stmts, LSN(r.replay.Load()))
					if kind == roTx {
						h.beginOnReplica(r, stmts)
					} else if code {
						// Code an autocommit read runs may DECLARE ... WITH
						// HOLD: its snapshot is at least this replay position.
						h.lowerHold(LSN(r.replay.Load()))
					}
					return h.sendRouted(s, msg, res)
				})
			})
		})
	})
}

// replicaStateCheck runs before a read is sent to the replica connection
// in use (an autocommit read, or the first request of a read-only
// transaction), with no transaction open there. When a request since the
// connection opened may have run code of the database's there that the
// proxy cannot see into (rt.replicaState: sessionCode), that code may
// have changed the session's settings or role for good, where the
// primary session, and so SHOW and everything else the client's session
// answers, has not (round 9, attacker R's M2), and no query can show that
// it did not: custom settings (app.tenant) are in no view (round 10,
// attacker T's M2; round 11, V's M1 and M2: reading the names out of the
// database's code missed some and cost without bound). So the replica
// connection is closed (a new one, opened for the next routed read, is a
// new connection's session, as the primary session is) and k(false):
// this read goes to the primary. Unchanged: k(true), no round trip.
//
// A closed connection takes its statement copies (void from now:
// replicaCode) and its WITH HOLD cursors with it: a later FETCH of one is
// answered 34000 (no such cursor), never with its rows. Keeping the
// connection for its cursors would run the rest of the transaction that
// FETCHes them in the changed session. Declaring a cursor, fetching from
// it and reading relations that run no code do not set rt.replicaState
// (sessionCode), so only a session whose own code ran there loses them.
// Since round 12 (attacker X's M1) an autocommit read that may run such
// code, and a read-only transaction whose first request may, go to the
// primary instead (runsSessionCode): only a later request of a read-only
// transaction open on the replica sets it, and what its code set is lost
// (docs/security.md, Known limits).
func (h *fenceSession) replicaStateCheck(s gateConn, k func(ok bool) error) error {
	if !h.rt.replicaState {
		return k(true)
	}
	h.rt.replicaState = false
	if err := s.usePrimary(); err != nil {
		return err
	}
	s.dropReplica()
	h.rt.replicaCode = h.seq
	h.rt.holdFloor = 0
	return k(false)
}

// runsDBCode reports whether a read may run the database's code: a
// function the proxy does not know to be read-only, text it could not
// read, or a relation or expression whose reads run code (a view's or a
// policy's function, an index expression's, an operator's:
// relCode, by the read set the primary has now). Such reads go to the
// primary once code ran on the primary session (routeQuery). Without a
// read set (an untracked database, or one being read again) every read
// of a relation may.
func (h *fenceSession) runsDBCode(stmts []*rewrite.Stmt) bool {
	for _, st := range stmts {
		if st == nil || st.Opaque || st.UserCalls || h.relCode(st, ^LSN(0)) {
			return true
		}
	}
	return false
}

// sessionCode reports whether stmts, sent on an upstream whose replica
// has replayed up to at (^LSN(0) for the primary), may run code of the
// database's that the proxy cannot see into, which may change that
// session's settings for good (set_config('app.tenant', ..., false)):
// custom settings among them, which no query can list. It decides R1
// (rt.primaryCodeRan, on the primary) and R3 (rt.replicaState, on the
// replica). Counted: text the proxy could not read, a DO block, a CALL,
// a function it does not know to be read-only (rewrite.Stmt.UserCalls),
// and a relation or expression whose reads may run code that changes the
// session's state (settingRelCode: the read set's sets; a view or policy
// that only reads the session, current_setting, changes nothing). An EXECUTE is judged by the statement it runs, as the
// proxy knows it: when no state-changing request is unanswered and
// nothing in the same request may replace it (sessionCodeIn), else it
// counts. Not counted: statements that run no code of the database's
// (SET, SHOW, FETCH, MOVE, CLOSE, transaction control, DDL that names no
// function), and a trigger a write fires (docs/security.md, Known
// limits).
func (h *fenceSession) sessionCode(stmts []*rewrite.Stmt, at LSN) bool {
	resolve := !h.unsettled()
	for _, st := range stmts {
		if st != nil && (st.Kind == rewrite.Prepare || st.Kind == rewrite.Deallocate || st.Kind == rewrite.Discard) {
			resolve = false // it may replace what a later EXECUTE of the request runs
		}
	}
	for _, st := range stmts {
		if h.stmtSessionCode(st, at, resolve, 0) {
			return true
		}
	}
	return false
}

// stmtSessionCode is sessionCode for one statement; depth 1 for the
// statement an EXECUTE runs (which cannot itself be an EXECUTE).
func (h *fenceSession) stmtSessionCode(st *rewrite.Stmt, at LSN, resolve bool, depth int) bool {
	switch {
	case st == nil, st.Opaque, st.UserCalls, st.Kind == rewrite.Do, st.Kind == rewrite.Call:
		return true
	case h.settingRelCode(st, at):
		return true
	case st.Executes != "":
		if !resolve || depth > 0 {
			return true
		}
		h.mu.Lock()
		ps, ok := h.be.stmts.Statement(st.Executes)
		h.mu.Unlock()
		return !ok || ps.Stmt != nil && h.stmtSessionCode(ps.Stmt, at, resolve, depth+1)
	}
	return false
}

// settingRelCode is relSets (code that may change the session's state)
// where the proxy keeps a read set for the session's database
// (catalog.tracked, with protected tables). While the
// set is being read again after a DDL notification, the last one loaded
// (catalog.settled) judges: counting every relation then, as the read
// routing does, would cost every session that touched one in the window
// (a CREATE TEMP TABLE anywhere makes one) its read-only transactions on
// the replica for good (R2); a relation redefined in that window to run
// code is counted from the next load on (docs/security.md, Known limits).
// Never loaded: every relation counts. In a database it keeps none for,
// the proxy does not know which
// relations run code, and relSets says yes for every one: counting them
// would have every read of a relation cost the replica connection (R3)
// and send the session's later code reads to the primary (R1). There
// only the code a statement calls itself counts (sessionCode); a view's
// or a policy's function that sets a custom setting is not seen
// (docs/security.md, Known limits: custom settings made by code).
func (h *fenceSession) settingRelCode(st *rewrite.Stmt, at LSN) bool {
	if !h.keepsReadSet() {
		return false
	}
	if h.cat.reads.Load() != nil {
		return h.relSets(st, at)
	}
	if len(st.ReadRelations) == 0 && !st.CatalogExprs {
		return false
	}
	rd := h.cat.settled.Load()
	for _, rel := range st.ReadRelations {
		if rd.setsRelCode(rel) {
			return true
		}
	}
	return rd.runsCode(st)
}

// runsSessionCode reports whether a read about to go to a replica that
// has replayed up to at (anyReplay: judged by the set the primary has)
// may run code that changes the session's state: sessionCode, whose
// relations count by the read set's sets as that replica has it (relSets:
// a replica that has not replayed the set counts every relation; while
// the set is read again after DDL, the last set loaded judges, as for
// sessionCode, docs/security.md, Known limits). Such a read goes to the
// primary (routeQuery). Without a read set only what the statement calls
// itself counts, and a plain read calls nothing that may: such a
// database is routed as before.
func (h *fenceSession) runsSessionCode(stmts []*rewrite.Stmt, at LSN) bool {
	return h.sessionCode(stmts, at)
}

// keepsReadSet reports whether the proxy keeps a read set for the
// session's database: read routing is on, the catalog notifies DDL
// (tracked) and the database has protected tables.
func (h *fenceSession) keepsReadSet() bool {
	return h.cat != nil && h.cat.tracked.Load() && h.protects()
}

// sendRouted sends a read to the replica connection in use and, if the
// replica fails before answering it, to the primary. Client side.
func (h *fenceSession) sendRouted(s gateConn, msg []byte, res *rewrite.Result) error {
	rs := s.readRouter()
	rs.stats.Replica.Add(1)
	s.startRouted(true)
	// The replica reads the text as the gate did (replstate.go).
	if err := h.alignReplica(s, msg[headerLen:len(msg)-1]); err != nil {
		s.stopRouted()
		return err
	}
	if err := h.sendClient(s, msg, res); err != nil {
		s.stopRouted()
		return err
	}
	return s.routeThen(h.last, func(retry bool) error {
		if !retry {
			return nil
		}
		rs.stats.Retries.Add(1)
		h.mu.Lock()
		h.st.TxStatus('I')
		h.mu.Unlock()
		if err := h.sendClient(s, msg, res); err != nil {
			return err
		}
		if res != nil && plan.ChangesState(res.Stmts...) {
			h.markState() // as query does after a send that did not wait
		}
		return nil
	})
}

// sessionKnown reports whether the replica connection's session may
// serve a read as the primary's would: the proxy knows that nothing has
// changed the primary's session where it could not see since it last
// read it back. Code of the client's run on the primary (a DO block, a
// function, a trigger: codeRan) may have changed any setting (search_path
// by set_config) or the role (EXECUTE 'SET ROLE ...', set_config('role',
// ...)), which the replica connection does not have: a read there would
// resolve names or privileges otherwise (issue 30, round 5, attacker K's
// M2). So after such code the settings are read back from the primary
// (resync: one round trip, before the first read that would go to the
// replica) with what else the session has set; if it set anything other
// than fence.*, or a role, the session is pinned to the primary as an
// explicit SET pins it. Client side, nothing of the message done yet:
// the read-back parks it, and it is handled again from the start
// (resynced). false: read this one on the primary.
func (h *fenceSession) sessionKnown(s gateConn, onRep bool) (bool, error) {
	h.mu.Lock()
	known, diverged, defaults := h.sessKnown, h.sessDiverged, h.defaultsKnown
	h.mu.Unlock()
	if h.rt.primaryCode > known || !defaults && !onRep {
		if onRep || h.resynced {
			return false, nil // on the replica, or the read-back did not answer
		}
		if err := h.resync(s); err != nil {
			return false, err
		}
		h.mu.Lock()
		known, diverged = h.sessKnown, h.sessDiverged
		h.mu.Unlock()
		if h.rt.primaryCode > known {
			return false, nil
		}
	}
	if diverged {
		h.rt.pinned = true
		return false, nil
	}
	return true, nil
}

// replicaAgrees reports whether the replica connection in use took the
// same settings from the role's and the database's defaults as the
// primary session did (defaultsSQL): it opens at the session's first
// routed read, and an ALTER ROLE or ALTER DATABASE ... SET since the
// session began gives it other defaults than the primary session kept
// (round 6, attacker M's M2: its search_path resolved the read's names
// otherwise). When they differ the session is pinned to the primary.
// The primary's are read once per session, with the read-back before
// its first routed read (sessionKnown); the replica's when the
// connection opens (replicaDefaults): no cost per read.
func (h *fenceSession) replicaAgrees(s gateConn) bool {
	rd, ok := s.replicaDefaults()
	h.mu.Lock()
	pd, known := h.defaults, h.defaultsKnown
	h.mu.Unlock()
	return ok && known && rd == pd
}

func (h *fenceSession) toPrimary(s gateConn, msg []byte, res *rewrite.Result) error {
	if err := s.usePrimary(); err != nil {
		return err
	}
	return h.sendClient(s, msg, res)
}

// routeOther keeps the extended protocol (and everything but a Query) on
// the primary, except inside a transaction open on the replica. A batch
// (up to Sync) stays on the upstream where it began. Client goroutine.
func (h *fenceSession) routeOther(s gateConn) error {
	if !s.OnReplica() || h.inBatch {
		return nil
	}
	if s.outstanding() {
		if err := h.barrier(s); err != nil {
			return err
		}
	}
	if h.tx() != session.Idle {
		return nil
	}
	return s.usePrimary()
}

func (h *fenceSession) tx() session.TxState {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.st.Tx()
}

func (h *fenceSession) get(name string) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	v, _ := h.st.Get(name)
	return v
}

// replicaReads reports whether the session may read from replicas.
func (h *fenceSession) replicaReads() bool {
	switch strings.ToLower(h.get("fence.read_replicas")) {
	case "off", "false", "0", "no":
		return false
	}
	return true
}

func (h *fenceSession) notePins(s gateConn, stmts []*rewrite.Stmt) {
	for _, st := range stmts {
		switch {
		case st.Kind == rewrite.Discard && st.Name == "ALL":
			h.rt.pinned = false
			h.forgetStatements(s)
		case st.Kind == rewrite.Deallocate && st.All:
			h.forgetStatements(s)
		case pins(st):
			h.rt.pinned = true
		}
	}
}

// requirement is what a replica must have replayed to serve a read.
type requirement struct {
	lsn   LSN
	job   string // with check: verify token on the replica's fence row
	epoch int64  // the session's fence.epoch, 0 when not set
	token int64
	check bool
	// blind: the proxy cannot tell which takeovers the read needs (its
	// watcher is reconnecting), or (noEra) the replica has not shown the
	// primary's era, so its positions cannot be compared (era.go): no
	// replica may serve it.
	blind bool
	// behind: the read names relations or resolves expressions the proxy
	// judges by its read set (the primary's catalog), and the replica has
	// not replayed the position that set was read at: its own catalog may
	// say otherwise (a view not yet redefined away from a protected table,
	// a policy not yet dropped: issue 30, round 9, attacker R's H1). The
	// read was judged as if the set were unknown: protected, running code.
	behind bool
	// catalog: the read set's position the judgement rested on (0: none).
	catalog LSN
	// noEra: the replica has not shown the primary's era (era.go).
	noEra bool
	// stale: the takeover tracker is not known to be current (its
	// notifications may be held up: freshWithin, lsn.go), so the proxy
	// cannot tell which takeovers the read needs. blind is set too; the
	// read policy decides, as for a replica that is behind.
	stale bool
	what  string // for messages
}

// anyReplay judges a read as for a replica that has replayed everything:
// the caller then compares req.catalog with the replica's position
// itself.
const anyReplay = ^LSN(0)

// catalogAt is the read set a judgement for a replica that has replayed
// up to at may rest on: the proxy's, when the replica has replayed the
// position it was read at; else nil (an unknown set: every relation
// exposes protected data and runs code), so nothing the primary's
// catalog calls safe is taken on trust from an older catalog.
func (h *fenceSession) catalogAt(at LSN) (rd *readSet, behind bool) {
	rd = h.cat.reads.Load()
	if rd != nil && at < rd.lsn {
		return nil, true
	}
	return rd, false
}

// require works out what the read needs on a replica that has replayed
// up to at; protected is false when it can reach no protected data (any
// healthy replica that has replayed the catalog as the proxy knows it
// will do: req.catalog, at or below at). Every judgement that rests on
// the read set rests on it only for a replica that has replayed it
// (catalogAt): otherwise the read is judged as reaching anything
// (req.behind), in every path, with or without a transaction.
//
// A read is protected when it may reach protected data: through a
// relation it names (readSet.exposes), or through code the database runs
// inside its expressions where it names none (an operator, a cast, a
// domain's check, a function written as a field: readSet.runsCode); and
// every read-only transaction. A protected read needs every takeover the
// proxy has seen, and everything before its watcher started (tk.all), as
// a reader without fence metadata does, and on top of that the reader's
// own generation and fence.min_lsn: metadata never makes a reader's
// guarantee weaker. A generation the watcher has not seen yet is checked
// on the replica's fence row (or was, by this session: rt.checked).
//
// A reader whose generation the watcher has not seen yet, or that demands
// fence.min_lsn, is protected whatever relation it names: the catalog may
// have changed before that generation in a way the proxy has not heard of
// (DDL is notified in commit order with takeovers, so a reader whose
// takeover has been seen reads a catalog that is current up to it).
func (h *fenceSession) require(stmts []*rewrite.Stmt, kind readKind, at LSN) (req requirement, protected bool) {
	var v readVals // the four a requirement reads (not the policy's: the common path reads those only when it must)
	h.mu.Lock()
	v.job, _ = h.st.Get(session.JobKey)
	v.epoch, _ = h.st.Get(session.Epoch)
	v.token, _ = h.st.Get(session.Token)
	v.minLSN, _ = h.st.Get(session.MinLSN)
	h.mu.Unlock()
	return h.requireWith(stmts, kind, v, at)
}

// readVals are the settings a read's requirement and policy depend on.
type readVals struct {
	job, epoch, token, minLSN, policy, wait string
}

// readVals reads them from the session state.
func (h *fenceSession) readVals() readVals {
	h.mu.Lock()
	defer h.mu.Unlock()
	var v readVals
	v.job, _ = h.st.Get(session.JobKey)
	v.epoch, _ = h.st.Get(session.Epoch)
	v.token, _ = h.st.Get(session.Token)
	v.minLSN, _ = h.st.Get(session.MinLSN)
	v.policy, _ = h.st.Get(session.ReadPolicy)
	v.wait, _ = h.st.Get(session.ReadWait)
	return v
}

// requireWith is require with the settings v.
func (h *fenceSession) requireWith(stmts []*rewrite.Stmt, kind readKind, v readVals, at LSN) (req requirement, protected bool) {
	prot := h.cat.prot.Load()
	if prot.Len() == 0 {
		return req, false
	}
	job, epochText, tokText, minText := v.job, v.epoch, v.token, v.minLSN
	tk := &h.cat.tk
	token, terr := strconv.ParseInt(strings.TrimSpace(tokText), 10, 64)
	gen := job != "" && terr == nil && token > 0
	var seen takeover
	known := false // the watcher has seen the session's generation
	if gen {
		seen, known = tk.lookup(job)
		known = known && seen.token >= token
		if !known {
			// Ask the watcher to read the job's fence row: later reads
			// of this generation then need no fence-row check.
			tk.hint(job)
		}
	}
	rd, behind := h.catalogAt(at)
	// A read-only transaction may read anything later. A read that
	// names no relation and nothing the catalog resolves (SELECT 1,
	// SELECT now()) reads no protected data, whatever the catalog says.
	catalog := false // the answer rests on the read set
	for _, st := range stmts {
		catalog = catalog || len(st.ReadRelations) > 0 || st.CatalogExprs
	}
	// Everything below rests on what the watcher has heard (takeovers,
	// and DDL, which drops the read set): only while it is fresh
	// (freshWithin, lsn.go). Otherwise notifications may be held up (a
	// flood, a stalled commit) and the read set is judged unknown, and
	// no replica serves a protected read (req.stale).
	stale := (kind == roTx || catalog) && !tk.current(time.Now())
	if stale {
		rd = nil
	}
	protected = kind == roTx
	for _, st := range stmts {
		for _, rel := range st.ReadRelations {
			protected = protected || rd.exposes(rel)
		}
		if st.CatalogExprs {
			protected = protected || rd.runsCode(st)
		}
	}
	if !protected && !catalog {
		return req, false // no catalog to agree on
	}
	if catalog {
		req.behind = behind
		req.catalog = h.cat.reads.Load().position()
	}
	// A known takeover newer than the read set may have been read from
	// its fence row before the DDL notified ahead of it arrived: the set
	// cannot vouch for the relations then.
	if !protected && !(gen && (!known || rd.vouched() < seen.lsn) || minText != "") {
		return req, false
	}
	req.lsn = tk.all()
	req.what = "every takeover seen so far"
	// Takeovers while the watcher reconnects are seen by nobody; while
	// it is not known to be current, which it has heard is not known.
	req.blind = !h.cat.live.Load()
	req.stale = stale && !req.blind
	req.blind = req.blind || stale
	if gen {
		req.what = fmt.Sprintf("job %q token %d and every takeover seen so far", job, token)
		if !known {
			if c, ok := h.rt.checked[job]; ok && c.token >= token {
				seen, known = c, true
			}
		}
		if known {
			req.lsn = max(req.lsn, seen.lsn)
		} else {
			req.job, req.token, req.check = job, token, true
			req.epoch, _ = strconv.ParseInt(strings.TrimSpace(epochText), 10, 64)
		}
	}
	if minText != "" {
		if m, err := parseLSN(minText); err == nil && m > req.lsn {
			req.lsn = m
			req.what += fmt.Sprintf(" and fence.min_lsn %s", m)
		}
	}
	return req, true
}

// pendingError carries the FN007 answer.
type pendingError struct{ e *fence.Error }

func (p *pendingError) Error() string { return p.e.Message }

// replicaCurrent decides whether r may serve the read now, waiting when
// the session's policy says so, and runs k with the decision. The error
// is a *pendingError for policy pending. It may leave the session on the
// replica (after a fence-row check); the caller switches as it decides.
// Client side; on the loop its waits park it.
func (h *fenceSession) replicaCurrent(s gateConn, r *replica, stmts []*rewrite.Stmt, kind readKind, k func(ok bool, err error) error) error {
	return h.replicaCurrentAfter(s, r, stmts, kind, false, k)
}

// replicaCurrentAfter is replicaCurrent; waited: the read has waited for
// the takeover tracker once already.
func (h *fenceSession) replicaCurrentAfter(s gateConn, r *replica, stmts []*rewrite.Stmt, kind readKind, waited bool, k func(ok bool, err error) error) error {
	// Judged by the read set as the proxy has it (anyReplay), so that a
	// read the set calls protected meets the session's read policy
	// whatever the replica's catalog; one it calls safe needs the
	// replica to have replayed the set (req.catalog), or the primary
	// serves it: the replica may still define what it names otherwise.
	// (What the set says of code, for held cursors, is judged at the
	// replica's position: mayRunCode, heldKnown.)
	req, protected := h.require(stmts, kind, anyReplay)
	if !protected {
		// Reads of unprotected data never wait and never get FN007. A
		// catalog position means something only on the primary's
		// history (era.go).
		return k(req.catalog == 0 || h.eraOK(r) && LSN(r.replay.Load()) >= req.catalog, nil)
	}
	if req.stale && h.eraOK(r) {
		return h.staleRead(s, r, stmts, kind, req, waited, k)
	}
	if req.blind || !h.eraOK(r) {
		// Not the replica's being behind: no policy waits for it, no
		// FN007; the primary answers.
		return k(false, nil)
	}
	checked := LSN(r.replay.Load())
	return h.replayed(s, r, req, func(ok bool, err error) error {
		if ok || err != nil {
			return k(ok, err)
		}
		switch strings.ToLower(h.get(session.ReadPolicy)) {
		case "wait":
			return h.waitReplay(s, r, req, checked, k)
		case "pending":
			replay := LSN(r.replay.Load())
			msg := fmt.Sprintf("generation pending on replica: %s is not yet visible on replica %s", req.what, r.addr)
			if req.check {
				msg += fmt.Sprintf(" (its fence row there is behind; replayed up to %s)", replay)
			} else {
				msg += fmt.Sprintf(" (needs WAL position %s, replayed %s)", req.lsn, replay)
			}
			return k(false, &pendingError{&fence.Error{Code: fence.CodePending, Message: "pgfence: " + msg,
				Hint: "retry shortly, or read from the primary with SET fence.read_policy = 'primary' (or 'wait')"}})
		}
		return k(false, nil)
	})
}

// staleRead decides a protected read while the takeover tracker is not
// known to be current (req.stale: notifications may be held up, lsn.go's
// freshWithin). When a marker can make it current soon (none in flight,
// or a recent one), the read waits for it, up to freshWithin (policy
// wait: fence.read_wait), off the client, and is judged again: after a
// pause in reads that costs one marker's round trip. Otherwise, or when
// that did not help, it is a read whose requirement is not known, and
// the policy decides as for a replica that is behind: the primary,
// FN007 (pending), or (wait) the primary once the wait is over.
func (h *fenceSession) staleRead(s gateConn, r *replica, stmts []*rewrite.Stmt, kind readKind, req requirement, waited bool, k func(ok bool, err error) error) error {
	rs := s.readRouter()
	tk := &h.cat.tk
	policy := strings.ToLower(h.get(session.ReadPolicy))
	if !waited && (tk.waitable(time.Now()) || policy == "wait") {
		wait := freshWithin
		if policy == "wait" {
			wait = DefaultReadWait
			if v := h.get(session.ReadWait); v != "" {
				if d, err := session.ParseDuration(v); err == nil {
					wait = d
				}
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		ending := s.ending()
		return s.offClient(func() error {
			tk.waitFresh(ctx, ending)
			return nil
		}, func(error) error {
			cancel()
			return h.replicaCurrentAfter(s, r, stmts, kind, true, k)
		}, cancel, true)
	}
	rs.stats.Stale.Add(1)
	if policy == "pending" {
		return k(false, &pendingError{&fence.Error{Code: fence.CodePending,
			Message: fmt.Sprintf("pgfence: generation pending on replica: the proxy cannot tell yet which takeovers this read needs (%s): its takeover notifications are held up (a flood of notifications, or a commit that has not finished)", req.what),
			Hint:    "retry shortly, or read from the primary with SET fence.read_policy = 'primary' (or 'wait')"}})
	}
	return k(false, nil)
}

// waitReplay waits, up to fence.read_wait, for r to have replayed what
// req needs (fence.read_policy=wait), and runs k with the outcome. The
// replica's polls are waited for off the loop (offClient): one wait
// lasts until r is healthy and has replayed req.lsn, and, when its fence
// row decides (req.check), replayed past checked, where the row was
// last read; the fence row is read again then. The wait ends early when
// the session ends.
func (h *fenceSession) waitReplay(s gateConn, r *replica, req requirement, checked LSN, k func(bool, error) error) error {
	rs := s.readRouter()
	wait := DefaultReadWait
	if v := h.get(session.ReadWait); v != "" {
		if d, err := session.ParseDuration(v); err == nil {
			wait = d
		}
	}
	rs.stats.Waits.Add(1)
	rs.stats.Waiting.Add(1)
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	ending := s.ending()
	go func() {
		// The wait is over, or the session ends (its continuation then
		// never runs): the poll off the loop gives up.
		select {
		case <-ending:
		case <-ctx.Done():
		}
		cancel()
		rs.stats.Waiting.Add(-1)
	}()
	done := func(ok bool, err error) error {
		cancel()
		return k(ok, err)
	}
	var poll func() error
	poll = func() error {
		var seen LSN
		f := func() error {
			for {
				lsn, err := r.refresh(ctx)
				if err != nil {
					return err
				}
				if r.healthy.Load() && lsn >= req.lsn && (!req.check || lsn > checked) {
					seen = lsn
					return nil
				}
			}
		}
		return s.offClient(f, func(err error) error {
			if err != nil {
				return done(false, nil)
			}
			checked = seen
			return h.replayed(s, r, req, func(ok bool, err error) error {
				if ok || err != nil || ctx.Err() != nil {
					return done(ok, err)
				}
				return poll()
			})
		}, nil, true)
	}
	return poll()
}

// replayed checks req against r's cached replay position, and against its
// fence row when the proxy does not know the session's token, and runs k
// with the outcome.
func (h *fenceSession) replayed(s gateConn, r *replica, req requirement, k func(bool, error) error) error {
	if LSN(r.replay.Load()) < req.lsn || !h.eraOK(r) {
		return k(false, nil)
	}
	if !req.check {
		return k(true, nil)
	}
	return h.fenceRowCheck(s, r, req, k)
}

// fenceRowCheck asks the replica whether its fence row for req.job has
// reached req.token, on the session's replica connection, and runs k with
// the answer. The answer is this session's only (rt.checked): the query
// runs in the client's session, whose own objects and settings (a
// search_path, an operator) may have made it up, so it must not teach
// the database's takeover tracker, which every session trusts.
func (h *fenceSession) fenceRowCheck(s gateConn, r *replica, req requirement, k func(bool, error) error) error {
	return s.useReplica(r, func(err error) error {
		if err != nil {
			return k(false, nil)
		}
		s.readRouter().stats.FenceChecks.Add(1)
		q := fenceCheckQuery(req, h.cat.reached.Load())
		h.mu.Lock()
		h.rt.row = ""
		h.mu.Unlock()
		s.startRouted(false)
		if err := h.send(s, queryMsg(nil, q), &tag{kind: 'Q', segs: []seg{{step: stepFenceCheck}}}, false); err != nil {
			s.stopRouted()
			return err
		}
		return s.routeThen(h.last, func(retry bool) error {
			if retry {
				h.mu.Lock()
				h.st.TxStatus('I')
				h.mu.Unlock()
				return k(false, nil)
			}
			h.mu.Lock()
			row := h.rt.row
			h.mu.Unlock()
			tokText, lsnText, _ := strings.Cut(row, " ")
			tok, err1 := strconv.ParseInt(tokText, 10, 64)
			lsn, err2 := parseLSN(lsnText)
			if err1 != nil || err2 != nil {
				return k(false, nil)
			}
			if tok > 0 && lsn > 0 {
				if old, ok := h.rt.checked[req.job]; !ok || tok > old.token || tok == old.token && lsn < old.lsn {
					if h.rt.checked == nil {
						h.rt.checked = map[string]takeover{}
					}
					h.rt.checked[req.job] = takeover{token: tok, lsn: lsn}
				}
			}
			return k(tok >= req.token, nil)
		})
	})
}

// fenceCheckQuery asks a replica for "token replay_lsn": the largest token
// its fence row of req.job shows, or with fence.replica_reached (reached,
// a SECURITY DEFINER function that reveals no token) req.token when the
// replica has replayed that generation and 0 when not. It runs as the
// client's role on the session's replica connection: without the function
// that role needs SELECT on fence.fences.
func fenceCheckQuery(req requirement, reached bool) string {
	lsn := " OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) coalesce(pg_catalog.pg_last_wal_replay_lsn()::pg_catalog.text, '0/0')"
	token := "'" + strconv.FormatInt(req.token, 10) + "'::pg_catalog.int8"
	job := plan.Literal(req.job) + "::pg_catalog.text"
	if reached {
		epoch := "NULL::pg_catalog.int8"
		if req.epoch > 0 {
			epoch = "'" + strconv.FormatInt(req.epoch, 10) + "'::pg_catalog.int8"
		}
		return "SELECT (CASE WHEN fence.replica_reached(" + job + ", " + epoch + ", " + token + ") THEN " + token +
			" ELSE '0'::pg_catalog.int8 END)::pg_catalog.text" + lsn
	}
	return "SELECT coalesce((SELECT f.max_issued_token FROM fence.fences AS f WHERE f.job_key OPERATOR(pg_catalog.=) " + job +
		"), '0'::pg_catalog.int8)::pg_catalog.text" + lsn
}

// routeRow takes the DataRow of a routing query. Server goroutine, under
// h.mu.
func (h *fenceSession) routeRow(s gateConn, sg seg, msg []byte) {
	switch sg.step {
	case stepFenceCheck:
		h.rt.row = rowValue(msg)
	case stepLSN:
		if h.st.Tx() != session.Idle {
			return
		}
		v := rowValue(msg)
		if v == "" {
			return
		}
		if rs := s.readRouter(); rs != nil {
			rs.stats.CommitLSN.Add(1)
		}
		s.WriteClient(encode(nil, &pgproto3.ParameterStatus{Name: ParamCommitLSN, Value: v}))
	}
}

// sendClient sends the client's Query as it is. After a query that called
// a fence.* function and left no transaction open (or the COMMIT of a
// transaction that did), the query's ReadyForQuery is held back and sent
// after the ParameterStatus fence.commit_lsn.
func (h *fenceSession) sendClient(s gateConn, msg []byte, res *rewrite.Result) error {
	t := &tag{kind: 'Q', segs: clientSegs(res)}
	tail, ends, begins := false, false, false
	if res != nil && !s.OnReplica() {
		for _, st := range res.Stmts {
			switch {
			case st.CallsFence:
				h.rt.fenceTx, tail = true, true
			case st.Kind == rewrite.Commit || st.Kind == rewrite.Rollback:
				tail, ends = tail || h.rt.fenceTx, true
			case st.Kind == rewrite.Begin:
				begins = true
			}
		}
	}
	if !tail {
		return h.send(s, msg, t, true)
	}
	t.hideReady = true
	if err := h.send(s, msg, t, true); err != nil {
		return err
	}
	// Visible, so its ReadyForQuery is the client's; its rows are hidden.
	if err := h.send(s, queryMsg(nil, insertLSNQuery), &tag{kind: 'Q', segs: []seg{{step: stepLSN}}}, true); err != nil {
		return err
	}
	if ends || !begins && h.tx() == session.Idle {
		h.rt.fenceTx = false
	}
	return nil
}

// routeGated: a query the gate rewrites goes to the primary (it writes),
// unless a read-only transaction is open on the replica, where it fails as
// it would on the primary. Called after barrier.
func (h *fenceSession) routeGated(s gateConn) error {
	if !s.OnReplica() || h.tx() != session.Idle {
		return nil
	}
	return s.usePrimary()
}

// Named prepared statements live on the upstream that parsed them. A
// session whose read-only transaction runs on the replica may parse a
// statement there and bind it later on the primary (pgx's statement cache
// does), or the other way round. So the router keeps which upstream has
// which version (stmtCopies), and parses a statement on the current
// upstream (hidden, ahead of the client's message) before a Bind or
// Describe names it there: the version the server accepted (Prepared.Raw,
// the Parse it answered with ParseComplete), which the gate judges each
// Execute by. A version left behind on the other upstream is closed before
// a newer one is parsed there, or the name used there.
//
// What the router believes rests on the server's answers: each Parse or
// Close of a name (the client's, or a hidden copy's) is remembered with
// its request (stmtCopies.req), and the bookkeeping assumes it succeeds
// only until it is answered. A message naming the statement in a later
// batch first has that answer (stmtSettle: a wait only when it is still
// outstanding; a Bind waits there anyway, boundStmt); if the server
// skipped it (an earlier error in its batch) or refused it (42P05: the
// name exists), the name's presence on either upstream is unknown, and
// its next use closes it and parses the accepted version again. Within a
// batch, a message after the Parse or Close runs only if it succeeded, so
// nothing waits: pgx's Parse, Bind of a name and its later Binds cost no
// round trip. Nothing is copied into a batch the server is known to be
// skipping (the client's message is skipped too).

const (
	onPrimary uint8 = 1 << iota
	onReplica
)

// stmtCopies is where the client's named statements exist, by name: the
// per-upstream half of what fenceSession.stmts holds per client.
type stmtCopies struct {
	on    map[string]uint8 // where the accepted version exists
	stale map[string]uint8 // where another version may exist
	// req: the last request sent that makes or removes the name on an
	// upstream, with its batch (fenceSession.batchNo); on and stale hold
	// what it does if it succeeds, until it is answered (stmtSettle).
	req map[string]stmtReq
	// repAt: the request that last parsed, copied or closed the name on
	// the replica connection (stmtAt); before routeState.replicaCode, what
	// the replica has under the name is unknown.
	repAt map[string]uint64
}

type stmtReq struct {
	r     *Request
	batch uint64
}

// routeMsg follows an extended-protocol message: back to the primary when
// idle, and the named statement it needs on the current upstream. Client
// goroutine; it runs before the gate handles the message, and returns
// ErrWait (on the loop) only before it has done anything.
func (h *fenceSession) routeMsg(s gateConn, msg []byte) error {
	if s.readRouter() == nil {
		return nil
	}
	if s.OnReplica() {
		if err := h.routeOther(s); err != nil {
			return err
		}
	}
	body := msg[headerLen:]
	var name string
	switch msg[0] {
	case 'S':
		h.rt.batchEnded = false
		return nil
	case 'P':
		name, _, _ = cstring(body)
	case 'B':
		_, rest, _ := cstring(body)
		name, _, _ = cstring(rest)
	case 'D', 'C':
		if len(body) > 1 && body[0] == 'S' {
			name, _, _ = cstring(body[1:])
		}
	}
	named := name != "" && !plan.Reserved(name) // a reserved name: the gate refuses it (FN013)
	if named {
		if err := h.stmtSettle(s, name, msg[0]); err != nil {
			return err // ErrWait on the loop: nothing done yet
		}
	}
	up := h.upstream(s)
	if msg[0] == 'P' && up == onReplica {
		// Read there as the gate reads it (replstate.go).
		_, text, _ := cstring(body)
		q, _, _ := cstring(text)
		if err := h.alignReplicaBatch(s, []byte(q)); err != nil {
			return err
		}
	}
	if !named || msg[0] == 'C' || h.batchSkipping() {
		return nil // a Close is followed once sent (stmtSent)
	}
	sc := h.stmtCopies()
	// void: code of the client's has run on the replica connection since
	// the name was last parsed, copied or closed there, and may have
	// replaced it (EXECUTE 'DEALLOCATE ...', 'PREPARE ...' in a DO block
	// or a function: issue 30, round 5, attacker K's H2): what is there is
	// unknown, so it is closed and copied again before use.
	void := up == onReplica && sc.repAt[name] < h.rt.replicaCode
	if q, ok := sc.req[name]; ok && h.inBatch && q.batch == h.batchNo && !void {
		return nil // parsed, closed or copied earlier in this batch: it runs only if that succeeded
	}
	if msg[0] == 'P' {
		if void || sc.stale[name]&up != 0 {
			// Another version here, or one the router cannot rule out:
			// close it first (a Close of a missing statement succeeds).
			if err := h.closeCopy(s, name); err != nil {
				return err
			}
		}
		return nil // the rest once the Parse is sent (stmtSent)
	}
	var p []byte
	copySQL := ""
	h.mu.Lock()
	if ps, ok := h.be.stmts.Statement(name); ok {
		if ps.Raw == nil || ps.SQL {
			// A statement of SQL PREPARE (or parsed before read
			// routing): on the primary only.
			if up == onPrimary {
				h.mu.Unlock()
				return nil
			}
			copySQL = h.sqlCopyLocked(ps)
		} else {
			p = ps.Raw
		}
	}
	h.mu.Unlock()
	if copySQL != "" {
		// Made again on the replica before each use, from its PREPARE
		// (round 8, attacker P's M2).
		if err := h.alignInBatch(s, copySQL); err != nil {
			return err
		}
		sc.stale[name] |= onReplica
		h.stmtReq(name)
		h.stmtAt(name, up)
		return nil
	}
	if void && h.inBatch {
		if cs, ok := h.batchStmts[name]; ok {
			// The gate binds this batch's Parse (or Close) of the name
			// (boundStmt): that version, or none.
			p = nil
			if cs != nil {
				p = cs.raw
			}
		}
	}
	if p != nil && sc.on[name]&up != 0 && !void {
		return nil // the accepted version is here
	}
	if void || (sc.on[name]|sc.stale[name])&up != 0 {
		// Another version here, or one the router cannot rule out: close
		// it first (a Close of a missing statement succeeds).
		if err := h.closeCopy(s, name); err != nil {
			return err
		}
	}
	if p == nil {
		return nil // the server refuses the Bind: the gate knows no such statement here
	}
	if up == onReplica {
		_, text, _ := cstring(p[headerLen:])
		q, _, _ := cstring(text)
		if err := h.alignReplicaBatch(s, []byte(q)); err != nil {
			return err
		}
	}
	if err := h.send(s, p, &tag{kind: 'P', step: stepStmtCopy}, false); err != nil {
		return err
	}
	sc.on[name] |= up
	h.stmtReq(name)
	h.stmtAt(name, up)
	return nil
}

// sqlCopyLocked is the proxy's own statement that makes ps, a statement
// of SQL PREPARE on the primary, on the replica connection as the primary
// has it: any statement of that name there deallocated, then ps's PREPARE
// run again (plpgsql's EXECUTE: one statement, whatever the replica has).
// "" when the same text may not make the same statement there: it reads
// differently under other lexing settings (sensitive), or the session's
// search_path may have changed since it was prepared (SET, RESET). Then the replica has no
// such statement and the server says so (26000). h.mu held.
func (h *fenceSession) sqlCopyLocked(ps *session.Prepared) string {
	if !ps.SQL || ps.Text == "" || sensitive([]byte(ps.Text)) {
		return ""
	}
	if h.st.PathEpoch() != ps.PathEpoch {
		return ""
	}
	name := plan.Literal(ps.Name)
	return "DO $pgfence$BEGIN IF EXISTS (SELECT FROM pg_catalog.pg_prepared_statements WHERE name OPERATOR(pg_catalog.=) " + name +
		") THEN EXECUTE 'DEALLOCATE ' OPERATOR(pg_catalog.||) pg_catalog.quote_ident(" + name + "); END IF; EXECUTE " +
		plan.Literal(ps.Text) + "; END$pgfence$"
}

// sqlCopies sends, inside the transaction open on the replica and ahead
// of a simple Query or a Parse (batch), the copies of the SQL-level
// prepared statements its statements EXECUTE (sqlCopyLocked), hidden.
func (h *fenceSession) sqlCopies(s gateConn, stmts []*rewrite.Stmt, batch bool) error {
	if h.tx() == session.Failed {
		return nil // the server refuses the EXECUTE too (25P02)
	}
	for _, st := range stmts {
		if st.Executes == "" {
			continue
		}
		h.mu.Lock()
		sql := ""
		if ps, ok := h.be.stmts.Statement(st.Executes); ok {
			sql = h.sqlCopyLocked(ps)
		}
		h.mu.Unlock()
		if sql == "" {
			continue
		}
		if batch {
			if err := h.alignInBatch(s, sql); err != nil {
				return err
			}
		} else if err := h.send(s, h.qmsg(sql), &tag{kind: 'Q', segs: []seg{{step: stepAlign}}, hideReady: true}, false); err != nil {
			return err
		}
		sc := h.stmtCopies()
		sc.stale[st.Executes] |= onReplica
		h.stmtReq(st.Executes)
		h.stmtAt(st.Executes, onReplica)
	}
	return nil
}

// stmtAt records that name was just parsed, copied or closed on up
// (the request h.seq): what is there is known as of then (routeMsg's void).
func (h *fenceSession) stmtAt(name string, up uint8) {
	if up == onReplica {
		h.rt.stmts.repAt[name] = h.seq
	}
}

// upstream is the upstream in use, as a stmtCopies bit.
func (h *fenceSession) upstream(s gateConn) uint8 {
	if s.OnReplica() {
		return onReplica
	}
	return onPrimary
}

// stmtSettle has the answer to the last request that made or removed
// name on an upstream, when it was sent in an earlier batch: waiting for
// it if it is outstanding (for a Bind or Describe, for every request sent
// before the batch, as boundStmt does: the accepted version it copies is
// then the one the gate binds by). If it was skipped or refused, the
// name's presence on both upstreams is unknown. ErrWait on the loop:
// nothing done yet.
func (h *fenceSession) stmtSettle(s gateConn, name string, typ byte) error {
	sc := h.stmtCopies()
	q, ok := sc.req[name]
	if ok && h.inBatch && q.batch == h.batchNo {
		return nil
	}
	var r *Request
	if ok {
		r = q.r
	}
	if typ == 'B' || typ == 'D' {
		r = h.last // this message starts a batch
		if h.inBatch {
			r = h.stmtWait
		}
		if r == nil && ok {
			r = q.r
		}
	}
	if err := h.wait(s, r); err != nil {
		return err
	}
	if !ok {
		return nil
	}
	delete(sc.req, name)
	if q.r.Skipped || q.r.Error != nil {
		delete(sc.on, name)
		sc.stale[name] = onPrimary | onReplica
	}
	return nil
}

// stmtSent follows the client's Parse (parsed) or Close of statement
// name, just sent (h.last) on the current upstream: as if it succeeded,
// until it is answered (stmtSettle).
func (h *fenceSession) stmtSent(s gateConn, name string, parsed bool) {
	if s.readRouter() == nil || name == "" || plan.Reserved(name) {
		return
	}
	up := h.upstream(s)
	other := up ^ (onPrimary | onReplica)
	sc := h.stmtCopies()
	if (sc.on[name]|sc.stale[name])&other != 0 {
		sc.stale[name] |= other
	}
	if sc.stale[name] &^= up; sc.stale[name] == 0 {
		delete(sc.stale, name)
	}
	if parsed {
		sc.on[name] = up
	} else {
		delete(sc.on, name)
	}
	h.stmtReq(name)
	h.stmtAt(name, up)
}

// stmtReq records h.last as the last request making or removing name.
func (h *fenceSession) stmtReq(name string) {
	h.rt.stmts.req[name] = stmtReq{r: h.last, batch: h.batchNo}
}

// batchSkipping reports whether the server is known to skip the rest of
// the current batch: its last request failed or was skipped.
func (h *fenceSession) batchSkipping() bool {
	r := h.last
	if !h.inBatch || r == nil {
		return false
	}
	select {
	case <-r.Done():
		return r.Skipped || r.Error != nil
	default:
		return false
	}
}

func (h *fenceSession) stmtCopies() *stmtCopies {
	sc := &h.rt.stmts
	if sc.on == nil {
		sc.on, sc.stale, sc.req, sc.repAt = map[string]uint8{}, map[string]uint8{}, map[string]stmtReq{}, map[string]uint64{}
	}
	return sc
}

// closeCopy closes name on the current upstream, hidden: no version is
// there after it (if it runs).
func (h *fenceSession) closeCopy(s gateConn, name string) error {
	buf, _ := (&pgproto3.Close{ObjectType: 'S', Name: name}).Encode(nil)
	if err := h.send(s, buf, &tag{kind: 'C', step: stepStmtCopy}, false); err != nil {
		return err
	}
	sc := h.stmtCopies()
	up := h.upstream(s)
	sc.on[name] &^= up
	sc.stale[name] &^= up
	h.stmtReq(name)
	h.stmtAt(name, up)
	return nil
}

// forgetStatements: DISCARD ALL / DEALLOCATE ALL ran on the current
// upstream.
func (h *fenceSession) forgetStatements(s gateConn) {
	up := onPrimary
	if s.OnReplica() {
		up = onReplica
	}
	for n := range h.rt.stmts.on {
		h.rt.stmts.on[n] &^= up
		h.rt.stmts.stale[n] &^= up
	}
}
