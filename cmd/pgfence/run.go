package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pgfence/pgfence/internal/runner"
)

const runLong = `run acquires the lease for a job, runs COMMAND while holding it, and releases
it when COMMAND exits. It is all a legacy cron job needs:

    pgfence run --job nightly-report -- ./report.sh

COMMAND gets the lease's fencing metadata in its environment:

    PGOPTIONS                 "-c fence.job_key=… -c fence.epoch=… -c fence.token=…"
                              appended to any PGOPTIONS already set, so psql and
                              every other libpq client present the lease
    PGFENCE_JOB_KEY, PGFENCE_EPOCH, PGFENCE_TOKEN
    PGFENCE_LEASE_EXPIRES_AT  the expiry at acquisition (RFC 3339); renewals extend it

The lease is renewed every --renew-every (default ttl/3). When a renewal finds
the lease taken over, or renewals keep failing until the lease would have
expired, COMMAND is sent --kill-signal and, --grace later, SIGKILL. Its writes
to protected tables after a takeover are refused (FN001) by the gate anyway.
SIGINT, SIGTERM and SIGHUP sent to pgfence run are forwarded to COMMAND. Only
COMMAND's own process is signalled: a shell script should exec its last
program or trap TERM and pass it on.

The database is --database, else PGFENCE_DATABASE_URL, else DATABASE_URL, else
libpq's environment variables (PGHOST, PGPORT, PGDATABASE, PGUSER, ...).

Exit codes:
    N      COMMAND ran and exited with N (its own code)
    128+N  COMMAND was killed by signal N (or run was interrupted by signal N
           before COMMAND started)
    64     usage error
    70     pgfence failed, e.g. the database could not be reached
    75     the lease is held by another holder: COMMAND did not run
           (with --wait: still held when --wait-timeout ran out)
    76     the lease was lost while COMMAND ran; COMMAND was told to stop
    126    COMMAND could not be executed
    127    COMMAND was not found`

// runFunc runs a configured run; tests replace runner.Run with a fake.
type runFunc func(ctx context.Context, cfg runner.Config, log *zap.Logger) (int, error)

// newRunCmd is `pgfence run`: hold a lease while a command runs. The work
// is done by internal/runner; this file only maps flags and the environment
// to a runner.Config and the result to an exit code.
//
// Exit codes:
//
//	N        the command ran and exited with N (its own code)
//	128+N    the command was killed by signal N (or run was interrupted by
//	         signal N before the command started)
//	64       usage error: bad flags or arguments
//	70       pgfence failed, e.g. the database could not be reached
//	75       the lease is held by another holder (EX_TEMPFAIL); the command
//	         did not run. With --wait: still held when the wait timed out
//	76       the lease was lost while the command ran (taken over, or not
//	         renewable before it expired); the command was told to stop
//	126      the command could not be executed
//	127      the command was not found
func newRunCmd() *cobra.Command { return newRunCmdWith(runner.Run) }

func newRunCmdWith(run runFunc) *cobra.Command {
	var (
		job, holder, database, killSignal string
		ttl, waitTimeout, renewEvery      time.Duration
		grace                             time.Duration
		wait                              bool
	)
	cmd := &cobra.Command{
		Use:   "run --job KEY [flags] -- COMMAND [ARGS...]",
		Short: "Run a command while holding a job's lease (fencing metadata in PGOPTIONS)",
		Long:  runLong,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError("run: a COMMAND is required after --")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if job == "" {
				return usageError("run: --job is required")
			}
			sig, err := runner.ParseSignal(killSignal)
			if err != nil {
				return usageError("run: --kill-signal: " + err.Error())
			}
			if !cmd.Flags().Changed("database") {
				database = firstEnv("PGFENCE_DATABASE_URL", "DATABASE_URL")
			}
			log, err := runLogger(cmd)
			if err != nil {
				return usageError("run: " + err.Error())
			}
			defer log.Sync() //nolint:errcheck // stderr
			sigs := make(chan os.Signal, 4)
			signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
			defer signal.Stop(sigs)
			cfg := runner.Config{
				JobKey:      job,
				TTL:         ttl,
				Holder:      holder,
				DSN:         database,
				Wait:        wait || waitTimeout > 0,
				WaitTimeout: waitTimeout,
				RenewEvery:  renewEvery,
				Grace:       grace,
				KillSignal:  sig,
				Command:     args,
				Signals:     sigs,
			}
			// Signals are forwarded to the command, not used to cancel: the
			// command decides when to stop, and the lease is released after.
			code, err := run(context.WithoutCancel(cmd.Context()), cfg, log)
			switch {
			case err != nil:
				return &exitError{code: code, msg: "run: " + err.Error()}
			case code != 0:
				return &exitError{code: code}
			}
			return nil
		},
	}
	f := cmd.Flags()
	// Everything after COMMAND belongs to COMMAND, even without "--".
	f.SetInterspersed(false)
	f.StringVar(&job, "job", "", "job key naming the lease (required)")
	f.DurationVar(&ttl, "ttl", 30*time.Second, "lease duration granted by each acquire and renewal")
	f.StringVar(&holder, "holder", "", "holder name recorded with the lease (default hostname:pid)")
	f.StringVar(&database, "database", "", "database URL or DSN (default $PGFENCE_DATABASE_URL, else $DATABASE_URL, else libpq's PG* variables)")
	f.BoolVar(&wait, "wait", false, "wait while the lease is held by another holder instead of exiting 75")
	f.DurationVar(&waitTimeout, "wait-timeout", 0, "wait at most this long for the lease, then exit 75 (implies --wait)")
	f.DurationVar(&renewEvery, "renew-every", 0, "renewal interval (default ttl/3)")
	f.DurationVar(&grace, "grace", 10*time.Second, "time COMMAND has to exit after --kill-signal before SIGKILL")
	f.StringVar(&killSignal, "kill-signal", "TERM", "signal telling COMMAND its lease was lost")
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error {
		return usageError("run: " + err.Error())
	})
	return cmd
}

func usageError(msg string) error { return &exitError{code: runner.ExitUsage, msg: msg} }

func firstEnv(keys ...string) string {
	for _, k := range keys {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return ""
}

// runLogger logs to stderr at the root --log-level.
func runLogger(cmd *cobra.Command) (*zap.Logger, error) {
	level := zap.NewAtomicLevel()
	if f := cmd.Flag("log-level"); f != nil {
		if err := level.UnmarshalText([]byte(f.Value.String())); err != nil {
			return nil, fmt.Errorf("--log-level: %w", err)
		}
	}
	cfg := zap.NewProductionConfig()
	cfg.Level = level
	cfg.Encoding = "console"
	cfg.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	cfg.DisableStacktrace = true
	cfg.OutputPaths = []string{"stderr"}
	cfg.ErrorOutputPaths = []string{"stderr"}
	return cfg.Build()
}
