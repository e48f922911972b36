package fence

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// SQLSTATE codes of class FN raised by the fence functions and the proxy.
const (
	CodeStale               = "FN001" // token is not the fence's current token
	CodeLeaseHeld           = "FN002" // another holder's lease is live
	CodeConflict            = "FN003" // same generation and step, different payload
	CodeRetired             = "FN004" // epoch retired
	CodeUnknownJob          = "FN005" // job (or epoch) never issued
	CodeExpired             = "FN006" // receipt pruned by gc: cannot confirm
	CodePending             = "FN007" // generation pending on the replica
	CodeFencingRequired     = "FN008" // protected write without fence metadata
	CodeUnsupported         = "FN009" // unsupported in a gated transaction
	CodeProtectionLocked    = "FN010" // a change to a protected table that needs pgfence_bypass (DDL, unprotect)
	CodeNotOwner            = "FN011" // the lease belongs to another role, or the role may not take this job
	CodeGateTimeout         = "FN012" // the proxy ended a gated transaction its client left idle (gate_idle_timeout)
	CodeReserved            = "FN013" // a name reserved for pgfence (the proxy's statements, pgfence.* settings)
	CodeNotInstalled        = "FN014" // the database lacks the fence schema, or the role lacks pgfence_worker
	CodeFailover            = "FN015" // the generation was issued before a failover that may have lost a takeover: void
	CodeUnconfirmed         = "FN016" // committed on the primary, but the synchronous standby did not confirm it (its wait was cancelled): a failover may lose it
	CodeUnconfirmedTakeover = "FN017" // failover_mode sync: the generation's takeover is not yet on the synchronous standbys, so its first write is refused (nothing written)
	CodeReplay              = "FN00R" // idempotent replay (internal)
	sqlstateClassFencing    = "FN"
)

// Error is pgfence's error: a SQLSTATE and the words that tell a user
// what to do. It is the one error type of pgfence's protocol vocabulary,
// shared by this package, package session and the proxy:
//
//   - the fence functions and the backstop raise class FN in PostgreSQL,
//     and this package returns those as *Error (FromPostgres);
//   - the proxy refuses with an *Error what it will not send (FN008,
//     FN009, FN013, ...), and package session what PostgreSQL would refuse
//     (a malformed fence setting, 22023; a savepoint that does not exist,
//     3B001): codes outside class FN are standard PostgreSQL ones.
//
// Use errors.As to get it, or Code and the IsStale, IsLeaseHeld, ...
// helpers for class FN. Err, when set, is the cause (the *pgconn.PgError
// PostgreSQL raised), so errors.As and errors.Is reach it too.
type Error struct {
	Code    string // SQLSTATE: one of the Code constants, or a standard PostgreSQL code
	Message string
	Detail  string // optional
	Hint    string // optional: what the user can do
	Err     error  // optional: the cause
}

func (e *Error) Error() string {
	if e.Hint != "" {
		return fmt.Sprintf("%s (SQLSTATE %s; %s)", e.Message, e.Code, e.Hint)
	}
	return fmt.Sprintf("%s (SQLSTATE %s)", e.Message, e.Code)
}

// Unwrap returns the cause, Err.
func (e *Error) Unwrap() error { return e.Err }

// SQLState returns the error's SQLSTATE, as (*pgconn.PgError).SQLState
// does.
func (e *Error) SQLState() string { return e.Code }

// fencing reports whether code is of class FN.
func fencing(code string) bool { return len(code) == 5 && code[:2] == sqlstateClassFencing }

// FromPostgres maps an error from PostgreSQL to pgfence's vocabulary, and
// is the one place that does: a server error of class FN (raised by the
// fence functions or the backstop) becomes an *Error with its code,
// message, detail and hint, and the *pgconn.PgError as its cause. Every
// other error, and one that already is an *Error, is returned as it is;
// Setup tells which of them say that pgfence is not installed.
func FromPostgres(err error) error {
	var fe *Error
	if errors.As(err, &fe) {
		return err
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) && fencing(pg.Code) {
		return &Error{Code: pg.Code, Message: pg.Message, Detail: pg.Detail, Hint: pg.Hint, Err: pg}
	}
	return err
}

// Code returns the FN SQLSTATE of err, or "" when err is not a fence error.
// It recognises both *Error and a raw *pgconn.PgError (FromPostgres).
func Code(err error) string {
	var fe *Error
	if errors.As(FromPostgres(err), &fe) && fencing(fe.Code) {
		return fe.Code
	}
	return ""
}

// SetupProblem is why PostgreSQL refused pgfence for how it is installed,
// which a DBA fixes, rather than for the protocol. The proxy answers both
// with CodeNotInstalled and the command that fixes it; the CLI exits 78
// (NoSchema) or 77 (NotWorker).
type SetupProblem uint8

const (
	// Installed: the error is not about pgfence's installation.
	Installed SetupProblem = iota
	// NoSchema: the database has no fence schema, or an outdated one (a
	// function or table of it is missing): a DBA runs pgfence migrate.
	NoSchema
	// NotWorker: the role may not run the functions of the protocol: a
	// DBA grants it pgfence_worker.
	NotWorker
)

// Setup says which setup problem, if any, PostgreSQL's error with SQLSTATE
// code and message reports. A permission error on an administrative
// function (protect, grant_job, ...) or on a table of the fence schema
// (fence.fences: tokens are not the workers' to read) is not one: it is
// the role's right, not its setup.
func Setup(code, message string) SetupProblem {
	switch {
	case code == "3F000" && strings.Contains(message, `schema "fence"`),
		code == "42883" && strings.Contains(message, "function fence."),
		code == "42P01" && strings.Contains(message, `relation "fence.`):
		return NoSchema
	case code == "42501" && workerFunction(message):
		return NotWorker
	}
	return Installed
}

// workerFunctions are the functions of schema fence that pgfence_worker
// may run (migrations grant them).
var workerFunctions = []string{"acquire", "renew", "release", "retire", "gate", "commit", "commit_if_written",
	"accept_event", "has_generation", "replica_reached", "current_era"}

// workerFunction reports whether a permission error names one of the
// functions pgfence_worker may run.
func workerFunction(msg string) bool {
	f, ok := strings.CutPrefix(msg, "permission denied for function ")
	return ok && slices.Contains(workerFunctions, f)
}

// The outcomes a worker acts on have a helper each; for the other codes,
// compare Code(err) with the Code constants.

// IsFailover reports whether err is FN015: the generation was issued
// before a failover that may have lost a later takeover of the job, and is
// void: stop, acquire again and redo the work under the new generation.
func IsFailover(err error) bool { return Code(err) == CodeFailover }

// IsUnconfirmed reports whether err is FN016: the transaction committed
// on the primary, but its wait for the synchronous standby was cancelled,
// so a failover may lose it: do not act on what it returned; acquire (or
// renew) again.
func IsUnconfirmed(err error) bool { return Code(err) == CodeUnconfirmed }

// IsUnconfirmedTakeover reports whether err is FN017: in failover_mode
// sync, the takeover that issued the generation is not yet confirmed by
// the synchronous standbys (pg_stat_replication), so its first write was
// refused and nothing was written: retry the write (the standby may have
// it by then), or acquire again. A takeover made in the same transaction
// as the write is refused so at once: take the lease in a transaction of
// its own.
func IsUnconfirmedTakeover(err error) bool { return Code(err) == CodeUnconfirmedTakeover }

// IsStale reports whether err is FN001: the token is not the current one
// (another holder took over, or the lease was released): stop.
func IsStale(err error) bool { return Code(err) == CodeStale }

// IsLeaseHeld reports whether err is FN002: another holder's lease is
// live; try again later.
func IsLeaseHeld(err error) bool { return Code(err) == CodeLeaseHeld }

// IsConflict reports whether err is FN003: the same generation and step
// committed a different payload.
func IsConflict(err error) bool { return Code(err) == CodeConflict }

// IsRetired reports whether err is FN004: the epoch is retired.
func IsRetired(err error) bool { return Code(err) == CodeRetired }

// IsUnknownJob reports whether err is FN005: the job or epoch was never
// issued.
func IsUnknownJob(err error) bool { return Code(err) == CodeUnknownJob }
