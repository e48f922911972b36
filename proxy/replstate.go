package proxy

import (
	"strings"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
)

// The session state of a session's two backends (issue 30: attacker C's
// H4, M2, H5). The gate's view of the session (session.State, textState)
// is the primary backend's; the replica backend serves autocommit reads
// and read-only transactions, and must read what it is sent as the gate
// classified it, and keep nothing the primary's session does not have.
//
//   - The end of a transaction open on the replica ends what the replica
//     may run unjudged: a simple Query that goes on after its COMMIT (or
//     ROLLBACK, END, ABORT, PREPARE TRANSACTION; not AND CHAIN) is split
//     there. The part up to the end runs on the replica with its
//     ReadyForQuery hidden; if it raised an error, PostgreSQL would have
//     skipped the rest, so the client gets the ReadyForQuery and nothing
//     more; otherwise the rest is routed afresh, as the query it is (its
//     statements form their own implicit transaction block, as they did
//     within the whole query). An extended-protocol batch that ends the
//     transaction on the replica may not run another statement before its
//     Sync (0A000): the batch cannot be split where the server skips to
//     Sync after an error.
//   - Inside a transaction on the replica, a statement that would leave
//     the replica's session other than the primary's is refused (0A000):
//     a setting changed for longer than the transaction (SET, RESET,
//     set_config(..., false), SET SESSION CHARACTERISTICS, SET ROLE),
//     SET LOCAL of a setting that changes how text is read
//     (standard_conforming_strings, client_encoding), PREPARE, DEALLOCATE,
//     DISCARD, LISTEN, UNLISTEN, a temporary object, a FunctionCall. Its
//     transaction fails, as for any error. SET LOCAL of other settings,
//     SET TRANSACTION and savepoints run.
//   - Text is read on the replica under the primary's
//     standard_conforming_strings and client_encoding, which the gate
//     classified it under: the replica backend's reports of both are kept
//     per connection (never passed to the client), and when they differ
//     from the primary's, a SET of each is sent ahead of the text, in the
//     same write (no round trip; nothing when they agree). Within an
//     extended-protocol batch the SET is sent ahead of text that reads
//     differently under other settings (a backslash, a byte above 0x7F):
//     a statement of the batch may have changed them unreported yet.

// txEnd is the index of the statement of stmts that ends the open
// transaction, or -1.
func txEnd(stmts []*rewrite.Stmt) int {
	for i, st := range stmts {
		switch st.Kind {
		case rewrite.Commit, rewrite.Rollback:
			if !st.Chain {
				return i
			}
		case rewrite.PrepareTransaction:
			return i
		}
	}
	return -1
}

// revives is the index of the first statement of stmts that brings a
// failed transaction back (ROLLBACK TO SAVEPOINT, COMMIT AND CHAIN,
// ROLLBACK AND CHAIN): the server runs the statements after it, or -1.
func revives(stmts []*rewrite.Stmt) int {
	for i, st := range stmts {
		switch st.Kind {
		case rewrite.RollbackTo:
			return i
		case rewrite.Commit, rewrite.Rollback:
			if st.Chain {
				return i
			}
		}
	}
	return -1
}

// replicaOnlyState reports whether st, run inside a transaction on the
// replica, may leave the replica backend's session unlike the primary's
// after the transaction, or read later text unlike the gate.
func replicaOnlyState(st *rewrite.Stmt) bool {
	if st.UnknownGUCWrite || st.Temp {
		return true
	}
	switch st.Kind {
	case rewrite.Reset, rewrite.ResetAll, rewrite.Discard, rewrite.Prepare, rewrite.Deallocate,
		rewrite.Listen, rewrite.Unlisten:
		return true
	case rewrite.Other:
		// SET SESSION CHARACTERISTICS AS TRANSACTION ...: the session's
		// default_transaction_* settings.
		if strings.EqualFold(st.Name, "SESSION CHARACTERISTICS") {
			return true
		}
	}
	for _, g := range st.GUCs {
		if g.Unknown || !g.Local || g.Name == "" || g.NameParam != 0 || g.LocalParam != 0 ||
			g.Name == "client_encoding" || g.Name == "standard_conforming_strings" {
			return true
		}
	}
	return false
}

// errReplicaState is the refusal of a statement replicaOnlyState finds.
func errReplicaState() *fence.Error {
	return &fence.Error{Code: "0A000",
		Message: "pgfence: this statement would change the session of the replica serving this read-only transaction, not the session's own",
		Hint:    "change settings, prepared statements and other session state outside a READ ONLY transaction (SET LOCAL of settings other than standard_conforming_strings and client_encoding is allowed)"}
}

// errReplicaUnread refuses text the proxy cannot read inside a
// transaction on the replica (text PostgreSQL's grammar of the server's
// version accepts and the classifier's, PostgreSQL 17's, does not: a
// reserved word of a later version used as a name, say).
func errReplicaUnread() *fence.Error {
	return &fence.Error{Code: "0A000",
		Message: "pgfence cannot parse this statement, so it cannot judge it inside a read-only transaction served by a replica",
		Hint:    "run it outside a READ ONLY transaction (it then goes to the primary), or write it as PostgreSQL 17 reads it too (quote a name that is a reserved word there: system_user as a table alias, say)"}
}

// errReplicaGatedEnd refuses a query the gate rewrites that goes on after
// the end of a transaction on the replica: what follows the end needs the
// gate's plan for a session no longer in that transaction.
func errReplicaGatedEnd() *fence.Error {
	return &fence.Error{Code: "0A000",
		Message: "pgfence: a query that ends a read-only transaction served by a replica cannot go on with statements the write gate handles",
		Hint:    "send COMMIT or ROLLBACK as a query of its own, then the next statements"}
}

// replicaGated checks a query the gate rewrites, sent inside the
// transaction open on the replica (where it fails as it would on the
// primary): nil, or the refusal.
func replicaGated(stmts []*rewrite.Stmt) *fence.Error {
	end := len(stmts)
	if i := txEnd(stmts); i >= 0 {
		end = i + 1
	}
	for _, st := range stmts[:end] {
		if replicaOnlyState(st) {
			return errReplicaState()
		}
	}
	if end < len(stmts) {
		return errReplicaGatedEnd()
	}
	return nil
}

// errReplicaBatchEnd refuses a statement after the end of a transaction
// on the replica in the same extended-protocol batch.
func errReplicaBatchEnd() *fence.Error {
	return &fence.Error{Code: "0A000",
		Message: "pgfence: a batch that ends a read-only transaction served by a replica cannot run another statement before its Sync",
		Hint:    "send Sync after COMMIT or ROLLBACK, then the next statements"}
}

// inReplicaTx: the transaction open on the replica. On the replica the
// statements of stmts up to the end of the transaction are checked
// (replicaOnlyState) and, when the query goes on after it, it is split
// (splitAtTxEnd). Otherwise the query is sent there, in line with the
// primary's lexing settings. Client side, with nothing outstanding.
func (h *fenceSession) inReplicaTx(s gateConn, msg []byte, res *rewrite.Result, stmts []*rewrite.Stmt) error {
	raw := msg[headerLen : len(msg)-1]
	if res == nil {
		// Text the proxy could not read (round 8, attacker P's H5, M3):
		// what it reads and which session state it changes are unknown,
		// and it cannot move to the primary.
		return h.refuseQuery(s, errReplicaUnread())
	}
	end := len(stmts)
	if i := txEnd(stmts); i >= 0 {
		end = i + 1
	}
	for _, st := range stmts[:end] {
		if replicaOnlyState(st) {
			return h.refuseQuery(s, errReplicaState())
		}
	}
	if h.tx() == session.Failed {
		// The server runs nothing of a failed transaction but what ends
		// it or brings it back (ROLLBACK TO, COMMIT or ROLLBACK AND
		// CHAIN); what follows one of those runs in the transaction
		// again. So the query is split after it, and the rest judged as
		// a query of its own once the server has answered (round 8,
		// attacker P's H4): whether the transaction failed is known per
		// statement, not per query.
		if i := revives(stmts[:end]); i >= 0 && i+1 < len(stmts) {
			return h.splitAtTxEnd(s, msg, res, i+1)
		}
	}
	if err := h.alignReplica(s, raw); err != nil {
		return err
	}
	if h.tx() != session.Failed {
		// SQL-level prepared statements it EXECUTEs: made on the replica
		// too (route.go).
		if err := h.sqlCopies(s, stmts[:end], false); err != nil {
			return err
		}
	}
	if end == len(stmts) {
		return h.routeInTx(s, msg, res, stmts)
	}
	// Judged by the takeover tracker: once it is current (freshInTx).
	return h.freshInTx(s, stmts[:end], false, func() error { return h.headInTx(s, msg, res, stmts, end) })
}

// headInTx sends a query that ends the transaction on the replica and
// goes on after it (inReplicaTx).
func (h *fenceSession) headInTx(s gateConn, msg []byte, res *rewrite.Result, stmts []*rewrite.Stmt, end int) error {
	// The part up to the end runs in the transaction: judged against
	// its snapshots first, refused rather than waited for (a rare shape);
	// the rest is routed afresh.
	if r := s.replicaOpen(); r != nil && h.tx() != session.Failed { // failed: nothing in the head brings it back (above)
		head, neutral, cursor := stmts[:end], true, false
		h.noteImport(head)
		for _, st := range head {
			neutral = neutral && neutralStmt(st)
			cursor = cursor || h.readsCursor(st, LSN(r.replay.Load()))
		}
		if !neutral {
			if req, protected, _ := h.txRequire(r, head); protected && (req.blind || req.check || req.lsn > h.txBound(cursor)) {
				return h.refuseInTx(s, r, req, "the transaction's snapshot, or a cursor's, was taken before")
			}
		}
		h.noteHold(head, false, LSN(r.replay.Load()))
		h.rt.replicaState = h.rt.replicaState || h.sessionCode(head, LSN(r.replay.Load())) // code may change the replica's session (route.go)
	}
	return h.splitAtTxEnd(s, msg, res, end)
}

// splitAtTxEnd sends the statements of res before end (the last of them
// ends the transaction on the replica) and, once answered without an
// error, routes the rest as a query of its own.
func (h *fenceSession) splitAtTxEnd(s gateConn, msg []byte, res *rewrite.Result, end int) error {
	raw := msg[headerLen : len(msg)-1]
	off := res.Stmts[end].Offset
	h.mu.Lock()
	c := h.be.text.codec
	h.mu.Unlock()
	var head, rest []byte
	if c == nil || c.IsUTF8() {
		if off > len(raw) {
			return h.refuseQuery(s, errReplicaBatchEnd()) // unreachable: offsets are the text's
		}
		head, rest = raw[:off], raw[off:]
	} else {
		sql, err := c.Decode(raw)
		if err != nil || off > len(sql) {
			return h.refuseQuery(s, textError(err))
		}
		head, rest = h.encode(sql[:off]), h.encode(sql[off:])
	}
	headRes := &rewrite.Result{Stmts: res.Stmts[:end]}
	// The rest's statements at their offsets in its own text (it may be
	// split again); copies: the classifier's results may be shared.
	restRes := &rewrite.Result{Stmts: make([]*rewrite.Stmt, 0, len(res.Stmts)-end)}
	for _, st := range res.Stmts[end:] {
		c := *st
		c.Offset -= off
		restRes.Stmts = append(restRes.Stmts, &c)
	}
	t := &tag{kind: 'Q', segs: clientSegs(headRes), hideReady: true}
	if err := h.send(s, queryMsg(nil, string(head)), t, true); err != nil {
		return err
	}
	return h.barrierThen(s, func() error {
		h.mu.Lock()
		failed := h.errShown
		h.mu.Unlock()
		if failed {
			// PostgreSQL skips the rest of a query after an error: the
			// client gets the ReadyForQuery it would have, an empty
			// query's (its EmptyQueryResponse hidden).
			return h.send(s, h.qmsg(""), &tag{kind: 'Q', segs: []seg{{step: stepAlign}}}, true)
		}
		next := queryMsg(nil, string(rest))
		return h.routeQuery(s, next, restRes)
	})
}

// alignReplica makes the replica backend read the next text as the gate
// classified it: with the primary's standard_conforming_strings and
// client_encoding. It sends the SETs needed, hidden, ahead of the text
// (nothing when they agree). Outside an extended-protocol batch, with
// nothing outstanding on the replica: its reports are current.
func (h *fenceSession) alignReplica(s gateConn, raw []byte) error {
	if h.inBatch {
		return h.alignReplicaBatch(s, raw)
	}
	sql, scs, enc := h.replicaDiff(s, false)
	if sql == "" {
		return nil
	}
	s.setReplicaText(scs, enc)
	segs := make([]seg, 0, 2)
	for range splitN(sql) {
		segs = append(segs, seg{step: stepAlign})
	}
	return h.send(s, h.qmsg(sql), &tag{kind: 'Q', segs: segs, hideReady: true}, false)
}

// alignReplicaBatch is alignReplica inside an extended-protocol batch on
// the replica, ahead of raw, the text of a Parse: text that reads alike
// under every setting needs nothing; other text gets the SETs whatever
// the backend last reported, since a statement of the batch may have
// changed them unreported yet.
func (h *fenceSession) alignReplicaBatch(s gateConn, raw []byte) error {
	if !sensitive(raw) {
		return nil
	}
	sql, scs, enc := h.replicaDiff(s, true)
	if sql == "" {
		return nil
	}
	s.setReplicaText(scs, enc)
	for _, q := range splitN(sql) {
		if err := h.alignInBatch(s, q); err != nil {
			return err
		}
	}
	return nil
}

// replicaDiff is the SET statements that give the replica backend the
// primary's lexing settings (all of them with force), and those values.
func (h *fenceSession) replicaDiff(s gateConn, force bool) (sql, scs, enc string) {
	rscs, renc, ok := s.replicaText()
	if !ok || !s.OnReplica() {
		return "", "", ""
	}
	h.mu.Lock()
	scs, enc = "on", h.be.text.encName
	if h.be.text.scsOff {
		scs = "off"
	}
	failed := h.st.Tx() == session.Failed
	h.mu.Unlock()
	if failed || enc == "" {
		return "", "", "" // the server reads nothing but the end of the transaction
	}
	if force || rscs != scs {
		sql += "SET standard_conforming_strings = " + scs + ";"
	}
	if force || renc != enc {
		sql += "SET client_encoding = " + plan.Literal(enc) + ";"
	}
	return sql, scs, enc
}

// splitN splits replicaDiff's SQL into its statements.
func splitN(sql string) []string {
	var out []string
	for len(sql) > 0 {
		i := 0
		for i < len(sql) && sql[i] != ';' {
			i++
		}
		out = append(out, sql[:i])
		if i < len(sql) {
			i++
		}
		sql = sql[i:]
	}
	return out
}

// alignInBatch sends q in the batch as the gate's own
// statement (Parse, Bind, Execute, Close of plan.RaiseStatement), its
// answers hidden.
func (h *fenceSession) alignInBatch(s gateConn, q string) error {
	const name = plan.RaiseStatement
	var buf []byte
	for _, m := range []pgproto3.FrontendMessage{
		&pgproto3.Close{ObjectType: 'S', Name: name},
		&pgproto3.Parse{Name: name, Query: q},
		&pgproto3.Bind{DestinationPortal: plan.Portal, PreparedStatement: name},
		&pgproto3.Execute{Portal: plan.Portal},
		&pgproto3.Close{ObjectType: 'P', Name: plan.Portal},
		&pgproto3.Close{ObjectType: 'S', Name: name},
	} {
		buf, _ = m.Encode(buf[:0])
		var kind byte
		switch m.(type) {
		case *pgproto3.Close:
			kind = 'C'
		case *pgproto3.Parse:
			kind = 'P'
		case *pgproto3.Bind:
			kind = 'B'
		case *pgproto3.Execute:
			kind = 'E'
		}
		if err := h.send(s, buf, &tag{kind: kind, step: stepAlign}, false); err != nil {
			return err
		}
	}
	return nil
}

// replicaBatch checks an Execute of st in an extended-protocol batch on
// the replica (inside its transaction): nil to send it, else the refusal.
func (h *fenceSession) replicaBatch(st *rewrite.Stmt) *fence.Error {
	if h.rt.batchEnded {
		return errReplicaBatchEnd()
	}
	if st == nil {
		return nil
	}
	if replicaOnlyState(st) {
		return errReplicaState()
	}
	if txEnd([]*rewrite.Stmt{st}) == 0 {
		h.rt.batchEnded = true
	}
	return nil
}
