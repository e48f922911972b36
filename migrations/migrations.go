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
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/tern/v2/migrate"

	"github.com/pgfence/pgfence/internal/ownsql"
)

// VersionTable records the applied schema version.
const VersionTable = "public.pgfence_schema_version"

//go:embed *.sql
var files embed.FS

// Apply brings the fence schema in the connected database up to date. It is
// safe to call repeatedly and from several processes at once. It refuses
// (Preflight) a database where what it would run or read was made by
// someone other than a superuser.
func Apply(ctx context.Context, conn *pgx.Conn) error {
	if err := Preflight(ctx, conn); err != nil {
		return err
	}
	m, err := migrate.NewMigrator(ctx, conn, VersionTable)
	if err != nil {
		return fmt.Errorf("migrations: prepare %s: %w", VersionTable, err)
	}
	if err := m.LoadMigrations(files); err != nil {
		return fmt.Errorf("migrations: load: %w", err)
	}
	return retryLocks(ctx, func() error { return m.Migrate(ctx) })
}

// MigrateTo brings the fence schema to version (not beyond the latest):
// for tests of upgrades, and for upgrading in stages. Apply is MigrateTo
// the latest version.
func MigrateTo(ctx context.Context, conn *pgx.Conn, version int32) error {
	if err := Preflight(ctx, conn); err != nil {
		return err
	}
	m, err := migrate.NewMigrator(ctx, conn, VersionTable)
	if err != nil {
		return fmt.Errorf("migrations: prepare %s: %w", VersionTable, err)
	}
	if err := m.LoadMigrations(files); err != nil {
		return fmt.Errorf("migrations: load: %w", err)
	}
	return retryLocks(ctx, func() error { return m.MigrateTo(ctx, version) })
}

// lockRetries bounds how often retryLocks tries a migration that gave up
// waiting for a lock.
const lockRetries = 20

// retryLocks runs migrate, and runs it again while it fails with 55P03
// (lock_not_available). A migration that alters a table every gated
// transaction locks (019 adds a column to fence.fences) sets a short
// lock_timeout, so that waiting for a long transaction does not stall
// every other gated transaction behind its lock request; the migration is
// rolled back and tried again here, up to lockRetries times, about a
// minute. Migrations already applied stay applied (each is its own
// transaction).
func retryLocks(ctx context.Context, migrate func() error) error {
	for attempt := 1; ; attempt++ {
		err := migrate()
		var pgErr *pgconn.PgError
		if err == nil {
			return nil
		}
		if !errors.As(err, &pgErr) || pgErr.Code != "55P03" || attempt == lockRetries {
			if pgErr != nil && pgErr.Code == "55P03" {
				return fmt.Errorf("migrations: apply: %w (tried %d times: a long transaction holds what the migration alters; find it in pg_stat_activity, end it or wait, and run the migration again)", err, attempt)
			}
			return fmt.Errorf("migrations: apply: %w", err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("migrations: apply: %w (while waiting to try again: %w)", err, ctx.Err())
		case <-time.After(time.Duration(attempt) * 100 * time.Millisecond):
		}
	}
}

// versionTableSQL reads, from pg_catalog alone, who made VersionTable and
// what it is: owner is a superuser, relkind, row security, triggers.
const versionTableSQL = `SELECT o.rolsuper, c.relkind::pg_catalog.text, c.relrowsecurity,
  EXISTS (SELECT FROM pg_catalog.pg_trigger AS t WHERE t.tgrelid OPERATOR(pg_catalog.=) c.oid),
  EXISTS (SELECT FROM pg_catalog.pg_rewrite AS r WHERE r.ev_class OPERATOR(pg_catalog.=) c.oid)
FROM pg_catalog.pg_class AS c
  JOIN pg_catalog.pg_namespace AS n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
  JOIN pg_catalog.pg_roles AS o ON o.oid OPERATOR(pg_catalog.=) c.relowner
WHERE n.nspname OPERATOR(pg_catalog.=) 'public' AND c.relname OPERATOR(pg_catalog.=) 'pgfence_schema_version'`

// ErrUntrusted is returned (wrapped) by Apply and MigrateTo for a database
// where a schema named fence, or the version table, exists and is not a
// superuser's plain work.
var ErrUntrusted = errors.New("migrations: refusing to build on what pgfence does not trust")

// Preflight checks, from pg_catalog alone, that what a migration would
// read, run or build on is a superuser's: schema fence, if it exists, and
// everything in it (ownsql.Check); the version table, if it exists, a
// plain table a superuser owns, without row security, triggers or rules.
// A migration runs as a superuser; a schema named fence or a version
// table that a worker made first (in a database it owns, or in schema
// public where it may create tables) would run the worker's code with a
// superuser's rights. Run migrations on a connection that pins its
// search_path too (internal/ownsql.Pin; pgfence migrate does): their SQL
// names pg_catalog's functions without the schema. A connection that is
// not a superuser's is not checked: it has only its own rights to lose,
// and migrations from version 5 on refuse it (42501).
func Preflight(ctx context.Context, conn *pgx.Conn) error {
	if conn.PgConn().ParameterStatus("is_superuser") != "on" {
		return nil
	}
	trust, err := ownsql.Check(ctx, conn.PgConn(), nil)
	if err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	if trust.Untrusted() {
		return fmt.Errorf("%w: %s (schema fence and everything in it must be a superuser's)", ErrUntrusted, trust.Problem)
	}
	var super, rls, triggers, rules bool
	var kind string
	err = conn.QueryRow(ctx, versionTableSQL).Scan(&super, &kind, &rls, &triggers, &rules)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil
	case err != nil:
		return fmt.Errorf("migrations: read %s: %w", VersionTable, err)
	case !super || kind != "r" || rls || triggers || rules:
		return fmt.Errorf("%w: %s is not a plain table of a superuser's (a superuser owner: %v, relkind %q, row security %v, triggers %v, rules %v)",
			ErrUntrusted, VersionTable, super, kind, rls, triggers, rules)
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
// It reads the version table only after Preflight.
func Current(ctx context.Context, conn *pgx.Conn) (int32, error) {
	if err := Preflight(ctx, conn); err != nil {
		return 0, err
	}
	var exists bool
	if err := conn.QueryRow(ctx, "select pg_catalog.to_regclass($1) is not null", VersionTable).Scan(&exists); err != nil {
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
