package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/fence"
)

func newGCCmd() *cobra.Command {
	var (
		dsn  string
		keep time.Duration
	)
	cmd := &cobra.Command{
		Use:   "gc",
		Short: "Prune commit receipts of closed generations",
		Long: `Delete commit receipts older than --keep, but only of closed generations
(a token older than its job's current one, or a retired epoch), and advance
the pruned-through watermark: a later retry of a pruned generation gets FN006
(cannot confirm), never a second commit. Fence and epoch rows are never
deleted. --keep should exceed the retry window plus the longest message delay.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			conn, err := connectDatabase(ctx, cmd, dsn)
			if err != nil {
				return err
			}
			defer conn.Close(ctx)
			n, err := fence.GC(ctx, conn, keep)
			if err != nil {
				return err
			}
			if jsonFlag(cmd) {
				return printJSON(cmd.OutOrStdout(), map[string]any{"pruned": n, "keep_ms": keep.Milliseconds()})
			}
			fmt.Fprintf(cmd.OutOrStdout(), "pruned %d receipts older than %s\n", n, formatDuration(keep))
			return nil
		},
	}
	cmd.Flags().StringVar(&dsn, "database", "", databaseHelp)
	cmd.Flags().Var(newDuration(&keep, 7*24*time.Hour), "keep", "keep receipts committed within this long, e.g. 7d, 720h")
	return cmd
}
