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
//     the maximum (else ErrStale: *Error with Code CodeStale);
//   - the commit receipt, keyed (job, epoch, token, step) and holding a
//     payload digest, is consulted before the fence, so a retry after a lost
//     commit response is answered Replayed, or a conflict (CodeConflict).
//
// Server errors of SQLSTATE class FN are returned as *Error; use errors.As
// or the IsStale, IsLeaseHeld, ... helpers.
//
// Digest computes the proxy's v1 payload digest (DESIGN §5); the proxy and
// any other client that commits receipts for the same generations must use
// it.
//
// Package fence is not a job scheduler and does not renew leases in the
// background: callers decide when to renew.
package fence
