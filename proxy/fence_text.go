package proxy

import (
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/clientenc"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
)

// How the gate reads the client's text, and how it keeps its view of the
// session's settings equal to the server's.
//
// Text: the client writes SQL in its client_encoding, which PostgreSQL
// reads with standard_conforming_strings deciding what a backslash in a
// string means. Both change what the statements are, so the gate decodes
// the text as the server will (clientenc) and parses it with the same
// setting before it classifies it. Its view of the two is the server's:
// the startup's ParameterStatus, every later ParameterStatus (the server
// reports a change of either before the next ReadyForQuery), and a read
// of the settings (resync) where a change may have happened since the
// last ReadyForQuery in an extended-protocol batch. A request that may
// change them (a SET of either, RESET ALL, DISCARD ALL, transaction
// control, anything opaque) makes the view uncertain until a later
// ReadyForQuery or resync; text that does not depend on them (ASCII
// without backslashes reads alike in every client encoding PostgreSQL
// has) is read at once; other text waits for the view to be certain.
//
// Settings the gate tracks (fence.*, search_path): session.State follows
// them from the statements' text. A statement whose effect its text does
// not tell (set_config with a name or value that is neither a literal nor
// a bound parameter, as pg_dump sends) is let through, and before the gate
// next decides anything from them it reads them back from the server
// (resync). After a resync inside a transaction, the end of the
// transaction is uncertain again (a SET LOCAL it could not see reverts, a
// SET does not). A function or DO block that calls set_config itself is
// not followed (reading the settings back after every function call would
// cost a round trip each): a client that changes its fence settings from
// inside one can only get itself refused — the gate checks the generation
// it knows and the backstop the one the server has, and both must hold.

// settingsSQL reads what the gate keeps of the session's settings. Its
// columns are settingNames, in order.
var (
	settingNames = []string{session.JobKey, session.Epoch, session.Token, session.Step,
		session.PayloadDigest, session.ReadPolicy, session.ReadWait, session.MinLSN,
		session.SearchPath, "client_encoding", "standard_conforming_strings"}
	settingsSQL = func() string {
		var b strings.Builder
		b.WriteString("SELECT ")
		for i, n := range settingNames {
			if i > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "pg_catalog.current_setting('%s', true)", n)
		}
		b.WriteString(", " + sessionStateSQL)
		return b.String()
	}()
)

// sessionStateSQL reads what, besides the tracked settings, makes the
// session's state other than a new connection's (its replica
// connection's): the settings other than fence.* the session has set
// (SET, set_config, by the client or by its code), its role (SET ROLE),
// its session authorization, and whether its temporary schema holds a
// relation or a type ('t'), which an unqualified name means there before
// any schema of the search path (created by code the proxy cannot see:
// EXECUTE 'CREATE TEMP TABLE ...' in a DO block or a function; round 6,
// attacker M's M1). Only those two kinds are looked up there implicitly
// (functions, operators, collations are not). Not counted: the gate's own
// pgfence_no_prepare (no columns; fence.refuse_prepare makes it in every
// session that writes protected rows), the row types of relations and
// arrays (their relation, or their element, is counted). The catalogs are read only
// when the session has a temporary schema (CASE: the EXISTS are initplans,
// run when reached). Then the settings taken from the role's and the
// database's defaults (defaultsSQL). Five columns, after settingNames'.
const sessionStateSQL = "(SELECT pg_catalog.string_agg(s.name, ' ') FROM pg_catalog.pg_settings AS s" +
	" WHERE s.source OPERATOR(pg_catalog.=) 'session' AND pg_catalog.left(s.name, 6) OPERATOR(pg_catalog.<>) 'fence.')," +
	" pg_catalog.current_setting('role'), pg_catalog.current_setting('session_authorization')," +
	" CASE WHEN pg_catalog.pg_my_temp_schema() OPERATOR(pg_catalog.=) '0'::pg_catalog.oid THEN 'f'" +
	" WHEN EXISTS (SELECT FROM pg_catalog.pg_class AS c WHERE c.relnamespace OPERATOR(pg_catalog.=) pg_catalog.pg_my_temp_schema()" +
	" AND NOT (c.relname OPERATOR(pg_catalog.=) 'pgfence_no_prepare' AND c.relnatts OPERATOR(pg_catalog.=) 0))" +
	" OR EXISTS (SELECT FROM pg_catalog.pg_type AS y WHERE y.typnamespace OPERATOR(pg_catalog.=) pg_catalog.pg_my_temp_schema()" +
	" AND y.typtype OPERATOR(pg_catalog.<>) 'c' AND y.typcategory OPERATOR(pg_catalog.<>) 'A')" +
	" THEN 't' ELSE 'f' END, " + defaultsSQL

// defaultsSQL reads the settings a connection took from the role's and the
// database's defaults (ALTER ROLE/DATABASE ... SET) when it started, as
// "name=value" in name order: the primary session's (sessionStateSQL),
// and a replica connection's when it opens (replicaDefaults, replica.go).
// A replica connection opened later than the session gets the defaults
// as they are then; if they differ, its session is not the primary's
// (round 6, attacker M's M2). Custom settings (app.tenant) among the
// defaults of this database and login are not in pg_settings: their
// values are read by name (round 10, T-M1's defaults changed after the
// session opened).
const defaultsSQL = "(SELECT COALESCE(pg_catalog.string_agg(s.name OPERATOR(pg_catalog.||) '=' OPERATOR(pg_catalog.||) s.setting, ' ' ORDER BY s.name), '') FROM (" +
	"SELECT s.name, s.setting FROM pg_catalog.pg_settings AS s WHERE s.source OPERATOR(pg_catalog.=) ANY ('{database,user,\"database user\"}'::pg_catalog.text[])" +
	" UNION SELECT pg_catalog.lower(pg_catalog.split_part(d.c, '=', 1)), COALESCE(pg_catalog.current_setting(pg_catalog.split_part(d.c, '=', 1), true), '<unset>')" +
	" FROM pg_catalog.pg_db_role_setting AS r, pg_catalog.unnest(r.setconfig) AS d(c)" +
	" WHERE r.setdatabase OPERATOR(pg_catalog.=) ANY (ARRAY['0'::pg_catalog.oid, (SELECT db.oid FROM pg_catalog.pg_database AS db WHERE db.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())])" +
	" AND r.setrole OPERATOR(pg_catalog.=) ANY (ARRAY['0'::pg_catalog.oid, (SELECT ro.oid FROM pg_catalog.pg_roles AS ro WHERE ro.rolname OPERATOR(pg_catalog.=) pg_catalog.\"session_user\"())])" +
	" AND pg_catalog.strpos(pg_catalog.split_part(d.c, '=', 1), '.') OPERATOR(pg_catalog.>) 0" +
	" AND NOT EXISTS (SELECT FROM pg_catalog.pg_settings AS x WHERE x.name OPERATOR(pg_catalog.=) pg_catalog.lower(pg_catalog.split_part(d.c, '=', 1)))" +
	") AS s)"

// settingsStmt is the gate's statement for settingsSQL.
const settingsStmt = "pgfence_settings"

// textState is the gate's view of how the server reads the client's text.
// Written by the server side, read by the client side, under
// fenceSession.mu.
type textState struct {
	codec     *clientenc.Codec
	scsOff    bool   // standard_conforming_strings off
	serverEnc string // server_encoding, fixed for the session
	encName   string // client_encoding as the server last reported it
	// knownSeq: the requests up to this one (fenceSession.seq) have been
	// answered through a ReadyForQuery or a resync, so codec and scsOff
	// are the server's as of then. gucSeq: likewise for the tracked
	// settings (a resync only: they are not reported).
	knownSeq, gucKnown uint64
}

func newTextState(params map[string]string, log *zap.Logger) textState {
	ts := textState{serverEnc: params["server_encoding"], scsOff: params["standard_conforming_strings"] == "off"}
	if ts.serverEnc == "" {
		ts.serverEnc = "UTF8"
	}
	ce := params["client_encoding"]
	if ce == "" {
		ce = "UTF8"
	}
	ts.setEncoding(ce, log)
	return ts
}

// setEncoding follows a client_encoding the server reported. An encoding
// clientenc does not know (none of PostgreSQL's is missing) leaves the
// codec nil, which refuses every text that is not plain ASCII.
func (ts *textState) setEncoding(name string, log *zap.Logger) {
	ts.encName = name
	c, err := clientenc.New(name, ts.serverEnc)
	if err != nil {
		log.Warn("cannot read this client_encoding; refusing non-ASCII text", zap.String("client_encoding", name), zap.Error(err))
		ts.codec = nil
		return
	}
	ts.codec = c
}

// paramStatus follows a ParameterStatus from the server. Callers hold h.mu.
func (h *fenceSession) paramStatus(s gateConn, msg []byte) {
	var ps pgproto3.ParameterStatus
	if err := ps.Decode(msg[headerLen:]); err != nil {
		return
	}
	switch ps.Name {
	case "client_encoding":
		h.be.text.setEncoding(ps.Value, s.Logger())
	case "standard_conforming_strings":
		h.be.text.scsOff = ps.Value == "off"
	case "application_name":
		h.be.appName = ps.Value
	}
}

// sensitive reports whether text may read differently under another
// client_encoding or standard_conforming_strings: it has a byte above
// 0x7F or a backslash.
func sensitive(raw []byte) bool {
	for _, c := range raw {
		if c >= 0x80 || c == '\\' {
			return true
		}
	}
	return false
}

// decodeText returns the client's text as the server will read it, with
// the parse options that go with it, after making sure the gate's view of
// the client's encoding is current where the text depends on it.
func (h *fenceSession) decodeText(s gateConn, raw []byte) (string, rewrite.Options, error) {
	if sensitive(raw) {
		h.mu.Lock()
		uncertain := h.encSeq > h.be.text.knownSeq
		h.mu.Unlock()
		if uncertain && !h.readsAlike(raw) {
			if err := h.knowText(s); err != nil {
				return "", rewrite.Options{}, err
			}
		}
	}
	h.mu.Lock()
	c, opts := h.be.text.codec, rewrite.Options{NonStandardStrings: h.be.text.scsOff}
	h.mu.Unlock()
	if c == nil {
		for _, b := range raw {
			if b >= 0x80 {
				return "", opts, &clientenc.Error{Code: "22021", Message: "pgfence cannot read this session's client_encoding; send ASCII text or use a client_encoding PostgreSQL reports"}
			}
		}
		return string(raw), opts, nil
	}
	sql, err := c.Decode(raw)
	return sql, opts, err
}

// readsAlike reports whether raw classifies alike under every
// client_encoding and standard_conforming_strings a statement in flight
// may have switched to, so it can be read at once with the settings the
// gate knows: every encoding reads its ASCII bytes as the same characters
// (clientenc.SameASCII) and its classification holds no name or value
// with another character (rewrite.Result.ASCIINames), no dollar-quote tag
// has one (two byte sequences may read as the same tag in one encoding
// and not in another), and, if it has a backslash, it classifies alike
// with standard_conforming_strings on and off (rewrite.SameClass). Text
// the gate cannot read with its settings does not read alike: the server
// may have switched to the encoding that reads it.
func (h *fenceSession) readsAlike(raw []byte) bool {
	high := false
	for _, c := range raw {
		if c >= 0x80 {
			high = true
			break
		}
	}
	if high && (!clientenc.SameASCII(raw) || dollarTagHigh(raw)) {
		return false
	}
	h.mu.Lock()
	c, scsOff := h.be.text.codec, h.be.text.scsOff
	h.mu.Unlock()
	sql := string(raw)
	if high {
		if c == nil {
			return false
		}
		var err error
		if sql, err = c.Decode(raw); err != nil {
			return false
		}
	}
	res, err := h.f.classifier.ClassifyWith(sql, rewrite.Options{NonStandardStrings: scsOff})
	if err != nil || high && !res.ASCIINames() {
		return false
	}
	if strings.IndexByte(sql, '\\') < 0 {
		return true
	}
	other, err := h.f.classifier.ClassifyWith(sql, rewrite.Options{NonStandardStrings: !scsOff})
	return err == nil && rewrite.SameClass(res, other)
}

// dollarTagHigh reports whether raw has a dollar-quote tag (or what may
// be one: $, identifier characters, $) with a byte above 0x7F.
func dollarTagHigh(raw []byte) bool {
	for i, c := range raw {
		if c != '$' {
			continue
		}
		high := false
		j := i + 1
		for ; j < len(raw); j++ {
			b := raw[j]
			if b >= 0x80 {
				high = true
			} else if !(b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '_') {
				break
			}
		}
		if high && j < len(raw) && raw[j] == '$' {
			return true
		}
	}
	return false
}

// knowText waits until the gate knows the client_encoding and
// standard_conforming_strings the next text is read with: outside an
// extended-protocol batch every request sent so far ends in a
// ReadyForQuery, before which the server reports any change; inside one
// it reads them (resync). In a failed transaction it does neither (the
// server refuses everything but the end of the transaction, and a read
// would fail the batch): the current view stands.
func (h *fenceSession) knowText(s gateConn) error {
	if h.inBatch {
		return h.resync(s)
	}
	return h.barrier(s)
}

// encode returns text the gate sends upstream (a rewritten query, an
// injected statement, a parameter) in the client's encoding, which the
// server reads it in. Text the gate sends came from the client's own (a
// job key, a statement) or is ASCII, so it is encodable; a character that
// is not becomes '?', and a statement using it fails rather than running
// with another value.
func (h *fenceSession) encode(text string) []byte {
	h.mu.Lock()
	c := h.be.text.codec
	h.mu.Unlock()
	if c == nil || c.IsUTF8() {
		return []byte(text)
	}
	b, err := c.Encode(text)
	if err == nil {
		return b
	}
	var sb strings.Builder
	for _, r := range text {
		if e, err := c.Encode(string(r)); err == nil {
			sb.Write(e)
		} else {
			sb.WriteByte('?')
		}
	}
	return []byte(sb.String())
}

// qmsg is a Query message for sql, in the client's encoding.
func (h *fenceSession) qmsg(sql string) []byte {
	return queryMsg(nil, string(h.encode(sql)))
}

// resync reads the tracked settings and the text settings back from the
// server and waits for the answer (see the file comment). It is sent
// where the stream is: inside a batch as Parse/Bind/Execute without a
// Sync; outside, with a hidden Sync of its own. Not in a failed
// transaction: its Parse would fail and take the client's next messages
// with it. Nor again for a message handled again after one (resynced).
func (h *fenceSession) resync(s gateConn) error {
	h.mu.Lock()
	failed := h.st.Tx() == session.Failed
	inTx := h.st.Tx() != session.Idle
	h.mu.Unlock()
	if failed || h.resynced {
		return nil
	}
	batch := h.inBatch
	var buf []byte
	send := func(m pgproto3.FrontendMessage, t *tag) error {
		buf, _ = m.Encode(buf[:0])
		return h.send(s, buf, t, false)
	}
	if err := send(&pgproto3.Close{ObjectType: 'S', Name: settingsStmt}, &tag{kind: 'C', step: stepSettings}); err != nil {
		return err
	}
	if err := send(&pgproto3.Parse{Name: settingsStmt, Query: settingsSQL}, &tag{kind: 'P', step: stepSettings}); err != nil {
		return err
	}
	if err := send(&pgproto3.Bind{DestinationPortal: plan.Portal, PreparedStatement: settingsStmt}, &tag{kind: 'B', step: stepSettings}); err != nil {
		return err
	}
	if err := send(&pgproto3.Execute{Portal: plan.Portal}, &tag{kind: 'E', step: stepSettings, idleRead: !inTx && !batch}); err != nil {
		return err
	}
	exec := h.last
	if err := send(&pgproto3.Close{ObjectType: 'P', Name: plan.Portal}, &tag{kind: 'C', step: stepSettings}); err != nil {
		return err
	}
	// Not left behind for the client to find in pg_prepared_statements.
	if err := send(&pgproto3.Close{ObjectType: 'S', Name: settingsStmt}, &tag{kind: 'C', step: stepSettings}); err != nil {
		return err
	}
	if !batch {
		if err := send(&pgproto3.Sync{}, &tag{kind: 'S', step: stepSettings, hideReady: true}); err != nil {
			return err
		}
	}
	parked := false
	err := h.then(s, &until{r: exec}, func() error {
		h.resyncInTx = inTx
		if parked {
			// Parked until now: the message is handled again from the
			// start, with the settings read (resynced: not again).
			h.resynced = true
			return ErrWait
		}
		return nil
	})
	parked = err == errParked
	return err
}

// applySettings takes the row resync read. Callers hold h.mu.
func (h *fenceSession) applySettings(s gateConn, msg []byte, t *tag) {
	vals := rowValues(msg)
	if len(vals) != len(settingNames)+5 {
		return
	}
	if t.idleRead {
		state := vals[len(settingNames):]
		h.sessKnown = t.seq
		h.sessDiverged = state[0] != nil || state[1] == nil || *state[1] != "none" ||
			state[2] == nil || *state[2] != h.user || state[3] == nil || *state[3] != "f"
		if state[4] != nil {
			h.defaults, h.defaultsKnown = *state[4], true
		}
	}
	vals = vals[:len(settingNames)]
	for i, n := range settingNames {
		v := vals[i]
		switch n {
		case "client_encoding":
			if v != nil {
				h.be.text.setEncoding(*v, s.Logger())
			}
		case "standard_conforming_strings":
			h.be.text.scsOff = v != nil && *v == "off"
		default:
			if v == nil {
				h.st.Resync(n, "", false)
			} else {
				h.st.Resync(n, *v, true)
			}
		}
	}
	if t.seq > h.be.text.knownSeq {
		h.be.text.knownSeq = t.seq
	}
	if t.seq > h.be.text.gucKnown {
		h.be.text.gucKnown = t.seq
	}
}

// rowValues decodes a DataRow's columns as text (nil for NULL).
func rowValues(msg []byte) []*string {
	b := msg[headerLen:]
	if len(b) < 2 {
		return nil
	}
	n := int(binary.BigEndian.Uint16(b))
	b = b[2:]
	out := make([]*string, 0, n)
	for i := 0; i < n; i++ {
		if len(b) < 4 {
			return nil
		}
		l := int32(binary.BigEndian.Uint32(b))
		b = b[4:]
		if l < 0 {
			out = append(out, nil)
			continue
		}
		if int(l) > len(b) {
			return nil
		}
		v := string(b[:l])
		out = append(out, &v)
		b = b[l:]
	}
	return out
}

// noteSent records what a client request sent upstream may have changed
// that the gate cannot see from its text (see the file comment). code
// reports that it may run code of the client's (!runsNoCode, or text
// the gate could not read): see codeRan.
//
// A statement that visibly leaves the primary session unlike a new
// connection's (pins: SET, a temporary object) pins the session to the
// primary here, whatever path sent it: the router's simple Query, the
// gate's rewritten one, an extended-protocol Execute (round 6: a gated
// transaction's CREATE TEMP TABLE, attacker L's M1, and an Execute of
// SET search_path were not followed).
func (h *fenceSession) noteSent(s gateConn, t *tag) (code bool) {
	var stmts []*rewrite.Stmt
	var pf session.ParamFunc
	unknown := false
	switch t.kind {
	case 'Q':
		if len(t.segs) == 0 {
			unknown = true
		}
		for _, sg := range t.segs {
			if sg.step == stepClient {
				if sg.stmt == nil {
					unknown = true
				} else {
					stmts = append(stmts, sg.stmt)
				}
			}
		}
	case 'E':
		if t.cp == nil || t.cp.stmt == nil {
			unknown = true
		} else {
			stmts = append(stmts, t.cp.stmt)
			h.mu.Lock()
			pf = paramFunc(t.cp, h.be.text.codec)
			h.mu.Unlock()
		}
	case 'F':
		unknown = true
	default:
		return false
	}
	code = unknown
	enc, guc, txEnd := unknown, unknown, false
	gen := unknown // may set the generation unseen (txUnseen)
	if unknown && h.protects() {
		h.idle.fenceCall.Store(t.seq) // may lock protected rows (fence_idle.go)
	}
	pin := false
	for _, st := range stmts {
		switch {
		case st.Kind == rewrite.Discard && st.Name == "ALL":
			pin = false // as notePins: DISCARD ALL unpins
		case pins(st):
			pin = true
		}
		if st.CallsFence || mayLock(st) && h.protects() {
			// fence.gate, fence.acquire...: may lock a fence row; a
			// write, a locking read, LOCK, code: may lock protected
			// rows a gated write (holding its fence row) then waits for.
			h.idle.fenceCall.Store(t.seq)
		}
		code = code || !runsNoCode(st)
		enc = enc || !runsNoCode(st) || changesText(st)
		if !guc {
			// A DO block or a CALL (code the proxy cannot see into, run
			// for its effects: a set_config inside it) may change a
			// tracked setting: read them back before the gate next
			// decides from them. Without it a DO block's
			// set_config('fence.step', ...) left the gate's receipt under
			// the step before, and the backstop's under the new one
			// (round 6, L). A function called in a query is not counted
			// (a read-back before every gated statement after one would
			// cost a round trip each): docs/security.md, receipts.
			guc = st.Kind == rewrite.Do || st.Kind == rewrite.Call
		}
		gen = gen || st.Kind == rewrite.Do || st.Kind == rewrite.Call
		if !guc || !gen {
			h.mu.Lock()
			guc = guc || h.st.Uncertain(st, pf)
			gen = gen || h.st.UncertainGeneration(st, pf)
			h.mu.Unlock()
		}
		switch st.Kind {
		case rewrite.Commit, rewrite.Rollback, rewrite.RollbackTo, rewrite.Release, rewrite.PrepareTransaction:
			txEnd = true
		}
		if st.Kind == rewrite.RollbackTo {
			// It drops the portals made since the savepoint and lets the
			// transaction run those an error had left behind a refused
			// or skipped Bind: what each name means is unknown
			// (portalLive; round 6, attacker M's H1).
			h.portalsTouched = t.seq
		}
	}
	if pin && !s.OnReplica() {
		h.rt.pinned = true
	}
	if !s.OnReplica() && (unknown || h.sessionCode(stmts, ^LSN(0))) {
		// (unknown: text the proxy could not read, a FunctionCall.)
		h.rt.primaryCodeRan = true
	}
	if enc {
		h.encSeq = t.seq
	}
	if gen {
		h.txUnseen = true
	}
	if guc || txEnd && h.resyncInTx {
		h.gucSeq = t.seq
		if txEnd {
			h.resyncInTx = false
		}
	}
	return code
}

// runsNoCode reports whether st certainly runs no code but PostgreSQL's
// own, so it cannot change a setting unseen. Client code runs in far more
// places than a function call the proxy can see: a view's or a policy's
// function, a trigger, a rule, a column's default, a domain's check, an
// operator, a cast, an index expression, a deferred trigger at COMMIT. So
// only statements that evaluate nothing of the client's qualify:
// transaction and savepoint control that fires no trigger, SET and RESET
// (whose own effects changesText weighs), PREPARE (parsed, not run),
// DEALLOCATE, LISTEN, UNLISTEN, DISCARD.
// mayLock reports whether st may take a lock a gated write could wait
// for: anything but a plain read or a statement that reads nothing
// (issue 30, attacker D's M1: a worker's FOR UPDATE or LOCK TABLE without
// fence metadata, left idle, held another role's gated write, and with it
// that job's fence row and its takeover).
func mayLock(st *rewrite.Stmt) bool {
	if runsNoCode(st) {
		return false
	}
	switch st.Kind {
	case rewrite.Read, rewrite.CopyTo:
		return st.LockingRead || st.Opaque || st.UserCalls || st.PrimaryOnlyFuncs || st.Executes != ""
	case rewrite.Commit, rewrite.Notify:
		return false
	}
	return true
}

// protects reports whether the session's database has protected tables
// (as far as the catalog knows; unknown counts as yes).
func (h *fenceSession) protects() bool {
	if h.cat == nil {
		return true
	}
	p := h.cat.prot.Load()
	return p == nil || p.Len() > 0
}

func runsNoCode(st *rewrite.Stmt) bool {
	switch st.Kind {
	case rewrite.Begin, rewrite.Savepoint, rewrite.Release, rewrite.RollbackTo, rewrite.Rollback,
		rewrite.Set, rewrite.Reset, rewrite.ResetAll, rewrite.Prepare, rewrite.Deallocate,
		rewrite.Listen, rewrite.Unlisten, rewrite.Discard:
		return len(st.Builtins) == 0 && !st.Opaque
	}
	return false
}

// changesText reports whether st may change how the server reads the
// client's text: client_encoding (SET NAMES too), standard_conforming_strings,
// RESET ALL, DISCARD ALL, an effect on a parameter it cannot name, or the
// end of a transaction or savepoint that undoes such a change.
func changesText(st *rewrite.Stmt) bool {
	if st.UnknownGUCWrite {
		return true
	}
	switch st.Kind {
	case rewrite.Commit, rewrite.Rollback, rewrite.RollbackTo, rewrite.Release, rewrite.PrepareTransaction:
		return true
	case rewrite.Discard:
		return st.Name == "ALL"
	}
	for _, g := range st.GUCs {
		switch {
		case g.Op == rewrite.GUCResetAll, g.Name == "", g.Uncertain(),
			g.Name == "client_encoding", g.Name == "standard_conforming_strings":
			return true
		}
	}
	return false
}

// settleSettings reads the tracked settings back before the gate decides
// from them, when a request since the last read may have changed them in
// a way its text does not tell.
func (h *fenceSession) settleSettings(s gateConn) error {
	h.mu.Lock()
	uncertain := h.gucSeq > h.be.text.gucKnown
	h.mu.Unlock()
	if !uncertain {
		return nil
	}
	return h.resync(s)
}

// isTextError reports whether err is decodeText's verdict on the text
// (not a failure to wait).
func isTextError(err error) bool {
	_, ok := err.(*clientenc.Error)
	return ok
}

// textError is the refusal of text the gate cannot read safely: invalid
// in the client's encoding, or rejected by the parser.
func textError(err error) *fence.Error {
	if ce, ok := err.(*clientenc.Error); ok {
		return &fence.Error{Code: ce.Code, Message: ce.Message,
			Hint: "send text valid in the session's client_encoding, or set client_encoding to the encoding the client really uses"}
	}
	var pe *rewrite.ParseError
	if e, ok := err.(*rewrite.ParseError); ok {
		pe = e
	}
	if pe != nil {
		return &fence.Error{Code: "42601", Message: strings.TrimPrefix(pe.Err.Error(), "classify: "),
			Hint: "pgfence could not parse this statement, so it was not sent: on a fenced session every statement must be one PostgreSQL's grammar accepts"}
	}
	return &fence.Error{Code: "42601", Message: err.Error()}
}
