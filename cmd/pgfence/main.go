// Command pgfence is the pgfence CLI: the proxy (serve), schema management
// (migrate, protect), leases (lease, run), retention (gc), the history
// audit (audit) and a local development cluster (dev).
//
// Every subcommand shares one grammar (cli.go, docs/cli.md): the database
// from --database, else $PGFENCE_DATABASE_URL or $DATABASE_URL, else
// libpq's PG* variables; --json for machine-readable output and errors;
// one table of exit codes.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := execute(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "pgfence",
		Short: "Leases and fencing tokens enforced at the PostgreSQL write",
		Long: `pgfence: leases and fencing tokens enforced at the PostgreSQL write.

Every command takes the database the same way: --database, else
$PGFENCE_DATABASE_URL, else $DATABASE_URL, else libpq's PG* variables
(PGHOST, PGPORT, PGUSER, PGDATABASE, ...). --json prints results, and
errors on stderr, as JSON. Exit codes are one table for every command:
see docs/cli.md.`,
		Version:       versionString(),
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetVersionTemplate("{{.Version}}\n")
	pf := root.PersistentFlags()
	pf.String("log-level", envOr("PGFENCE_LOG_LEVEL", "info"), "log level: debug, info, warn, error (PGFENCE_LOG_LEVEL)")
	pf.String("log-format", envOr("PGFENCE_LOG_FORMAT", "auto"), "log format: text, json, or auto (text on a terminal, else JSON) (PGFENCE_LOG_FORMAT)")
	pf.Bool("json", false, "machine-readable output: results as JSON, errors on stderr as JSON, logs as JSON")
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError(err.Error()) })
	root.AddCommand(
		newVersionCmd(),
		newMigrateCmd(),
		newProtectCmd(),
		newLeaseCmd(),
		newGCCmd(),
		newDevCmd(),
		newServeCmd(),
		newPasswdCmd(),
		newRunCmd(),
		newAuditCmd(),
	)
	return root
}
