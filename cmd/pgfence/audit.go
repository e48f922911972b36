package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/audit"
)

func newAuditCmd() *cobra.Command {
	var (
		db            database
		since, until  string
		results       []string
		maxViolations int
	)
	cmd := &cobra.Command{
		Use:   "audit",
		Short: "Check a live pgfence history for violations of the guarantees",
		Long: `Read the history kept in PostgreSQL (commit receipts, the token issuance
log, epochs, fences, the consumer log and the result tables named with
--result) in one read-only REPEATABLE READ snapshot, and report violations of:

  1. no commit under a token after a larger token of the same job had been
     issued and committed (L2), ordered by PostgreSQL's commit timestamps
     (track_commit_timestamp; without it, a weaker clock comparison);
  2. one receipt per (job_key, epoch, token, step), and no orphans: every
     --result row's (job, token) has a receipt (and, on request, every
     receipt its row);
  5. no consumer applied an event older than one it had already applied;
  6. no token reused across epochs of a key (L5).

Checks 3 and 4 need clients' records and run only in the chaos run.

--since and --until (RFC 3339, a date, or a duration meaning that long ago)
audit a window: receipts by committed_at, tokens and result rows by the
time their token was issued, the consumer log by time. --result
TABLE:JOBCOL:TOKENCOL names a table whose rows carry their job key and token
(repeat it for several tables): each row needs a receipt. Append :every when
every commit of the default step writes a row with its token, or :upsert when
it writes the job's single row that a larger token overwrites; then each such
receipt also needs its row. Do not use them for a table only some jobs write.

Exit status: 0 with no violation, 1 with violations; when the audit could not
run, the codes of docs/cli.md (64 bad flags, 69 database unreachable, ...).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			opts, err := auditOptions(since, until, results, maxViolations)
			if err != nil {
				return usageError(err.Error())
			}
			var rep *audit.Report
			err = db.with(cmd, func(ctx context.Context, conn *pgx.Conn) (err error) {
				for i, r := range opts.Results {
					if opts.Results[i].Table, err = db.qualify(ctx, conn, r.Table); err != nil {
						return fmt.Errorf("--result %s: %w", r.Table, err)
					}
				}
				rep, err = audit.Run(ctx, conn, opts)
				return err
			})
			if err != nil {
				return err
			}
			if err := printResult(cmd, output{json: rep, indent: true, text: rep.WriteText}); err != nil {
				return fmt.Errorf("write report: %w", err)
			}
			if !rep.OK() {
				return &exitError{code: exitViolations}
			}
			return nil
		},
	}
	db.addFlag(cmd.Flags())
	cmd.Flags().StringVar(&since, "since", "", "audit history from this time on (RFC 3339, YYYY-MM-DD, or a duration ago such as 24h or 7d)")
	cmd.Flags().StringVar(&until, "until", "", "audit history before this time (same forms as --since)")
	cmd.Flags().StringArrayVar(&results, "result", nil, "TABLE:JOBCOL:TOKENCOL[:rows|every|upsert], a table whose rows carry their generation (repeatable)")
	cmd.Flags().IntVar(&maxViolations, "max-violations", 100, "violations shown per check (the rest are counted)")
	return cmd
}

// auditOptions are the audit's options from its flags.
func auditOptions(since, until string, results []string, maxViolations int) (audit.Options, error) {
	opts := audit.Options{MaxViolations: maxViolations}
	now := time.Now()
	var err error
	if opts.Since, err = parseAuditTime(since, now); err != nil {
		return opts, fmt.Errorf("--since: %w", err)
	}
	if opts.Until, err = parseAuditTime(until, now); err != nil {
		return opts, fmt.Errorf("--until: %w", err)
	}
	for _, r := range results {
		t, err := parseResultTable(r)
		if err != nil {
			return opts, fmt.Errorf("--result: %w", err)
		}
		opts.Results = append(opts.Results, t)
	}
	return opts, nil
}

// parseAuditTime reads an RFC 3339 time, a date, or a duration meaning
// that long before now. "" is the zero time (unbounded).
func parseAuditTime(s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if t, err := time.ParseInLocation(time.DateOnly, s, time.Local); err == nil {
		return t, nil
	}
	if d, err := parseDuration(strings.TrimPrefix(s, "-")); err == nil {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("%q is not an RFC 3339 time, a date (YYYY-MM-DD) or a duration (24h)", s)
}

// parseResultTable reads TABLE:JOBCOL:TOKENCOL[:MODE]. Mode "rows" (the
// default) checks rows → receipts only; "every" also requires a row with
// the same token for every receipt of the default step; "upsert" requires
// a row of the job with a token at least the receipt's (one row per job,
// overwritten by larger tokens).
func parseResultTable(s string) (audit.ResultTable, error) {
	parts := strings.Split(s, ":")
	if len(parts) == 3 {
		parts = append(parts, "rows")
	}
	if len(parts) != 4 || parts[0] == "" || parts[1] == "" || parts[2] == "" {
		return audit.ResultTable{}, fmt.Errorf("%q is not TABLE:JOBCOL:TOKENCOL[:rows|every|upsert]", s)
	}
	t := audit.ResultTable{Table: parts[0], JobKeyColumn: parts[1], TokenColumn: parts[2]}
	switch parts[3] {
	case "rows":
	case "every":
		t.Steps = []string{""}
	case "upsert":
		t.Steps, t.Upsert = []string{""}, true
	default:
		return audit.ResultTable{}, fmt.Errorf("%q: mode %q is not rows, every or upsert", s, parts[3])
	}
	return t, nil
}
