package main

// The grammar every subcommand shares: exit codes, how errors are printed
// (text or JSON), how the database is found, the holder default, durations
// with days. docs/cli.md is the user's side of this file.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/runner"
)

// Exit codes, one table for every command (sysexits.h where it has a
// name for the case). docs/cli.md lists them; keep the two in step.
const (
	exitOK          = 0
	exitViolations  = 1                      // audit: the history violates a guarantee
	exitUsage       = runner.ExitUsage       // 64 EX_USAGE: bad flags or arguments
	exitDataErr     = 65                     // EX_DATAERR: the database rejected the input (bad job key, unknown job or token, no such table)
	exitUnavailable = runner.ExitUnavailable // 69 EX_UNAVAILABLE: the database cannot be reached; an address is in use
	exitSoftware    = runner.ExitInternal    // 70 EX_SOFTWARE: an unexpected error
	exitTempFail    = runner.ExitLeaseHeld   // 75 EX_TEMPFAIL: the lease is held by another holder, or a wait ran out
	exitLeaseLost   = runner.ExitLeaseLost   // 76: the token is stale or its epoch retired: another holder took over
	exitNoPerm      = 77                     // EX_NOPERM: permission denied, authentication failed
	exitConfig      = 78                     // EX_CONFIG: bad configuration; the fence schema is not installed
)

// exitError carries an exit code and what to print out of a command.
type exitError struct {
	code int
	msg  string // "" prints nothing (a command's own exit code, passed on)
	hint string // printed after msg, and as "hint" in JSON
	err  error  // the cause, when there is one (its SQLSTATE goes into JSON)
}

func (e *exitError) Error() string { return e.msg }
func (e *exitError) Unwrap() error { return e.err }

func usageError(msg string) error { return &exitError{code: exitUsage, msg: msg} }

// exitWith classifies err under the exit code table, with msg prefixed by
// what the command was doing.
func exitWith(err error) *exitError {
	var ee *exitError
	if errors.As(err, &ee) {
		return ee
	}
	code, hint := classify(err)
	return &exitError{code: code, msg: err.Error(), hint: hint, err: err}
}

// classify maps an error to an exit code and, where the fix is known, a
// hint.
func classify(err error) (int, string) {
	switch fence.Code(err) {
	case fence.CodeStale, fence.CodeRetired:
		return exitLeaseLost, ""
	case fence.CodeLeaseHeld:
		return exitTempFail, ""
	case fence.CodeUnknownJob:
		return exitDataErr, ""
	case fence.CodeNotOwner:
		return exitNoPerm, ""
	case fence.CodeNotInstalled:
		return exitConfig, ""
	case "":
	default:
		return exitSoftware, ""
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		switch fence.Setup(pg.Code, pg.Message) {
		case fence.NoSchema:
			return exitConfig, "the fence schema is not installed in this database: run pgfence migrate with a DBA connection"
		case fence.NotWorker:
			return exitNoPerm, "the role may lack pgfence_worker: a DBA runs GRANT pgfence_worker TO <role>"
		}
		switch {
		case pg.Code == "42501", pg.Code == "28000", pg.Code == "28P01":
			return exitNoPerm, ""
		case pg.Code == "3D000":
			return exitConfig, "check the database name in --database (or DATABASE_URL, PGDATABASE)"
		case pg.Code == "55P03":
			return exitTempFail, ""
		case pg.Code == "53300", strings.HasPrefix(pg.Code, "08"), strings.HasPrefix(pg.Code, "57P"):
			return exitUnavailable, ""
		case strings.HasPrefix(pg.Code, "22"), pg.Code == "42P01", pg.Code == "42703", pg.Code == "42704":
			return exitDataErr, ""
		}
		return exitSoftware, ""
	}
	var ce *pgconn.ConnectError
	var ne net.Error
	switch {
	case errors.As(err, &ce), errors.As(err, &ne), errors.Is(err, context.DeadlineExceeded):
		return exitUnavailable, ""
	}
	return exitSoftware, ""
}

// errorJSON is an error as --json prints it on stderr.
type errorJSON struct {
	Error    string `json:"error"`
	SQLSTATE string `json:"sqlstate,omitempty"`
	Hint     string `json:"hint,omitempty"`
	ExitCode int    `json:"exit_code"`
}

// printError writes e to w: "pgfence: msg" and a hint line, or one JSON
// object.
func printError(w io.Writer, e *exitError, asJSON bool) {
	if e.msg == "" {
		return
	}
	hint := e.hint
	var pg *pgconn.PgError
	sqlstate := ""
	if errors.As(e.err, &pg) {
		sqlstate = pg.Code
		if hint == "" && pg.Hint != "" && !strings.Contains(e.msg, pg.Hint) {
			hint = pg.Hint
		}
	} else if c := fence.Code(e.err); c != "" {
		sqlstate = c
	}
	if asJSON {
		b, _ := json.Marshal(errorJSON{Error: e.msg, SQLSTATE: sqlstate, Hint: hint, ExitCode: e.code})
		fmt.Fprintf(w, "%s\n", b)
		return
	}
	fmt.Fprintln(w, "pgfence:", e.msg)
	if hint != "" {
		fmt.Fprintln(w, "pgfence: hint:", hint)
	}
}

// execute runs the CLI with args and returns the process exit code,
// printing errors to stderr.
func execute(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	root := newRootCmd()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := runRoot(ctx, root)
	if err == nil {
		return exitOK
	}
	ee := exitWith(err)
	asJSON, _ := root.PersistentFlags().GetBool("json")
	printError(stderr, ee, asJSON || jsonInArgs(args))
	return ee.code
}

// jsonInArgs reports --json among args before "--": for errors that stop
// the flags from being parsed (an unknown command, a bad flag value).
func jsonInArgs(args []string) bool {
	for _, a := range args {
		switch a {
		case "--":
			return false
		case "--json", "--json=true":
			return true
		}
	}
	return false
}

// runRoot executes root and returns its error classified: an error from
// before a command's RunE (flags, arguments, an unknown command) is a usage
// error; one from a RunE is classified by exitWith.
func runRoot(ctx context.Context, root *cobra.Command) error {
	started := false
	var wrap func(c *cobra.Command)
	wrap = func(c *cobra.Command) {
		if run := c.RunE; run != nil {
			c.RunE = func(cmd *cobra.Command, args []string) error {
				started = true
				if err := run(cmd, args); err != nil {
					return exitWith(err)
				}
				return nil
			}
		}
		for _, sub := range c.Commands() {
			wrap(sub)
		}
	}
	wrap(root)
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil || started {
		return err
	}
	var ee *exitError
	if errors.As(err, &ee) {
		return ee
	}
	usage := &exitError{code: exitUsage, msg: err.Error()}
	if cmd != nil {
		usage.hint = fmt.Sprintf("run '%s --help' for usage", cmd.CommandPath())
	}
	return usage
}

// groupCmd is a command that only holds subcommands: bare, it prints its
// help; with an unknown subcommand it is a usage error.
func groupCmd(c *cobra.Command) *cobra.Command {
	c.Args = cobra.ArbitraryArgs
	c.RunE = func(cmd *cobra.Command, args []string) error {
		if len(args) > 0 {
			return &exitError{code: exitUsage, msg: fmt.Sprintf("unknown command %q for %q", args[0], cmd.CommandPath()),
				hint: fmt.Sprintf("run '%s --help' for usage", cmd.CommandPath())}
		}
		return cmd.Help()
	}
	return c
}

// jsonFlag reports the root --json flag.
func jsonFlag(cmd *cobra.Command) bool {
	f := cmd.Flag("json")
	return f != nil && f.Value.String() == "true"
}

// printJSON writes v as one line of JSON.
func printJSON(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "%s\n", b)
	return err
}

// --- the database ---

const databaseHelp = "database URL or DSN (default $PGFENCE_DATABASE_URL, else $DATABASE_URL, else libpq's PG* variables)"

// addDatabaseFlag adds --database to cmd (persistent, for a group).
func addDatabaseFlag(cmd *cobra.Command, dsn *string) {
	cmd.PersistentFlags().StringVar(dsn, "database", "", databaseHelp)
}

// databaseFromEnv is the database when no flag names it: the first of
// PGFENCE_DATABASE_URL and DATABASE_URL that is set, with its source; ""
// means libpq's PG* variables.
func databaseFromEnv() (dsn, from string) {
	for _, k := range []string{"PGFENCE_DATABASE_URL", "DATABASE_URL"} {
		if v := os.Getenv(k); v != "" {
			return v, k
		}
	}
	return "", ""
}

// resolveDatabase is --database if given, else databaseFromEnv.
func resolveDatabase(cmd *cobra.Command, dsn string) string {
	if f := cmd.Flag("database"); f != nil && f.Changed {
		return dsn
	}
	v, _ := databaseFromEnv()
	return v
}

// connectDatabase connects to the --database DSN or its defaults, with a
// 10 s connect timeout unless the DSN sets one and application_name
// "pgfence <command>" unless it is set.
func connectDatabase(ctx context.Context, cmd *cobra.Command, dsn string) (*pgx.Conn, error) {
	cfg, err := databaseConfig(cmd, dsn)
	if err != nil {
		return nil, err
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	return conn, nil
}

// withDatabase runs f with a connection to the command's database (dsn
// from --database, or the chain), closed after.
func withDatabase(cmd *cobra.Command, dsn string, f func(ctx context.Context, conn *pgx.Conn) error) error {
	ctx := cmd.Context()
	conn, err := connectDatabase(ctx, cmd, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	return f(ctx, conn)
}

func databaseConfig(cmd *cobra.Command, dsn string) (*pgx.ConnConfig, error) {
	dsn = resolveDatabase(cmd, dsn)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, usageError("--database: " + err.Error())
	}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = 10 * time.Second
	}
	if _, ok := cfg.RuntimeParams["application_name"]; !ok {
		cfg.RuntimeParams["application_name"] = "pgfence " + cmd.Name()
	}
	return cfg, nil
}

// --- the holder ---

// defaultHolder is the holder recorded with a lease when --holder is not
// given, the same for every command: $PGFENCE_HOLDER, else HOST:PID of the
// process that keeps the lease (pgfence run itself; for lease acquire, its
// parent: the script that renews and releases it).
func defaultHolder(pid int) string {
	if h := os.Getenv("PGFENCE_HOLDER"); h != "" {
		return h
	}
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "localhost"
	}
	return host + ":" + strconv.Itoa(pid)
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
