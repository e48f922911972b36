// Package fence is the pgfence protocol against PostgreSQL: leases and
// fencing tokens (Acquire, Renew, Release, Retire), the write gate and
// commit receipts (Gate, Commit, RunTx), receipt retention (GC), external
// consumers (AcceptEvent) and protected tables (Protect, Unprotect).
//
// Every operation is a call to a server-side function in schema fence
// (installed by package migrations), so the guarantees hold for any client:
// a Go worker can use this package directly, without the proxy. The
// functions take the same lock, in the same order, as the proxy's gate:
//
//   - a takeover (Acquire) advances the fence's max_issued_token in the
//     transaction that issues the lease;
//   - a gated transaction locks the fence row and requires its token to be
//     the maximum (else an *Error with Code CodeStale);
//   - the commit receipt, keyed (job, epoch, token, step) and holding a
//     payload digest, is consulted before the fence, so a retry after a lost
//     commit response is answered Replayed, or a conflict (CodeConflict).
//
// # The protocol's vocabulary
//
// This package also holds the words the rest of pgfence speaks in, so
// that a worker, package session and the proxy mean the same thing by
// them: Generation (a job's epoch, token and step: what a transaction is
// gated with), the SQLSTATEs of class FN (the Code constants), Error (the
// one error type for them, and for the standard codes pgfence refuses
// with), FromPostgres and Setup (the one place PostgreSQL's errors are
// read as pgfence's: class FN, and the errors that say pgfence is not
// installed), and Digest, the proxy's v1 payload digest (DESIGN §5), which
// the proxy and any other client that commits receipts for the same
// generations must use.
//
// Server errors of SQLSTATE class FN are returned as *Error; use errors.As,
// Code, or the IsStale, IsLeaseHeld, ... helpers, which recognise a raw
// *pgconn.PgError too (the backstop's refusal of a plain statement).
//
// Package fence is not a job scheduler and does not renew leases in the
// background: callers decide when to renew (package internal/runner does,
// for pgfence run). It does not speak the wire protocol and knows nothing
// of the proxy: it depends on pgx only, and nothing of pgfence's own.
package fence
