package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
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
	db := new(database)
	cmd := groupCmd(&cobra.Command{
		Use:   "lease",
		Short: "Acquire, renew, release, retire and inspect job leases",
		Long:  "Acquire, renew, release and retire job leases and their fencing tokens; list and show them.\n" + leaseOutput,
	})
	db.addFlag(cmd.PersistentFlags())

	var (
		job   string
		token int64
		ttl   time.Duration
		force bool
	)
	// leaseCmd is a command on the lease of the job --job names: no
	// arguments, key=value output (leaseOutput says how to use it).
	leaseCmd := func(use, short, long string, run func(ctx context.Context, conn *pgx.Conn) (output, error)) *cobra.Command {
		c := &cobra.Command{Use: use, Short: short, Long: long + leaseOutput, Args: cobra.NoArgs,
			RunE: db.runE(func(ctx context.Context, conn *pgx.Conn, _ []string) (output, error) { return run(ctx, conn) })}
		c.Flags().StringVar(&job, "job", "", "job key (required)")
		c.MarkFlagRequired("job")
		return c
	}
	tokenFlag := func(c *cobra.Command) {
		c.Flags().Int64Var(&token, "token", 0, "fencing token held (required)")
		c.MarkFlagRequired("token")
	}

	renew := leaseCmd("renew --job K --token T [--ttl 30s]", "Extend the lease held with a token",
		"Extend the lease held with a token by --ttl from now.\n",
		func(ctx context.Context, conn *pgx.Conn) (output, error) {
			exp, err := fence.Renew(ctx, conn, job, token, ttl)
			if err != nil {
				return output{}, err
			}
			return keyValues(field{"job_key", job}, field{"token", token}, field{"expires_at", exp}), nil
		})
	tokenFlag(renew)
	renew.Flags().Var(newDuration(&ttl, 30*time.Second), "ttl", "lease duration, e.g. 30s, 5m, 1d")

	release := leaseCmd("release --job K --token T", "End the lease held with a token now",
		"End the lease held with a token now. The token stays current until the next acquire.\n",
		func(ctx context.Context, conn *pgx.Conn) (output, error) {
			if err := fence.Release(ctx, conn, job, token); err != nil {
				return output{}, err
			}
			return keyValues(field{"job_key", job}, field{"released", true}), nil
		})
	tokenFlag(release)

	retire := leaseCmd("retire --job K [--token T | --force]", "Close the job's current epoch",
		`Close the job's current epoch: its lease ends, requests naming the epoch get
FN004 forever, and the next acquire opens a new epoch with a larger token.

With --token, the holder ends its own job: the token must be the job's
current one and the connection's role the one that acquired it. Without a
token, only a member of pgfence_bypass (or a superuser) may retire, and a
live lease is refused (exit 75) unless --force.
`,
		func(ctx context.Context, conn *pgx.Conn) (output, error) {
			if err := fence.Retire(ctx, conn, job, fence.RetireOptions{Token: token, Force: force}); err != nil {
				if fence.IsLeaseHeld(err) && !force {
					err = fmt.Errorf("%w\nthe lease is live: pass --force to end it and retire the job anyway", err)
				}
				return output{}, err
			}
			return keyValues(field{"job_key", job}, field{"retired", true}), nil
		})
	retire.Flags().Int64Var(&token, "token", 0, "your own current fencing token (the holder retiring its job)")
	retire.Flags().BoolVar(&force, "force", false, "without --token: also end a live lease")

	cmd.AddCommand(newLeaseAcquireCmd(db), renew, release, retire, newLeaseListCmd(db), newLeaseShowCmd(db))
	return cmd
}

func newLeaseAcquireCmd(db *database) *cobra.Command {
	req := leaseRequest{db: db}
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
			// The holder is the parent: the script that goes on to renew
			// and release the lease.
			cfg, err := req.config(cmd, os.Getppid())
			if err != nil {
				return err
			}
			log, err := commandLogger(cmd)
			if err != nil {
				return usageError(err.Error())
			}
			l, code, err := runner.Acquire(cmd.Context(), cfg, log)
			if err != nil {
				return runnerExit(code, err)
			}
			return printResult(cmd, keyValues(field{"job_key", l.JobKey}, field{"holder", l.Holder}, field{"epoch", l.Epoch},
				field{"token", l.Token}, field{"expires_at", l.ExpiresAt}))
		},
	}
	req.addFlags(cmd, "job key (required)", "lease duration, e.g. 30s, 5m, 1d")
	cmd.MarkFlagRequired("job")
	return cmd
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

func newLeaseListCmd(db *database) *cobra.Command {
	return &cobra.Command{
		Use:   "list",
		Short: "List every job: its state (held, expired, free, retired), holder, epoch, token, expiry",
		Args:  cobra.NoArgs,
		RunE: db.runE(func(ctx context.Context, conn *pgx.Conn, _ []string) (output, error) {
			infos, err := queryLeases(ctx, conn, nil)
			if err != nil {
				return output{}, err
			}
			return listing(infos, "no jobs: no lease was ever acquired",
				[]string{"JOB KEY", "STATE", "HOLDER", "EPOCH", "TOKEN", "EXPIRES AT", "HELD FOR"},
				func(li leaseInfo) []string {
					return []string{li.JobKey, li.State, orDash(li.Holder), strconv.FormatInt(li.Epoch, 10), intOrDash(li.CurrentToken),
						timeOrDash(li.ExpiresAt), msOrDash(li.HeldForMS)}
				}), nil
		}),
	}
}

func newLeaseShowCmd(db *database) *cobra.Command {
	return &cobra.Command{
		Use:   "show KEY",
		Short: "Show one job's lease: state, holder, epoch, token, expiry, when it was taken, time held",
		Args:  cobra.ExactArgs(1),
		RunE: db.runE(func(ctx context.Context, conn *pgx.Conn, args []string) (output, error) {
			infos, err := queryLeases(ctx, conn, &args[0])
			if err != nil {
				return output{}, err
			}
			if len(infos) == 0 {
				return output{}, &exitError{code: exitDataErr, msg: fmt.Sprintf("job %q is unknown: no lease was ever acquired for it", args[0]),
					hint: "pgfence lease list shows the jobs there are"}
			}
			li := infos[0]
			lines := [][]string{
				{"job_key", li.JobKey},
				{"state", li.State},
				{"holder", orDash(li.Holder)},
				{"epoch", strconv.FormatInt(li.Epoch, 10)},
				{"current_token", intOrDash(li.CurrentToken)},
			}
			if li.Token != nil {
				lines = append(lines, []string{"lease_token", strconv.FormatInt(*li.Token, 10)})
			}
			lines = append(lines,
				[]string{"expires_at", timeOrDash(li.ExpiresAt)},
				[]string{"held_since", timeOrDash(li.HeldSince)},
				[]string{"held_for", msOrDash(li.HeldForMS)},
				[]string{"last_renewal", "not recorded"},
				[]string{"retired_at", timeOrDash(li.RetiredAt)})
			return output{json: li, text: func(w io.Writer) error { return writeTable(w, lines) }}, nil
		}),
	}
}
