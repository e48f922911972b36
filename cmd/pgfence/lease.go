package main

import (
	"encoding/json"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/fence"
)

// Exit codes of the lease commands.
const (
	exitLeaseHeld = 3
	exitStale     = 4
)

const leaseExitCodes = `
Output is shell-friendly key=value lines (eval "$(pgfence lease acquire ...)"),
or JSON with --json.

Exit codes:
  0  success
  1  other errors (bad input, unknown job, database unreachable)
  3  the lease is held by another holder (FN002)
  4  the token is stale: another holder took over (FN001)`

func newLeaseCmd() *cobra.Command {
	var (
		dsn    string
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "lease",
		Short: "Acquire, renew, release and retire job leases",
		Long:  "Acquire, renew, release and retire job leases and their fencing tokens.\n" + leaseExitCodes,
	}
	cmd.PersistentFlags().StringVar(&dsn, "database", "", "database URL or DSN (default $PGFENCE_DATABASE_URL, else $DATABASE_URL, else libpq's PG* variables)")
	cmd.PersistentFlags().BoolVar(&asJSON, "json", false, "print JSON instead of key=value lines")

	var job, holder string
	var token int64
	var ttl time.Duration
	jobFlag := func(c *cobra.Command) {
		c.Flags().StringVar(&job, "job", "", "job key")
		c.MarkFlagRequired("job")
	}
	tokenFlag := func(c *cobra.Command) {
		c.Flags().Int64Var(&token, "token", 0, "fencing token held")
		c.MarkFlagRequired("token")
	}
	ttlFlag := func(c *cobra.Command) {
		c.Flags().DurationVar(&ttl, "ttl", 30*time.Second, "lease duration")
	}
	run := func(f func(cmd *cobra.Command) (map[string]any, []string, error)) func(*cobra.Command, []string) error {
		return func(cmd *cobra.Command, args []string) error {
			out, keys, err := f(cmd)
			if err != nil {
				return leaseExit(err)
			}
			return printKV(cmd.OutOrStdout(), asJSON, out, keys)
		}
	}

	acquire := &cobra.Command{
		Use:   "acquire --job K --holder H [--ttl 30s]",
		Short: "Take the lease and a new fencing token",
		Long:  "Take the lease on a job and a new fencing token (a new epoch if the job is new or retired).\n" + leaseExitCodes,
		Args:  cobra.NoArgs,
		RunE: run(func(cmd *cobra.Command) (map[string]any, []string, error) {
			ctx := cmd.Context()
			conn, err := connectDatabase(ctx, cmd, dsn)
			if err != nil {
				return nil, nil, err
			}
			defer conn.Close(ctx)
			l, err := fence.Acquire(ctx, conn, job, holder, ttl)
			if err != nil {
				return nil, nil, err
			}
			return map[string]any{"job_key": l.JobKey, "holder": l.Holder, "epoch": l.Epoch, "token": l.Token, "expires_at": l.ExpiresAt},
				[]string{"job_key", "holder", "epoch", "token", "expires_at"}, nil
		}),
	}
	jobFlag(acquire)
	acquire.Flags().StringVar(&holder, "holder", "", "name of the worker taking the lease")
	acquire.MarkFlagRequired("holder")
	ttlFlag(acquire)

	renew := &cobra.Command{
		Use:   "renew --job K --token T [--ttl 30s]",
		Short: "Extend the lease held with a token",
		Long:  "Extend the lease held with a token by --ttl from now.\n" + leaseExitCodes,
		Args:  cobra.NoArgs,
		RunE: run(func(cmd *cobra.Command) (map[string]any, []string, error) {
			ctx := cmd.Context()
			conn, err := connectDatabase(ctx, cmd, dsn)
			if err != nil {
				return nil, nil, err
			}
			defer conn.Close(ctx)
			exp, err := fence.Renew(ctx, conn, job, token, ttl)
			if err != nil {
				return nil, nil, err
			}
			return map[string]any{"job_key": job, "token": token, "expires_at": exp}, []string{"job_key", "token", "expires_at"}, nil
		}),
	}
	jobFlag(renew)
	tokenFlag(renew)
	ttlFlag(renew)

	release := &cobra.Command{
		Use:   "release --job K --token T",
		Short: "End the lease held with a token now",
		Long:  "End the lease held with a token now. The token stays current until the next acquire.\n" + leaseExitCodes,
		Args:  cobra.NoArgs,
		RunE: run(func(cmd *cobra.Command) (map[string]any, []string, error) {
			ctx := cmd.Context()
			conn, err := connectDatabase(ctx, cmd, dsn)
			if err != nil {
				return nil, nil, err
			}
			defer conn.Close(ctx)
			if err := fence.Release(ctx, conn, job, token); err != nil {
				return nil, nil, err
			}
			return map[string]any{"job_key": job, "released": true}, []string{"job_key", "released"}, nil
		}),
	}
	jobFlag(release)
	tokenFlag(release)

	var force bool
	retire := &cobra.Command{
		Use:   "retire --job K [--token T | --force]",
		Short: "Close the job's current epoch",
		Long: `Close the job's current epoch: its lease ends, requests naming the epoch get
FN004 forever, and the next acquire opens a new epoch with a larger token.

With --token, the holder ends its own job: the token must be the job's
current one and the connection's role the one that acquired it. Without a
token, only a member of pgfence_bypass (or a superuser) may retire, and a
live lease is refused (exit 3) unless --force.
` + leaseExitCodes,
		Args: cobra.NoArgs,
		RunE: run(func(cmd *cobra.Command) (map[string]any, []string, error) {
			ctx := cmd.Context()
			conn, err := connectDatabase(ctx, cmd, dsn)
			if err != nil {
				return nil, nil, err
			}
			defer conn.Close(ctx)
			if err := fence.Retire(ctx, conn, job, fence.RetireOptions{Token: token, Force: force}); err != nil {
				if fence.IsLeaseHeld(err) && !force {
					err = fmt.Errorf("%w\nthe lease is live: pass --force to end it and retire the job anyway", err)
				}
				return nil, nil, err
			}
			return map[string]any{"job_key": job, "retired": true}, []string{"job_key", "retired"}, nil
		}),
	}
	jobFlag(retire)
	retire.Flags().Int64Var(&token, "token", 0, "your own current fencing token (the holder retiring its job)")
	retire.Flags().BoolVar(&force, "force", false, "without --token: also end a live lease")

	cmd.AddCommand(acquire, renew, release, retire)
	return cmd
}

// leaseExit maps fence errors to the documented exit codes.
func leaseExit(err error) error {
	switch {
	case fence.IsLeaseHeld(err):
		return &exitError{code: exitLeaseHeld, msg: err.Error()}
	case fence.IsStale(err):
		return &exitError{code: exitStale, msg: err.Error()}
	}
	return err
}

var shellSafe = regexp.MustCompile(`^[A-Za-z0-9_.:+@/-]*$`)

// printKV prints key=value lines a shell can eval (values quoted when
// needed; times in RFC 3339), or one JSON object.
func printKV(w io.Writer, asJSON bool, m map[string]any, keys []string) error {
	if asJSON {
		b, err := json.Marshal(m)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintf(w, "%s\n", b)
		return err
	}
	for _, k := range keys {
		var s string
		switch v := m[k].(type) {
		case time.Time:
			s = v.UTC().Format(time.RFC3339Nano)
		case int64:
			s = strconv.FormatInt(v, 10)
		case bool:
			s = strconv.FormatBool(v)
		default:
			s = fmt.Sprint(v)
		}
		if !shellSafe.MatchString(s) {
			s = "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
		}
		if _, err := fmt.Fprintf(w, "%s=%s\n", k, s); err != nil {
			return err
		}
	}
	return nil
}
