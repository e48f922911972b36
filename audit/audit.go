package audit

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
)

// DBTX is what Run reads through, the fence functions' fence.DBTX:
// *pgx.Conn, *pgxpool.Pool and pgx.Tx satisfy it. When db can begin
// transactions (*pgx.Conn, *pgxpool.Pool), Run opens its own REPEATABLE
// READ READ ONLY transaction; a pgx.Tx is used as it is, and its snapshot
// is the caller's business.
type DBTX = fence.DBTX

type beginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// The checks, numbered as in issue 7.
const (
	CheckStaleCommit  = 1 // L2: commit under a token after a larger one was issued
	CheckReceipts     = 2 // one receipt per generation and step; no orphans
	CheckAcknowledged = 3 // acknowledged commits are present with their digest
	CheckReads        = 4 // L4: no reader saw a generation below its own
	CheckConsumer     = 5 // L6: consumers never went backwards
	CheckLifecycle    = 6 // L5: no token reused across epochs
)

var checkTitles = map[int]string{
	CheckStaleCommit:  "no commit under a token after a larger token was issued and committed (L2)",
	CheckReceipts:     "one receipt per (job_key, epoch, token, step), no orphan rows or receipts",
	CheckAcknowledged: "every acknowledged commit is present with the digest sent",
	CheckReads:        "no reader saw a generation below its own (L4)",
	CheckConsumer:     "consumers never applied an event older than one already applied (L6)",
	CheckLifecycle:    "no token reused across epochs of a key (L5)",
}

// Client outcomes, as recorded by a client for one attempt.
const (
	OutcomeCommitted = "committed"
	OutcomeReplayed  = "replayed"
	OutcomeConflict  = "conflict"
	OutcomeStale     = "stale"
	OutcomeExpired   = "expired"
	OutcomeError     = "error"
	OutcomeUnknown   = "unknown"
)

// Options selects what Run audits. The zero value audits the whole history
// of the database with checks 1, 2, 5 and 6.
type Options struct {
	// Since and Until bound the window audited (zero: unbounded): receipts
	// by committed_at, issuance and result rows by the issued_at of their
	// token, the consumer log by at, client records by At. Since is
	// inclusive, Until exclusive.
	Since, Until time.Time
	// Results are protected tables whose rows carry their generation
	// (check 2).
	Results []ResultTable
	// Clients are the attempts clients recorded (check 3, and the
	// operations by outcome). Nil: no client check.
	Clients []ClientRecord
	// Reads are reader observations (check 4). Nil: no reader check.
	Reads []ReadRecord
	// MaxViolations is how many violations of each check are reported in
	// detail (default 100); the rest are only counted.
	MaxViolations int
}

// ResultTable names a table whose rows carry the (job, token) that wrote
// them.
type ResultTable struct {
	Table        string // as in SQL, optionally schema-qualified
	JobKeyColumn string // compared as text with receipts.job_key
	TokenColumn  string // compared as bigint with receipts.token
	// Steps, when not nil, are the receipt steps whose commits write a row
	// of this table ("" is the default step): every such receipt must have
	// a row. Nil checks only rows → receipts.
	Steps []string
	// Upsert says the table keeps one row per job that a larger token
	// overwrites (L1): a receipt is then satisfied by a row of its job with
	// a token at least its own.
	Upsert bool
}

// ClientRecord is one attempt a client recorded.
type ClientRecord struct {
	Job     string
	Epoch   int64
	Token   int64
	Step    string
	Digest  []byte // the payload digest sent; nil: presence only
	Outcome string // Outcome*
	At      time.Time
}

// ReadRecord is one read: a reader carrying generation GenerationToken of
// Job saw a result written under SawToken (0: it saw no result row).
type ReadRecord struct {
	Job             string
	GenerationToken int64
	SawToken        int64
}

// Field is one column of a row shown as evidence.
type Field struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

// Row is a row that shows a violation, with the table (or record kind) it
// comes from.
type Row struct {
	Source string  `json:"source"`
	Fields []Field `json:"fields"`
}

// Violation is one broken guarantee.
type Violation struct {
	Check       int    `json:"check"`
	Description string `json:"description"`
	Rows        []Row  `json:"rows"`
}

// Report is the result of Run.
type Report struct {
	Since *time.Time `json:"since,omitempty"`
	Until *time.Time `json:"until,omitempty"`
	// Checks lists the checks that ran.
	Checks []int `json:"checks"`
	// Skipped says which checks (or parts) could not run, and why.
	Skipped []string `json:"skipped,omitempty"`
	// Notes qualify the result (fallbacks, unverifiable rows).
	Notes []string `json:"notes,omitempty"`
	// OutcomeSource is "client records" or "receipts".
	OutcomeSource string           `json:"outcome_source"`
	Outcomes      map[string]int64 `json:"outcomes"`
	// Counts are sizes of what was read (receipts, tokens issued, ...).
	Counts     map[string]int64 `json:"counts"`
	Violations []Violation      `json:"violations"`
	// Omitted counts violations beyond Options.MaxViolations, per check.
	Omitted map[int]int64 `json:"omitted,omitempty"`
	// Eras are the server histories the fence ran on (fence.eras: one per
	// promotion, restore or copy), oldest first.
	Eras []Era `json:"eras,omitempty"`
}

// Era is one server history of the fence (migration 19, docs/failover.md).
type Era struct {
	Era      int32     `json:"era"`
	Timeline int32     `json:"timeline"`
	BeganAt  time.Time `json:"began_at"`
	// Lossless: the transition into this era lost no acknowledged takeover
	// (failover_mode sync, or the era the fence was installed in).
	Lossless bool   `json:"lossless"`
	Reason   string `json:"reason"`
}

// OK reports whether no violation was found.
func (r *Report) OK() bool {
	if len(r.Violations) > 0 {
		return false
	}
	for _, n := range r.Omitted {
		if n > 0 {
			return false
		}
	}
	return true
}

// ViolationsOf returns the reported violations of one check.
func (r *Report) ViolationsOf(check int) []Violation {
	var out []Violation
	for _, v := range r.Violations {
		if v.Check == check {
			out = append(out, v)
		}
	}
	return out
}

// Run audits the history in db. It returns an error only when the audit
// itself failed; violations are in the report.
func Run(ctx context.Context, db DBTX, opts Options) (*Report, error) {
	if opts.MaxViolations <= 0 {
		opts.MaxViolations = 100
	}
	if !opts.Since.IsZero() && !opts.Until.IsZero() && !opts.Until.After(opts.Since) {
		return nil, fmt.Errorf("audit: window is empty: until %s is not after since %s",
			opts.Until.Format(time.RFC3339Nano), opts.Since.Format(time.RFC3339Nano))
	}
	q := db
	if b, ok := db.(beginner); ok {
		tx, err := b.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
		if err != nil {
			return nil, fmt.Errorf("audit: begin snapshot: %w", err)
		}
		defer tx.Rollback(context.WithoutCancel(ctx))
		q = tx
	}
	a := &auditor{q: q, opts: opts, perCheck: map[int]int{}, rep: &Report{
		Outcomes: map[string]int64{},
		Counts:   map[string]int64{},
		Omitted:  map[int]int64{},
	}}
	if !opts.Since.IsZero() {
		s := opts.Since
		a.rep.Since, a.since = &s, s
	}
	if !opts.Until.IsZero() {
		u := opts.Until
		a.rep.Until, a.until = &u, u
	}
	if err := a.run(ctx); err != nil {
		return nil, fmt.Errorf("audit: %w", err)
	}
	if len(a.rep.Omitted) == 0 {
		a.rep.Omitted = nil
	}
	return a.rep, nil
}

type auditor struct {
	q            DBTX
	opts         Options
	since, until any // time.Time or nil (SQL null: unbounded)
	commitTS     bool
	hasLog       bool
	hasEras      bool // fence.eras (migration 19): failovers are recorded
	rep          *Report
	perCheck     map[int]int
}

func (a *auditor) run(ctx context.Context) error {
	var tcs string
	var hasFence bool
	err := a.q.QueryRow(ctx, `select pg_catalog.current_setting('track_commit_timestamp'),
		pg_catalog.to_regclass('fence.receipts') is not null, pg_catalog.to_regclass('fence.consumer_log') is not null,
		pg_catalog.to_regclass('fence.eras') is not null`).Scan(&tcs, &hasFence, &a.hasLog, &a.hasEras)
	if err != nil {
		return fmt.Errorf("read settings: %w", err)
	}
	if !hasFence {
		return errors.New("no fence schema in this database (run pgfence migrate)")
	}
	a.commitTS = tcs == "on"
	if !a.commitTS {
		a.note("track_commit_timestamp is off: check 1 compares receipts' committed_at with issued_at (sound, weaker) and skips commits after retirement")
	}
	steps := []struct {
		check int
		fn    func(context.Context) error
	}{
		{CheckStaleCommit, a.checkStaleCommits},
		{CheckReceipts, a.checkReceipts},
		{CheckAcknowledged, a.checkAcknowledged},
		{CheckReads, a.checkReads},
		{CheckConsumer, a.checkConsumer},
		{CheckLifecycle, a.checkLifecycle},
	}
	for _, s := range steps {
		switch {
		case s.check == CheckAcknowledged && a.opts.Clients == nil,
			s.check == CheckReads && a.opts.Reads == nil:
			continue
		case s.check == CheckConsumer && !a.hasLog:
			a.rep.Skipped = append(a.rep.Skipped, "check 5: fence.consumer_log is missing (schema older than migration 004: run pgfence migrate)")
			continue
		}
		if err := s.fn(ctx); err != nil {
			return fmt.Errorf("check %d: %w", s.check, err)
		}
		a.rep.Checks = append(a.rep.Checks, s.check)
	}
	if err := a.count(ctx); err != nil {
		return err
	}
	if err := a.eras(ctx); err != nil {
		return err
	}
	sort.Slice(a.rep.Violations, func(i, j int) bool { return a.rep.Violations[i].Check < a.rep.Violations[j].Check })
	return nil
}

func (a *auditor) note(s string) { a.rep.Notes = append(a.rep.Notes, s) }

// violate records a violation, or only counts it beyond MaxViolations.
func (a *auditor) violate(check int, desc string, rows ...Row) {
	if a.perCheck[check] >= a.opts.MaxViolations {
		a.rep.Omitted[check]++
		return
	}
	a.perCheck[check]++
	a.rep.Violations = append(a.rep.Violations, Violation{Check: check, Description: desc, Rows: rows})
}

// cts is the commit timestamp of the transaction that wrote alias's row,
// or null when commit timestamps are not tracked.
func (a *auditor) cts(alias string) string {
	if a.commitTS {
		return "pg_xact_commit_timestamp(" + alias + ".xmin)"
	}
	return "null::timestamptz"
}

// window is the SQL condition for col within [Since, Until), on args $1
// and $2 of every query.
func window(col string) string {
	return "($1::timestamptz is null or " + col + " >= $1) and ($2::timestamptz is null or " + col + " < $2)"
}

// each runs sql with the window arguments ($1, $2) followed by args and
// calls fn for every row, as column name → value.
func (a *auditor) each(ctx context.Context, sql string, args []any, fn func(v vals) error) error {
	return a.query(ctx, sql, append([]any{a.since, a.until}, args...), fn)
}

// query is each without the window arguments.
// violations reports a violation of check for every row sql (bound to
// the window, then args) returns, described by describe; what names the
// query in its error.
func (a *auditor) violations(ctx context.Context, check int, what, sql string, args []any, describe func(v vals) (string, []Row)) error {
	err := a.each(ctx, sql, args, func(v vals) error {
		desc, rows := describe(v)
		a.violate(check, desc, rows...)
		return nil
	})
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return nil
}

func (a *auditor) query(ctx context.Context, sql string, args []any, fn func(v vals) error) error {
	rows, err := a.q.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	fds := rows.FieldDescriptions()
	for rows.Next() {
		raw, err := rows.Values()
		if err != nil {
			return err
		}
		v := make(vals, len(fds))
		for i, fd := range fds {
			v[fd.Name] = raw[i]
		}
		if err := fn(v); err != nil {
			return err
		}
	}
	return rows.Err()
}

// vals is a result row by column name; evidence columns are named
// prefix_column (r_token, i_epoch, ...).
type vals map[string]any

// row builds evidence from the columns prefix+name.
func (v vals) row(source, prefix string, names ...string) Row {
	r := Row{Source: source}
	for _, n := range names {
		r.Fields = append(r.Fields, Field{Name: n, Value: format(v[prefix+n])})
	}
	return r
}

func (v vals) str(name string) string { return format(v[name]) }

func (v vals) bool(name string) bool {
	b, _ := v[name].(bool)
	return b
}

func format(x any) string {
	switch x := x.(type) {
	case nil:
		return "null"
	case time.Time:
		if x.IsZero() {
			return ""
		}
		return x.UTC().Format(time.RFC3339Nano)
	case []byte:
		return hex.EncodeToString(x)
	case string:
		return x
	case int64:
		return strconv.FormatInt(x, 10)
	default:
		return fmt.Sprint(x)
	}
}
