package main

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/fence"
)

func newProtectCmd() *cobra.Command {
	var db database
	cmd := groupCmd(&cobra.Command{
		Use:   "protect",
		Short: "Manage protected tables (the backstop trigger)",
		Long: `A protected table refuses every write that does not carry a current fencing
token in the session settings fence.job_key, fence.epoch and fence.token: from
the proxy, direct connections, functions, DO blocks, views and FK cascades.
Protecting a partitioned table or an inheritance parent protects its whole
tree, including members added later. Members of the role pgfence_bypass are
exempt (and logged); only they (and superusers) may unprotect, or change a
protected table's triggers, rules, name, owner or members (docs/security.md).

Run it as a DBA (the table's owner) on the database itself, not through the
proxy.`,
	})
	db.addFlag(cmd.PersistentFlags())

	var column string
	add := &cobra.Command{
		Use:   "add TABLE",
		Short: "Protect a table and its partitions or children (a no-op if already protected the same way)",
		Args:  cobra.ExactArgs(1),
		RunE: db.runE(func(ctx context.Context, conn *pgx.Conn, args []string) (output, error) {
			table, err := db.qualify(ctx, conn, args[0])
			if err != nil {
				return output{}, err
			}
			return protected(args[0], true, fence.Protect(ctx, conn, table, column))
		}),
	}
	add.Flags().StringVar(&column, "job-key-column", "", "also scope rows: a fenced session may only write rows whose COLUMN equals its fence.job_key")

	remove := &cobra.Command{
		Use:   "remove TABLE",
		Short: "Remove the protection from a table and its tree (a no-op if not protected; needs pgfence_bypass)",
		Args:  cobra.ExactArgs(1),
		RunE: db.runE(func(ctx context.Context, conn *pgx.Conn, args []string) (output, error) {
			table, err := db.qualify(ctx, conn, args[0])
			if err != nil {
				return output{}, err
			}
			return protected(args[0], false, fence.Unprotect(ctx, conn, table))
		}),
	}

	list := &cobra.Command{
		Use:   "list",
		Short: "List protected tables",
		Args:  cobra.NoArgs,
		RunE: db.runE(func(ctx context.Context, conn *pgx.Conn, _ []string) (output, error) {
			tables, err := fence.ProtectedTables(ctx, conn)
			if err != nil {
				return output{}, err
			}
			rows := make([]protectedTable, len(tables))
			for i, t := range tables {
				rows[i] = protectedTable(t)
			}
			return listing(rows, "no protected tables",
				[]string{"SCHEMA", "TABLE", "ROOT", "JOB KEY COLUMN", "PROTECTED AT", "NOTE"},
				func(t protectedTable) []string {
					note := ""
					if !t.Exists {
						note = "table dropped; run protect remove"
					}
					return []string{t.Schema, t.Table, t.Root, orDash(t.JobKeyColumn), t.ProtectedAt.UTC().Format("2006-01-02 15:04:05Z"), note}
				}), nil
		}),
	}
	cmd.AddCommand(add, remove, list)
	return cmd
}

// protected is the output of protect add (on) and remove, when err is nil.
func protected(table string, on bool, err error) (output, error) {
	if err != nil {
		return output{}, err
	}
	text := textf("protected %s", table)
	if !on {
		text = textf("unprotected %s", table)
	}
	return output{json: map[string]any{"table": table, "protected": on}, text: text}, nil
}

// protectedTable is a fence.ProtectedTable as protect list --json prints
// it (the root is for the text table only).
type protectedTable struct {
	Schema       string    `json:"schema"`
	Table        string    `json:"table"`
	Root         string    `json:"-"`
	JobKeyColumn string    `json:"job_key_column,omitempty"`
	ProtectedAt  time.Time `json:"protected_at"`
	Exists       bool      `json:"exists"`
}
