//go:build drivers

package drivers

// checkOrder is the table's row order; every driver prints a subset.
var checkOrder = []string{
	"connect", "simple_query", "extended_query", "prepared", "prepared_server", "binary",
	"transaction", "savepoint", "error_recovery", "syntax_error", "notice", "listen_notify",
	"copy_out", "copy_in", "cancel", "statement_timeout", "server_cursor", "pool",
	"pipeline", "large_value", "large_result", "client_encoding", "backend_pid",
	"fence_acquire", "fence_commit", "fence_replay", "fence_conflict", "fence_stale",
	"fence_autocommit", "fence_copy", "fence_no_metadata", "fence_pipeline",
}

// variantOrder orders a driver's variants in the table.
var variantOrder = []string{
	"psycopg2", "psycopg", "psycopg prepare_threshold=0", "node-postgres",
	"pgjdbc", "pgjdbc prepareThreshold=0", "pgjdbc prepareThreshold=1", "pgjdbc prepareThreshold=-1",
	"pgjdbc preferQueryMode=simple", "pgjdbc preferQueryMode=extendedForPrepared", "pgjdbc binaryTransfer=false",
	"pgx cache_statement", "pgx cache_describe", "pgx describe_exec", "pgx exec", "pgx simple_protocol",
}

// knownProxyFailures are the checks that pass straight to PostgreSQL and
// fail through pgfence serve today, "variant/check" → why, with the part
// of issue 19 that fixes it. Each is a bug of the proxy, not of the
// check: the check stays as strict as it must be. The matrix fails when
// one of these passes, so the list cannot go stale: delete the line with
// the fix.
//
// A key is "variant/check", or "*/check" for every variant of every
// driver (then each variant's pass is reported).
var knownProxyFailures = map[string]string{}
