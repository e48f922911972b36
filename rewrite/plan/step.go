package plan

import (
	"fmt"
	"strings"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/session"
)

// Kind is what a step of a plan is.
type Kind uint8

const (
	// Client is the client's own statement Stmt.
	Client Kind = iota
	// Begin opens a transaction block around an implicit transaction
	// (a protected COPY FROM in a simple query, whose receipt must
	// follow its data).
	Begin
	// Gate is the lock check, fence.gate(Gen), before the transaction's
	// first protected write.
	Gate
	// Savepoint is SAVEPOINT ReceiptSavepoint before a receipt in the
	// client's own transaction, so that what follows can tell a failed
	// receipt from a failed statement of the client's.
	Savepoint
	// Receipt is the commit receipt: fence.commit(Gen, digest) when
	// Gated, else fence.commit_if_written.
	Receipt
	// Raise fails the query or batch with Err, as PostgreSQL fails a
	// statement of its own.
	Raise
)

var kindNames = [...]string{Client: "statement", Begin: "begin", Gate: "gate", Savepoint: "savepoint", Receipt: "receipt", Raise: "raise"}

func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return "kind?"
}

// Step is one statement of a plan: the client's, or one the gate injects.
type Step struct {
	Kind Kind
	// Stmt is the index of the client's statement the step is (Client)
	// or stands before; -1 after the last.
	Stmt int
	// At is where a step of a simple query goes in the client's text:
	// the byte offset of the statement it stands before, or -1 after
	// the last (the text is then separated by a newline, since the
	// client's may end in a -- comment).
	At int

	Gen fence.Generation // Gate, Receipt: the generation checked
	// genFrom is where a simple query's plan took Gen from: 0 the
	// transaction's gate state (session.Gate.Gen), i+1 the fence settings
	// as statement i runs (the session's, with the query's own SETs
	// before it). The Cache puts the session's generation into a plan it
	// reuses from there.
	genFrom int
	// Gated: a receipt after the gate (fence.commit); else the
	// transaction is tentative (fence.commit_if_written).
	Gated bool
	// BeforeCommit: a receipt right before the client's COMMIT, which
	// on a replay must still be answered COMMIT.
	BeforeCommit bool
	// TxBound: a receipt of an extended batch's implicit transaction in
	// which something that may end it ran after the gate (a CALL or DO
	// that commits inside, a Query or FunctionCall message): it runs as
	// TxReceiptStatement, bound to the transaction id taken before that
	// (ExecPlan.CaptureTx, Batch.MayEnd).
	TxBound bool
	Digest  Digest // Receipt: what its digest covers

	Err *fence.Error // Raise: the refusal
}

// Source is where a receipt's digest comes from.
type Source uint8

const (
	// FromTransaction: the transaction's digest (session.Gate.Digest)
	// with Digest.Stmts added.
	FromTransaction Source = iota
	// FromStatements: a new digest of Digest.Stmts (the transaction
	// began in this query).
	FromStatements
	// FromClient: the client's own fence.payload_digest,
	// Digest.Sum, version ClientDigestVersion.
	FromClient
	// FromSession: as the session has it when the step is sent (after a
	// COPY's data): its fence.payload_digest, else the transaction's
	// digest.
	FromSession
	// FromBatch: the extended-protocol batch's own, Digest.Sum and
	// Digest.Version, computed by Batch from the statements it executed
	// with their parameters and their COPY data.
	FromBatch
)

// Digest says what a receipt's payload digest covers.
type Digest struct {
	Source  Source
	Stmts   []int  // FromTransaction, FromStatements: the query's statements it adds, in order
	Sum     []byte // FromClient, FromBatch
	Version string // FromBatch
	Items   int    // FromBatch: how many items it covers (for String)
	// sumFrom is where a simple query's plan took FromClient's Sum from,
	// as Step.genFrom: i+1, the fence settings as statement i runs
	// (len(stmts)+1: after the last). The Cache puts the session's
	// digest into a plan it reuses from there.
	sumFrom int
}

// Resolve computes the digest a receipt step sends for d: stmts are the
// query's statements, ss the session (its transaction's running digest,
// its fence.payload_digest). For FromTransaction it adds d.Stmts to the
// transaction's digest and takes them off again, so the caller holds the
// session state as it would to change it.
func Resolve(d Digest, ss *session.State, stmts []*rewrite.Stmt) ([]byte, string) {
	switch d.Source {
	case FromClient:
		return d.Sum, ClientDigestVersion
	case FromBatch:
		return d.Sum, d.Version
	case FromSession:
		if sum, ok := clientDigest(ss.Get(session.PayloadDigest)); ok {
			return sum, ClientDigestVersion
		}
		if live, ok := ss.Gate().Digest.(*fence.Digest); ok {
			return live.Sum(), fence.DigestVersion
		}
		return (&fence.Digest{}).Sum(), fence.DigestVersion
	}
	live, ok := ss.Gate().Digest.(*fence.Digest)
	if d.Source == FromStatements || !ok {
		live = &fence.Digest{}
	}
	mark := live.Mark()
	for _, i := range d.Stmts {
		live.Statement(DigestText(stmts[i], queryPrepared(ss, stmts[:i])), nil)
	}
	sum := live.Sum()
	live.Rollback(mark)
	return sum, fence.DigestVersion
}

// DigestText is what statement st adds to a receipt's digest: its
// canonical text and, for an EXECUTE, what the prepared statement it runs
// is, as prepared finds it by name ("": not known). The name alone left
// what the write does out of the digest: a different write under a
// committed step, the same EXECUTE of a statement prepared anew, was
// answered as its replay "with the same payload" (round 18, attacker AG's
// M1); so did the same statement prepared with other parameter types
// (round 19, attacker AK's M1).
//
// A statement that an older server's grammar reads otherwise than the
// classifier's (GrammarTypes, GrammarCalls: PostgreSQL 16 made json a
// keyword, so 15 looks json up on the search path, where a domain may
// shadow it) is digested by its own text, not the deparse, which writes
// json and pg_catalog.json alike (round 23, attacker AW's M1).
func DigestText(st *rewrite.Stmt, prepared func(name string) string) string {
	text := st.Canonical()
	if st.GrammarTypes != 0 || st.GrammarCalls != 0 {
		text = "TEXT\x00" + strings.TrimSpace(st.SQL)
	}
	if st.Executes == "" || prepared == nil {
		return text
	}
	if p := prepared(st.Executes); p != "" {
		return text + "\x00" + p
	}
	return text
}

// preparedText is what a prepared statement is for the digest: an
// SQL-level one's PREPARE statement (its parameter types with its
// query), a protocol-level one's canonical text and the parameter types
// its Parse gave.
func preparedText(p *session.Prepared) string {
	if p.SQL {
		return "PREPARE\x00" + strings.TrimSpace(p.Text)
	}
	if p.Stmt == nil {
		return "PARSE\x00"
	}
	var b strings.Builder
	b.WriteString("PARSE\x00")
	b.WriteString(p.Stmt.Canonical())
	for _, oid := range p.ParamOIDs {
		fmt.Fprintf(&b, "\x00%d", oid)
	}
	return b.String()
}

// Prepared finds the session's prepared statements by name (DigestText).
func Prepared(ss *session.State) func(string) string {
	return func(name string) string {
		if p, ok := ss.Statements().Statement(name); ok {
			return preparedText(p)
		}
		return ""
	}
}

// queryPrepared finds a prepared statement as a statement after before,
// in the same query, runs it: the last PREPARE of the name in before (as
// the session will have recorded it), or the session's.
func queryPrepared(ss *session.State, before []*rewrite.Stmt) func(string) string {
	return func(name string) string {
		for j := len(before) - 1; j >= 0; j-- {
			if b := before[j]; b.Kind == rewrite.Prepare && b.Name == name {
				return preparedText(&session.Prepared{SQL: true, Text: b.SQL})
			}
		}
		return Prepared(ss)(name)
	}
}

// Digested reports whether st goes into a receipt's digest: what may
// write (its text is part of what the transaction did). Reads do not.
// Whatever the statement's kind: a statement that writes a relation
// (Writes: COPY (INSERT … RETURNING) TO, a writable CTE anywhere) is
// digested as the gate gates it, not by a list of kinds that writes can
// be written around (round 22, AQ-M1).
func Digested(st *rewrite.Stmt) bool { return st.MayWrite() }
