// Package plan decides what the write gate adds to a client's transaction:
// given what the proxy knows of a session (its settings, transaction and
// gate state, the database's protected tables) and the classified
// statements of a simple Query, or the messages of an extended-protocol
// batch one at a time, it returns the steps to inject around the client's
// statements — the lock check (fence.gate) before the first protected
// write, the commit receipt (fence.commit, or fence.commit_if_written for a
// transaction that may have written where the gate cannot see) before the
// commit, the savepoint and the restoring query that tell a failed receipt
// from a failed statement, the BEGIN around a protected COPY FROM, and the
// refusals (FN008, FN009, FN013, 22023, 25P01) with their SQLSTATE and
// message. A query the gate has nothing to add to gets the plan with no
// steps: pass-through.
//
// The gate's SQL is written here, once: the named statements the proxy
// prepares on each upstream connection (Statements), the text spliced into
// simple queries (GateSQL, CommitSQL, RaiseSQL) and the names reserved
// for them.
//
// Planning does no I/O and is deterministic: the same session state and
// statements give the same plan (rewrite/testdata/plans pins every shape
// the proxy injects, rendered by Step.String and Query.Text). It reads the
// session state and never changes it; a Batch keeps the state of one
// extended-protocol batch between its messages. Executing a plan —
// sending the messages, waiting for answers, interpreting them, applying
// them to the session state — is package proxy's; Gated and Completed say
// what an answer means for the gate's own part of the state, so that the
// proxy and the golden plans' model of the server keep it alike. A
// receipt's digest is computed as it is sent, when it covers what the
// transaction did before the query (Digest says what it covers; Resolve
// computes it).
//
// It is a package of its own, not part of package rewrite, because it
// reads session.State, and package session builds on rewrite's
// classification: in rewrite it would need a second description of the
// session state in types of its own.
package plan
