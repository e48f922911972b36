package plan

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/session"
)

// The refusals a plan can hold. Each is a *fence.Error: the SQLSTATE
// and the message the client gets, as an ErrorResponse of the statement
// refused (the proxy raises it in the client's query or batch, so the
// server aborts the transaction as it would for an error of its own).

// Reserved reports whether name is reserved for the gate's own prepared
// statements and portals.
func Reserved(name string) bool { return strings.HasPrefix(name, ReservedPrefix) }

// ReservedName is the refusal (FN013) of a client's use of a reserved name
// for a prepared statement, portal or cursor (what).
func ReservedName(what, name string) *fence.Error {
	return &fence.Error{Code: fence.CodeReserved,
		Message: fmt.Sprintf("%s %q: names beginning with %q are reserved for pgfence's own statements", what, name, ReservedPrefix),
		Hint:    "give the prepared statement or portal another name"}
}

// reservedStmt refuses (FN013) a statement that names one of the gate's
// statements or sets one of the backstop's own settings.
func reservedStmt(st *rewrite.Stmt) *fence.Error {
	switch {
	case (st.Kind == rewrite.Prepare || st.Kind == rewrite.Deallocate || st.Kind == rewrite.Execute) && Reserved(st.Name):
		return ReservedName("prepared statement", st.Name)
	case Reserved(st.Executes):
		return ReservedName("prepared statement", st.Executes)
	case st.Kind == rewrite.Read && Reserved(st.Name):
		return ReservedName("cursor", st.Name) // DECLARE: a cursor is a portal
	}
	for _, g := range st.GUCs {
		if strings.HasPrefix(g.Name, ReservedSettingPrefix) {
			return &fence.Error{Code: fence.CodeReserved,
				Message: fmt.Sprintf("parameter %q: settings beginning with %q are reserved for pgfence's backstop", g.Name, ReservedSettingPrefix),
				Hint:    "fence metadata is set with fence.job_key, fence.epoch, fence.token and fence.step"}
		}
	}
	return nil
}

// checkStmt is the refusal of st before anything of its query or batch
// runs: a reserved name (FN013), or a malformed fence setting (22023,
// session.State.Check; params resolves the $n parameters of set_config).
func checkStmt(ss *session.State, st *rewrite.Stmt, params session.ParamFunc) *fence.Error {
	if e := reservedStmt(st); e != nil {
		return e
	}
	if len(st.GUCs) > 0 {
		if err := ss.Check(st, params); err != nil {
			return AsSessionError(err)
		}
	}
	return nil
}

// AsSessionError is err as the refusal a client gets: err itself when it
// is a *fence.Error, else 22023 with its message.
func AsSessionError(err error) *fence.Error {
	var se *fence.Error
	if errors.As(err, &se) {
		return se
	}
	return &fence.Error{Code: "22023", Message: err.Error()}
}

// fencingRequired is FN008 for st, a protected write in a session without
// a complete fence generation, naming the table (table: "" when unknown)
// and what of the generation is missing (ov: the query's own SETs before
// st).
func fencingRequired(table string, ss *session.State, ov overlay) *fence.Error {
	what := "a protected table"
	if table != "" {
		what = "protected table " + table
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

// prepareTransaction is FN009 for PREPARE TRANSACTION in a transaction
// that owes a receipt (hint: what to do instead).
func prepareTransaction(g fence.Generation, hint string) *fence.Error {
	return &fence.Error{Code: fence.CodeUnsupported,
		Message: fmt.Sprintf("PREPARE TRANSACTION is not supported in a fenced transaction (job %q, token %d)", g.JobKey, g.Token),
		Hint:    hint}
}

// commitAfterEarlierRollback is FN009 for a COMMIT in the query of a
// ROLLBACK TO of a savepoint an earlier query made, in a transaction that
// owes a receipt: the receipt's digest is planned from this query's text,
// and the rollback cuts statements of earlier queries out of it, which the
// proxy learns only as the server answers.
func commitAfterEarlierRollback(g fence.Generation) *fence.Error {
	return &fence.Error{Code: fence.CodeUnsupported,
		Message: fmt.Sprintf("ROLLBACK TO a savepoint of an earlier query and COMMIT in one query are not supported in a fenced transaction (job %q, token %d): the commit receipt must cover what the rollback kept", g.JobKey, g.Token),
		Hint:    "send COMMIT as a query of its own after the ROLLBACK TO"}
}

// commitThenCopy is FN009 for a COMMIT followed by a COPY FROM in one
// query of a transaction that owes a receipt: what follows the COMMIT is
// settled once the query is answered, which the COPY would hold up waiting
// for the client's data.
func commitThenCopy(g fence.Generation) *fence.Error {
	return &fence.Error{Code: fence.CodeUnsupported,
		Message: fmt.Sprintf("COMMIT followed by COPY FROM in one query is not supported in a fenced transaction (job %q, token %d)", g.JobKey, g.Token),
		Hint:    "send the COPY as a query of its own after the COMMIT"}
}

// copyThenCommit is FN009 for a COPY FROM and the COMMIT after it in one
// query of a transaction that owes a receipt: the receipt must cover the
// COPY's data, which only comes after the query's text has gone.
func copyThenCommit(g fence.Generation) *fence.Error {
	return &fence.Error{Code: fence.CodeUnsupported,
		Message: fmt.Sprintf("COPY FROM and COMMIT in one query are not supported in a fenced transaction (job %q, token %d): the commit receipt must cover the COPY data", g.JobKey, g.Token),
		Hint:    "send COMMIT as a query of its own after the COPY"}
}

// blockOnly is PostgreSQL's own 25P01 for st (named by refusedImplicit)
// outside a transaction block, for a query the plan turns into a block.
func blockOnly(st *rewrite.Stmt) *fence.Error {
	return &fence.Error{Code: session.CodeNoActiveTransaction, Message: refusedImplicit(st) + " can only be used in transaction blocks"}
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

// CheckName refuses (FN013) a client's prepared statement, portal or
// cursor (what) named with a reserved name; nil when name is the
// client's to use.
func CheckName(what, name string) *fence.Error {
	if !Reserved(name) {
		return nil
	}
	return ReservedName(what, name)
}
