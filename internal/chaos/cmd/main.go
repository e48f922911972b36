// Command chaos runs the pgfence chaos run (make chaos): a primary and a
// streaming replica, two `pgfence serve` processes, workers under
// `pgfence run`, readers, a consumer and a nemesis, then the checker. It
// exits 0 only when the checker finds no violation.
//
//	chaos --pgfence bin/pgfence --duration 5m [--seed N] [--faults k,...] [--failover async|sync]
//
// Its hidden subcommand `worker` is the worker program the run starts
// under `pgfence run`.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/pgfence/pgfence/internal/chaos"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "worker" {
		os.Exit(worker(os.Args[2:]))
	}
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	fs := flag.NewFlagSet("chaos", flag.ContinueOnError)
	var cfg chaos.Config
	var faults, failover string
	fs.DurationVar(&cfg.Duration, "duration", 5*time.Minute, "how long the workload and the nemesis run")
	fs.Uint64Var(&cfg.Seed, "seed", 0, "seed of every random choice (0: from the clock; the summary prints it)")
	fs.IntVar(&cfg.Workers, "workers", 6, "worker slots")
	fs.IntVar(&cfg.Jobs, "jobs", 3, "job keys the workers compete for")
	fs.IntVar(&cfg.Readers, "readers", 3, "readers (policies primary, wait, pending in turn)")
	fs.DurationVar(&cfg.TTL, "ttl", 0, "lease TTL of each pgfence run (0: 2s, 8s with --failover async, 12s with --failover sync)")
	fs.DurationVar(&cfg.FaultGap, "fault-gap", 2*time.Second, "mean pause between faults")
	fs.StringVar(&faults, "faults", "", "comma-separated fault kinds (default: all but failover)")
	fs.StringVar(&failover, "failover", "", "add the failover fault (once per run), with asynchronous (async) or synchronous (sync) replication")
	fs.StringVar(&cfg.Pgfence, "pgfence", "bin/pgfence", "the pgfence binary")
	fs.StringVar(&cfg.Dir, "dir", "", "directory for records and logs (default: a temporary one)")
	if err := fs.Parse(args); err != nil {
		return 64
	}
	if faults != "" {
		var err error
		if cfg.Faults, err = chaos.ParseFaults(faults); err != nil {
			fmt.Fprintln(os.Stderr, "chaos:", err)
			return 64
		}
	}
	if failover != "" {
		var err error
		if cfg.Failover, err = chaos.ParseFailoverMode(failover); err != nil {
			fmt.Fprintln(os.Stderr, "chaos:", err)
			return 64
		}
	}
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		return 70
	}
	cfg.Self = self
	if cfg.Pgfence, err = filepath.Abs(cfg.Pgfence); err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		return 70
	}
	log, err := zap.NewDevelopment()
	if err != nil {
		return 70
	}
	cfg.Log = log
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	sum, err := chaos.Run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		return 70
	}
	sum.WriteText(os.Stdout)
	if !sum.OK() {
		return 1
	}
	return 0
}

func worker(args []string) int {
	fs := flag.NewFlagSet("chaos worker", flag.ContinueOnError)
	var cfg chaos.WorkerConfig
	fs.StringVar(&cfg.Name, "name", "", "worker name recorded with each attempt")
	fs.StringVar(&cfg.Records, "records", "", "JSON-lines file for the attempts")
	fs.Uint64Var(&cfg.Seed, "seed", 1, "seed")
	fs.IntVar(&cfg.Steps, "steps", 0, "commits under the token (0: 1 to 3)")
	fs.StringVar(&cfg.Primary, "primary", "", "the primary (used only by a broken build)")
	if err := fs.Parse(args); err != nil {
		return 64
	}
	cfg.DSN = os.Getenv("DATABASE_URL")
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	code, err := chaos.Work(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos worker:", err)
	}
	return code
}
