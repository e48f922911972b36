package proxy

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/clientenc"
	"github.com/pgfence/pgfence/rewrite"
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
	wrapped   bool       // extended: a gated write in an implicit transaction; the receipt goes before its Sync
	wrap      extWrap    // extended: what the wrapped batch's receipt needs
	commitRB  bool       // extended: a gated COMMIT was sent; restore after the Sync
	commitReq *Request   // extended: that COMMIT, while commitRB
	copyTail  *copyState // simple protocol: a gated COPY FROM is streaming
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

// extWrap follows a wrapped extended-protocol batch on the client side, so
// its receipt step can be pipelined before the Sync without waiting: the
// generation gated and the digest of the statements executed since.
type extWrap struct {
	gen     fence.Generation
	gated   bool // the gate step ran in the batch; else it is tentative (commit_if_written)
	digest  fence.Digest
	client  []byte // fence.payload_digest, when the client gives its own
	marks   map[string][]int
	written map[string]bool // portals already digested (suspended portals run again)
}

func (w *extWrap) add(st *rewrite.Stmt, portal string, cp *cportal) {
	switch st.Kind {
	case rewrite.Savepoint:
		w.marks[st.Name] = append(w.marks[st.Name], w.digest.Mark())
		return
	case rewrite.RollbackTo:
		if m := w.marks[st.Name]; len(m) > 0 {
			w.digest.Rollback(m[len(m)-1])
		}
		return
	}
	if !isDigested(st) || w.written[portal] {
		return
	}
	w.written[portal] = true
	w.digest.Statement(st.Canonical(), cp.digestParams())
}

func (w *extWrap) sum() ([]byte, string) {
	if w.client != nil {
		return w.client, digestClient
	}
	return w.digest.Sum(), fence.DigestVersion
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

func (p *cportal) digestParams() []fence.Param {
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

// copyState is what remains to send after a gated COPY FROM in a wrapped
// simple query: the receipt step, COMMIT and the final ROLLBACK.
type copyState struct {
	gen   fence.Generation
	gated bool // else tentative: the receipt step is commit_if_written
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
)

// receiptSavepoint is the savepoint stepSavepoint makes.
const receiptSavepoint = "pgfence_receipt"

// seg is one statement of a simple Query as sent upstream.
type seg struct {
	step step
	stmt *rewrite.Stmt
	gen  fence.Generation
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
	inserts []insertion // where gate text was spliced in (error positions)
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
	gen     fence.Generation
	// explicitCommit as in seg, for the extended protocol.
	explicitCommit bool
	// about is the client statement a gate step guards (for the log).
	about *rewrite.Stmt
	// sent: when the request (a gate or commit step, or a query holding
	// one) went upstream, for the latency histograms; in a query, moved
	// on at each statement's completion. Zero: not timed.
	sent time.Time
}

type insertion struct{ at, n int }

// The gate's named statements, prepared once per upstream connection.
const (
	gateStmt      = "pgfence_gate"
	commitStmt    = "pgfence_commit"
	commitIfStmt  = "pgfence_commit_if"
	savepointStmt = "pgfence_savepoint"
	gatePortal    = "pgfence_p"
	digestClient  = "client"
)

// The gate's SQL names every type by its schema, so that no search_path
// (which a client sets) can put a type or cast of its own in the gate's
// arguments.
var gateStatements = [][2]string{
	{gateStmt, "SELECT fence.gate($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.int8, $4::pg_catalog.text)"},
	{commitStmt, "SELECT fence.commit($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.int8, $4::pg_catalog.text, $5::pg_catalog.bytea, $6::pg_catalog.text)"},
	{commitIfStmt, "SELECT fence.commit_if_written($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.int8, $4::pg_catalog.text, $5::pg_catalog.bytea, $6::pg_catalog.text)"},
	{savepointStmt, "SAVEPOINT " + receiptSavepoint},
}

// reservedPrefix starts the names of the gate's own prepared statements
// and portals (and pgfence_raise, pgfence_p); a client may not parse,
// bind, describe, execute, close, PREPARE, EXECUTE or DEALLOCATE one, so
// it cannot make the gate run SQL of its choosing. reservedGUCPrefix
// starts the settings the backstop keeps for itself (pgfence.replay, ...).
const (
	reservedPrefix    = "pgfence_"
	reservedGUCPrefix = "pgfence."
)

func reserved(name string) bool { return strings.HasPrefix(name, reservedPrefix) }

// reservedError is the refusal of a client's use of a reserved name.
func reservedError(what, name string) *fence.Error {
	return &fence.Error{Code: fence.CodeReserved,
		Message: fmt.Sprintf("%s %q: names beginning with %q are reserved for pgfence's own statements", what, name, reservedPrefix),
		Hint:    "give the prepared statement or portal another name"}
}

// reservedStmt refuses a statement that names one of the gate's
// statements or sets one of the backstop's own settings.
func reservedStmt(st *rewrite.Stmt) *fence.Error {
	switch {
	case (st.Kind == rewrite.Prepare || st.Kind == rewrite.Deallocate || st.Kind == rewrite.Execute) && reserved(st.Name):
		return reservedError("prepared statement", st.Name)
	case reserved(st.Executes):
		return reservedError("prepared statement", st.Executes)
	case st.Kind == rewrite.Read && reserved(st.Name):
		return reservedError("cursor", st.Name) // DECLARE: a cursor is a portal
	}
	for _, g := range st.GUCs {
		if strings.HasPrefix(g.Name, reservedGUCPrefix) {
			return &fence.Error{Code: fence.CodeReserved,
				Message: fmt.Sprintf("parameter %q: settings beginning with %q are reserved for pgfence's backstop", g.Name, reservedGUCPrefix),
				Hint:    "fence metadata is set with fence.job_key, fence.epoch, fence.token and fence.step"}
		}
	}
	return nil
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
		if reserved(m.Name) {
			return Drop, h.raiseExt(s, reservedError("prepared statement", m.Name))
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
		if reserved(m.PreparedStatement) {
			return Drop, h.raiseExt(s, reservedError("prepared statement", m.PreparedStatement))
		}
		if reserved(m.DestinationPortal) {
			return Drop, h.raiseExt(s, reservedError("portal", m.DestinationPortal))
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
			if reserved(name) {
				return Drop, h.raiseExt(s, reservedError(closeWhat(body[0]), name))
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
			if name := string(body[1 : len(body)-1]); reserved(name) {
				return Drop, h.raiseExt(s, reservedError(closeWhat(body[0]), name))
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

// hasKind reports whether one of stmts is of kind k.
func hasKind(stmts []*rewrite.Stmt, k rewrite.Kind) bool {
	for _, st := range stmts {
		if st.Kind == k {
			return true
		}
	}
	return false
}

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
// may write one, or a write to a table the catalog does not list yet. In
// a fenced session such a statement makes the transaction tentative
// (session.Gate.Tentative). Callers hold h.mu.
//
// It asks whether the database has the fence schema, not whether the
// catalog lists a protected table: a table protected since the catalog
// was read (by any route, migration 010) already has its backstop, which
// fences the write and marks the transaction; commit_if_written then
// writes the receipt, and answers a retry as the gate answers a replay.
// A database without the schema pays nothing.
func (h *fenceSession) maybeWrite(st *rewrite.Stmt) bool {
	if st == nil || !h.cat.schema.Load() {
		return false
	}
	// A COPY FROM into another table is left out: a trigger of that table
	// writing a protected one is fenced and receipted by the backstop
	// itself (backstop-v1), and wrapping every COPY of a fenced session
	// would move its data off the event loop.
	return st.Kind != rewrite.CopyFrom && (st.Writes() || opaque(st))
}

// fencedQuery reports whether the session has a fence generation now, or
// the query sets a fence parameter (its statements may then run fenced).
// Callers hold h.mu.
func (h *fenceSession) fencedQuery(stmts []*rewrite.Stmt) bool {
	if _, ok := h.st.Generation(); ok {
		return true
	}
	for _, st := range stmts {
		for _, g := range st.GUCs {
			if strings.HasPrefix(g.Name, "fence.") || g.Op == rewrite.GUCResetAll {
				return true
			}
		}
	}
	return false
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
	if _, ok := h.st.Generation(); ok || h.st.Gate().Gated {
		return true
	}
	return decoding && h.cat.prot.Load().Len() > 0
}

// query handles a simple Query.
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
	if mayNeedGate(res.Stmts...) {
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

	// Refuse malformed fence parameters at SET time, before anything runs.
	h.mu.Lock()
	var bad error
	needGate := false
	fenced := h.fencedQuery(res.Stmts)
	for _, st := range res.Stmts {
		if bad == nil {
			if e := reservedStmt(st); e != nil {
				bad = e
			}
		}
		if bad == nil && len(st.GUCs) > 0 {
			bad = h.st.Check(st, nil)
		}
		if h.protectedWrite(st) || fenced && h.maybeWrite(st) ||
			h.st.Gate().Due() && (st.Kind == rewrite.Commit || st.Kind == rewrite.PrepareTransaction) {
			needGate = true
		}
	}
	h.mu.Unlock()
	if bad == nil && needGate && s.OnLoop() && (hasKind(res.Stmts, rewrite.CopyFrom) || commitInside(res)) {
		// A gated COPY FROM may wait for its CopyInResponse (awaitCopy),
		// a COMMIT with statements after it for its answer
		// (settleCommit): the client goroutine sends them. Nothing is
		// done yet. A COPY FROM the gate leaves alone stays on the loop.
		return ErrWait
	}
	h.f.Stats.Classified.Add(int64(len(res.Stmts)))
	if bad != nil {
		return h.refuseQuery(s, bad)
	}
	if !needGate {
		if err := h.routeQuery(s, msg, res); err != nil { // replica or primary: route.go
			return err
		}
		if changesState(res.Stmts...) {
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
	return h.gatedQuery(s, sql, res)
}

// refusedImplicit names st as PostgreSQL's error does when st is refused
// outside a transaction block ("SAVEPOINT can only be used in transaction
// blocks"), or returns "".
func refusedImplicit(st *rewrite.Stmt) string {
	switch {
	case st.Kind == rewrite.Savepoint:
		return "SAVEPOINT"
	case st.Kind == rewrite.Release:
		return "RELEASE SAVEPOINT"
	case st.Kind == rewrite.RollbackTo:
		return "ROLLBACK TO SAVEPOINT"
	case st.Kind == rewrite.Commit && st.Chain:
		return "COMMIT AND CHAIN"
	case st.Kind == rewrite.Rollback && st.Chain:
		return "ROLLBACK AND CHAIN"
	}
	return ""
}

// commitInside reports whether a COMMIT of the query is not its last
// statement, or chains.
func commitInside(res *rewrite.Result) bool {
	for i, st := range res.Stmts {
		if st.Kind == rewrite.Commit && (st.Chain || i < len(res.Stmts)-1) {
			return true
		}
	}
	return false
}

// mayNeedGate reports whether a statement could need the gate's attention
// with the session state as it will be: a write, a commit, or something
// that may run a prepared or opaque write.
func mayNeedGate(stmts ...*rewrite.Stmt) bool {
	for _, st := range stmts {
		switch {
		case st.Writes(), opaque(st):
			return true
		}
		switch st.Kind {
		case rewrite.Commit, rewrite.PrepareTransaction, rewrite.CopyFrom, rewrite.Execute:
			return true
		}
	}
	return false
}

// changesState reports whether statements change what the gate decides
// from: tracked parameters, the transaction, prepared statements.
func changesState(stmts ...*rewrite.Stmt) bool {
	for _, st := range stmts {
		if len(st.GUCs) > 0 || st.UnknownGUCWrite {
			return true
		}
		switch st.Kind {
		case rewrite.Read, rewrite.Write, rewrite.Other, rewrite.CopyTo, rewrite.CopyFrom, rewrite.Listen, rewrite.Unlisten, rewrite.Notify:
		default:
			return true
		}
	}
	return false
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

// gatedQuery rewrites a simple query that writes a protected table (or
// commits a gated transaction): the gate goes right before the first
// protected write, the receipt step right before the client's COMMIT, and
// an implicit transaction ends with the receipt step (see plan). It runs
// with the session state settled (after barrier).
func (h *fenceSession) gatedQuery(s *Session, sql string, res *rewrite.Result) error {
	h.mu.Lock()
	if h.st.Tx() == session.Failed {
		// The server refuses everything but ROLLBACK; nothing to gate.
		h.mu.Unlock()
		return h.send(s, h.qmsg(sql), &tag{kind: 'Q', segs: clientSegs(res)}, true)
	}
	p := h.plan(sql, res)
	h.mu.Unlock()
	defer h.markState()
	h.copyGated = p.copy
	h.copyTail = p.tail
	h.copyLeft = countKind(res, rewrite.CopyFrom)
	h.copyTag = p.tag
	if p.tail != nil {
		p.tag.copyIn = make(chan struct{}, h.copyLeft)
	}
	p.tag.sent = time.Now() // metrics: step latency
	if c := p.commit; c != nil {
		// A lone COMMIT: the receipt step as the gate's prepared
		// statement (parsed once per connection, not per commit), a Sync
		// whose ReadyForQuery is hidden, then the client's COMMIT.
		if err := h.prepareExt(s); err != nil {
			return err
		}
		if err := h.execNamed(s, commitStmtFor(c.gated), commitArgs(c.gen, c.sum, c.version),
			&tag{kind: 'E', step: stepCommit, gen: c.gen, explicitCommit: true, sent: time.Now()}); err != nil {
			return err
		}
		if err := h.send(s, []byte{'S', 0, 0, 0, 4}, &tag{kind: 'S', step: stepCommit, hideRFQ: true}, false); err != nil {
			return err
		}
	} else if err := h.send(s, h.qmsg(p.text), p.tag, true); err != nil {
		return err
	}
	if p.then != nil {
		return h.send(s, h.qmsg(p.then.text), p.then.tag, true)
	}
	if p.settle {
		return h.settleCommit(s, p.tag)
	}
	if p.tail != nil {
		return h.awaitCopy(s, p.tag)
	}
	return nil
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
	if h.wrapped {
		f(&h.wrap.digest)
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

// qplan is a rewritten simple query.
type qplan struct {
	text   string
	tag    *tag
	settle bool        // a gated COMMIT inside it: wait for it, then end as settleCommit does
	then   *qplan      // a second query after it (COMMIT; its ReadyForQuery is the client's)
	commit *commitStep // instead of text: the receipt step as a prepared statement
	tail   *copyState  // a gated COPY FROM in a wrapped transaction: finish at CopyDone
	copy   bool        // a COPY FROM in a gated transaction: its data goes into the digest
}

// commitStep is a receipt step's arguments.
type commitStep struct {
	gen     fence.Generation
	sum     []byte
	version string
	gated   bool // else tentative: commit_if_written
}

// item is a piece of the rewritten query: the client's statement i
// (text == "") or injected text at byte offset at.
type item struct {
	at   int
	text string
	seg  seg
}

// plan splices the gate's steps into sql. Callers hold h.mu, with the
// session state settled.
func (h *fenceSession) plan(sql string, res *rewrite.Result) qplan {
	g := h.st.Gate()
	gated, tentative, gen := g.Gated, g.Tentative, g.Gen
	due := func() bool { return gated || tentative } // a receipt step is due at the commit
	explicit := h.st.Tx() == session.InTx && h.st.Explicit()
	blockStart := 0 // where the current implicit transaction began
	ov := overlay{}

	// The receipt step's digest must cover this query's own writes, which
	// have not run yet: follow them on the live digest and undo that at
	// the end (the server goroutine adds them for real as they complete).
	var d *fence.Digest
	restore := -1
	if live, ok := g.Digest.(*fence.Digest); ok && due() {
		d, restore = live, live.Mark()
	}
	marks := map[string][]int{}
	digestNow := func() ([]byte, string) {
		if v := ov.value(h.st, session.PayloadDigest); v != "" {
			if b, err := hex.DecodeString(v); err == nil {
				return b, digestClient
			}
		}
		if d == nil {
			d = &fence.Digest{}
		}
		return d.Sum(), fence.DigestVersion
	}

	var items []item
	inject := func(at int, text string, sg seg) { items = append(items, item{at: at, text: text, seg: sg}) }
	// refuse fails the query at st with e, as PostgreSQL would fail st:
	// the rest is not sent (the caller breaks the loop).
	refuse := func(st *rewrite.Stmt, e *fence.Error) {
		inject(st.Offset, raiseSQL(e)+";", seg{step: stepRaise, stmt: st})
		items = append(items, item{at: st.Offset, seg: seg{step: stepClient, stmt: st}})
	}
	wrapped, hasCopy, explicitCommit := false, false, false
	copyInTx := false       // a gated COPY FROM in the current transaction, in this query
	wrapStart := 0          // where the wrapped implicit transaction began
	var lastStep commitStep // the receipt step spliced before the client's COMMIT
	// blockOnly: the items index and statement of the first statement of
	// the current implicit transaction that PostgreSQL refuses outside a
	// transaction block (see the end).
	blockOnly, blockOnlyStmt := -1, (*rewrite.Stmt)(nil)
loop:
	for i, st := range res.Stmts {
		switch {
		case !gated && h.protectedWrite(st):
			cur, ok := ov.generation(h.st)
			if !ok {
				h.f.Stats.Unfenced.Add(1)
				refuse(st, fencingRequired(st, h.cat, h.st, ov))
				break loop
			}
			if !explicit {
				// An implicit transaction: the receipt step ends it (see
				// below), and PostgreSQL commits it only if every
				// statement, the gate and the receipt succeeded.
				wrapped, wrapStart = true, blockStart
			}
			inject(st.Offset, gateSQL(cur)+";", seg{step: stepGate, gen: cur, stmt: st})
			if !due() && (d == nil || restore < 0) {
				d = &fence.Digest{}
			}
			gated, gen = true, cur
		case !due() && h.maybeWrite(st):
			// It may write a protected table where the gate cannot see:
			// the backstop checks it, and the commit writes a receipt if
			// the backstop marked the transaction (tentative). Without a
			// generation the backstop refuses it (FN008): nothing due.
			cur, ok := ov.generation(h.st)
			if !ok {
				break
			}
			if !explicit {
				wrapped, wrapStart = true, blockStart
			}
			tentative, gen = true, cur
			if d == nil || restore < 0 {
				d = &fence.Digest{}
			}
		case due() && st.Kind == rewrite.PrepareTransaction:
			refuse(st, &fence.Error{Code: fence.CodeUnsupported,
				Message: fmt.Sprintf("PREPARE TRANSACTION is not supported in a fenced transaction (job %q, token %d)", gen.JobKey, gen.Token),
				Hint:    "commit the transaction with COMMIT: pgfence writes the commit receipt in the same transaction"})
			break loop
		case due() && st.Kind == rewrite.Commit && hasKind(res.Stmts[i+1:], rewrite.CopyFrom):
			// What follows the COMMIT is settled once the query is
			// answered (settleCommit), which a COPY FROM after it would
			// hold up waiting for the client's data: refused before the
			// COMMIT runs.
			refuse(st, &fence.Error{Code: fence.CodeUnsupported,
				Message: fmt.Sprintf("COMMIT followed by COPY FROM in one query is not supported in a fenced transaction (job %q, token %d)", gen.JobKey, gen.Token),
				Hint:    "send the COPY as a query of its own after the COMMIT"})
			break loop
		case due() && st.Kind == rewrite.Commit && copyInTx:
			// The receipt must cover the COPY's data, which only comes
			// after this query's text has gone: the COMMIT is refused,
			// and the transaction aborts with nothing of it committed.
			refuse(st, &fence.Error{Code: fence.CodeUnsupported,
				Message: fmt.Sprintf("COPY FROM and COMMIT in one query are not supported in a fenced transaction (job %q, token %d): the commit receipt must cover the COPY data", gen.JobKey, gen.Token),
				Hint:    "send COMMIT as a query of its own after the COPY"})
			break loop
		case due() && st.Kind == rewrite.Commit:
			sum, version := digestNow()
			if explicit && i > 0 && i == len(res.Stmts)-1 && !st.Chain {
				// See the plan's end: the receipt in a savepoint, so that
				// what follows the query can tell its failure from an
				// earlier statement's.
				inject(st.Offset, "SAVEPOINT "+receiptSavepoint+";", seg{step: stepSavepoint})
			}
			inject(st.Offset, commitSQL(gated, gen, sum, version)+";", seg{step: stepCommit, gen: gen, explicitCommit: true})
			if explicit {
				// The client's own transaction: its COMMIT must run
				// whatever the receipt step did (below). A COMMIT ending
				// an implicit one is skipped with the rest of the query
				// when the step fails, as PostgreSQL would after any
				// error, and the transaction rolls back all the same.
				explicitCommit = true
				lastStep = commitStep{gen: gen, sum: sum, version: version, gated: gated}
			}
		}
		if due() && d != nil {
			switch st.Kind {
			case rewrite.Savepoint:
				marks[st.Name] = append(marks[st.Name], d.Mark())
			case rewrite.RollbackTo:
				if m := marks[st.Name]; len(m) > 0 {
					d.Rollback(m[len(m)-1])
				}
			default:
				if isDigested(st) {
					d.Statement(st.Canonical(), nil)
				}
			}
		}
		if !explicit && blockOnly < 0 && refusedImplicit(st) != "" {
			blockOnly, blockOnlyStmt = len(items), st
		}
		switch st.Kind {
		case rewrite.Begin:
			// In an implicit transaction, BEGIN makes it the client's
			// explicit one (as PostgreSQL does, without a warning): it
			// goes on after this query, and the receipt step waits for
			// the client's COMMIT.
			explicit, wrapped = true, false
		case rewrite.Commit, rewrite.Rollback:
			if !st.Chain {
				explicit = false
			}
			gated, tentative, wrapped, copyInTx = false, false, false, false
			d, restore = nil, -1
			if i+1 < len(res.Stmts) {
				blockStart = res.Stmts[i+1].Offset
			}
			blockOnly = -1
		case rewrite.CopyFrom:
			if due() {
				hasCopy, copyInTx = true, true
			}
		}
		ov.apply(st)
		items = append(items, item{at: st.Offset, seg: seg{step: stepClient, stmt: st}})
	}
	if wrapped && hasCopy {
		// The receipt covers the COPY data, so it can only be sent after
		// CopyDone, in a query of its own: the transaction must outlast
		// this query. Make it explicit from its start (first among the
		// items there: the sort below keeps their order). A statement
		// PostgreSQL refuses in the implicit transaction (SAVEPOINT, AND
		// CHAIN) would pass in the explicit one: it fails as it would
		// have, with PostgreSQL's error, and the query stops there.
		if blockOnly >= 0 {
			raise := item{at: blockOnlyStmt.Offset, text: raiseSQL(&fence.Error{Code: "25P01",
				Message: refusedImplicit(blockOnlyStmt) + " can only be used in transaction blocks"}) + ";", seg: seg{step: stepRaise}}
			items = append(items[:blockOnly], append([]item{raise}, items[blockOnly:]...)...)
		}
		items = append([]item{{at: wrapStart, text: "BEGIN;", seg: seg{step: stepBegin}}}, items...)
	}
	// Injected text goes before the client statement at the same offset;
	// items are in order except a BEGIN placed back at wrapStart.
	sort.SliceStable(items, func(a, b int) bool { return items[a].at < items[b].at })

	var b strings.Builder
	b.Grow(len(sql) + 256)
	t := &tag{kind: 'Q'}
	prev := 0
	for _, it := range items {
		if it.text == "" {
			t.segs = append(t.segs, it.seg)
			continue
		}
		b.WriteString(sql[prev:it.at])
		prev = it.at
		// In characters: PostgreSQL reports error positions so.
		t.inserts = append(t.inserts, insertion{at: utf8.RuneCountInString(sql[:it.at]), n: utf8.RuneCountInString(it.text)})
		b.WriteString(it.text)
		t.segs = append(t.segs, it.seg)
	}
	b.WriteString(sql[prev:])
	p := qplan{tag: t, copy: hasCopy}
	switch {
	case wrapped && hasCopy:
		// The receipt covers the COPY data: it is sent at CopyDone.
		p.tail = &copyState{gen: gen, gated: gated}
		t.hideRFQ = true
	case wrapped:
		// The receipt step is the implicit transaction's last statement
		// (a newline first: the client's text may end in a -- comment).
		// The transaction stays PostgreSQL's implicit one, so the
		// client's statements in it behave as they would straight to
		// PostgreSQL (SAVEPOINT refused, BEGIN turning it explicit),
		// and it commits at the end of the query only if nothing failed.
		sum, version := digestNow()
		b.WriteString("\n;")
		b.WriteString(commitSQL(gated, gen, sum, version))
		t.segs = append(t.segs, seg{step: stepCommit, gen: gen})
	case explicitCommit && len(res.Stmts) == 1 && lastCommit(res, t.segs):
		p.commit = &lastStep
		p.then = &qplan{text: sql, tag: &tag{kind: 'Q', segs: []seg{{step: stepClient, stmt: res.Stmts[0]}}}}
	case explicitCommit && lastCommit(res, t.segs):
		// The client's statements, the receipt step in a savepoint and
		// the client's COMMIT, then a query that ends the transaction
		// only if the receipt step failed (the COMMIT was skipped): it
		// returns to the savepoint and rolls back. When a statement of
		// the client's failed before, there is no savepoint: the
		// transaction stays failed, as it would straight to PostgreSQL,
		// until the client rolls it back. After a COMMIT there is no
		// transaction. Either way the query fails at once, unseen.
		t.hideRFQ = true
		p.then = &qplan{text: restoreSQL, tag: restoreTag()}
	case explicitCommit:
		// The client's COMMIT with statements after it (or AND CHAIN):
		// whatever follows must see the transaction as PostgreSQL left
		// it, so the proxy waits for the answer (settleCommit).
		t.hideRFQ, p.settle = true, true
	}
	if restore >= 0 && d != nil {
		d.Rollback(restore)
	}
	p.text = b.String()
	return p
}

// lastCommit reports whether the query's last statement is a COMMIT that
// the plan kept as its last segment (nothing of the gate's after it).
func lastCommit(res *rewrite.Result, segs []seg) bool {
	n := len(segs)
	last := res.Stmts[len(res.Stmts)-1]
	return n > 0 && last.Kind == rewrite.Commit && !last.Chain && segs[n-1].step == stepClient && segs[n-1].stmt == last
}

// finishWrapped ends a wrapped transaction whose receipt step could not be
// spliced into the query text (COPY FROM: the digest covers its data). It
// waits for the COPY to complete so the digest is whole.
func (h *fenceSession) finishWrapped(s *Session, cs *copyState) error {
	gen := cs.gen
	if err := h.barrier(s); err != nil {
		return err
	}
	h.mu.Lock()
	sum, version := h.digest()
	h.mu.Unlock()
	t := &tag{kind: 'Q', segs: []seg{{step: stepCommit, gen: gen}}, hideRFQ: true, sent: time.Now()}
	if err := h.send(s, h.qmsg(commitSQL(cs.gated, gen, sum, version)), t, false); err != nil {
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
// receipt step in a savepoint before it, a query that ends the
// transaction only if that step failed (see plan). Its ReadyForQuery is
// the one the client sees.
func (h *fenceSession) sendRestore(s *Session) error {
	return h.send(s, h.qmsg(restoreSQL), restoreTag(), true)
}

const restoreSQL = "ROLLBACK TO SAVEPOINT " + receiptSavepoint + "; ROLLBACK"

func restoreTag() *tag {
	return &tag{kind: 'Q', step: stepRollback, segs: []seg{{step: stepRestore}, {step: stepRollback}}}
}

// refuseQuery answers a query with err without running any of it.
func (h *fenceSession) refuseQuery(s *Session, err error) error {
	return h.send(s, h.qmsg(raiseSQL(asFenceError(err))), &tag{kind: 'Q', segs: []seg{{step: stepRaise}}}, true)
}

func asFenceError(err error) *fence.Error {
	var se *fence.Error
	if errors.As(err, &se) {
		return se
	}
	return &fence.Error{Code: "22023", Message: err.Error()}
}

// commitSQL is the receipt step for a digest: fence.commit after the
// gate step, else (a tentative transaction) fence.commit_if_written,
// which writes the receipt only if the backstop marked the transaction.
func commitSQL(gated bool, gen fence.Generation, digest []byte, version string) string {
	if !gated {
		return strings.Replace(commitSQLGated(gen, digest, version), "fence.commit(", "fence.commit_if_written(", 1)
	}
	return commitSQLGated(gen, digest, version)
}

func commitSQLGated(gen fence.Generation, digest []byte, version string) string {
	// E'' for the digest too: with standard_conforming_strings off a
	// plain '\x..' would be read as escapes.
	return fmt.Sprintf("SELECT fence.commit(%s, %d, %d, %s, E'\\\\x%s'::pg_catalog.bytea, %s)",
		literal(gen.JobKey), gen.Epoch, gen.Token, literal(gen.Step), hex.EncodeToString(digest), literal(version))
}

// digest returns the transaction's payload digest: the client's own
// (fence.payload_digest) or the proxy's v1 digest. Callers hold h.mu.
func (h *fenceSession) digest() ([]byte, string) {
	if v, ok := h.st.Get(session.PayloadDigest); ok && v != "" {
		if d, err := hex.DecodeString(v); err == nil {
			return d, digestClient
		}
	}
	if d, ok := h.st.Gate().Digest.(*fence.Digest); ok {
		return d.Sum(), fence.DigestVersion
	}
	return (&fence.Digest{}).Sum(), fence.DigestVersion
}

func gateSQL(g fence.Generation) string {
	return fmt.Sprintf("SELECT fence.gate(%s, %d, %d, %s)", literal(g.JobKey), g.Epoch, g.Token, literal(g.Step))
}

// raiseSQL is a statement that fails with e, so the server aborts the
// transaction exactly as it would for its own error.
func raiseSQL(e *fence.Error) string {
	s := "DO $pgfence$BEGIN RAISE EXCEPTION USING ERRCODE = " + literal(e.Code) + ", MESSAGE = " + literal(e.Message)
	if e.Hint != "" {
		s += ", HINT = " + literal(e.Hint)
	}
	return s + "; END$pgfence$"
}

// literal quotes s as an escape-string literal, correct whatever
// standard_conforming_strings is.
func literal(s string) string {
	var b strings.Builder
	b.WriteString("E'")
	for _, r := range s {
		switch r {
		case '\'':
			b.WriteString("''")
		case '\\':
			b.WriteString(`\\`)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('\'')
	return b.String()
}

// fencingRequired is FN008 for st, naming what of the generation the
// session lacks (ov: the query's own SETs before st).
func fencingRequired(st *rewrite.Stmt, cat *catalog, ss *session.State, ov overlay) *fence.Error {
	rels := cat.prot.Load().ProtectedWrites(st, ss.SearchPath())
	what := "a protected table"
	if len(rels) > 0 {
		what = "protected table " + rels[0].String()
	}
	return &fence.Error{Code: fence.CodeFencingRequired,
		Message: fmt.Sprintf("fencing required: this statement writes %s but %s", what, strings.Join(ov.missing(ss), " and ")),
		Hint:    "take a lease with fence.acquire (or run the job under `pgfence run`) and set fence.job_key, fence.epoch and fence.token, e.g. PGOPTIONS='-c fence.job_key=... -c fence.epoch=... -c fence.token=...'"}
}

// missing names what of the fence generation is not set, or not usable.
func (o overlay) missing(ss *session.State) []string {
	var out []string
	for _, n := range []string{session.JobKey, session.Epoch, session.Token} {
		v := strings.TrimSpace(o.value(ss, n))
		switch {
		case v == "":
			out = append(out, n+" is not set")
		case n != session.JobKey:
			if x, err := strconv.ParseInt(v, 10, 64); err != nil || x <= 0 {
				out = append(out, fmt.Sprintf("%s (%q) is not a positive integer", n, v))
			}
		}
	}
	if len(out) == 0 {
		out = append(out, "its fence generation is not complete")
	}
	return out
}

// overlay follows the fence parameters a query's own SETs change before a
// later statement of the same query runs.
type overlay map[string]*string

func (o overlay) apply(st *rewrite.Stmt) {
	for _, g := range st.GUCs {
		switch g.Op {
		case rewrite.GUCSet:
			if session.Tracked(g.Name) && g.ValueParam == 0 && !g.Unknown {
				v := g.Value
				o[g.Name] = &v
			}
		case rewrite.GUCReset:
			if session.Tracked(g.Name) {
				o[g.Name] = nil
			}
		case rewrite.GUCResetAll:
			clear(o)
			o["*reset"] = nil
		}
	}
}

func (o overlay) value(ss *session.State, name string) string {
	if v, ok := o[name]; ok {
		if v == nil {
			return ""
		}
		return *v
	}
	if _, reset := o["*reset"]; reset {
		return ""
	}
	v, _ := ss.Get(name)
	return v
}

func (o overlay) generation(ss *session.State) (fence.Generation, bool) {
	get := func(name string) string {
		if v, ok := o[name]; ok {
			if v == nil {
				return ""
			}
			return *v
		}
		if _, reset := o["*reset"]; reset {
			return ""
		}
		v, _ := ss.Get(name)
		return v
	}
	if len(o) == 0 {
		return ss.Generation()
	}
	k := get(session.JobKey)
	e, err1 := strconv.ParseInt(strings.TrimSpace(get(session.Epoch)), 10, 64)
	t, err2 := strconv.ParseInt(strings.TrimSpace(get(session.Token)), 10, 64)
	if k == "" || err1 != nil || err2 != nil || e <= 0 || t <= 0 {
		return fence.Generation{}, false
	}
	return fence.Generation{JobKey: k, Epoch: e, Token: t, Step: get(session.Step)}, true
}

// execute handles an extended-protocol Execute.
func (h *fenceSession) execute(s *Session, msg []byte) error {
	var m pgproto3.Execute
	if err := m.Decode(msg[headerLen:]); err != nil {
		return h.send(s, msg, &tag{kind: 'E'}, true)
	}
	if reserved(m.Portal) {
		return h.raiseExt(s, reservedError("portal", m.Portal))
	}
	cp := h.portals[m.Portal]
	var st *rewrite.Stmt
	if cp != nil {
		st = cp.stmt
	}
	if r := h.commitReq; r != nil && h.commitRB {
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
			h.commitRB = false
		}
	}
	t := &tag{kind: 'E', portal: m.Portal, cp: cp}
	if st == nil {
		return h.send(s, msg, t, true)
	}
	if mayNeedGate(st) {
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
	var bad error
	if e := reservedStmt(st); e != nil {
		bad = e
	} else if len(st.GUCs) > 0 {
		bad = h.st.Check(st, paramFunc(cp, h.text.codec))
	}
	g := h.st.Gate()
	need := h.protectedWrite(st) && !g.Gated
	_, fencedNow := h.st.Generation()
	tent := !need && !g.Due() && fencedNow && h.maybeWrite(st) && !(h.wrapped && !h.wrap.gated)
	commit := g.Due() && st.Kind == rewrite.Commit
	prepTx := g.Due() && st.Kind == rewrite.PrepareTransaction
	h.mu.Unlock()
	if bad != nil {
		if err := h.raiseExt(s, asFenceError(bad)); err != nil {
			return err
		}
		return h.send(s, msg, t, true)
	}
	if h.wrapped && (st.Kind == rewrite.Begin || st.Kind == rewrite.Rollback) {
		// No receipt step at the Sync: BEGIN makes the implicit
		// transaction the client's explicit one (the step waits for its
		// COMMIT), ROLLBACK ends it. (In a batch that already failed the
		// server skips both, and the step would be skipped too.)
		h.wrapped = false
	}
	if !need && !tent && !commit && !prepTx {
		if h.wrapped {
			h.wrap.add(st, m.Portal, cp) // the receipt at the Sync covers every write of the batch
		}
		if err := h.send(s, msg, t, true); err != nil {
			return err
		}
		if changesState(st) {
			h.markState()
		}
		return nil
	}
	if err := h.settle(s); err != nil {
		return err
	}
	defer h.markState()
	h.mu.Lock()
	g = h.st.Gate()
	failed := h.st.Tx() == session.Failed
	explicit := h.st.Tx() == session.InTx && h.st.Explicit()
	gen, ok := h.st.Generation()
	var fr *fence.Error
	if !ok {
		fr = fencingRequired(st, h.cat, h.st, overlay{})
	}
	h.mu.Unlock()
	switch {
	case failed:
		// The server refuses it; nothing to gate. (In a batch an earlier
		// error already made the server skip to Sync, the gate's steps
		// with it: harmless.)
	case need && !g.Gated && !ok:
		h.f.Stats.Unfenced.Add(1)
		if err := h.raiseExt(s, fr); err != nil {
			return err
		}
	case need && !g.Gated:
		if err := h.prepareExt(s); err != nil {
			return err
		}
		if !explicit {
			// An implicit transaction (up to Sync): the receipt step
			// ends it at the Sync, and PostgreSQL commits it only if
			// nothing before failed.
			h.wrapBatch(gen)
			h.wrap.gated = true
		}
		if err := h.execNamed(s, gateStmt, gateArgs(gen), &tag{kind: 'E', step: stepGate, gen: gen, about: st}); err != nil {
			return err
		}
	case tent:
		// May write a protected table unseen: the backstop fences it and
		// marks the transaction; an implicit one ends with the receipt
		// step that writes a receipt if it did (commit_if_written), an
		// explicit one gets it at its COMMIT (the server side records
		// the transaction as tentative).
		if !explicit && !h.wrapped {
			if err := h.prepareExt(s); err != nil {
				return err
			}
			h.wrapBatch(gen)
		}
	case prepTx:
		if err := h.raiseExt(s, &fence.Error{Code: fence.CodeUnsupported,
			Message: fmt.Sprintf("PREPARE TRANSACTION is not supported in a fenced transaction (job %q, token %d)", g.Gen.JobKey, g.Gen.Token),
			Hint:    "commit the transaction with COMMIT"}); err != nil {
			return err
		}
	case commit:
		if err := h.prepareExt(s); err != nil {
			return err
		}
		h.mu.Lock()
		sum, version := h.digest()
		h.mu.Unlock()
		args := commitArgs(g.Gen, sum, version)
		stmt := commitStmtFor(g.Gated)
		if explicit {
			// The receipt step in a savepoint: after the Sync, the
			// transaction is ended only if the step failed (sync).
			if err := h.execNamed(s, savepointStmt, nil, &tag{kind: 'E', step: stepSavepoint}); err != nil {
				return err
			}
		}
		if err := h.execNamed(s, stmt, args, &tag{kind: 'E', step: stepCommit, gen: g.Gen, explicitCommit: true}); err != nil {
			return err
		}
		// An implicit transaction (the client's COMMIT ends it, with
		// PostgreSQL's warning) rolls back by itself at the Sync when
		// the step fails.
		h.commitRB = explicit
		h.wrapped = false
	}
	if h.wrapped {
		h.wrap.add(st, m.Portal, cp)
	}
	if st.Kind == rewrite.CopyFrom && !failed && (g.Due() || need && ok || tent) {
		// Its data goes into the digest (copyDigest), up to CopyDone.
		h.copyGated, h.copyLeft = true, 1
	}
	if err := h.send(s, msg, t, true); err != nil {
		return err
	}
	if commit && h.commitRB {
		h.commitReq = h.last
	}
	return nil
}

// wrapBatch starts following an implicit transaction of the extended
// protocol (up to its Sync) whose receipt step goes before the Sync.
func (h *fenceSession) wrapBatch(gen fence.Generation) {
	h.wrapped = true
	h.wrap = extWrap{gen: gen, marks: map[string][]int{}, written: map[string]bool{}}
	h.mu.Lock()
	if v, ok := h.st.Get(session.PayloadDigest); ok && v != "" {
		h.wrap.client, _ = hex.DecodeString(v)
	}
	h.mu.Unlock()
}

// sync handles an extended-protocol Sync: a wrapped implicit transaction
// ends here with the receipt step, which PostgreSQL skips when anything
// before it in the batch failed (the transaction then rolls back).
func (h *fenceSession) sync(s *Session, msg []byte) error {
	if h.wrapped {
		h.wrapped = false
		gen := h.wrap.gen
		sum, version := h.wrap.sum()
		args := commitArgs(gen, sum, version)
		if err := h.execNamed(s, commitStmtFor(h.wrap.gated), args, &tag{kind: 'E', step: stepCommit, gen: gen}); err != nil {
			return err
		}
		defer h.markState()
	}
	if h.commitRB {
		h.commitRB, h.commitReq = false, nil
		if err := h.send(s, msg, &tag{kind: 'S', hideRFQ: true}, true); err != nil {
			return err
		}
		return h.sendRestore(s)
	}
	return h.send(s, msg, &tag{kind: 'S'}, true)
}

// commitStmtFor is the receipt step's prepared statement (see commitSQL).
func commitStmtFor(gated bool) string {
	if gated {
		return commitStmt
	}
	return commitIfStmt
}

func commitArgs(gen fence.Generation, d []byte, v string) [][]byte {
	return [][]byte{[]byte(gen.JobKey), []byte(strconv.FormatInt(gen.Epoch, 10)), []byte(strconv.FormatInt(gen.Token, 10)),
		[]byte(gen.Step), []byte(`\x` + hex.EncodeToString(d)), []byte(v)}
}

func gateArgs(g fence.Generation) [][]byte {
	return [][]byte{[]byte(g.JobKey), []byte(strconv.FormatInt(g.Epoch, 10)), []byte(strconv.FormatInt(g.Token, 10)), []byte(g.Step)}
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
	for _, gs := range gateStatements {
		buf, _ = (&pgproto3.Close{ObjectType: 'S', Name: gs[0]}).Encode(buf[:0])
		if err := h.send(s, buf, &tag{kind: 'C', step: stepPrepare}, false); err != nil {
			return err
		}
		buf, _ = (&pgproto3.Parse{Name: gs[0], Query: gs[1]}).Encode(buf[:0])
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
	buf, _ := (&pgproto3.Bind{DestinationPortal: gatePortal, PreparedStatement: stmt, Parameters: args}).Encode(nil)
	if err := h.send(s, buf, &tag{kind: 'B', step: t.step}, false); err != nil {
		return err
	}
	buf, _ = (&pgproto3.Execute{Portal: gatePortal}).Encode(buf[:0])
	if t.step == stepGate || t.step == stepCommit {
		t.sent = time.Now() // metrics: step latency
	}
	if err := h.send(s, buf, t, false); err != nil {
		return err
	}
	buf, _ = (&pgproto3.Close{ObjectType: 'P', Name: gatePortal}).Encode(buf[:0])
	return h.send(s, buf, &tag{kind: 'C', step: t.step}, false)
}

// raiseExt fails the current extended batch with e: a DO block raising
// it, parsed and executed through the gate's portal (the client's unnamed
// statement is left alone). The server then skips to Sync.
func (h *fenceSession) raiseExt(s *Session, e *fence.Error) error {
	const name = "pgfence_raise"
	buf, _ := (&pgproto3.Close{ObjectType: 'S', Name: name}).Encode(nil)
	if err := h.send(s, buf, &tag{kind: 'C', step: stepRaise}, false); err != nil {
		return err
	}
	buf, _ = (&pgproto3.Parse{Name: name, Query: string(h.encode(raiseSQL(e)))}).Encode(buf[:0])
	if err := h.send(s, buf, &tag{kind: 'P', step: stepRaise}, false); err != nil {
		return err
	}
	buf, _ = (&pgproto3.Bind{DestinationPortal: gatePortal, PreparedStatement: name}).Encode(buf[:0])
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
	buf, _ = (&pgproto3.Execute{Portal: gatePortal}).Encode(buf[:0])
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
		} else if sg.step > stepRoute {
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
	if st > stepRoute {
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
		e.Position = unshift(e.Position, t.inserts)
	default:
		// A gate step's PL/pgSQL context names pgfence's internals, not
		// anything of the client's.
		e.Where = ""
	}
	s.WriteClient(encode(nil, &e))
	return Drop, nil
}

// unshift moves an error position (1-based, in characters) in the
// rewritten query back to the client's text (insertions are counted in
// characters too).
func unshift(pos int32, ins []insertion) int32 {
	p := int(pos) - 1
	shift := 0
	for _, in := range ins {
		if p >= in.at+shift+in.n {
			shift += in.n
		} else if p >= in.at+shift {
			return int32(in.at + 1) // inside our text: point at the client's statement
		}
	}
	return int32(p - shift + 1)
}

// applyClient applies a client statement the server completed.
func (h *fenceSession) applyClient(st *rewrite.Stmt, msg []byte, cp *cportal) {
	ctag := commandTag(msg)
	g := h.st.Gate()
	if !g.Due() && h.maybeWrite(st) {
		if gen, ok := h.st.Generation(); ok {
			g.Tentative = true
			g.Gen = gen
			if g.Digest == nil {
				g.Digest = &fence.Digest{}
			}
		}
	}
	if g.Due() && isDigested(st) {
		if d, ok := g.Digest.(*fence.Digest); ok {
			var params []fence.Param
			if cp != nil {
				params = cp.digestParams()
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

func isDigested(st *rewrite.Stmt) bool {
	switch st.Kind {
	case rewrite.Write, rewrite.CopyFrom, rewrite.Call, rewrite.Do, rewrite.Execute:
		return true
	}
	return st.Opaque // a function call may write: its text is part of what the transaction did
}

// commitResult counts a receipt step's answer.
func (h *fenceSession) commitResult(msg []byte) {
	if rowValue(msg) == "committed" {
		h.f.Stats.Committed.Add(1)
	}
}

// gateResult records the gate's answer ('ok' or 'replay').
func (h *fenceSession) gateResult(gen fence.Generation, msg []byte) {
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
