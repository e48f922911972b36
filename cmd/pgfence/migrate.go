package main

import (
	"context"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/migrations"
)

// addDatabaseFlag adds --database, defaulting to $PGFENCE_DATABASE_URL, else
// $DATABASE_URL (else libpq's PG* variables).
func addDatabaseFlag(cmd *cobra.Command, dsn *string) {
	cmd.Flags().StringVar(dsn, "database", "", "database URL or DSN (default $PGFENCE_DATABASE_URL, else $DATABASE_URL, else libpq's PG* variables)")
}

// connectDatabase connects to the --database DSN or its defaults.
func connectDatabase(ctx context.Context, cmd *cobra.Command, dsn string) (*pgx.Conn, error) {
	if !cmd.Flags().Changed("database") {
		for _, k := range []string{"PGFENCE_DATABASE_URL", "DATABASE_URL"} {
			if v := os.Getenv(k); v != "" {
				dsn = v
				break
			}
		}
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	return conn, nil
}

func newMigrateCmd() *cobra.Command {
	var dsn string
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Install or upgrade the fence schema in a database",
		Long: `Install or upgrade pgfence's schema "fence" (sequences, fences, leases,
receipts, the protocol functions and the backstop trigger) and the roles
pgfence_worker and pgfence_bypass. Safe to run repeatedly and concurrently;
the applied version is kept in public.pgfence_schema_version.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			conn, err := connectDatabase(ctx, cmd, dsn)
			if err != nil {
				return err
			}
			defer conn.Close(ctx)
			before, err := migrations.Current(ctx, conn)
			if err != nil {
				return err
			}
			if err := migrations.Apply(ctx, conn); err != nil {
				return err
			}
			after, err := migrations.Current(ctx, conn)
			if err != nil {
				return err
			}
			if before == after {
				fmt.Fprintf(cmd.OutOrStdout(), "fence schema is up to date (version %d)\n", after)
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "fence schema migrated from version %d to %d\n", before, after)
			}
			return nil
		},
	}
	addDatabaseFlag(cmd, &dsn)
	return cmd
}
