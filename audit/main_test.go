package audit_test

import (
	"os"
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// cluster is the package's PostgreSQL (track_commit_timestamp = on).
var cluster *pgtest.Cluster

func TestMain(m *testing.M) {
	os.Exit(pgtest.Run(m, pgtest.Options{}, migrations.Prepare, &cluster))
}
