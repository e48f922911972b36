// Command pgfence is the pgfence CLI: the proxy (serve), schema management
// (migrate, protect), leases (lease, run), retention (gc) and a local
// development cluster (dev).
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root := newRootCmd()
	err := root.ExecuteContext(ctx)
	stop()
	if err != nil {
		var ee *exitError
		if errors.As(err, &ee) {
			if ee.msg != "" {
				fmt.Fprintln(os.Stderr, "pgfence:", ee.msg)
			}
			os.Exit(ee.code)
		}
		fmt.Fprintln(os.Stderr, "pgfence:", err)
		os.Exit(1)
	}
}

// exitError carries a specific process exit code out of a command.
type exitError struct {
	code int
	msg  string
}

func (e *exitError) Error() string { return e.msg }

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "pgfence",
		Short:         "Leases and fencing tokens enforced at the PostgreSQL write",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().String("log-level", envOr("PGFENCE_LOG_LEVEL", "info"), "log level: debug, info, warn, error (PGFENCE_LOG_LEVEL)")
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

func envOr(key, def string) string {
	if v, ok := os.LookupEnv(key); ok {
		return v
	}
	return def
}
