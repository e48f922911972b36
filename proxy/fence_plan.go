package proxy

import (
	"encoding/binary"
	"fmt"
	"strings"
	"unicode/utf8"

	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
)

// protectedWrite reports whether st may write a protected table. Callers
// hold h.mu.
func (h *fenceSession) protectedWrite(st *rewrite.Stmt) bool {
	return plan.ProtectedWrite(h.cat.prot.Load(), h.st, st)
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
	if st == nil || !h.fenceUsable() {
		return false
	}
	// A COPY FROM into another table is left out: a trigger of that table
	// writing a protected one is fenced and receipted by the backstop
	// itself (backstop-v1), and wrapping every COPY of a fenced session
	// would move its data off the event loop.
	return st.Kind != rewrite.CopyFrom && (st.Writes() || plan.Opaque(st))
}

// fenceUsable reports whether the session's database has a fence schema
// the gate can rely on. It is the one predicate for "no fence schema":
// where it is false the gate adds nothing to any transaction, and a
// session that presents fence metadata has its writes refused (FN014,
// noFenceSchema). A fence schema the proxy does not trust (not owned by a
// superuser) must count as none here. Callers hold h.mu, or need no
// consistency with the rest of the session's state.
func (h *fenceSession) fenceUsable() bool { return h.cat.schema.Load() }

// noFenceSchema is FN014 for the first of stmts that writes or may write
// (DML, COPY FROM, DDL that writes rows, CALL, DO, a function call,
// EXECUTE) in a session that presents fence metadata — fence.job_key,
// fence.epoch or fence.token set, by the startup options, an earlier SET
// or set_config, or a SET in stmts themselves — in a database the proxy
// knows no usable fence schema of (fenceUsable): the client means its
// writes to be fenced, and nothing can fence them there. It returns nil
// otherwise: unfenced work passes, as PostgreSQL lets it, and so do a
// fenced session's reads, and statements in a failed transaction (the
// server refuses them). The session itself is not refused at its start:
// tools that carry PGOPTIONS everywhere still connect and read.
//
// The proxy's knowledge may be old: a database restored whole after the
// proxy's first session in it has the schema before the catalog is read
// again (docs/security.md, "The protected set is always current"). So the
// refusal is sent as noSchemaProbe, which the server raises only if the
// database still has no fence schema owned by a superuser when the
// statement runs; otherwise the statement runs, fenced by the backstop,
// as before. Callers hold h.mu, with the session state settled.
func (h *fenceSession) noFenceSchema(stmts ...*rewrite.Stmt) *fence.Error {
	if h.fenceUsable() || h.st.Tx() == session.Failed || !presentsFence(h.st, stmts) {
		return nil
	}
	for _, st := range stmts {
		// What writes, and the statements that are there to run code
		// (CALL, DO, EXECUTE). A read that calls functions passes: tools
		// that carry PGOPTIONS everywhere read the catalogs with
		// built-ins the classifier does not know by name (pg_dumpall:
		// acldefault, array_to_string, shobj_description), and where
		// there is no fence schema nothing is protected. A SELECT of a
		// user's function that writes is the gap (docs/security.md).
		if st.Writes() || st.Kind == rewrite.CopyFrom || st.Kind == rewrite.Call || st.Kind == rewrite.Do || st.Kind == rewrite.Execute {
			h.f.warnOnce("fencedNoSchema:"+h.db, "fenced client in a database without a fence schema: its writes are refused (FN014) until `pgfence migrate` runs",
				zap.String("database", h.db), zap.String("user", h.user))
			return &fence.Error{Code: fence.CodeNotInstalled,
				Message: fmt.Sprintf("pgfence: database %q has no fence schema (none owned by a superuser), so the fence metadata this session presents (fence.job_key, fence.epoch, fence.token) cannot fence its writes: refused", h.db),
				Hint:    fmt.Sprintf("a DBA runs: pgfence migrate --database 'postgres://<dba>@<host>/%s'; or connect without fence metadata (PGOPTIONS) to write unfenced", h.db)}
		}
	}
	return nil
}

// noSchemaProbe is a statement that fails with e unless the database has a
// schema fence owned by a superuser. Everything in it is qualified: it
// runs with the client's search_path.
func noSchemaProbe(e *fence.Error) string {
	return "DO $pgfence$BEGIN IF NOT EXISTS (SELECT FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles r" +
		" ON r.oid OPERATOR(pg_catalog.=) n.nspowner WHERE n.nspname OPERATOR(pg_catalog.=) " + plan.Literal("fence") +
		" AND r.rolsuper) THEN RAISE EXCEPTION USING ERRCODE = " + plan.Literal(e.Code) + ", MESSAGE = " + plan.Literal(e.Message) +
		", HINT = " + plan.Literal(e.Hint) + "; END IF; END$pgfence$"
}

// prepareLockProbe fails with FN009 when this backend holds any lock on
// a protected table (issue 30, attacker C's M1): a prepared transaction
// keeps its locks after its client has gone, until an administrator
// ends it, so one that read FOR UPDATE another job's rows, locked a
// protected table or wrote it pins that job for ever. The database
// refuses PREPARE only after a fenced write (a temporary relation opened
// then); a locking read runs no pgfence code. PostgreSQL's own lock table
// decides, not the text: a lock taken through a view, a function or a
// CTE counts. A protected table is one with a trigger calling a function
// of schema fence (pg_trigger and pg_proc are readable by every role,
// fence.protected_tables is not); a client that puts such a trigger on
// its own table only refuses its own PREPARE. Sent by the proxy right
// before a client's PREPARE TRANSACTION, in the client's transaction,
// with the client's search_path: everything is qualified.
//
// PREPARE fires the transaction's deferred triggers, after the probe: a
// client's deferred constraint trigger would take its locks then (round
// 2, attacker E's M1), and one fired early can defer itself again (SET
// CONSTRAINTS inside it). So the probe also refuses a transaction that
// may have deferred trigger events pending: one that changed (holds a
// lock stronger than ROW SHARE on) a table with a deferrable trigger.
// Only a change queues a constraint trigger's event (they are AFTER ROW
// triggers of INSERT, UPDATE, DELETE, MERGE and COPY), and a change holds
// its table's lock to the end of the transaction: the lock table decides
// again, not the text. A deferrable foreign key counts too (its checks
// are such triggers, and take KEY SHARE locks on the rows they reference).
var prepareLockProbe = own("PREPARE TRANSACTION lock probe", onSession, `DO $pgfence$BEGIN IF EXISTS (SELECT FROM pg_catalog.pg_locks AS l
  JOIN pg_catalog.pg_trigger AS t ON t.tgrelid OPERATOR(pg_catalog.=) l.relation
  JOIN pg_catalog.pg_proc AS f ON f.oid OPERATOR(pg_catalog.=) t.tgfoid
  JOIN pg_catalog.pg_namespace AS n ON n.oid OPERATOR(pg_catalog.=) f.pronamespace
  WHERE l.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid() AND l.locktype OPERATOR(pg_catalog.=) 'relation'
    AND l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database AS d WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
    AND n.nspname OPERATOR(pg_catalog.=) 'fence') THEN
  RAISE EXCEPTION USING ERRCODE = 'FN009', MESSAGE = 'PREPARE TRANSACTION is not supported in a transaction that locked a protected table (read it FOR UPDATE or FOR SHARE, locked or wrote it): a prepared transaction keeps its locks after its client has gone',
    HINT = 'COMMIT or ROLLBACK the transaction';
END IF;
IF EXISTS (SELECT FROM pg_catalog.pg_locks AS l
  JOIN pg_catalog.pg_trigger AS t ON t.tgrelid OPERATOR(pg_catalog.=) l.relation
  WHERE l.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid() AND l.locktype OPERATOR(pg_catalog.=) 'relation'
    AND l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database AS d WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
    AND l.mode OPERATOR(pg_catalog.<>) 'AccessShareLock' AND l.mode OPERATOR(pg_catalog.<>) 'RowShareLock'
    AND t.tgdeferrable) THEN
  RAISE EXCEPTION USING ERRCODE = 'FN009', MESSAGE = 'PREPARE TRANSACTION is not supported, in a database with protected tables, in a transaction that changed a table with deferrable constraint triggers or foreign keys: they run at PREPARE, after pgfence has checked the transaction''s locks',
    HINT = 'COMMIT or ROLLBACK the transaction';
END IF; END$pgfence$`)

// prepareProbed reports whether stmts has a PREPARE TRANSACTION the lock
// probe must precede: in a database with a fence schema and protected
// tables. Callers hold h.mu.
func (h *fenceSession) prepareProbed(stmts []*rewrite.Stmt) bool {
	if !h.fenceUsable() || h.cat.prot.Load().Len() == 0 {
		return false
	}
	for _, st := range stmts {
		if st.Kind == rewrite.PrepareTransaction {
			return true
		}
	}
	return false
}

// probeQuery sends a simple query of a fenced session in a database the
// proxy knows no fence schema of with noSchemaProbe before it, in the
// same query: the server skips the client's statements if the probe fails.
func (h *fenceSession) probeQuery(s gateConn, sql string, res *rewrite.Result, e *fence.Error) error {
	return h.probeQueryWith(s, sql, res, noSchemaProbe(e))
}

// probeQueryWith sends a simple query with probe before it, in the same
// query: the server skips the client's statements if the probe fails.
func (h *fenceSession) probeQueryWith(s gateConn, sql string, res *rewrite.Result, probe string) error {
	probe += ";"
	segs := append([]seg{{step: stepRaise, stmt: res.Stmts[0]}}, clientSegs(res)...)
	t := &tag{kind: 'Q', segs: segs, inserts: plan.Insertions{{At: 0, N: utf8.RuneCountInString(probe)}}}
	if plan.ChangesState(res.Stmts...) {
		defer h.markState()
	}
	return h.send(s, h.qmsg(probe+sql), t, true)
}

// noFenceSchemaCall is noFenceSchema for a FunctionCall message (the
// fast path), which calls a function by its OID msg names: a user's
// function (an OID from FirstNormalObjectId on) may write. A built-in's
// (below it: libpq's large-object calls, which pg_restore makes) passes,
// as a read calling a built-in does: the message cannot carry the
// server-side probe, and the proxy's knowledge of the schema may be older
// than a restore running through this very session.
func (h *fenceSession) noFenceSchemaCall(msg []byte) *fence.Error {
	if len(msg) >= 9 && binary.BigEndian.Uint32(msg[5:9]) < firstNormalObjectID {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.noFenceSchema(&rewrite.Stmt{Kind: rewrite.Call, Opaque: true, UserCalls: true})
}

// userFunctionCall reports whether the FunctionCall msg calls a function
// made after initdb (a user's, which may write), or one it cannot read.
func userFunctionCall(msg []byte) bool {
	return len(msg) < 9 || binary.BigEndian.Uint32(msg[5:9]) >= firstNormalObjectID
}

// fencedFunctionCall refuses a FunctionCall of a user's function in a
// fenced session (one that presents a generation, or whose transaction
// owes a receipt): FN009. The fast path carries no query text: its
// arguments would be in no receipt's digest, nor in the backstop's
// (current_query() is empty), so a different call under a committed step
// would be answered as its replay "with the same payload" (round 23,
// AV-M2). The same call as SELECT f($1) is digested whole. Built-ins
// (libpq's large-object calls) pass, as elsewhere. Callers have the
// session state settled.
func (h *fenceSession) fencedFunctionCall() *fence.Error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.mayOweReceipt() { // fence_extended.go
		return nil
	}
	return &fence.Error{Code: fence.CodeUnsupported,
		Message: "a fast-path function call (FunctionCall message) of a user's function in a fenced session is not supported: its arguments would not be in the commit receipt's payload digest",
		Hint:    "call the function with a query, SELECT f($1, ...), which the receipt's digest covers"}
}

// firstNormalObjectID is PostgreSQL's FirstNormalObjectId: every OID below
// it was made by initdb.
const firstNormalObjectID = 16384

// presentsFence reports whether a session in state ss presents fence
// metadata to stmts: one of the generation's settings is set, or a
// statement of stmts sets one.
func presentsFence(ss *session.State, stmts []*rewrite.Stmt) bool {
	for _, name := range []string{session.JobKey, session.Epoch, session.Token} {
		if _, ok := ss.Get(name); ok {
			return true
		}
	}
	for _, st := range stmts {
		for _, g := range st.GUCs {
			if g.Op == rewrite.GUCSet && strings.HasPrefix(strings.ToLower(g.Name), "fence.") {
				return true
			}
		}
	}
	return false
}

// planTables answers the planner's questions about the protected tables
// from the session's catalog (plan.Tables). Callers hold h.mu.
type planTables fenceSession

func (t *planTables) ProtectedWrite(st *rewrite.Stmt) bool {
	return (*fenceSession)(t).protectedWrite(st)
}

func (t *planTables) MayWriteUnseen(st *rewrite.Stmt) bool {
	return (*fenceSession)(t).maybeWrite(st)
}

func (t *planTables) ProtectedTable(st *rewrite.Stmt) string {
	if rels := t.cat.prot.Load().ProtectedWrites(st, t.st.SearchPath()); len(rels) > 0 {
		return rels[0].String()
	}
	return ""
}

// planSession is what the planner knows of the session. Callers hold
// h.mu, with the session state settled.
func (h *fenceSession) planSession() plan.Session {
	return plan.Session{State: h.st, Tables: (*planTables)(h)}
}
