package main

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/fence"
)

func newEraCmd() *cobra.Command {
	var db database
	cmd := groupCmd(&cobra.Command{
		Use:   "era",
		Short: "Show the failover era, or start a new one after restoring a backup",
		Long: `Every server history the fence has run on is an era (docs/failover.md): a
promotion starts one by itself, and voids every generation issued before it
unless the failover was lossless. A physical backup or any copy of the data
directory restored as the primary on its own timeline looks like a crash
restart to the database: after such a restore, 'pgfence era new' is a
mandatory step (docs/failover.md, "After restoring a backup").`,
	})
	db.addFlag(cmd.PersistentFlags())

	show := &cobra.Command{
		Use:   "show",
		Short: "Show the era the server is in (fence.current_era())",
		Args:  cobra.NoArgs,
		RunE: db.runE(func(ctx context.Context, conn *pgx.Conn, _ []string) (output, error) {
			e, err := fence.CurrentEra(ctx, conn)
			return eraOutput(e, err)
		}),
	}

	var reason string
	newEra := &cobra.Command{
		Use:   "new --reason TEXT",
		Short: "Start a new era now: every generation issued before is void, every lease free (needs pgfence_bypass)",
		Long: `Start a new era now (fence.new_era): every generation issued before is void
(FN015), every lease free, and the token and epoch numbers move past a new
random floor above every number drawn. Run it in each database with the fence
schema after restoring a backup, or any copy of the data directory, as the
primary. It waits for transactions that hold fence rows, and holds the next
off until it commits. Needs a superuser or a member of pgfence_bypass.`,
		Args: cobra.NoArgs,
		RunE: db.runE(func(ctx context.Context, conn *pgx.Conn, _ []string) (output, error) {
			if reason == "" {
				return output{}, usageError("--reason is required: what was restored or copied, and when")
			}
			e, err := fence.NewEra(ctx, conn, reason)
			return eraOutput(e, err)
		}),
	}
	newEra.Flags().StringVar(&reason, "reason", "", "why (recorded in fence.eras): what was restored or copied, and when")
	cmd.AddCommand(show, newEra)
	return cmd
}

// eraOutput is the output of era show and era new, when err is nil.
func eraOutput(e fence.Era, err error) (output, error) {
	if err != nil {
		return output{}, err
	}
	return keyValues(field{"era", e.Era}, field{"timeline", e.Timeline}, field{"began_at", e.BeganAt},
		field{"lossless", e.Lossless}, field{"reason", e.Reason}), nil
}
