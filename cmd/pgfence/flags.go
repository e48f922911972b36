package main

// Flags with the same meaning in every command that has them (docs/cli.md,
// "Flags every command shares"): the holder default, the wait flags,
// durations with days.

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/internal/runner"
)

// --- the holder ---

// defaultHolder is the holder recorded with a lease when --holder is not
// given, the same for every command: $PGFENCE_HOLDER, else HOST:PID of the
// process that keeps the lease (pgfence run itself; for lease acquire, its
// parent: the script that renews and releases it).
func defaultHolder(pid int) string {
	if h := os.Getenv("PGFENCE_HOLDER"); h != "" {
		return h
	}
	return runner.DefaultHolder(pid)
}

const holderHelp = "holder name recorded with the lease (default $PGFENCE_HOLDER, else HOST:PID of the process keeping the lease)"

// --- durations ---

// durationValue is a flag.Value for durations that also accepts days:
// "30s", "5m", "36h", "7d", "1d12h".
type durationValue time.Duration

func newDuration(p *time.Duration, def time.Duration) *durationValue {
	*p = def
	return (*durationValue)(p)
}

func (d *durationValue) Set(s string) error {
	v, err := parseDuration(s)
	if err != nil {
		return err
	}
	*d = durationValue(v)
	return nil
}

func (d *durationValue) Type() string   { return "duration" }
func (d *durationValue) String() string { return formatDuration(time.Duration(*d)) }

// parseDuration reads a Go duration ("1h30m", "250ms") that may also use
// the unit d (24 hours): "7d", "1d12h", "1.5d".
func parseDuration(s string) (time.Duration, error) {
	in := strings.TrimSpace(s)
	neg := strings.HasPrefix(in, "-")
	rest := in
	if neg || strings.HasPrefix(in, "+") {
		rest = in[1:]
	}
	var total time.Duration
	for rest != "" {
		i := 0
		for i < len(rest) && (rest[i] == '.' || rest[i] >= '0' && rest[i] <= '9') {
			i++
		}
		j := i
		for j < len(rest) && !(rest[j] == '.' || rest[j] >= '0' && rest[j] <= '9') {
			j++
		}
		num, unit := rest[:i], rest[i:j]
		rest = rest[j:]
		if num == "" {
			return 0, fmt.Errorf("invalid duration %q (want e.g. 30s, 5m, 2h, 7d)", s)
		}
		if unit == "d" {
			f, err := strconv.ParseFloat(num, 64)
			if err != nil {
				return 0, fmt.Errorf("invalid duration %q (want e.g. 30s, 5m, 2h, 7d)", s)
			}
			total += time.Duration(f * float64(24*time.Hour))
			continue
		}
		if unit == "" && num != "0" {
			return 0, fmt.Errorf("invalid duration %q: missing unit (want e.g. 30s, 5m, 2h, 7d)", s)
		}
		d, err := time.ParseDuration(num + unit)
		if err != nil {
			return 0, fmt.Errorf("invalid duration %q (want e.g. 30s, 5m, 2h, 7d)", s)
		}
		total += d
	}
	if in == "" {
		return 0, fmt.Errorf("invalid duration %q (want e.g. 30s, 5m, 2h, 7d)", s)
	}
	if neg {
		total = -total
	}
	return total, nil
}

// formatDuration prints d with days when it is a whole number of them.
func formatDuration(d time.Duration) string {
	if d > 0 && d%(24*time.Hour) == 0 {
		return strconv.FormatInt(int64(d/(24*time.Hour)), 10) + "d"
	}
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// --- leases ---

// waitFlags are the flags of lease acquire and run that say how long to
// wait for a lease.
type waitFlags struct {
	wait, noWait bool
	waitTimeout  time.Duration
	lockTimeout  time.Duration
}

func (w *waitFlags) add(c *cobra.Command) {
	f := c.Flags()
	f.BoolVar(&w.wait, "wait", false, "wait while the lease is held by another holder (and while the database is unreachable)")
	f.BoolVar(&w.noWait, "no-wait", false, "give up at once when the lease is held by another holder: exit 75 (the default)")
	f.Var(newDuration(&w.waitTimeout, 0), "wait-timeout", "wait at most this long for the lease, then exit 75 (implies --wait; default no limit)")
	f.Var(newDuration(&w.lockTimeout, 30*time.Second), "lock-timeout",
		"give up, naming the blocking session, after waiting this long for the job's fence row while an open transaction holds it (0: no limit)")
	c.MarkFlagsMutuallyExclusive("wait", "no-wait")
}

// waiting reports whether to wait for a held lease.
func (w *waitFlags) waiting() bool { return !w.noWait && (w.wait || w.waitTimeout > 0) }

// leaseRequest is what lease acquire and run ask the runner for, from the
// flags both take: --job, --holder, --ttl, the wait flags and the
// database.
type leaseRequest struct {
	db          *database
	job, holder string
	ttl         time.Duration
	waitFlags
}

// addFlags adds --job, --ttl (with the command's own help), --holder and
// the wait flags to c.
func (r *leaseRequest) addFlags(c *cobra.Command, jobHelp, ttlHelp string) {
	f := c.Flags()
	f.StringVar(&r.job, "job", "", jobHelp)
	f.Var(newDuration(&r.ttl, 30*time.Second), "ttl", ttlHelp)
	f.StringVar(&r.holder, "holder", "", holderHelp)
	r.waitFlags.add(c)
}

// config is the runner.Config of the request; without --holder the holder
// is the default for pid, the process that keeps the lease.
func (r *leaseRequest) config(cmd *cobra.Command, pid int) (runner.Config, error) {
	connCfg, err := r.db.config(cmd)
	if err != nil {
		return runner.Config{}, err
	}
	holder := r.holder
	if holder == "" {
		holder = defaultHolder(pid)
	}
	return runner.Config{
		JobKey:      r.job,
		Holder:      holder,
		TTL:         r.ttl,
		DSN:         r.db.dsn(cmd),
		ConnConfig:  connCfg,
		Wait:        r.waiting(),
		WaitTimeout: r.waitTimeout,
		LockTimeout: r.lockTimeout,
	}, nil
}

// envOr is $key, or def when it is not set.
func envOr(key, def string) string {
	if v, ok := os.LookupEnv(key); ok {
		return v
	}
	return def
}
