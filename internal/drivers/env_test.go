//go:build drivers

package drivers

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/testbin"
	"github.com/pgfence/pgfence/migrations"
)

// cluster is the package's PostgreSQL: databases cloned from a template
// with the fence schema and the protected table of the fencing checks.
var cluster *pgtest.Cluster

// checkSchema is what every check database starts with: the protected
// table of the fencing flows (the README's results table). The checks
// make their own scratch tables.
const checkSchema = `
CREATE TABLE results (
	job_key text PRIMARY KEY,
	payload text NOT NULL,
	token   bigint NOT NULL
);
SELECT fence.protect('results');
`

func TestMain(m *testing.M) {
	code := pgtest.Run(m, pgtest.Options{}, func(ctx context.Context, conn *pgx.Conn) error {
		if err := migrations.Prepare(ctx, conn); err != nil {
			return err
		}
		_, err := conn.Exec(ctx, checkSchema)
		return err
	}, &cluster)
	testbin.Remove() // built once for every startServe
	os.Exit(code)
}

// serve is a running `pgfence serve` in front of cluster.
type serve struct {
	Port    int
	LogPath string
}

// startServe starts `pgfence serve` as a user would, write gate on (its
// default), in front of the cluster's primary on a free loopback port.
// Client authentication is trust, said explicitly: the listener is
// loopback only.
func startServe(t *testing.T) *serve {
	t.Helper()
	logPath := filepath.Join(t.TempDir(), "pgfence.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { logf.Close() }) // after Serve's, which ends the process
	_, addr := testbin.Serve(t, logf, "--listen", "127.0.0.1:0", "--auth", "trust",
		"--primary", cluster.Primary.DSN("postgres"))
	return &serve{Port: addr.Port, LogPath: logPath}
}

// target is one way of reaching PostgreSQL: straight or through the proxy.
type target struct {
	Name     string // "direct" or "proxy"
	Port     int
	Database string
}

// DSN is a libpq URL for the target as the superuser postgres.
func (tg target) DSN() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", tg.Port, tg.Database)
}

// ObserverDSN is a direct connection to the target's database, for
// observing (pg_stat_activity, receipts) on a separate connection.
func (tg target) ObserverDSN() string {
	return cluster.Primary.DSN(tg.Database)
}

// Env is the environment of a check script: libpq's PG* variables (which
// node-postgres reads too) and PGFENCE_* for what the scripts need besides.
func (tg target) Env() []string {
	var env []string
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "PG") {
			continue // PGOPTIONS, PGSERVICE, ... of the caller must not leak in
		}
		env = append(env, kv)
	}
	return append(env,
		"PGHOST=127.0.0.1",
		fmt.Sprintf("PGPORT=%d", tg.Port),
		"PGUSER=postgres",
		"PGDATABASE="+tg.Database,
		"PGSSLMODE=disable",
		"PGCONNECT_TIMEOUT=10",
		"PGFENCE_TARGET="+tg.Name,
		"PYTHONDONTWRITEBYTECODE=1",
		fmt.Sprintf("PGFENCE_OBSERVER_PORT=%d", cluster.Primary.Port),
	)
}

// tailFile returns the last n bytes of a file.
func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "(" + err.Error() + ")"
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
