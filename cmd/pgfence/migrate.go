package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/migrations"
)

func newMigrateCmd() *cobra.Command {
	var dsn string
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Install or upgrade the fence schema in a database (a DBA, once)",
		Long: `Install or upgrade pgfence's schema "fence" (sequences, fences, leases,
receipts, the protocol functions and the backstop trigger) and the roles
pgfence_worker and pgfence_bypass. Safe to run repeatedly and concurrently;
the applied version is kept in public.pgfence_schema_version.

Run it as a DBA: a role that may create schemas in the database and create
roles. Then grant pgfence_worker to each application role that takes leases
or writes protected tables:

    GRANT pgfence_worker TO app;`,
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
			out := cmd.OutOrStdout()
			switch {
			case jsonFlag(cmd):
				return printJSON(out, map[string]any{"from_version": before, "version": after, "migrated": before != after})
			case before == after:
				fmt.Fprintf(out, "fence schema is up to date (version %d)\n", after)
			default:
				fmt.Fprintf(out, "fence schema migrated from version %d to %d\n", before, after)
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&dsn, "database", "", databaseHelp)
	return cmd
}
