package main

import (
	"os"
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// cluster is the package's PostgreSQL, shared by every test of cmd/pgfence:
// databases cloned from a migrated template.
var cluster *pgtest.Cluster

func TestMain(m *testing.M) {
	os.Exit(pgtest.Run(m, pgtest.Options{}, migrations.Prepare, &cluster))
}
