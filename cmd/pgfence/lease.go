package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/runner"
)

const leaseOutput = `
Output is shell-friendly key=value lines, or one JSON object with --json.
A command that fails prints nothing on stdout and exits non-zero, so in a
script take the output first and eval it after:

    set -e
    lease=$(pgfence lease acquire --job nightly-report --ttl 5m)   # exits here unless the lease is ours
    eval "$lease"                                                 # job_key, holder, epoch, token, expires_at

(eval "$(pgfence lease acquire ...)" alone does not stop a script: eval of
nothing succeeds.)

Exit codes (docs/cli.md has the whole table):
  0   success
  64  usage error
  65  bad input: invalid job key, ttl or token; unknown job (FN005)
  69  the database cannot be reached
  75  the lease is held by another holder (FN002), or a wait ran out
  76  the token is stale or its epoch retired: another holder took over (FN001, FN004)
  77  permission denied (the role lacks pgfence_worker)
  78  the fence schema is not installed (run pgfence migrate)`

func newLeaseCmd() *cobra.Command {
	var dsn string
	cmd := groupCmd(&cobra.Command{
		Use:   "lease",
		Short: "Acquire, renew, release, retire and inspect job leases",
		Long:  "Acquire, renew, release and retire job leases and their fencing tokens; list and show them.\n" + leaseOutput,
	})
	addDatabaseFlag(cmd, &dsn)

	var job string
	var token int64
	var ttl time.Duration
	jobFlag := func(c *cobra.Command) {
		c.Flags().StringVar(&job, "job", "", "job key (required)")
		c.MarkFlagRequired("job")
	}
	tokenFlag := func(c *cobra.Command) {
		c.Flags().Int64Var(&token, "token", 0, "fencing token held (required)")
		c.MarkFlagRequired("token")
	}
	ttlFlag := func(c *cobra.Command) {
		c.Flags().Var(newDuration(&ttl, 30*time.Second), "ttl", "lease duration, e.g. 30s, 5m, 1d")
	}
	// withConn runs f with a connection to the database and prints its
	// key=value result.
	withConn := func(f func(ctx context.Context, conn *pgx.Conn) (map[string]any, []string, error)) func(*cobra.Command, []string) error {
		return func(cmd *cobra.Command, args []string) error {
			return withDatabase(cmd, dsn, func(ctx context.Context, conn *pgx.Conn) error {
				out, keys, err := f(ctx, conn)
				if err != nil {
					return err
				}
				return printKV(cmd.OutOrStdout(), jsonFlag(cmd), out, keys)
			})
		}
	}

	renew := &cobra.Command{
		Use:   "renew --job K --token T [--ttl 30s]",
		Short: "Extend the lease held with a token",
		Long:  "Extend the lease held with a token by --ttl from now.\n" + leaseOutput,
		Args:  cobra.NoArgs,
		RunE: withConn(func(ctx context.Context, conn *pgx.Conn) (map[string]any, []string, error) {
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
		Long:  "End the lease held with a token now. The token stays current until the next acquire.\n" + leaseOutput,
		Args:  cobra.NoArgs,
		RunE: withConn(func(ctx context.Context, conn *pgx.Conn) (map[string]any, []string, error) {
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
live lease is refused (exit 75) unless --force.
` + leaseOutput,
		Args: cobra.NoArgs,
		RunE: withConn(func(ctx context.Context, conn *pgx.Conn) (map[string]any, []string, error) {
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

	cmd.AddCommand(newLeaseAcquireCmd(&dsn), renew, release, retire, newLeaseListCmd(&dsn), newLeaseShowCmd(&dsn))
	return cmd
}

// waitFlags are the flags of lease acquire and run that say how long to
// wait for a lease.
type waitFlags struct {
	wait, noWait bool
	waitTimeout  time.Duration
	lockTimeout  time.Duration
}

func (w *waitFlags) add(c *cobra.Command, heldExit string) {
	f := c.Flags()
	f.BoolVar(&w.wait, "wait", false, "wait while the lease is held by another holder (and while the database is unreachable)")
	f.BoolVar(&w.noWait, "no-wait", false, "give up at once when the lease is held by another holder: exit "+heldExit+" (the default)")
	f.Var(newDuration(&w.waitTimeout, 0), "wait-timeout", "wait at most this long for the lease, then exit 75 (implies --wait; default no limit)")
	f.Var(newDuration(&w.lockTimeout, 30*time.Second), "lock-timeout",
		"give up, naming the blocking session, after waiting this long for the job's fence row while an open transaction holds it (0: no limit)")
	c.MarkFlagsMutuallyExclusive("wait", "no-wait")
}

// waiting reports whether to wait for a held lease.
func (w *waitFlags) waiting() bool { return !w.noWait && (w.wait || w.waitTimeout > 0) }

func newLeaseAcquireCmd(dsn *string) *cobra.Command {
	var (
		job, holder string
		ttl         time.Duration
		w           waitFlags
	)
	cmd := &cobra.Command{
		Use:   "acquire --job K [--holder H] [--ttl 30s] [--wait]",
		Short: "Take the lease and a new fencing token",
		Long: `Take the lease on a job and a new fencing token (a new epoch if the job is new
or retired), and print them.

The acquire locks the job's fence row. A transaction that holds it (a write
through the proxy or a fence.gate that has not committed yet) makes it wait:
after a second the blocking session is named on stderr, and after
--lock-timeout the acquire gives up (exit 75) naming it. A transaction left
open forever (a stopped worker, an idle psql) shows there.
` + leaseOutput,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			connCfg, err := databaseConfig(cmd, *dsn)
			if err != nil {
				return err
			}
			log, err := commandLogger(cmd)
			if err != nil {
				return usageError(err.Error())
			}
			if holder == "" {
				holder = defaultHolder(os.Getppid())
			}
			l, code, err := runner.Acquire(ctx, runner.Config{
				JobKey:      job,
				Holder:      holder,
				TTL:         ttl,
				ConnConfig:  connCfg,
				Wait:        w.waiting(),
				WaitTimeout: w.waitTimeout,
				LockTimeout: w.lockTimeout,
			}, log)
			if err != nil {
				return runnerExit(code, err)
			}
			return printKV(cmd.OutOrStdout(), jsonFlag(cmd),
				map[string]any{"job_key": l.JobKey, "holder": l.Holder, "epoch": l.Epoch, "token": l.Token, "expires_at": l.ExpiresAt},
				[]string{"job_key", "holder", "epoch", "token", "expires_at"})
		},
	}
	f := cmd.Flags()
	f.StringVar(&job, "job", "", "job key (required)")
	cmd.MarkFlagRequired("job")
	f.StringVar(&holder, "holder", "", holderHelp)
	f.Var(newDuration(&ttl, 30*time.Second), "ttl", "lease duration, e.g. 30s, 5m, 1d")
	w.add(cmd, "75")
	return cmd
}

// runnerExit is the exit error for a runner failure: the runner's code,
// except that ExitInternal is refined by the exit code table.
func runnerExit(code int, err error) *exitError {
	ee := exitWith(err)
	if code != runner.ExitInternal {
		ee.code = code
	}
	return ee
}

// leaseInfo is one job's fence and lease, as lease list and lease show
// print them.
type leaseInfo struct {
	JobKey       string     `json:"job_key"`
	State        string     `json:"state"` // held, expired, free, retired
	Epoch        int64      `json:"epoch"`
	CurrentToken *int64     `json:"current_token"` // the largest token issued; nil for a role that may not read tokens
	Holder       string     `json:"holder,omitempty"`
	Token        *int64     `json:"token,omitempty"` // the lease's token
	ExpiresAt    *time.Time `json:"expires_at,omitempty"`
	HeldSince    *time.Time `json:"held_since,omitempty"` // when the lease's token was issued
	HeldForMS    *int64     `json:"held_for_ms,omitempty"`
	// LastRenewal is not recorded by the schema (fence.leases has no
	// renewal time): always null.
	LastRenewal *time.Time `json:"last_renewal"`
	RetiredAt   *time.Time `json:"retired_at,omitempty"`
}

const leaseQuery = `
select f.job_key, f.epoch, f.max_issued_token, f.retired_at,
       l.holder, l.token, l.expires_at, i.issued_at, clock_timestamp(),
       coalesce(l.token = f.max_issued_token and l.expires_at > clock_timestamp(), false)
  from fence.fences f
  left join fence.leases l on l.job_key = f.job_key
  left join fence.issuance i on i.token = l.token
 where $1::text is null or f.job_key = $1
 order by f.job_key`

// jobsQuery reads what fence.jobs shows every role: no tokens (a holder
// learns its own from fence.acquire), no issuance times.
const jobsQuery = `
select j.job_key, j.epoch, null::bigint, j.retired_at,
       j.lease_holder, null::bigint, j.lease_expires_at, null::timestamptz, clock_timestamp(), j.lease_live
  from fence.jobs j
 where $1::text is null or j.job_key = $1
 order by j.job_key`

// queryLeases reads the leases of every job, or of job when it is not nil.
// Tokens and the time a lease has been held are for DBAs (pgfence_bypass)
// only: other roles read fence.jobs, without them.
func queryLeases(ctx context.Context, conn *pgx.Conn, job *string) ([]leaseInfo, error) {
	infos, err := queryLeasesWith(ctx, conn, job, leaseQuery)
	var pg *pgconn.PgError
	if errors.As(err, &pg) && pg.Code == "42501" {
		infos, err = queryLeasesWith(ctx, conn, job, jobsQuery)
	}
	return infos, err
}

func queryLeasesWith(ctx context.Context, conn *pgx.Conn, job *string, query string) ([]leaseInfo, error) {
	rows, err := conn.Query(ctx, query, job)
	if err != nil {
		return nil, fmt.Errorf("read leases: %w", err)
	}
	var out []leaseInfo
	for rows.Next() {
		var li leaseInfo
		var holder *string
		var now time.Time
		var live bool
		if err := rows.Scan(&li.JobKey, &li.Epoch, &li.CurrentToken, &li.RetiredAt, &holder, &li.Token, &li.ExpiresAt, &li.HeldSince, &now, &live); err != nil {
			rows.Close()
			return nil, fmt.Errorf("read leases: %w", err)
		}
		if holder != nil {
			li.Holder = *holder
		}
		switch {
		case li.RetiredAt != nil:
			li.State = "retired"
		case live:
			li.State = "held"
		case li.ExpiresAt == nil || li.CurrentToken != nil && (li.Token == nil || *li.Token != *li.CurrentToken):
			li.State = "free" // released, or superseded by a newer token
		default:
			li.State = "expired"
		}
		if li.State == "held" && li.HeldSince != nil {
			ms := now.Sub(*li.HeldSince).Milliseconds()
			li.HeldForMS = &ms
		}
		out = append(out, li)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read leases: %w", err)
	}
	return out, nil
}

func newLeaseListCmd(dsn *string) *cobra.Command {
	return &cobra.Command{
		Use:   "list",
		Short: "List every job: its state (held, expired, free, retired), holder, epoch, token, expiry",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var infos []leaseInfo
			err := withDatabase(cmd, *dsn, func(ctx context.Context, conn *pgx.Conn) (err error) {
				infos, err = queryLeases(ctx, conn, nil)
				return err
			})
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if jsonFlag(cmd) {
				if infos == nil {
					infos = []leaseInfo{}
				}
				return printJSON(out, infos)
			}
			if len(infos) == 0 {
				fmt.Fprintln(out, "no jobs: no lease was ever acquired")
				return nil
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "JOB KEY\tSTATE\tHOLDER\tEPOCH\tTOKEN\tEXPIRES AT\tHELD FOR")
			for _, li := range infos {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\n", li.JobKey, li.State, orDash(li.Holder), li.Epoch, orDashInt(li.CurrentToken),
					timeOrDash(li.ExpiresAt), msOrDash(li.HeldForMS))
			}
			return tw.Flush()
		},
	}
}

func newLeaseShowCmd(dsn *string) *cobra.Command {
	return &cobra.Command{
		Use:   "show KEY",
		Short: "Show one job's lease: state, holder, epoch, token, expiry, when it was taken, time held",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var infos []leaseInfo
			err := withDatabase(cmd, *dsn, func(ctx context.Context, conn *pgx.Conn) (err error) {
				infos, err = queryLeases(ctx, conn, &args[0])
				return err
			})
			if err != nil {
				return err
			}
			if len(infos) == 0 {
				return &exitError{code: exitDataErr, msg: fmt.Sprintf("job %q is unknown: no lease was ever acquired for it", args[0]),
					hint: "pgfence lease list shows the jobs there are"}
			}
			li := infos[0]
			out := cmd.OutOrStdout()
			if jsonFlag(cmd) {
				return printJSON(out, li)
			}
			tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			row := func(k, v string) { fmt.Fprintf(tw, "%s\t%s\n", k, v) }
			row("job_key", li.JobKey)
			row("state", li.State)
			row("holder", orDash(li.Holder))
			row("epoch", strconv.FormatInt(li.Epoch, 10))
			row("current_token", orDashInt(li.CurrentToken))
			if li.Token != nil {
				row("lease_token", strconv.FormatInt(*li.Token, 10))
			}
			row("expires_at", timeOrDash(li.ExpiresAt))
			row("held_since", timeOrDash(li.HeldSince))
			row("held_for", msOrDash(li.HeldForMS))
			row("last_renewal", "not recorded")
			row("retired_at", timeOrDash(li.RetiredAt))
			return tw.Flush()
		},
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func timeOrDash(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

func msOrDash(ms *int64) string {
	if ms == nil {
		return "-"
	}
	return (time.Duration(*ms) * time.Millisecond).Round(time.Second).String()
}

var shellSafe = regexp.MustCompile(`^[A-Za-z0-9_.:+@/-]*$`)

// printKV prints key=value lines a shell can eval (values quoted when
// needed; times in RFC 3339), or one JSON object.
func printKV(w io.Writer, asJSON bool, m map[string]any, keys []string) error {
	if asJSON {
		return printJSON(w, m)
	}
	var b strings.Builder
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
		fmt.Fprintf(&b, "%s=%s\n", k, s)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// orDashInt is n, or "-" when the role may not see it.
func orDashInt(n *int64) string {
	if n == nil {
		return "-"
	}
	return strconv.FormatInt(*n, 10)
}
