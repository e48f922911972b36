package plan

import (
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"

	"github.com/pgfence/pgfence/fence"
)

// The names of the gate's own prepared statements, its portal and its
// savepoint, which the proxy creates on each upstream connection. Every
// name starts with ReservedPrefix.
const (
	GateStatement      = "pgfence_gate"      // fence.gate
	CommitStatement    = "pgfence_commit"    // fence.commit
	CommitIfStatement  = "pgfence_commit_if" // fence.commit_if_written
	SavepointStatement = "pgfence_savepoint" // SAVEPOINT ReceiptSavepoint
	RaiseStatement     = "pgfence_raise"     // a refusal (RaiseSQL), parsed for each use
	Portal             = "pgfence_p"         // the portal every one of them runs in
	ReceiptSavepoint   = "pgfence_receipt"   // the savepoint before a receipt in the client's transaction
)

// ClientDigestVersion is the digest version of a receipt whose digest the
// client gave itself (fence.payload_digest).
const ClientDigestVersion = "client"

// ReservedPrefix starts the names of the gate's own prepared statements,
// portals and savepoint: a client may not parse, bind, describe, execute,
// close, PREPARE, EXECUTE or DEALLOCATE one, so it cannot make the gate run
// SQL of its choosing. ReservedSettingPrefix starts the settings the
// backstop keeps for itself (pgfence.replay, ...).
const (
	ReservedPrefix        = "pgfence_"
	ReservedSettingPrefix = "pgfence."
)

// Statement is one of the gate's named statements.
type Statement struct{ Name, SQL string }

// Statements are the gate's named statements, which the proxy parses right
// before each use (so no client code can replace them). Their SQL names every type by its schema, so that no
// search_path (which a client sets) can put a type or cast of its own in
// the gate's arguments. Parameters: GateArgs and CommitArgs.
var Statements = []Statement{
	{GateStatement, "SELECT fence.gate($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.int8, $4::pg_catalog.text)"},
	{CommitStatement, "SELECT fence.commit($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.int8, $4::pg_catalog.text, $5::pg_catalog.bytea, $6::pg_catalog.text)"},
	{CommitIfStatement, "SELECT fence.commit_if_written($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.int8, $4::pg_catalog.text, $5::pg_catalog.bytea, $6::pg_catalog.text)"},
	{SavepointStatement, "SAVEPOINT " + ReceiptSavepoint},
}

// The gate's statements for a transaction that may end before its
// receipt step (Batch, Step.TxBound): TxStatement reads the transaction's
// id, and TxReceiptStatement is fence.commit in that transaction ($7 its
// id), fence.commit_if_written in any other.
const (
	TxStatement        = "pgfence_xid"
	TxReceiptStatement = "pgfence_commit_tx"
)

// TxStatements are the SQL of TxStatement and TxReceiptStatement, every
// name and type qualified as in Statements.
var TxStatements = []Statement{
	{TxStatement, "SELECT pg_catalog.pg_current_xact_id()::pg_catalog.text"},
	{TxReceiptStatement, "SELECT CASE WHEN pg_catalog.pg_current_xact_id_if_assigned() OPERATOR(pg_catalog.=) $7::pg_catalog.xid8" +
		" THEN fence.commit($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.int8, $4::pg_catalog.text, $5::pg_catalog.bytea, $6::pg_catalog.text)" +
		" ELSE fence.commit_if_written($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.int8, $4::pg_catalog.text, $5::pg_catalog.bytea, $6::pg_catalog.text) END"},
}

// StatementSQL is the SQL of the gate's named statement name ("" for a
// name that is not one of Statements or TxStatements).
func StatementSQL(name string) string {
	for _, list := range [][]Statement{Statements, TxStatements} {
		for _, s := range list {
			if s.Name == name {
				return s.SQL
			}
		}
	}
	return ""
}

// ReceiptStatement is the named statement of a receipt step: fence.commit
// after the gate, else (a tentative transaction) fence.commit_if_written.
func ReceiptStatement(gated bool) string {
	if gated {
		return CommitStatement
	}
	return CommitIfStatement
}

// GateArgs are GateStatement's parameters, as text.
func GateArgs(g fence.Generation) [][]byte {
	return [][]byte{[]byte(g.JobKey), []byte(strconv.FormatInt(g.Epoch, 10)), []byte(strconv.FormatInt(g.Token, 10)), []byte(g.Step)}
}

// CommitArgs are the parameters of CommitStatement and CommitIfStatement,
// as text.
func CommitArgs(g fence.Generation, digest []byte, version string) [][]byte {
	return [][]byte{[]byte(g.JobKey), []byte(strconv.FormatInt(g.Epoch, 10)), []byte(strconv.FormatInt(g.Token, 10)),
		[]byte(g.Step), []byte(`\x` + hex.EncodeToString(digest)), []byte(version)}
}

// GateSQL is the lock check for g as a statement of a simple query. Like
// Statements, it names every argument's type by its schema, and writes
// numbers as quoted literals: an integer literal would be an int4 (which a
// function of a client's own could match better than fence.gate's bigint)
// and a negative one a prefix operator looked up on the search_path.
func GateSQL(g fence.Generation) string {
	return fmt.Sprintf("SELECT fence.gate(%s, %s, %s, %s)", textArg(g.JobKey), int8Arg(g.Epoch), int8Arg(g.Token), textArg(g.Step))
}

// textArg and int8Arg are a step's arguments, typed (GateSQL).
func textArg(s string) string { return Literal(s) + "::pg_catalog.text" }
func int8Arg(n int64) string  { return "'" + strconv.FormatInt(n, 10) + "'::pg_catalog.int8" }

// CommitSQL is the receipt step for a digest as a statement of a simple
// query: fence.commit after the gate, else (a tentative transaction)
// fence.commit_if_written, which writes the receipt only if the backstop
// marked the transaction.
func CommitSQL(gated bool, g fence.Generation, digest []byte, version string) string {
	fn := "fence.commit"
	if !gated {
		fn = "fence.commit_if_written"
	}
	// E'' for the digest too: with standard_conforming_strings off a
	// plain '\x..' would be read as escapes.
	return fmt.Sprintf("SELECT %s(%s, %s, %s, %s, E'\\\\x%s'::pg_catalog.bytea, %s)",
		fn, textArg(g.JobKey), int8Arg(g.Epoch), int8Arg(g.Token), textArg(g.Step), hex.EncodeToString(digest), textArg(version))
}

// RaiseSQL is a statement that fails with e, so the server aborts the
// transaction exactly as it would for an error of its own.
func RaiseSQL(e *fence.Error) string {
	s := "DO $pgfence$BEGIN RAISE EXCEPTION USING ERRCODE = " + Literal(e.Code) + ", MESSAGE = " + Literal(e.Message)
	if e.Hint != "" {
		s += ", HINT = " + Literal(e.Hint)
	}
	return s + "; END$pgfence$"
}

// RestoreSQL follows a query or batch whose COMMIT had the receipt step in
// ReceiptSavepoint before it: it ends the transaction only if that step
// failed (the COMMIT was then skipped and the savepoint exists); otherwise
// it fails at once, unseen, leaving the session as the client's
// statements left it.
const RestoreSQL = "ROLLBACK TO SAVEPOINT " + ReceiptSavepoint + "; ROLLBACK"

// Literal quotes s as an escape-string literal, correct whatever
// standard_conforming_strings is.
func Literal(s string) string {
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
