package main

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/fence"
)

func newGCCmd() *cobra.Command {
	var (
		db   database
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
		RunE: db.runE(func(ctx context.Context, conn *pgx.Conn, _ []string) (output, error) {
			n, err := fence.GC(ctx, conn, keep)
			if err != nil {
				return output{}, err
			}
			return output{json: map[string]any{"pruned": n, "keep_ms": keep.Milliseconds()},
				text: textf("pruned %d receipts older than %s", n, formatDuration(keep))}, nil
		}),
	}
	db.addFlag(cmd.Flags())
	cmd.Flags().Var(newDuration(&keep, 7*24*time.Hour), "keep", "keep receipts committed within this long, e.g. 7d, 720h")
	return cmd
}
