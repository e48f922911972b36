package main

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/fence"
)

func newProtectCmd() *cobra.Command {
	var dsn string
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
	addDatabaseFlag(cmd, &dsn)

	var column string
	add := &cobra.Command{
		Use:   "add TABLE",
		Short: "Protect a table and its partitions or children (a no-op if already protected the same way)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			conn, err := connectDatabase(ctx, cmd, dsn)
			if err != nil {
				return err
			}
			defer conn.Close(ctx)
			if err := fence.Protect(ctx, conn, args[0], column); err != nil {
				return err
			}
			if jsonFlag(cmd) {
				return printJSON(cmd.OutOrStdout(), map[string]any{"table": args[0], "protected": true})
			}
			fmt.Fprintf(cmd.OutOrStdout(), "protected %s\n", args[0])
			return nil
		},
	}
	add.Flags().StringVar(&column, "job-key-column", "", "also scope rows: a fenced session may only write rows whose COLUMN equals its fence.job_key")

	remove := &cobra.Command{
		Use:   "remove TABLE",
		Short: "Remove the protection from a table and its tree (a no-op if not protected; needs pgfence_bypass)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			conn, err := connectDatabase(ctx, cmd, dsn)
			if err != nil {
				return err
			}
			defer conn.Close(ctx)
			if err := fence.Unprotect(ctx, conn, args[0]); err != nil {
				return err
			}
			if jsonFlag(cmd) {
				return printJSON(cmd.OutOrStdout(), map[string]any{"table": args[0], "protected": false})
			}
			fmt.Fprintf(cmd.OutOrStdout(), "unprotected %s\n", args[0])
			return nil
		},
	}

	list := &cobra.Command{
		Use:   "list",
		Short: "List protected tables",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			conn, err := connectDatabase(ctx, cmd, dsn)
			if err != nil {
				return err
			}
			defer conn.Close(ctx)
			tables, err := fence.ProtectedTables(ctx, conn)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if jsonFlag(cmd) {
				type row struct {
					Schema       string    `json:"schema"`
					Table        string    `json:"table"`
					JobKeyColumn string    `json:"job_key_column,omitempty"`
					ProtectedAt  time.Time `json:"protected_at"`
					Exists       bool      `json:"exists"`
				}
				rows := []row{}
				for _, t := range tables {
					rows = append(rows, row{t.Schema, t.Table, t.JobKeyColumn, t.ProtectedAt, t.Exists})
				}
				return printJSON(out, rows)
			}
			if len(tables) == 0 {
				fmt.Fprintln(out, "no protected tables")
				return nil
			}
			w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "SCHEMA\tTABLE\tROOT\tJOB KEY COLUMN\tPROTECTED AT\tNOTE")
			for _, t := range tables {
				col := t.JobKeyColumn
				if col == "" {
					col = "-"
				}
				note := ""
				if !t.Exists {
					note = "table dropped; run protect remove"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", t.Schema, t.Table, t.Root, col, t.ProtectedAt.UTC().Format("2006-01-02 15:04:05Z"), note)
			}
			return w.Flush()
		},
	}
	cmd.AddCommand(add, remove, list)
	return cmd
}
