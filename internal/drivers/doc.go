// Package drivers checks that real PostgreSQL drivers work through
// `pgfence serve` exactly as they do straight to PostgreSQL: psycopg2,
// psycopg 3, node-postgres, pgjdbc in several modes and pgx in each of its
// query exec modes, plus pgx's own test suite.
//
// Everything lives in test files built with the tag "drivers", so `make
// test` (go test ./...) does not need Python, Java or Node; `make
// test-drivers` and `make test-pgx-suite` run them:
//
//	go test -tags drivers -run TestDrivers ./internal/drivers/
//	go test -tags drivers -run TestPgxSuite ./internal/drivers/
//
// TestDrivers starts a throwaway cluster (internal/pgtest) with a protected
// table, builds and starts a real `pgfence serve` in front of it, and runs
// each driver's checks twice: straight to PostgreSQL and through the proxy.
// The checks of the drivers that are not Go are scripts beside this file
// (python/, node/, pgjdbc/); each prints one line per check,
//
//	check <TAB> variant <TAB> name <TAB> ok|fail|n/a <TAB> detail
//
// and the test builds the driver × check table from them (docs/
// compatibility.md). It fails when a check fails straight to PostgreSQL (a
// broken check), or through the proxy unless the check is in
// knownProxyFailures; and when a check listed there passes, so that the
// list cannot go stale.
//
// This package is not a benchmark and holds no proxy code.
package drivers
