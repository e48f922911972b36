package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

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
expired, or COMMAND runs longer than --max-runtime, COMMAND is sent
--kill-signal and, --grace later, SIGKILL. Its writes to protected tables
after a takeover are refused (FN001) by the gate anyway. SIGINT, SIGTERM and
SIGHUP sent to pgfence run are forwarded to COMMAND. Only COMMAND's own
process is signalled: a shell script should exec its last program or trap
TERM and pass it on.

After a PostgreSQL failover that may have lost a takeover, every generation
issued before it is void (FN015) and its job free (docs/failover.md). When a
renewal answers FN015, or COMMAND exits non-zero and a renewal tried then
does, run logs it (with the new era and timeline), stops COMMAND if it still
runs (--kill-signal, then SIGKILL after --grace), acquires the lease again
(same holder and ttl) and runs COMMAND again with the new generation in its
environment, at most --failover-restarts times (0: exit 76 instead). That is
what a takeover by a new generation would do: its token is above every token
issued before, the old one can commit nothing more, and a result written with
a token-ordered upsert keeps the rerun's. What COMMAND did outside the
database, and rows not ordered by token, are done again. A takeover by
another holder (FN001) is never restarted. --max-runtime bounds the whole
run, restarts included.

The acquire waits for the job's fence row while an open transaction holds it
(see pgfence lease acquire --help): the blocking session is logged after a
second, and named in the error after --lock-timeout.

The database is --database, else PGFENCE_DATABASE_URL, else DATABASE_URL, else
libpq's environment variables (PGHOST, PGPORT, PGDATABASE, PGUSER, ...).

Exit codes (docs/cli.md has the whole table):
    N      COMMAND ran and exited with N (its own code)
    128+N  COMMAND was killed by signal N (or run was interrupted by signal N
           before COMMAND started)
    64     usage error
    69     the database could not be reached: COMMAND did not run
    70     pgfence failed otherwise
    75     the lease is held by another holder: COMMAND did not run
           (with --wait: still held when --wait-timeout ran out; or the fence
           row stayed locked past --lock-timeout)
    76     the lease was lost while COMMAND ran, or release found it taken
           over; COMMAND was told to stop. Also a generation void after a
           failover (FN015) with no --failover-restarts left
    77     permission denied (the role lacks pgfence_worker)
    78     the fence schema is not installed (run pgfence migrate)
    124    COMMAND ran longer than --max-runtime and was stopped
    126    COMMAND could not be executed
    127    COMMAND was not found`

// runFunc runs a configured run; tests replace runner.Run with a fake.
type runFunc func(ctx context.Context, cfg runner.Config, log *zap.Logger) (int, error)

// newRunCmd is `pgfence run`: hold a lease while a command runs. The work
// is done by internal/runner; this file only maps flags and the environment
// to a runner.Config and the result to an exit code (runLong lists them).
func newRunCmd() *cobra.Command { return newRunCmdWith(runner.Run) }

func newRunCmdWith(run runFunc) *cobra.Command {
	var (
		db                            database
		req                           = leaseRequest{db: &db}
		killSignal                    string
		failoverRestarts              int
		renewEvery, grace, maxRuntime time.Duration
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
			if req.job == "" {
				return usageError("run: --job is required")
			}
			sig, err := runner.ParseSignal(killSignal)
			if err != nil {
				return usageError("run: --kill-signal: " + err.Error())
			}
			cfg, err := req.config(cmd, os.Getpid()) // the holder is run itself
			if err != nil {
				return err
			}
			log, err := commandLogger(cmd)
			if err != nil {
				return usageError("run: " + err.Error())
			}
			defer log.Sync() //nolint:errcheck // stderr
			sigs := make(chan os.Signal, 4)
			signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
			defer signal.Stop(sigs)
			if failoverRestarts < 0 {
				return usageError("run: --failover-restarts must not be negative")
			}
			cfg.RenewEvery, cfg.Grace, cfg.KillSignal, cfg.MaxRuntime = renewEvery, grace, sig, maxRuntime
			cfg.FailoverRestarts = failoverRestarts
			cfg.Command, cfg.Signals = args, sigs
			// Signals are forwarded to the command, not used to cancel: the
			// command decides when to stop, and the lease is released after.
			code, err := run(context.WithoutCancel(cmd.Context()), cfg, log)
			switch {
			case err != nil:
				ee := runnerExit(code, err)
				ee.msg = "run: " + ee.msg
				return ee
			case code != 0:
				return &exitError{code: code}
			}
			return nil
		},
	}
	f := cmd.Flags()
	// Everything after COMMAND belongs to COMMAND, even without "--".
	f.SetInterspersed(false)
	req.addFlags(cmd, "job key naming the lease (required)", "lease duration granted by each acquire and renewal, e.g. 30s, 5m, 1d")
	db.addFlag(f)
	f.Var(newDuration(&renewEvery, 0), "renew-every", "renewal interval (default ttl/3)")
	f.Var(newDuration(&grace, 10*time.Second), "grace", "time COMMAND has to exit after --kill-signal before SIGKILL")
	f.Var(newDuration(&maxRuntime, 0), "max-runtime", "stop COMMAND (--kill-signal, then SIGKILL after --grace) once it has run this long, and exit 124 (default no limit)")
	f.StringVar(&killSignal, "kill-signal", "TERM", "signal telling COMMAND to stop (lease lost, --max-runtime)")
	f.IntVar(&failoverRestarts, "failover-restarts", 3, "times to acquire the lease again and rerun COMMAND after a failover voided its generation (FN015); 0: exit 76 instead")
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error {
		return usageError("run: " + err.Error())
	})
	return cmd
}
