// Package rewrite classifies SQL text for the pgfence proxy using
// PostgreSQL's own grammar (pg_query, PostgreSQL 17 parser).
//
// For every statement of a simple-Query string or an extended-protocol Parse
// it answers what the write gate and the read router need to know: the kind
// of statement (read, write, transaction control, SET/RESET, PREPARE/EXECUTE,
// COPY, ...), which relations it writes and reads, whether it locks rows,
// calls fence functions or primary-only functions, whether it is opaque to
// the proxy (CALL, DO, user functions), which run-time parameters it changes
// (SET, RESET, set_config), how many $n parameters it has, and its canonical
// SQL for the v1 payload digest. [Classifier] caches results by statement
// text; [Protected] decides whether a written relation is protected, given
// the session's search_path.
//
// Its sub-package plan plans the rewritten transaction: from these
// classifications and the session state, the steps the write gate adds
// around the client's statements, and the gate's SQL. Package rewrite
// itself changes no statement of the client's, and it does not know the
// database catalog: names are reported as written (folded as PostgreSQL
// folds identifiers), never resolved to OIDs. It does not track session
// state; see package session for that.
//
// # Failure to classify
//
// Classify returns an error only when PostgreSQL's grammar rejects the text.
// Such a statement cannot execute on the server either (pg_query carries the
// PostgreSQL 17 grammar, a superset of the PostgreSQL 15 server's), so the
// proxy forwards it and lets the server report the syntax error; it must not
// treat the failure as "no writes" for any other purpose. A caller that
// cannot forward an unclassified statement safely (for example inside a gated
// transaction) should refuse it: that is the fail-closed choice.
//
// # What the classifier cannot see
//
// Functions, procedures, DO blocks, triggers, rules, updatable views and
// foreign-key cascades may write relations the statement does not name.
// Statements that call anything but well-known read-only built-in functions
// are reported Opaque; the backstop trigger installed on every protected
// table fences those writes inside PostgreSQL.
package rewrite
