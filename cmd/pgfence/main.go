// Command pgfence is the pgfence CLI: the proxy (serve), schema management
// (migrate, protect), leases (lease, run), retention (gc), the history
// audit (audit), failover eras (era) and a local development cluster (dev). The work is done by
// the packages (proxy, fence, migrations, audit, internal/runner); this one
// maps flags, the environment and files to their calls, and their results
// and errors to output and an exit code.
//
// Every subcommand shares one grammar (docs/cli.md): the database from
// --database, else $PGFENCE_DATABASE_URL or $DATABASE_URL, else libpq's
// PG* variables; --json for machine-readable output and errors; one table
// of exit codes.
//
// # How a subcommand is built
//
// A subcommand is a newXxxCmd function in a file of its own returning a
// *cobra.Command, added to the root in newRootCmd (gc.go is the shortest
// whole example). It declares its flags and holds its own logic only; what
// every command shares comes from these files:
//
//   - database.go, the database: declare a database, add its flag with
//     db.addFlag(cmd.Flags()) (cmd.PersistentFlags() on a group: its
//     subcommands share it) and make the RunE db.runE(f): f gets one open
//     connection and the arguments and returns the output. db.with is for
//     a command that checks its flags before it connects (audit), db.config
//     for one that hands the connection on (lease acquire and run, through
//     leaseRequest).
//   - output.go, the result: an output is printed by runE, or by
//     printResult, on stdout: its json value as one line of JSON with
//     --json, else its text (textf for a line, keyValues for key=value
//     lines a shell can eval, listing for a list as an array or a table).
//   - exit.go, errors: return them as they are. execute classifies each by
//     the one exit code table (FN SQLSTATEs, PostgreSQL codes, connection
//     failures, with a hint where the fix is known) and prints it on
//     stderr, as text or as one JSON object. A command returns an
//     *exitError only for what the table cannot know: usageError for a bad
//     flag or argument, configError for serve's configuration, an exit code
//     of its own (audit's violations, run's command).
//   - flags.go, flags that mean the same everywhere: durations with days
//     (newDuration), --holder and its default, the wait flags.
//   - logging.go: commandLogger, the root --log-level and --log-format.
//   - main.go: groupCmd, for a command that only holds subcommands.
//
// serve is the one command with a configuration file: it reads each
// setting from the file, the environment and its flag in one loop over
// serveConfig's fields (config.go), so a new setting is a field and a flag.
//
// Tests run the CLI in-process as main does (main_test.go);
// TestEveryCommandHasTheCommonFlags checks a new command has --json and
// --database, and TestJSONOutput lists every command's --json output: add
// the new one there.
package main

import (
	"context"
	"fmt"
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
		newEraCmd(),
	)
	return root
}

// groupCmd is a command that only holds subcommands: bare, it prints its
// help; with an unknown subcommand it is a usage error.
func groupCmd(c *cobra.Command) *cobra.Command {
	c.Args = cobra.ArbitraryArgs
	c.RunE = func(cmd *cobra.Command, args []string) error {
		if len(args) > 0 {
			return &exitError{code: exitUsage, msg: fmt.Sprintf("unknown command %q for %q", args[0], cmd.CommandPath()),
				hint: fmt.Sprintf("run '%s --help' for usage", cmd.CommandPath())}
		}
		return cmd.Help()
	}
	return c
}
