package main

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/migrations"
)

func newMigrateCmd() *cobra.Command {
	var db database
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Install or upgrade the fence schema in a database (a DBA, once)",
		Long: `Install or upgrade pgfence's schema "fence" (sequences, fences, leases,
receipts, the protocol functions and the backstop trigger) and the roles
pgfence_worker, pgfence_bypass and pgfence_control. Safe to run repeatedly and
concurrently; the applied version is kept in public.pgfence_schema_version.

Run it as a superuser. It refuses a database where a schema "fence" or the
version table exists and is not a superuser's. Then grant pgfence_worker to
each application role that takes leases or writes protected tables, and
pgfence_control to the login role of the proxy's primary DSN:

    GRANT pgfence_worker TO app;
    GRANT pgfence_control TO pgfence;`,
		Args: cobra.NoArgs,
		RunE: db.runE(func(ctx context.Context, conn *pgx.Conn, _ []string) (output, error) {
			before, err := migrations.Current(ctx, conn)
			if err != nil {
				return output{}, err
			}
			if err := migrations.Apply(ctx, conn); err != nil {
				return output{}, err
			}
			after, err := migrations.Current(ctx, conn)
			if err != nil {
				return output{}, err
			}
			text := textf("fence schema migrated from version %d to %d", before, after)
			if before == after {
				text = textf("fence schema is up to date (version %d)", after)
			}
			return output{json: map[string]any{"from_version": before, "version": after, "migrated": before != after}, text: text}, nil
		}),
	}
	db.addFlag(cmd.Flags())
	return cmd
}
