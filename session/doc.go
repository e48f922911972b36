// Package session holds the proxy's per-connection state: the fence GUCs and
// search_path tracked with PostgreSQL's own transactional semantics, the
// transaction state (idle, in a transaction, failed; explicit or implicit),
// savepoints, and the write-gate state of the current transaction (a
// State, one per client); and the prepared statements and portals with
// their classification (Statements, one per upstream connection, which a
// State refers to).
//
// The proxy's wire loop drives a State from what the server answers, never
// from what the client asks: [State.Check] before forwarding a statement
// (malformed fence values are refused at SET time), [State.Apply] on its
// CommandComplete, [State.Fail] on an ErrorResponse, [State.TxStatus] on
// ReadyForQuery. Outside a transaction block a statement starts an implicit
// transaction, exactly as the server does; it ends at ReadyForQuery (a
// simple Query or a pipeline up to Sync), or at COMMIT/ROLLBACK.
//
// It speaks package fence's vocabulary: the generation a session presents
// and a transaction is gated with is a fence.Generation, and every refusal
// is a *fence.Error with the SQLSTATE PostgreSQL would give (22023 for a
// malformed fence setting, 25P02 in a failed transaction, ...).
//
// It is not a SQL parser (package rewrite classifies statements), it does no
// I/O, it does not decide what the gate injects (the proxy and package
// rewrite do), and it is not safe for concurrent use: one State (and the
// Statements it refers to) belongs to one client connection's wire loop.
//
// # What it cannot see
//
// Values set by ALTER ROLE/DATABASE ... SET, and GUC changes made inside
// functions, procedures or DO blocks, are invisible to the proxy. An unknown
// search_path is reported as nil, which package rewrite treats as "could be
// any schema" (fail closed).
package session
