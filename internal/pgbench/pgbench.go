// Package pgbench runs PostgreSQL's pgbench and psql against a local
// server for the measuring commands (internal/benchproxy,
// internal/benchreplica): on 127.0.0.1, as postgres, without TLS.
//
// It is not a test helper and measures nothing itself.
package pgbench

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Result is a timed pgbench run's throughput and average latency.
type Result struct {
	TPS     float64
	Latency float64 // ms
	Txns    int64   // transactions processed
}

var (
	tpsRe  = regexp.MustCompile(`tps = ([0-9.]+) \((?:without initial connection time|including reconnection times)\)`)
	latRe  = regexp.MustCompile(`latency average = ([0-9.]+) ms`)
	txnsRe = regexp.MustCompile(`number of transactions actually processed: ([0-9]+)`)
)

// Flags defines on flag.CommandLine the flags of every measuring command:
// -t (the duration of each pgbench run), -s (the pgbench scale) and
// -rounds (alternating rounds per cell, rounds by default).
func Flags(rounds int) (dur *time.Duration, scale, roundsFlag *int) {
	return flag.Duration("t", 5*time.Second, "duration of each pgbench run"),
		flag.Int("s", 2, "pgbench scale"),
		flag.Int("rounds", rounds, "alternating rounds per cell (results are averaged)")
}

// Run runs pgbench with args against db on port, env added to its
// environment, and returns what it printed.
func Run(env []string, port int, db string, args ...string) (string, error) {
	args = append([]string{"-h", "127.0.0.1", "-p", strconv.Itoa(port), "-U", "postgres"}, args...)
	cmd := exec.Command("pgbench", append(args, db)...)
	cmd.Env = append(append(os.Environ(), "PGSSLMODE=disable"), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// ErrNoTransactions is Measure's error for a run that completed no
// transaction (pgbench then prints no rate to read).
var ErrNoTransactions = errors.New("pgbench completed no transaction")

// Measure is Run of a timed run, read: its tps and average latency.
func Measure(env []string, port int, db string, args ...string) (Result, error) {
	out, err := Run(env, port, db, args...)
	if err != nil {
		return Result{}, fmt.Errorf("%w\n%s", err, out)
	}
	if m := txnsRe.FindStringSubmatch(out); m != nil && m[1] == "0" {
		return Result{}, ErrNoTransactions
	}
	t, l := tpsRe.FindStringSubmatch(out), latRe.FindStringSubmatch(out)
	if t == nil || l == nil {
		return Result{}, fmt.Errorf("cannot parse pgbench output:\n%s", out)
	}
	tps, _ := strconv.ParseFloat(t[1], 64)
	lat, _ := strconv.ParseFloat(l[1], 64)
	var n int64
	if m := txnsRe.FindStringSubmatch(out); m != nil {
		n, _ = strconv.ParseInt(m[1], 10, 64)
	}
	return Result{TPS: tps, Latency: lat, Txns: n}, nil
}

// Psql runs sql with psql -X -At against db on port and returns what it
// printed, without the trailing white space.
func Psql(port int, db, sql string) (string, error) {
	cmd := exec.Command("psql", "-X", "-At", "-h", "127.0.0.1", "-p", strconv.Itoa(port), "-U", "postgres", "-d", db, "-c", sql)
	cmd.Env = append(os.Environ(), "PGSSLMODE=disable")
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return "", fmt.Errorf("psql %s: %w\n%s", sql, err, ee.Stderr)
		}
		return "", fmt.Errorf("psql %s: %w", sql, err)
	}
	return strings.TrimRight(string(out), " \t\r\n"), nil
}
