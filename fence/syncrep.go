package fence

import (
	"context"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A commit the synchronous standby did not confirm is not an
// acknowledgement (round 11, attacker U's H1). In failover_mode sync a
// takeover is promised once the synchronous standby has it, but a cancel
// (the client's own CancelRequest, a driver's timeout, pg_cancel_backend
// by any session of the same role) ends a commit's wait for the standby:
// the commit stands on the primary and PostgreSQL answers success with
// only a WARNING. A failover to the standby then loses the takeover while
// the era keeps the previous holder's generation valid.
//
// pgx reports the WARNING only to the connection's notice handler, so
// WatchSyncRep installs one that notes it per connection, and Acquire,
// Renew, Release, Retire and NewEra fail with CodeUnconfirmed when their
// own commit drew it (on a *pgx.Conn or a *pgxpool.Pool whose
// configuration WatchSyncRep set up). pgfence's CLI and pgfence run set
// it up on every connection. A transaction of the caller's own (a pgx.Tx)
// commits later: call Unconfirmed after its Commit.

// IsSyncRepCancel reports whether a notice says a commit's wait for the
// synchronous standby ended before the standby confirmed it: severity
// WARNING (the unlocalized field, which no lc_messages translates) raised
// by PostgreSQL's routine SyncRepWaitForLSN (file syncrep.c), or with its
// English message from a server that sends neither field. PostgreSQL
// raises two WARNINGs there: SQLSTATE 01000 for a cancel, 57P01 for a
// termination.
//
// The message alone is not enough where the server names where a notice
// came from: any code can RAISE WARNING with those words, and a table
// owner's runs in workers' transactions (round 27, BH-H1: a trigger's
// warning made the proxy tell a worker that an open transaction had
// committed, and its retry applied the step twice). PL/pgSQL's RAISE
// says file pl_exec.c, routine exec_stmt_raise, which no SQL can change.
func IsSyncRepCancel(severityUnlocalized, routine, file, message string) bool {
	if severityUnlocalized != "WARNING" {
		return false
	}
	if routine != "" || file != "" {
		return routine == "SyncRepWaitForLSN" || file == "syncrep.c"
	}
	return strings.HasPrefix(message, "canceling wait for synchronous replication") ||
		strings.HasPrefix(message, "canceling the wait for synchronous replication")
}

// syncRepCancels holds, by connection, the last such notice not yet
// taken by a fence function or Unconfirmed.
var syncRepCancels sync.Map // *pgconn.PgConn -> *pgconn.Notice

// WatchSyncRep sets cfg up so that a lease function whose commit's wait
// for the synchronous standby was cancelled fails with CodeUnconfirmed
// (see Unconfirmed). cfg's own OnNotice, if any, still gets every notice.
func WatchSyncRep(cfg *pgconn.Config) {
	next := cfg.OnNotice
	cfg.OnNotice = func(pc *pgconn.PgConn, n *pgconn.Notice) {
		sev := n.SeverityUnlocalized
		if sev == "" {
			sev = n.Severity
		}
		if IsSyncRepCancel(sev, n.Routine, n.File, n.Message) {
			syncRepCancels.Store(pc, n)
		}
		if next != nil {
			next(pc, n)
		}
	}
}

// Unconfirmed returns a CodeUnconfirmed error when a commit on pc had its
// wait for the synchronous standby cancelled since the last call (or
// since the last fence function on it), and nil otherwise. It knows of
// such commits only on a connection whose configuration WatchSyncRep set
// up. Call it after committing a transaction that called Acquire, Renew,
// Release or Retire: on an error, do not act on what the transaction
// returned (acquire again).
func Unconfirmed(pc *pgconn.PgConn) error {
	v, ok := syncRepCancels.LoadAndDelete(pc)
	if !ok {
		return nil
	}
	n := v.(*pgconn.Notice)
	return &Error{
		Code: CodeUnconfirmed,
		Message: "the transaction committed on the primary, but its wait for the synchronous standby was cancelled: " +
			"the standby did not confirm it, and a failover may lose it",
		Detail: n.Message + " " + n.Detail,
		Hint:   "acquire the lease again (or renew it) and go on with the generation that returns",
	}
}

// confirmed runs f, a fence function's one autocommit statement, on db:
// on a *pgxpool.Pool on one of its connections, so that the notice of
// its commit is known to be its own. It fails with CodeUnconfirmed when
// that commit's wait for the synchronous standby was cancelled.
func confirmed(ctx context.Context, db DBTX, f func(DBTX) error) error {
	if p, ok := db.(*pgxpool.Pool); ok {
		c, err := p.Acquire(ctx)
		if err != nil {
			return err
		}
		defer c.Release()
		db = c.Conn()
	}
	c, ok := db.(*pgx.Conn)
	if !ok {
		return f(db) // a transaction: its commit is the caller's (Unconfirmed)
	}
	pc := c.PgConn()
	syncRepCancels.Delete(pc)
	if err := f(db); err != nil {
		return err
	}
	return Unconfirmed(pc)
}
