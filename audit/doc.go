// Package audit checks a pgfence history for violations of the guarantees
// (DESIGN §1; issue 7): it is the checker behind `pgfence audit` and the one
// the chaos run calls at its end with its clients' own records.
//
// Run reads, in one REPEATABLE READ READ ONLY transaction (a consistent
// snapshot; it writes nothing), the receipts, the issuance log, epochs,
// fences, gc watermarks, fence.consumer_log and the result tables the
// caller names, and reports violations of the guarantees below. Its SQL
// names pg_catalog's functions and operators without their schema in
// places: run it on a connection that pins search_path to pg_catalog,
// pg_temp in its startup parameters (internal/ownsql.Pin), as pgfence
// audit does, whenever the database is one others may create objects in
// or own (docs/security.md, "pgfence's own SQL"). It reports violations of:
//
//  1. (L2) no business commit under a token after a larger token of the
//     same job had been issued and committed;
//  2. at most one receipt per (job_key, epoch, token, step), and no orphans:
//     every result row's (job, token) has a receipt, and (when the caller
//     says which steps write a table) every such receipt has its row;
//  3. every commit a client saw acknowledged (committed or replayed) is
//     present with the digest it sent (client records only);
//  4. no reader carrying generation g saw a result of a generation below g
//     (client records only);
//  5. (L6) no consumer applied an event older than one it had applied for
//     the same key;
//  6. (L5) no token reused across epochs: every receipt's epoch is the epoch
//     its token was issued in, a key's epochs only grow with its tokens, and
//     the fence row agrees with the issuance log.
//
// # Order of commits (check 1)
//
// Receipts are the record of business commits: fence.commit writes the
// receipt in the business transaction. The order between a receipt
// transaction R (token t) and the acquire transaction A that issued a
// larger token t' of the same job is taken from PostgreSQL: the commit
// timestamps of both transactions (track_commit_timestamp, read with
// pg_xact_commit_timestamp(xmin) of the receipt row and of the issuance
// row; neither row is ever updated). This is sound because both
// transactions lock the job's fence row FOR UPDATE until they end, and
// PostgreSQL takes a transaction's commit timestamp before it releases its
// locks: when R commits first, A's lock (and its clock) comes after R's
// commit timestamp, so commit_ts(R) < issued_at(t') <= commit_ts(A). A
// receipt with commit_ts(R) > commit_ts(A) therefore committed after the
// takeover had committed: a violation, never a false alarm.
//
// Limits: commit timestamps of unrelated concurrent transactions are not
// ordered like their commits; the argument needs the lock, which correct
// pgfence always takes, and a wall clock that does not step backwards on
// the primary while the history is written. A broken gate that lets R
// commit within microseconds of A (between A's commit timestamp and A's
// commit becoming visible) may go unreported. Commit timestamps are kept
// only while track_commit_timestamp is on and only as far back as the
// clog; without them the check falls back to the receipt's committed_at
// (a clock reading inside R, before its commit) against the larger token's
// issued_at (a clock reading inside A, after it took the lock): still
// sound, weaker (the report says how many receipts were compared that way).
// Only the next larger token of the job is compared: acquires of one job
// are serialised by the same lock, so the next token is the first to
// commit, and check 1 also reports issuance committed out of token order.
// A receipt committed after its epoch was retired is reported under check 1
// too (commit timestamp of the retiring transaction, from the epoch row).
//
// # Failovers (fence.eras, migration 19)
//
// A promotion that lost a takeover leaves no larger token in the issuance
// log, so the comparison above cannot see a zombie's commit after it. The
// era can: a receipt under a token not above an era's valid_floor, written
// by a transaction younger than the one that made the era (backstop_xid
// against the era's began_xid: xid8 goes on across a promotion) and with a
// later clock reading (a restored copy counts xids from the start again),
// is reported under check 1. The report lists the eras and notes each one
// entered without failover_mode sync. Check 3 counts an acknowledged commit
// that is absent, under a token such an era voids, as lost in an
// asynchronous failover (what that replication mode allows), not as a
// violation; after a lossless era it is one.
//
// # Cost
//
// Every query is driven by the receipts, issuance, consumer log or result
// rows inside the optional window (Since, Until) and reaches other rows by
// primary key or index (a receipt's next issuance by (job_key, token), added
// by migration 004); nothing is joined in memory in Go. Only the
// violations travel to the client, at most MaxViolations of each check
// (the rest are counted). Result tables are the caller's: each is read in
// one pass.
//
// It is not a monitor (run it on demand or after a chaos run) and it does
// not repair anything; it also cannot see commits that bypassed the receipt
// (a bypass role writing directly) except as result rows without a receipt.
package audit
