// Package migrations installs and upgrades pgfence's schema (`fence`): the
// token and epoch sequences, fences, leases, receipts, the server-side
// protocol functions, the backstop trigger and the pgfence_worker and
// pgfence_bypass roles.
//
// The SQL is embedded and applied with tern; the applied version is kept in
// public.pgfence_schema_version. Concurrent migrators are safe: tern holds a
// PostgreSQL advisory lock while it migrates, and every migration runs in its
// own transaction, so a failure leaves the previous version intact.
//
// Migrating needs a superuser from version 5 on (version 8 installs the
// event triggers that guard protected tables' DDL); version 5 checks that
// before it changes anything.
//
// It is not a general migration tool for application tables.
package migrations

import (
	"context"
	"embed"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/tern/v2/migrate"
)

// VersionTable records the applied schema version.
const VersionTable = "public.pgfence_schema_version"

//go:embed *.sql
var files embed.FS

// Apply brings the fence schema in the connected database up to date. It is
// safe to call repeatedly and from several processes at once.
func Apply(ctx context.Context, conn *pgx.Conn) error {
	m, err := migrate.NewMigrator(ctx, conn, VersionTable)
	if err != nil {
		return fmt.Errorf("migrations: prepare %s: %w", VersionTable, err)
	}
	if err := m.LoadMigrations(files); err != nil {
		return fmt.Errorf("migrations: load: %w", err)
	}
	if err := m.Migrate(ctx); err != nil {
		return fmt.Errorf("migrations: apply: %w", err)
	}
	return nil
}

// MigrateTo brings the fence schema to version (not beyond the latest):
// for tests of upgrades, and for upgrading in stages. Apply is MigrateTo
// the latest version.
func MigrateTo(ctx context.Context, conn *pgx.Conn, version int32) error {
	m, err := migrate.NewMigrator(ctx, conn, VersionTable)
	if err != nil {
		return fmt.Errorf("migrations: prepare %s: %w", VersionTable, err)
	}
	if err := m.LoadMigrations(files); err != nil {
		return fmt.Errorf("migrations: load: %w", err)
	}
	if err := m.MigrateTo(ctx, version); err != nil {
		return fmt.Errorf("migrations: apply: %w", err)
	}
	return nil
}

// Latest is the version Apply migrates to.
func Latest() (int32, error) {
	m, err := migrate.NewMigrator(context.Background(), nil, VersionTable)
	if err != nil {
		return 0, err
	}
	if err := m.LoadMigrations(files); err != nil {
		return 0, fmt.Errorf("migrations: load: %w", err)
	}
	return int32(len(m.Migrations)), nil
}

// Current reports the version applied in the connected database (0 when
// pgfence was never migrated there).
func Current(ctx context.Context, conn *pgx.Conn) (int32, error) {
	var exists bool
	if err := conn.QueryRow(ctx, "select to_regclass($1) is not null", VersionTable).Scan(&exists); err != nil {
		return 0, fmt.Errorf("migrations: read version: %w", err)
	}
	if !exists {
		return 0, nil
	}
	var v int32
	if err := conn.QueryRow(ctx, "select version from "+VersionTable).Scan(&v); err != nil {
		return 0, fmt.Errorf("migrations: read version: %w", err)
	}
	return v, nil
}

// Prepare is Apply with the signature of pgtest.Prepare, for test
// templates.
func Prepare(ctx context.Context, conn *pgx.Conn) error { return Apply(ctx, conn) }
