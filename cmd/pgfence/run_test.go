package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/internal/runner"
)

// execRun runs `pgfence run args...` with run replaced by fake, returning
// the Config fake saw (nil when it was not called) and Execute's error.
func execRun(t *testing.T, fake runFunc, args ...string) (*runner.Config, error) {
	t.Helper()
	var got *runner.Config
	root := &cobra.Command{Use: "pgfence", SilenceUsage: true, SilenceErrors: true}
	root.PersistentFlags().String("log-level", "error", "")
	root.AddCommand(newRunCmdWith(func(ctx context.Context, cfg runner.Config, log *zap.Logger) (int, error) {
		got = &cfg
		return fake(ctx, cfg, log)
	}))
	root.SetArgs(append([]string{"run"}, args...))
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	return got, root.Execute()
}

func succeed(context.Context, runner.Config, *zap.Logger) (int, error) { return 0, nil }

func TestRunFlags(t *testing.T) {
	t.Setenv("PGFENCE_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "postgres://from-database-url/app")
	tests := []struct {
		name  string
		args  []string
		check func(t *testing.T, c *runner.Config)
	}{
		{"cron line defaults", []string{"--job", "nightly-report", "--", "./report.sh"}, func(t *testing.T, c *runner.Config) {
			if c.JobKey != "nightly-report" || c.TTL != 30*time.Second || c.Grace != 10*time.Second ||
				c.KillSignal != syscall.SIGTERM || c.Wait || c.RenewEvery != 0 || c.Holder != defaultHolder(os.Getpid()) ||
				c.LockTimeout != 30*time.Second || c.MaxRuntime != 0 || c.FailoverRestarts != 3 {
				t.Errorf("got %+v, want job nightly-report, ttl 30s, grace 10s, SIGTERM, no wait, default renewal and holder, lock timeout 30s, no max runtime, 3 failover restarts", c)
			}
			if c.DSN != "postgres://from-database-url/app" {
				t.Errorf("DSN: got %q, want the DATABASE_URL value", c.DSN)
			}
			if !slices.Equal(c.Command, []string{"./report.sh"}) {
				t.Errorf("command: got %q", c.Command)
			}
			if c.Signals == nil {
				t.Error("no signal channel: signals would not be forwarded")
			}
		}},
		{"every flag", []string{"--job", "j", "--ttl", "9s", "--holder", "h1", "--database", "postgres://flag/db",
			"--wait-timeout", "5s", "--renew-every", "2s", "--grace", "1s", "--kill-signal", "INT", "--failover-restarts", "0",
			"--", "psql", "-c", "select 1"},
			func(t *testing.T, c *runner.Config) {
				if c.TTL != 9*time.Second || c.Holder != "h1" || c.DSN != "postgres://flag/db" || !c.Wait ||
					c.WaitTimeout != 5*time.Second || c.RenewEvery != 2*time.Second || c.Grace != time.Second ||
					c.KillSignal != syscall.SIGINT || c.FailoverRestarts != 0 {
					t.Errorf("got %+v", c)
				}
				if !slices.Equal(c.Command, []string{"psql", "-c", "select 1"}) {
					t.Errorf("command: got %q", c.Command)
				}
			}},
		{"flags after the command are the command's", []string{"--job", "j", "./report.sh", "--ttl", "1s"}, func(t *testing.T, c *runner.Config) {
			if c.TTL != 30*time.Second || !slices.Equal(c.Command, []string{"./report.sh", "--ttl", "1s"}) {
				t.Errorf("got ttl %s, command %q; want 30s and the command with its own flags", c.TTL, c.Command)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := execRun(t, succeed, tt.args...)
			if err != nil {
				t.Fatalf("execute: %v", err)
			}
			if c == nil {
				t.Fatal("run was not called")
			}
			tt.check(t, c)
		})
	}
}

func TestRunDatabasePrefersPgfenceVariable(t *testing.T) {
	t.Setenv("PGFENCE_DATABASE_URL", "postgres://pgfence/app")
	t.Setenv("DATABASE_URL", "postgres://other/app")
	c, err := execRun(t, succeed, "--job", "j", "--", "true")
	if err != nil {
		t.Fatal(err)
	}
	if c.DSN != "postgres://pgfence/app" {
		t.Errorf("DSN: got %q, want PGFENCE_DATABASE_URL's value", c.DSN)
	}
}

func TestRunUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		{"--", "./report.sh"}, // no --job
		{"--job", "j"},        // no command
		{"--job", "j", "--kill-signal", "NOPE", "--", "x"}, // bad signal
		{"--job", "j", "--ttl", "soon", "--", "x"},         // bad duration
		{"--job", "j", "--bogus", "--", "x"},               // unknown flag
		{"--job", "j", "--failover-restarts", "-1", "--", "x"},
		{"--job", "j", "--failover-restarts", "many", "--", "x"},
	} {
		c, err := execRun(t, succeed, args...)
		var ee *exitError
		if !errors.As(err, &ee) || ee.code != runner.ExitUsage {
			t.Errorf("run %q: got %v, want exit code %d", args, err, runner.ExitUsage)
		}
		if c != nil {
			t.Errorf("run %q: the runner was called despite the usage error", args)
		}
	}
}

func TestRunExitCodes(t *testing.T) {
	tests := []struct {
		code    int
		err     error
		wantNil bool
	}{
		{0, nil, true},
		{7, nil, false},
		{runner.ExitLeaseHeld, fmt.Errorf("%w: held by x", runner.ErrLeaseHeld), false},
		{runner.ExitLeaseLost, fmt.Errorf("%w: taken over", runner.ErrLeaseLost), false},
		{runner.ExitSignalBase + 9, nil, false},
	}
	for _, tt := range tests {
		_, err := execRun(t, func(context.Context, runner.Config, *zap.Logger) (int, error) { return tt.code, tt.err },
			"--job", "j", "--", "x")
		if tt.wantNil {
			if err != nil {
				t.Errorf("runner returned %d, %v: got %v, want success", tt.code, tt.err, err)
			}
			continue
		}
		var ee *exitError
		if !errors.As(err, &ee) || ee.code != tt.code {
			t.Errorf("runner returned %d, %v: got %v, want exit code %d", tt.code, tt.err, err, tt.code)
			continue
		}
		if (tt.err != nil) != (ee.msg != "") {
			t.Errorf("runner returned %d, %v: message %q; want one exactly when pgfence failed", tt.code, tt.err, ee.msg)
		}
	}
}
