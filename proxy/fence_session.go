package proxy

import (
	"encoding/binary"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/clientenc"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
)

// fenceSession is the write gate's Handler for one client session.
//
// The client goroutine decides: it classifies each Query and Execute, and
// when a transaction is about to write a protected table it waits until
// every earlier request has been answered (so the session state is
// settled), then splices the fence steps in — into the query text for the
// simple protocol, as named prepared statements for the extended one.
// Everything it sends upstream goes through Session.Inject (visible for the
// client's own requests, hidden for the gate's), tagged, so the server
// goroutine knows what each response belongs to. ("Client goroutine" is
// the client side: on the event loop it runs on the loop's thread, and
// where it would wait it returns ErrWait first; see LoopClient.)
//
// The server goroutine follows: it applies every completed statement to the
// session state (GUCs, transaction, prepared statements, gate, digest) and
// turns the gate's outcomes into what the client sees.
type fenceSession struct {
	f   *Fence
	cat *catalog

	mu       sync.Mutex // guards st, prepared and text
	st       *session.State
	prepared bool      // the gate's named statements exist upstream
	text     textState // how the server reads the client's text (fence_text.go)
	appName  string    // application_name as the server last reported it (for the log)

	// Client goroutine only.
	last      *Request // the last request sent upstream
	inBatch   bool     // extended-protocol messages sent since the last Sync
	stmts     map[string]*cstmt
	portals   map[string]*cportal
	batch     plan.Batch // extended: the planner's view of the current batch
	commitReq *Request   // extended: a gated COMMIT whose restoring query is due (batch.Restoring)
	copyTail  *plan.Step // simple protocol: a gated COPY FROM is streaming; its receipt, to send after it
	copyGated bool       // CopyData goes into the digest
	copyLeft  int        // COPY FROM statements of the current query not yet done
	copyTag   *tag       // the current query's, while copyTail
	stateReq  *Request   // the last request sent that changes session or gate state
	prepReq   *Request   // the last Parse of the gate's statements, until known done
	// tainted: since the gate's statements were last parsed, the client
	// ran something that can execute SQL the proxy cannot see (a DO
	// block, a procedure, a user function: any of them may DEALLOCATE
	// and PREPARE under the gate's names), so they are parsed again
	// before their next use (prepareExt).
	tainted bool
	// seq numbers the requests sent (tag.seq); encSeq is the last that
	// may have changed how the server reads the client's text, gucSeq the
	// last that may have changed the tracked settings unseen, resyncInTx
	// that they were read back inside the current transaction
	// (fence_text.go).
	seq, encSeq, gucSeq uint64
	resyncInTx          bool

	// Server goroutine only.
	errShown bool // an error went to the client since its last ReadyForQuery

	rt routeState // read routing (route.go)

	idle idleClock // the idle watchdog's view (fence_idle.go)
}

// cstmt is a statement the client parsed (speculatively: kept as soon as
// the Parse is sent; a failed Parse makes the server skip to Sync anyway).
type cstmt struct {
	res  *rewrite.Result
	oids []uint32
}

// cportal is a bound portal with its parameters (copied).
type cportal struct {
	stmt    *rewrite.Stmt
	oids    []uint32
	formats []int16
	params  [][]byte
}

// paramFunc gives the session state p's text parameters as the server
// reads them: decoded from the client's encoding with c (the session's
// codec: callers hold h.mu to read it; nil reads them as they are).
func paramFunc(p *cportal, c *clientenc.Codec) session.ParamFunc {
	if p == nil {
		return nil
	}
	return func(n int) (*string, bool) {
		i := n - 1
		if i < 0 || i >= len(p.params) {
			return nil, false
		}
		if formatOf(p.formats, i) != 0 {
			return nil, false
		}
		if p.params[i] == nil {
			return nil, true
		}
		if c == nil || c.IsUTF8() {
			v := string(p.params[i])
			return &v, true
		}
		v, err := c.Decode(p.params[i])
		if err != nil {
			return nil, false
		}
		return &v, true
	}
}

func (p *cportal) DigestParams() []fence.Param {
	out := make([]fence.Param, len(p.params))
	for i, v := range p.params {
		var oid uint32
		if i < len(p.oids) {
			oid = p.oids[i]
		}
		out[i] = fence.Param{Format: formatOf(p.formats, i), TypeOID: oid, Value: v, Null: v == nil}
	}
	return out
}

func formatOf(formats []int16, i int) int16 {
	switch len(formats) {
	case 0:
		return 0
	case 1:
		return formats[0]
	}
	if i < len(formats) {
		return formats[i]
	}
	return 0
}

// step says what a segment of a request is.
type step uint8

const (
	stepClient    step = iota // the client's own statement
	stepBegin                 // BEGIN opening a transaction around an implicit one (gated COPY FROM)
	stepGate                  // SELECT fence.gate(...)
	stepCommit                // SELECT fence.commit(...)
	stepCommitTx              // COMMIT closing the wrapped transaction
	stepRaise                 // a DO block raising the gate's own error
	stepRollback              // ROLLBACK after a gated commit (no-op on success)
	stepPrepare               // Parse of the gate's named statements
	stepSavepoint             // SAVEPOINT before the receipt step in a client's query
	stepRestore               // ROLLBACK TO that savepoint after a failed receipt step
	stepSettings              // the settings read back (fence_text.go)

	// Read routing's own requests (route.go).
	stepFenceCheck // SELECT the replica's fence row
	stepLSN        // the WAL insert position after a fence.* call (insertLSNQuery)
	stepStmtCopy   // Parse/Close of a named statement on the other upstream
)

// routing reports whether the step is one of read routing's own requests,
// whose answers and failures are the router's business (route.go).
func (s step) routing() bool {
	switch s {
	case stepFenceCheck, stepLSN, stepStmtCopy:
		return true
	}
	return false
}

// seg is one statement of a simple Query as sent upstream.
type seg struct {
	step step
	stmt *rewrite.Stmt
	gen  session.Generation
	// explicitCommit: this commit step precedes the client's COMMIT, which
	// on a replay must still be answered "COMMIT".
	explicitCommit bool
}

// tag travels with each request upstream.
type tag struct {
	kind byte // the request's message type
	step step
	seq  uint64 // fenceSession.seq when sent

	// Query
	segs    []seg
	cur     int
	inserts plan.Insertions // where gate text was spliced in (error positions)
	hideRFQ bool
	// stepFailed: a gate step of this query failed (set by onError).
	stepFailed bool
	// copyIn, for a wrapped COPY FROM (qplan.tail), gets a token each
	// time the server starts one of the query's COPYs (CopyInResponse);
	// it has room for all of them. It is set before the tag is sent and
	// never changed: the client side waits on it while the server side
	// sends.
	copyIn chan struct{}

	// Parse / Bind / Execute / Close
	name    string
	portal  string
	res     *rewrite.Result
	oids    []uint32
	cp      *cportal
	closeOf byte
	gen     session.Generation
	// explicitCommit as in seg, for the extended protocol.
	explicitCommit bool
	// about is the client statement a gate step guards (for the log).
	about *rewrite.Stmt
	// sent: when the request (a gate or commit step, or a query holding
	// one) went upstream, for the latency histograms; in a query, moved
	// on at each statement's completion. Zero: not timed.
	sent time.Time
}

// ---------------------------------------------------------------------------
// Client goroutine

func (h *fenceSession) ClientMessage(s *Session, msg []byte) (Verdict, error) {
	h.idle.clientMsgs.Add(1)
	body := msg[headerLen:]
	if msg[0] != 'Q' && s.srv.rs != nil { // read routing: upstream and named statements (route.go)
		if err := h.routeMsg(s, msg); err != nil {
			return Drop, err
		}
	}
	switch msg[0] {
	case 'Q':
		return Drop, h.query(s, msg)
	case 'P':
		var m pgproto3.Parse
		if err := m.Decode(body); err != nil {
			return Forward, nil // the server will refuse it
		}
		if e := plan.CheckName("prepared statement", m.Name); e != nil {
			return Drop, h.raiseExt(s, e)
		}
		sql, opts, err := h.decodeText(s, []byte(m.Query))
		if err != nil && !isTextError(err) {
			return Drop, err
		}
		var res *rewrite.Result
		if err == nil {
			res, err = h.f.classifier.ClassifyWith(sql, opts)
		}
		if err != nil {
			if h.strict(true) {
				return Drop, h.raiseExt(s, textError(err))
			}
			res = nil // the server refuses it
		}
		h.stmts[m.Name] = &cstmt{res: res, oids: m.ParameterOIDs}
		return Drop, h.send(s, msg, &tag{kind: 'P', name: m.Name, res: res, oids: m.ParameterOIDs}, true)
	case 'B':
		var m pgproto3.Bind
		if err := m.Decode(body); err != nil {
			return Forward, nil
		}
		if e := plan.CheckName("prepared statement", m.PreparedStatement); e != nil {
			return Drop, h.raiseExt(s, e)
		}
		if e := plan.CheckName("portal", m.DestinationPortal); e != nil {
			return Drop, h.raiseExt(s, e)
		}
		cp := &cportal{formats: append([]int16(nil), m.ParameterFormatCodes...)}
		cp.params = make([][]byte, len(m.Parameters))
		for i, p := range m.Parameters {
			if p != nil {
				cp.params[i] = append(make([]byte, 0, len(p)), p...)
			}
		}
		if cs := h.stmts[m.PreparedStatement]; cs != nil {
			cp.oids = cs.oids
			if cs.res != nil && len(cs.res.Stmts) == 1 {
				cp.stmt = cs.res.Stmts[0]
			}
		}
		h.portals[m.DestinationPortal] = cp
		return Drop, h.send(s, msg, &tag{kind: 'B', name: m.PreparedStatement, portal: m.DestinationPortal}, true)
	case 'E':
		return Drop, h.execute(s, msg)
	case 'S':
		return Drop, h.sync(s, msg)
	case 'C':
		if len(body) >= 2 {
			name := string(body[1 : len(body)-1])
			if e := plan.CheckName(closeWhat(body[0]), name); e != nil {
				return Drop, h.raiseExt(s, e)
			}
			if body[0] == 'S' {
				delete(h.stmts, name)
			} else {
				delete(h.portals, name)
			}
			return Drop, h.send(s, msg, &tag{kind: 'C', closeOf: body[0], name: name}, true)
		}
		return Forward, nil
	case 'D', 'F':
		if msg[0] == 'D' && len(body) >= 2 {
			if e := plan.CheckName(closeWhat(body[0]), string(body[1:len(body)-1])); e != nil {
				return Drop, h.raiseExt(s, e)
			}
		}
		return Drop, h.send(s, msg, &tag{kind: msg[0]}, true)
	case 'H':
		return Forward, nil
	case 'd':
		if h.copyGated {
			h.copyDigest(func(d *fence.Digest) { d.CopyData(body) })
		}
		return Forward, nil
	case 'c', 'f':
		if h.copyTail != nil && s.OnLoop() {
			return Drop, ErrWait // finishWrapped waits for the COPY's end
		}
		if h.copyLeft > 0 {
			h.copyLeft--
		}
		if h.copyGated {
			h.copyGated = h.copyLeft > 0 // the query's next COPY too
			h.copyDigest((*fence.Digest).EndCopy)
		}
		if err := s.ForwardMessage(msg); err != nil {
			return Drop, err
		}
		if t := h.copyTail; t != nil {
			if h.copyLeft > 0 {
				// The query has another COPY FROM: the receipt waits
				// for it, unless the query ends first (an error).
				started, err := h.nextCopy(s)
				if err != nil || started {
					return Drop, err
				}
			}
			h.copyTail, h.copyGated = nil, false
			return Drop, h.finishWrapped(s, t)
		}
		return Drop, nil
	}
	return Forward, nil
}

// closeWhat names the object a Close or Describe of type typ refers to.
func closeWhat(typ byte) string {
	if typ == 'S' {
		return "prepared statement"
	}
	return "portal"
}

// LoopClient: ClientMessage may run on the event loop. Where it would
// wait (wait, awaitCopy, finishWrapped), it returns ErrWait on the loop
// before it has sent anything.
func (h *fenceSession) LoopClient() bool { return true }

// send passes a message upstream through the queue with its tag; visible
// requests' responses reach the client.
func (h *fenceSession) send(s *Session, msg []byte, t *tag, visible bool) error {
	switch msg[0] {
	case 'P', 'B', 'E', 'D', 'C', 'H':
		h.inBatch = true
	case 'S':
		h.inBatch = false
	}
	h.seq++
	if t != nil {
		t.seq = h.seq
	}
	r, err := s.inject(msg, t, visible)
	if err != nil {
		return err
	}
	if r != nil {
		h.last = r
	}
	if visible && t != nil {
		h.noteSent(t)
	}
	return nil
}

// settle waits until every request sent so far that changes the session
// state (tracked parameters, the transaction, prepared statements, the
// gate) has been answered, so the state the server goroutine keeps is what
// the next statement will run with. A client's plain reads and writes in
// flight are not waited for: the common path costs no round trip.
func (h *fenceSession) settle(s *Session) error {
	if err := h.wait(s, h.stateReq); err != nil {
		return err
	}
	h.stateReq = nil
	return nil
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

// barrier waits until every request sent so far has been answered.
func (h *fenceSession) barrier(s *Session) error {
	if err := h.wait(s, h.last); err != nil {
		return err
	}
	h.stateReq = nil
	return nil
}

// wait waits until r has been answered.
func (h *fenceSession) wait(s *Session, r *Request) error {
	if r == nil {
		return nil
	}
	select {
	case <-r.Done():
		return nil
	default:
	}
	if s.OnLoop() {
		return ErrWait // nothing sent yet: again on the client goroutine
	}
	if h.inBatch {
		// Make the server flush what it has for the batch so far.
		if _, err := s.Inject([]byte{'H', 0, 0, 0, 4}, nil); err != nil {
			return err
		}
	}
	if err := s.FlushServer(); err != nil {
		return err
	}
	select {
	case <-r.Done():
		return nil
	case <-s.closing:
		return errSessionClosing
	}
}

// protectedWrite reports whether st may write a protected table. Callers
// hold h.mu.
func (h *fenceSession) protectedWrite(st *rewrite.Stmt) bool {
	if st == nil {
		return false
	}
	p := h.cat.prot.Load()
	if p.Len() == 0 {
		return false
	}
	sp := h.st.SearchPath()
	if len(p.ProtectedWrites(st, sp)) > 0 {
		return true
	}
	if st.Executes != "" {
		if ps, ok := h.st.Statement(st.Executes); ok && ps.Stmt != nil {
			return len(p.ProtectedWrites(ps.Stmt, sp)) > 0
		}
	}
	return false
}

// maybeWrite reports whether st may write a protected table where the
// gate cannot see (it is not one of protectedWrite's): a DO block, a
// procedure, a function call, a write to a table whose triggers or rules
// may write one. In a fenced session such a statement makes
// the transaction tentative (session.Gate.Tentative). Callers hold h.mu.
func (h *fenceSession) maybeWrite(st *rewrite.Stmt) bool {
	if st == nil || h.cat.prot.Load().Len() == 0 {
		return false
	}
	// A COPY FROM into another table is left out: a trigger of that table
	// writing a protected one is fenced and receipted by the backstop
	// itself (backstop-v1), and wrapping every COPY of a fenced session
	// would move its data off the event loop.
	return st.Kind != rewrite.CopyFrom && (st.Writes() || plan.Opaque(st))
}

// needsOwnText reports whether a write classified from another text of
// its shape (rewrite.Classifier.ClassifyShared) must be classified from
// its own: when it is digested — it writes a protected table, or runs in a
// gated transaction — the digest needs its own canonical text. Other
// writes need only the structure, which the shape shares.
func (h *fenceSession) needsOwnText(res *rewrite.Result) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.st.Gate().Gated {
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
	if _, _, _, _, ok := h.st.Generation(); ok || h.st.Gate().Gated {
		return true
	}
	return decoding && h.cat.prot.Load().Len() > 0
}

// query handles a simple Query: it classifies it, plans it (rewrite/plan)
// and executes the plan.
func (h *fenceSession) query(s *Session, msg []byte) error {
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
		// The server reports the syntax error (or the empty query).
		return h.routeQuery(s, msg, nil) // route.go
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
	}
	h.mu.Lock()
	q := plan.PlanQuery(h.planSession(), res.Stmts)
	h.mu.Unlock()
	if q.Waits && s.OnLoop() {
		// The client goroutine sends it. Nothing is done yet.
		return ErrWait
	}
	h.f.Stats.Classified.Add(int64(len(res.Stmts)))
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
	if err := h.settle(s); err != nil {
		return err
	}
	if err := h.routeGated(s); err != nil { // route.go
		return err
	}
	return h.runQuery(s, sql, res, &q)
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

// runQuery executes the plan of a simple query the gate rewrites (or, in
// a failed transaction, sends as it is). It runs with the session state
// settled.
func (h *fenceSession) runQuery(s *Session, sql string, res *rewrite.Result, q *plan.Query) error {
	if q.Action == plan.AsIs {
		// The server refuses everything but ROLLBACK; nothing to gate.
		return h.send(s, h.qmsg(sql), &tag{kind: 'Q', segs: clientSegs(res)}, true)
	}
	if q.Unfenced {
		h.f.Stats.Unfenced.Add(1)
	}
	h.mu.Lock()
	text, inserts := q.Text(sql, h.st, res.Stmts)
	var sum []byte
	var version string
	if q.Ending == plan.LoneCommit {
		sum, version = plan.Resolve(q.Steps[0].Digest, h.st, res.Stmts)
	}
	h.mu.Unlock()
	defer h.markState()
	t := &tag{kind: 'Q', segs: querySegs(q.Steps, res.Stmts), inserts: inserts}
	h.copyGated = q.CopyDigested
	h.copyTail = q.CopyReceipt
	h.copyLeft = countKind(res, rewrite.CopyFrom)
	h.copyTag = t
	if q.CopyReceipt != nil {
		t.copyIn = make(chan struct{}, h.copyLeft)
	}
	t.sent = time.Now() // metrics: step latency
	switch q.Ending {
	case plan.LoneCommit:
		// The receipt as the gate's prepared statement (parsed once per
		// connection, not per commit), a Sync whose ReadyForQuery is
		// hidden, then the client's COMMIT.
		r := &q.Steps[0]
		if err := h.prepareExt(s); err != nil {
			return err
		}
		if err := h.execNamed(s, plan.ReceiptStatement(r.Gated), plan.CommitArgs(r.Gen, sum, version),
			&tag{kind: 'E', step: stepCommit, gen: r.Gen, explicitCommit: true, sent: time.Now()}); err != nil {
			return err
		}
		if err := h.send(s, []byte{'S', 0, 0, 0, 4}, &tag{kind: 'S', step: stepCommit, hideRFQ: true}, false); err != nil {
			return err
		}
		return h.send(s, h.qmsg(sql), &tag{kind: 'Q', segs: []seg{{step: stepClient, stmt: res.Stmts[0]}}}, true)
	case plan.Restore, plan.AwaitCommit, plan.AfterCopy:
		t.hideRFQ = true
	}
	if err := h.send(s, h.qmsg(text), t, true); err != nil {
		return err
	}
	switch q.Ending {
	case plan.Restore:
		return h.sendRestore(s)
	case plan.AwaitCommit:
		return h.settleCommit(s, t)
	case plan.AfterCopy:
		return h.awaitCopy(s, t)
	}
	return nil
}

// querySegs are the segments of a rewritten query's tag: one per step.
func querySegs(steps []plan.Step, stmts []*rewrite.Stmt) []seg {
	segs := make([]seg, len(steps))
	for i, ps := range steps {
		sg := seg{step: stepOf(ps.Kind), gen: ps.Gen, explicitCommit: ps.BeforeCommit}
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
		return stepCommit
	case plan.Raise:
		return stepRaise
	}
	return stepClient
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
func (h *fenceSession) awaitCopy(s *Session, t *tag) error {
	if err := s.FlushServer(); err != nil {
		return err
	}
	select {
	case <-t.copyIn:
		return nil
	case <-h.last.Done():
	case <-s.closing:
		return errSessionClosing
	}
	select {
	case <-t.copyIn:
		// Started and already finished: the client still sends CopyDone.
		return nil
	default:
	}
	h.copyTail, h.copyGated = nil, false
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
func (h *fenceSession) nextCopy(s *Session) (bool, error) {
	if err := s.FlushServer(); err != nil {
		return false, err
	}
	t := h.copyTag
	select {
	case <-t.copyIn:
		return true, nil
	case <-h.last.Done():
	case <-s.closing:
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

// finishWrapped ends a wrapped transaction whose receipt step could not be
// spliced into the query text (COPY FROM: the digest covers its data). It
// waits for the COPY to complete so the digest is whole.
func (h *fenceSession) finishWrapped(s *Session, receipt *plan.Step) error {
	if err := h.barrier(s); err != nil {
		return err
	}
	h.mu.Lock()
	sum, version := plan.Resolve(receipt.Digest, h.st, nil)
	h.mu.Unlock()
	t := &tag{kind: 'Q', segs: []seg{{step: stepCommit, gen: receipt.Gen}}, hideRFQ: true, sent: time.Now()}
	if err := h.send(s, h.qmsg(plan.StepSQL(receipt, sum, version)), t, false); err != nil {
		return err
	}
	defer h.markState()
	return h.sendCommit(s)
}

// sendCommit sends COMMIT as a query of its own, whose ReadyForQuery is
// the one the client sees: it commits the wrapped transaction, or ends it
// when a gate step failed.
func (h *fenceSession) sendCommit(s *Session) error {
	return h.send(s, h.qmsg("COMMIT"), &tag{kind: 'Q', segs: []seg{{step: stepCommitTx}}}, true)
}

// sendRollback sends a ROLLBACK whose ReadyForQuery is the one the client
// sees: after a successful commit it is a no-op (its warning is hidden);
// after a failed gate step it ends the failed transaction, so the client
// is idle and usable as the protocol promised.
func (h *fenceSession) sendRollback(s *Session) error {
	return h.send(s, h.qmsg("ROLLBACK"), &tag{kind: 'Q', step: stepRollback, segs: []seg{{step: stepRollback}}}, true)
}

// settleCommit ends a client's query whose gated COMMIT had statements
// after it, once the query is answered. If the receipt step failed, the
// COMMIT and everything after it was skipped and the transaction is
// aborted: ROLLBACK ends it (the client has the step's error, or COMMIT
// and the replay NOTICE). Otherwise the transaction is as the client's
// statements left it (committed and maybe a new one begun, or failed by a
// statement of the client's before the COMMIT), and an empty query gives
// the client the ReadyForQuery that says so. It runs on the client
// goroutine (query hands such a query off).
func (h *fenceSession) settleCommit(s *Session, t *tag) error {
	if err := h.barrier(s); err != nil {
		return err
	}
	h.mu.Lock()
	failed := t.stepFailed
	h.mu.Unlock()
	if failed {
		return h.sendRollback(s)
	}
	return h.send(s, h.qmsg(""), &tag{kind: 'Q', segs: []seg{{step: stepRestore}}}, true)
}

// sendRestore sends, after a client's query or batch whose COMMIT had the
// receipt step in a savepoint before it, the query that ends the
// transaction only if that step failed (plan.RestoreSQL). Its
// ReadyForQuery is the one the client sees.
func (h *fenceSession) sendRestore(s *Session) error {
	return h.send(s, h.qmsg(plan.RestoreSQL), &tag{kind: 'Q', step: stepRollback, segs: []seg{{step: stepRestore}, {step: stepRollback}}}, true)
}

// refuseQuery answers a query with err without running any of it.
func (h *fenceSession) refuseQuery(s *Session, err error) error {
	return h.send(s, h.qmsg(plan.RaiseSQL(plan.AsSessionError(err))), &tag{kind: 'Q', segs: []seg{{step: stepRaise}}}, true)
}

// execute handles an extended-protocol Execute: it plans it (plan.Batch)
// and executes the plan.
func (h *fenceSession) execute(s *Session, msg []byte) error {
	var m pgproto3.Execute
	if err := m.Decode(msg[headerLen:]); err != nil {
		return h.send(s, msg, &tag{kind: 'E'}, true)
	}
	if e := plan.CheckName("portal", m.Portal); e != nil {
		return h.raiseExt(s, e)
	}
	cp := h.portals[m.Portal]
	var st *rewrite.Stmt
	if cp != nil {
		st = cp.stmt
	}
	if r := h.commitReq; r != nil && h.batch.Restoring() {
		// The client goes on after a gated COMMIT, before its Sync. Once
		// the COMMIT is known to have committed, nothing is left to end
		// after the Sync (and a transaction the client opens meanwhile
		// must not be touched). If it failed, the server skips to the
		// Sync anyway.
		if err := h.wait(s, r); err != nil {
			return err // ErrWait on the loop: nothing done yet
		}
		h.commitReq = nil
		if !r.Skipped && r.Error == nil {
			h.batch.Committed()
		}
	}
	t := &tag{kind: 'E', portal: m.Portal, cp: cp}
	if st == nil {
		return h.send(s, msg, t, true)
	}
	if plan.MayNeedGate(st) {
		if h.unsettled() {
			if err := h.settle(s); err != nil {
				return err
			}
		}
		if err := h.settleSettings(s); err != nil {
			return err
		}
	}
	h.mu.Lock()
	var params session.ParamFunc
	if len(st.GUCs) > 0 {
		params = paramFunc(cp, h.text.codec)
	}
	ep := h.batch.Execute(h.planSession(), plan.Exec{Stmt: st, Portal: m.Portal, Params: params, Bound: cp})
	h.mu.Unlock()
	if ep.Refusal != nil {
		if err := h.raiseExt(s, ep.Refusal); err != nil {
			return err
		}
		return h.send(s, msg, t, true)
	}
	if !ep.Decides {
		if err := h.send(s, msg, t, true); err != nil {
			return err
		}
		if plan.ChangesState(st) {
			h.markState()
		}
		return nil
	}
	if err := h.settle(s); err != nil {
		return err
	}
	defer h.markState()
	if ep.Unfenced {
		h.f.Stats.Unfenced.Add(1)
	}
	if ep.Prepare {
		if err := h.prepareExt(s); err != nil {
			return err
		}
	}
	for i := range ep.Before {
		if err := h.execStep(s, &ep.Before[i], st); err != nil {
			return err
		}
	}
	if ep.CopyDigested {
		// Its data goes into the digest (copyDigest), up to CopyDone.
		h.copyGated, h.copyLeft = true, 1
	}
	if err := h.send(s, msg, t, true); err != nil {
		return err
	}
	if ep.AwaitCommit {
		h.commitReq = h.last
	}
	return nil
}

// execStep runs a planned step of the extended protocol in the current
// batch, as the gate's named statements; about is the client's statement
// it stands before.
func (h *fenceSession) execStep(s *Session, ps *plan.Step, about *rewrite.Stmt) error {
	switch ps.Kind {
	case plan.Raise:
		return h.raiseExt(s, ps.Err)
	case plan.Gate:
		return h.execNamed(s, plan.GateStatement, plan.GateArgs(ps.Gen), &tag{kind: 'E', step: stepGate, gen: ps.Gen, about: about})
	case plan.Savepoint:
		return h.execNamed(s, plan.SavepointStatement, nil, &tag{kind: 'E', step: stepSavepoint})
	case plan.Receipt:
		h.mu.Lock()
		sum, version := plan.Resolve(ps.Digest, h.st, nil)
		h.mu.Unlock()
		return h.execNamed(s, plan.ReceiptStatement(ps.Gated), plan.CommitArgs(ps.Gen, sum, version),
			&tag{kind: 'E', step: stepCommit, gen: ps.Gen, explicitCommit: ps.BeforeCommit})
	}
	return nil
}

// sync handles an extended-protocol Sync: a wrapped implicit transaction
// ends here with the receipt step, which PostgreSQL skips when anything
// before it in the batch failed (the transaction then rolls back).
func (h *fenceSession) sync(s *Session, msg []byte) error {
	sp := h.batch.Sync()
	if sp.Receipt != nil {
		if err := h.execStep(s, sp.Receipt, nil); err != nil {
			return err
		}
		defer h.markState()
	}
	if sp.Restore {
		h.commitReq = nil
		if err := h.send(s, msg, &tag{kind: 'S', hideRFQ: true}, true); err != nil {
			return err
		}
		return h.sendRestore(s)
	}
	return h.send(s, msg, &tag{kind: 'S'}, true)
}

// prepareExt parses the gate's named statements once per upstream
// connection (again after DISCARD ALL / DEALLOCATE ALL).
func (h *fenceSession) prepareExt(s *Session) error {
	if r := h.prepReq; r != nil {
		// The last Parse of them: PostgreSQL skips it, without a word,
		// when an earlier message of its batch failed. (Settled by now:
		// the gate step that followed it changed the state.)
		if err := h.wait(s, r); err != nil {
			return err
		}
		h.prepReq = nil
		if r.Skipped || r.Error != nil {
			h.mu.Lock()
			h.prepared = false
			h.mu.Unlock()
		}
	}
	h.mu.Lock()
	done := h.prepared
	h.prepared = true
	h.mu.Unlock()
	if done && !h.tainted {
		return nil
	}
	h.tainted = false
	// Close first (closing a statement that does not exist is not an
	// error): after a DO block, say, a statement of that name may be a
	// client's stand-in.
	var buf []byte
	for _, gs := range plan.Statements {
		buf, _ = (&pgproto3.Close{ObjectType: 'S', Name: gs.Name}).Encode(buf[:0])
		if err := h.send(s, buf, &tag{kind: 'C', step: stepPrepare}, false); err != nil {
			return err
		}
		buf, _ = (&pgproto3.Parse{Name: gs.Name, Query: gs.SQL}).Encode(buf[:0])
		if err := h.send(s, buf, &tag{kind: 'P', step: stepPrepare}, false); err != nil {
			return err
		}
	}
	h.prepReq = h.last
	return nil
}

// execNamed runs one of the gate's named statements in the current batch:
// Bind to the gate's portal, Execute, Close the portal.
func (h *fenceSession) execNamed(s *Session, stmt string, args [][]byte, t *tag) error {
	for i, a := range args {
		args[i] = h.encode(string(a)) // text parameters are in the client's encoding
	}
	buf, _ := (&pgproto3.Bind{DestinationPortal: plan.Portal, PreparedStatement: stmt, Parameters: args}).Encode(nil)
	if err := h.send(s, buf, &tag{kind: 'B', step: t.step}, false); err != nil {
		return err
	}
	buf, _ = (&pgproto3.Execute{Portal: plan.Portal}).Encode(buf[:0])
	if t.step == stepGate || t.step == stepCommit {
		t.sent = time.Now() // metrics: step latency
	}
	if err := h.send(s, buf, t, false); err != nil {
		return err
	}
	buf, _ = (&pgproto3.Close{ObjectType: 'P', Name: plan.Portal}).Encode(buf[:0])
	return h.send(s, buf, &tag{kind: 'C', step: t.step}, false)
}

// raiseExt fails the current extended batch with e: a DO block raising
// it, parsed and executed through the gate's portal (the client's unnamed
// statement is left alone). The server then skips to Sync.
func (h *fenceSession) raiseExt(s *Session, e *session.Error) error {
	const name = plan.RaiseStatement
	buf, _ := (&pgproto3.Close{ObjectType: 'S', Name: name}).Encode(nil)
	if err := h.send(s, buf, &tag{kind: 'C', step: stepRaise}, false); err != nil {
		return err
	}
	buf, _ = (&pgproto3.Parse{Name: name, Query: string(h.encode(plan.RaiseSQL(e)))}).Encode(buf[:0])
	if err := h.send(s, buf, &tag{kind: 'P', step: stepRaise}, false); err != nil {
		return err
	}
	buf, _ = (&pgproto3.Bind{DestinationPortal: plan.Portal, PreparedStatement: name}).Encode(buf[:0])
	if err := h.send(s, buf, &tag{kind: 'B', step: stepRaise}, false); err != nil {
		return err
	}
	// Close the statement before executing: after the error the server
	// skips everything up to Sync, and the portal dies with the
	// transaction.
	buf, _ = (&pgproto3.Close{ObjectType: 'S', Name: name}).Encode(buf[:0])
	if err := h.send(s, buf, &tag{kind: 'C', step: stepRaise}, false); err != nil {
		return err
	}
	buf, _ = (&pgproto3.Execute{Portal: plan.Portal}).Encode(buf[:0])
	return h.send(s, buf, &tag{kind: 'E', step: stepRaise}, false)
}

func queryMsg(dst []byte, sql string) []byte {
	dst = append(dst, 'Q', 0, 0, 0, 0)
	dst = append(dst, sql...)
	dst = append(dst, 0)
	binary.BigEndian.PutUint32(dst[1:5], uint32(len(dst)-1))
	return dst
}

// ---------------------------------------------------------------------------
// Server goroutine

func (h *fenceSession) ServerMessage(s *Session, msg []byte, req *Request) (Verdict, error) {
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
	case 'C', 'E', 'Z':
		h.idle.copyWait.Store(false)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if msg[0] == 'Z' {
		if v := h.idle.fenceCall.Load(); v != 0 && t.seq >= v && msg[headerLen] == 'I' {
			h.idle.fenceCall.CompareAndSwap(v, 0)
		}
		if err := h.st.TxStatus(msg[headerLen]); err != nil && t.step != stepRollback {
			s.Logger().Debug("session state resynchronised", zap.Error(err))
		}
		if t.seq > h.text.knownSeq {
			h.text.knownSeq = t.seq // every ParameterStatus before it is in
		}
		if t.hideRFQ || !req.Visible {
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
			h.st.Parse(t.name, t.res, t.oids)
		}
	case 'B':
		if msg[0] == '2' && t.step == stepClient {
			h.st.Bind(t.portal, t.name)
		}
	case 'C':
		if msg[0] == '3' && t.step == stepClient {
			if t.closeOf == 'S' {
				h.st.CloseStatement(t.name)
			} else {
				h.st.ClosePortal(t.name)
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

func (h *fenceSession) queryResponse(s *Session, msg []byte, t *tag) (Verdict, error) {
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
			return Drop, nil // settleCommit's empty query
		}
		return Forward, nil
	case 'D':
		if sg.step == stepGate {
			h.gateResult(sg.gen, msg)
		} else if sg.step == stepCommit {
			h.commitResult(msg)
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

func (h *fenceSession) executeResponse(s *Session, msg []byte, t *tag) (Verdict, error) {
	switch msg[0] {
	case 'C':
		h.timeStep(t, t.step)
		sg := seg{step: t.step, gen: t.gen, explicitCommit: t.explicitCommit}
		if t.step == stepClient && t.cp != nil {
			sg.stmt = t.cp.stmt
		}
		return h.complete(s, sg, msg, t.cp)
	case 'D':
		switch t.step {
		case stepGate:
			h.gateResult(t.gen, msg)
		case stepCommit:
			h.commitResult(msg)
		case stepSettings:
			h.applySettings(s, msg, t)
		}
	}
	if t.step != stepClient {
		return Drop, nil
	}
	return Forward, nil
}

// complete handles the CommandComplete of a segment.
func (h *fenceSession) complete(s *Session, sg seg, msg []byte, cp *cportal) (Verdict, error) {
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
	case stepCommit:
		// Counted by its row ('committed'; commit_if_written says 'none'
		// when nothing was written).
	case stepCommitTx:
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
func (h *fenceSession) onError(s *Session, msg []byte, t *tag) (Verdict, error) {
	st := t.step
	var sg seg
	if t.kind == 'Q' {
		sg = seg{step: stepClient}
		if t.cur < len(t.segs) {
			sg = t.segs[t.cur]
		}
		t.cur = len(t.segs) // the server skips the rest of the query
		st = sg.step
		t.stepFailed = st == stepGate || st == stepCommit || st == stepSavepoint
	} else {
		sg = seg{step: st, gen: t.gen, explicitCommit: t.explicitCommit, stmt: t.about}
		if st == stepClient && t.cp != nil {
			sg.stmt = t.cp.stmt
		}
	}
	if st.routing() {
		return Drop, nil // a routing query's failure is the router's business (route.go)
	}
	h.timeStep(t, st)
	h.st.Fail()
	if st == stepPrepare {
		h.prepared = false
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
	if st == stepCommit && e.Code == fence.CodeReplay {
		h.f.Stats.Replayed.Add(1)
		gen := sg.gen // the generation the receipt step ran with
		if gen.JobKey == "" {
			gen = h.st.Gate().Gen
		}
		if sg.explicitCommit {
			s.WriteClient(encode(nil, &pgproto3.CommandComplete{CommandTag: []byte("COMMIT")}))
		}
		s.WriteClient(encode(nil, &pgproto3.NoticeResponse{Severity: "NOTICE", SeverityUnlocalized: "NOTICE", Code: fence.CodeReplay,
			Message: fmt.Sprintf("pgfence: idempotent replay: job %q epoch %d token %d step %q was already committed with the same payload; nothing was applied twice",
				gen.JobKey, gen.Epoch, gen.Token, gen.Step),
			Detail: e.Detail}))
		h.logRefusal(s, &e, nil, "replayed") // fence_log.go
		// The rest of the batch is skipped; its errors stay hidden.
		h.errShown = true
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
		if !setup && (len(t.inserts) == 0 || e.Position == 0) {
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
func (h *fenceSession) applyClient(st *rewrite.Stmt, msg []byte, cp *cportal) {
	ctag := commandTag(msg)
	g := h.st.Gate()
	if !g.Due() && h.maybeWrite(st) {
		if k, e, t, step, ok := h.st.Generation(); ok {
			g.Tentative = true
			g.Gen = session.Generation{JobKey: k, Epoch: e, Token: t, Step: step}
			if g.Digest == nil {
				g.Digest = &fence.Digest{}
			}
		}
	}
	if g.Due() && plan.Digested(st) {
		if d, ok := g.Digest.(*fence.Digest); ok {
			var params []fence.Param
			if cp != nil {
				params = cp.DigestParams()
			}
			d.Statement(st.Canonical(), params)
		}
	}
	if st.Kind == rewrite.Discard && st.Name == "ALL" || st.Kind == rewrite.Deallocate && st.All {
		h.prepared = false
	}
	var pf session.ParamFunc
	if cp != nil {
		pf = paramFunc(cp, h.text.codec)
	}
	if err := h.st.Apply(st, ctag, pf); err != nil {
		h.f.log.Debug("session state could not follow a statement", zap.Error(err))
	}
}

// commitResult counts a receipt step's answer.
func (h *fenceSession) commitResult(msg []byte) {
	if rowValue(msg) == "committed" {
		h.f.Stats.Committed.Add(1)
	}
}

// gateResult records the gate's answer ('ok' or 'replay').
func (h *fenceSession) gateResult(gen session.Generation, msg []byte) {
	g := h.st.Gate()
	g.Gated = true
	g.Gen = gen
	g.Replay = rowValue(msg) == "replay"
	if g.Digest == nil {
		g.Digest = &fence.Digest{}
	}
	h.f.Stats.Gated.Add(1)
}

// Close gives back what the session held: its place in the idle watchdog
// and its reference on the database's watcher (which lives while its
// database has sessions).
func (h *fenceSession) Close(s *Session) {
	h.f.idle.remove(h)
	h.f.cats.release(h.cat)
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
