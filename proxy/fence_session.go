package proxy

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
)

// fenceSession is the write gate's Handler for one client session.
//
// The client goroutine decides: it classifies each Query and Execute, and
// when a statement may need the gate it waits until every earlier request
// that changes the session state has been answered (so the state is
// settled), asks rewrite/plan what to add, and executes the plan — the
// steps spliced into the query text for the simple protocol, run as named
// prepared statements for the extended one.
// Everything it sends upstream goes through Session.Inject (visible for the
// client's own requests, hidden for the gate's), tagged, so the server
// goroutine knows what each response belongs to. ("Client goroutine" is
// the client side: on the event loop it runs on the loop's thread, and
// where it must wait it parks there; see LoopClient.)
//
// The server goroutine follows: it applies every completed statement to the
// session state (GUCs, transaction, prepared statements, gate, digest) and
// turns the gate's outcomes into what the client sees.
//
// The code is split by concern, in the order a gated transaction visits
// it:
//
//   - fence_client.go: what becomes of each client message; a simple
//     Query is classified and planned there;
//   - fence_extended.go: the extended protocol's statements, portals and
//     batches, planned by plan.Batch;
//   - fence_copy.go: COPY data, and the transaction around a protected
//     COPY FROM;
//   - fence_plan.go: what the planner asks of the protected tables;
//   - fence_exec.go: executing a plan: sending, tagged, and waiting;
//   - fence_server.go: interpreting the server's answers;
//   - fence_text.go (how the server reads the client's text, the settings
//     read back), fence_log.go (refusals), fence_idle.go (the idle
//     watchdog), route.go (read routing).
type fenceSession struct {
	f        *Fence
	cat      *catalog
	user, db string // the session's role and database (for the log)

	mu sync.Mutex // guards st, and be's stmts and text
	// unconfirmed: the FN016 error the client gets for a commit whose
	// wait for the synchronous standby was cancelled, while it waits for
	// the CommandComplete of request unconfirmedSeq or the ReadyForQuery
	// (fence_syncrep.go). Server goroutine only.
	unconfirmed    []byte
	unconfirmedSeq uint64
	st             *session.State
	// be is the gate's view of the upstream connection (fence_backend.go).
	be *gateBackend

	// Client goroutine only.
	last    *Request // the last request sent upstream
	inBatch bool     // extended-protocol messages sent since the last Sync
	batchNo uint64   // counts the batches begun (stmtCopies.req)
	// batchStmts: the client's Parses (and Closes: nil) of the current
	// batch, what a Bind later in the batch runs if it runs at all; before
	// the batch, what the server answered (gateBackend.stmts), once
	// stmtWait, the last request sent before the batch, is answered
	// (boundStmt, fence_extended.go).
	batchStmts map[string]*clientStmt
	stmtWait   *Request
	// portals are the client's portals as bound (fence_extended.go). An
	// entry tells what its name denotes only while alive: bound at or
	// after portalsTouched, the seq of the last request that may have
	// closed or opened portals where the proxy cannot see (SQL DECLARE,
	// CLOSE, code), and after portalsEnded (portalLive).
	portals        map[string]*clientPortal
	portalsTouched uint64
	// copyFromReq: the last client Query with a COPY FROM, while it may be
	// unanswered; copyStarted gets a token (server side) at each
	// CopyInResponse. A Sync during its COPY's data is ignored by
	// PostgreSQL (syncInCopy, fence_copy.go).
	copyFromReq  *Request
	copyStarted  chan struct{}
	batch        plan.Batch // extended: the planner's view of the current batch
	commitReq    *Request   // extended: a gated COMMIT whose restoring query is due (batch.Restoring)
	copyReceipt  *plan.Step // simple protocol: a gated COPY FROM is streaming; its receipt, to send after it
	copyDigested bool       // CopyData goes into the digest
	copiesLeft   int        // COPY FROM statements of the current query not yet done
	copyQuery    *tag       // the current query's, while copyReceipt
	// copyExec is the client's last Execute of a COPY FROM, until the
	// client ends the COPY's data (or it is known not to have started):
	// a Sync that comes meanwhile may be one the server ignores
	// (fence_extended.go, sync).
	copyExec *copyExec
	// txReq is the gate's read of the wrapped batch's transaction id
	// (plan.TxStatement), until the batch's Sync; txID (under mu) its
	// answer: the receipt at the Sync is bound to it (fence_extended.go).
	txReq *Request
	txID  string
	// tail is the client's Execute of a COMMIT with a receipt step
	// before it, while the batch goes on after it (fence_replay.go);
	// replayedSeq (under mu) the seq of the last receipt step answered
	// by a replay.
	tail        *pendingTail
	replayedSeq uint64
	// replaySeq: the seq of the last request answered with FN00R,
	// whatever answered it (server goroutine writes, client side reads).
	replaySeq atomic.Uint64
	// portalsEnded (under mu): the seq of the last request answered with
	// the session idle; portals bound before it are gone (prunePortals).
	portalsEnded uint64
	// replaySettings (under mu): the session settings a replayed transaction
	// was answered as committing, which its rollback took away;
	// replayPending says there are some (restoreReplayed).
	replaySettings []session.Setting
	replayPending  atomic.Bool
	// replayAnswered: the pending replay was answered to the client as
	// its COMMIT committing (the receipt step's FN00R), so a failed
	// transaction it left is the proxy's to end (restoreReplayed).
	replayAnswered atomic.Bool
	// txUnseen (client side): a request of the current transaction may
	// have changed a tracked setting unseen (a DO block, a CALL, a
	// set_config the proxy could not read): what a replay of it took
	// away is not known (restoreReplayed).
	txUnseen bool
	// commitOut: a request that may end a transaction that may have
	// written was sent (a receipt step, a gated COMMIT, any statement that
	// may run code); the client's next request waits for its answer
	// (fence_client.go).
	commitOut   atomic.Bool
	portalsKept atomic.Int64 // len(portals) after the last Bind (tests)
	// sessKnown (under mu): the seq of the last settings read-back sent
	// outside a transaction and answered; sessDiverged: it found the
	// session's state other than a fresh connection's (a setting other
	// than fence.* set in the session, a role set): route.go's
	// sessionKnown.
	sessKnown    uint64
	sessDiverged bool
	// defaults (under mu): the settings the primary session took from the
	// role's and database's defaults (defaultsSQL), once a read-back
	// outside a transaction has read them (defaultsKnown): a replica
	// connection's must be the same (route.go's replicaAgrees).
	defaults      string
	defaultsKnown bool
	stateReq      *Request // the last request sent that changes session or gate state
	// digestReq is the last Execute sent of a statement a receipt's
	// digest may take (plan.Digested): its item joins the transaction's
	// digest when it completes. A COMMIT's receipt, whose digest is the
	// transaction's (FromSession), is planned only once it is answered
	// (round 23, attacker AW's M5: [INSERT, INSERT, COMMIT] in one batch
	// had the second INSERT, still in flight, left out).
	digestReq *Request
	// seq numbers the requests sent (tag.seq); encSeq is the last that
	// may have changed how the server reads the client's text, gucSeq the
	// last that may have changed the tracked settings unseen, resyncInTx
	// that they were read back inside the current transaction
	// (fence_text.go).
	seq, encSeq, gucSeq uint64
	resyncInTx          bool
	// resynced: the message being handled again on the loop has had its
	// resync (fence_text.go); cleared when it is done.
	resynced bool
	// restoreSent (client side): restoreReplayed has set the settings in
	// a transaction before the message being handled (not again for it).
	restoreSent bool

	// Server goroutine only.
	errShown bool // an error went to the client since its last ReadyForQuery

	rt routeState // read routing (route.go)

	idle idleClock // the idle watchdog's view (fence_idle.go)
}

// step says what a segment of a request is.
type step uint8

const (
	stepClient        step = iota // the client's own statement
	stepBegin                     // BEGIN opening a transaction around an implicit one (gated COPY FROM)
	stepGate                      // SELECT fence.gate(...)
	stepReceipt                   // the receipt: fence.commit, or fence.commit_if_written
	stepCommitWrapped             // COMMIT closing the transaction wrapped around a protected COPY FROM
	stepRaise                     // a DO block raising the gate's own error
	stepRollback                  // ROLLBACK after a gated commit (no-op on success)
	stepPrepare                   // Close and Parse of a gate's named statement before its use (execNamed)
	stepSavepoint                 // SAVEPOINT before the receipt step in a client's query
	stepRestore                   // ROLLBACK TO that savepoint after a failed receipt step
	stepSettings                  // the settings read back (fence_text.go)
	stepTxID                      // the wrapped batch's transaction id, read before a CALL or DO (plan.TxStatement)
	stepReplayed                  // the settings a replay took away, set again (restoreReplayed): it succeeds or the session ends

	// Read routing's own requests (route.go).
	stepFenceCheck // SELECT the replica's fence row
	stepLSN        // the WAL insert position after a fence.* call (insertLSNQuery)
	stepStmtCopy   // Parse/Close of a named statement on the other upstream
	stepAlign      // SET of the replica session's lexing settings to the primary's (replstate.go)
)

// routing reports whether the step is one of read routing's own requests,
// whose answers and failures are the router's business (route.go).
func (s step) routing() bool {
	switch s {
	case stepFenceCheck, stepLSN, stepStmtCopy, stepAlign:
		return true
	}
	return false
}

// seg is one statement of a simple Query as sent upstream.
type seg struct {
	step step
	stmt *rewrite.Stmt
	gen  fence.Generation
	// beforeCommit: this receipt step precedes the client's COMMIT, which
	// on a replay must still be answered "COMMIT".
	beforeCommit bool
}

// tag travels with each request upstream.
type tag struct {
	kind byte // the request's message type
	step step
	seq  uint64 // fenceSession.seq when sent

	// Query
	segs      []seg
	cur       int
	inserts   plan.Insertions // where gate text was spliced in (error positions)
	hideReady bool
	// shownAfter: its ReadyForQuery, even hidden, ends the errors hidden
	// since the last the client saw (errShown): what follows is shown.
	shownAfter bool
	// stepFailed: a gate step of this query failed (set by onError).
	stepFailed bool
	// receiptRow: the receipt step returned its row, so an error after it
	// is the end of the transaction's, not the receipt's own answer
	// (onError: round 25, BB-H1).
	receiptRow bool
	// afterReceipt: this query's error came after its receipt step's
	// row (onError).
	afterReceipt bool
	// replayAt: the receipt step of this query answered a replay (FN00R)
	// at segs[replayAt-1]; 0 when none did (set by onError).
	replayAt int
	// copyIn, for a wrapped COPY FROM (plan.AfterCopy), gets a token each
	// time the server starts one of the query's COPYs (CopyInResponse);
	// it has room for all of them. It is set before the tag is sent and
	// never changed: the client side waits on it while the server side
	// sends.
	copyIn chan struct{}
	// idleRead: this settings read-back (stepSettings) runs outside a
	// transaction, so what it reads is the session's (sessKnown).
	idleRead bool
	// started, for the client's Execute of a COPY FROM, is closed when
	// the server starts the COPY (CopyInResponse): see copyExec.
	started chan struct{}

	// Parse / Bind / Execute / Close
	name    string
	portal  string
	res     *rewrite.Result
	oids    []uint32
	cp      *clientPortal
	closeOf byte
	// raw: a named Parse's message, with read routing (session.Prepared.Raw).
	raw []byte
	gen fence.Generation
	// beforeCommit as in seg, for the extended protocol.
	beforeCommit bool
	// about is the client statement a gate step guards (for the log).
	about *rewrite.Stmt
	// sent: when the request (a gate or commit step, or a query holding
	// one) went upstream, for the latency histograms; in a query, moved
	// on at each statement's completion. Zero: not timed.
	sent time.Time
}

// LoopClient: ClientMessage may run on the event loop. Where it must wait
// (then, fence_exec.go) it parks the client side there, with the rest of
// its work as a continuation, or returns ErrWait before it has done
// anything.
func (h *fenceSession) LoopClient() bool { return true }

// Close gives back what the session held: its place in the idle watchdog
// and its reference on the database's watcher (which lives while its
// database has sessions).
func (h *fenceSession) Close(s *Session) {
	h.f.idle.remove(h)
	h.f.cats.release(h.cat)
}
