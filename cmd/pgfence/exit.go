package main

// Errors and the exit code table every command shares (docs/cli.md, "Exit
// codes"): a command's RunE returns its errors as they are; execute
// classifies them by the table and prints them on stderr, as text or, with
// --json, as one JSON object. runnerExit and listenError are the table's
// two refinements: the runner's own codes, and an address in use.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/runner"
	"github.com/pgfence/pgfence/migrations"
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
	exitTempFail    = runner.ExitLeaseHeld   // 75 EX_TEMPFAIL: the lease is held by another holder, a wait ran out, the synchronous standby did not confirm the commit (FN016), or a new generation's takeover not yet (FN017)
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

// usageError is a bad flag or argument: exit 64 with msg.
func usageError(msg string) error { return &exitError{code: exitUsage, msg: msg} }

// configError is a bad configuration (serve): exit 78 with err's message.
func configError(err error) error { return &exitError{code: exitConfig, msg: err.Error()} }

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
	if errors.Is(err, migrations.ErrUntrusted) {
		return exitConfig, "what pgfence migrate would build on must be a superuser's: see docs/security.md, \"pgfence's own SQL\""
	}
	switch fence.Code(err) {
	case fence.CodeStale, fence.CodeRetired:
		return exitLeaseLost, ""
	case fence.CodeLeaseHeld:
		return exitTempFail, ""
	case fence.CodeUnconfirmed:
		return exitTempFail, "the synchronous standby did not confirm the commit (its wait was cancelled), so a failover may lose it: run the command again"
	case fence.CodeUnconfirmedTakeover:
		return exitTempFail, "the synchronous standby has not confirmed the lease's takeover yet, so the write was refused: run the command again (check pg_stat_replication on the primary if it persists)"
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

// runnerExit is the exit error for a runner failure: the runner's code,
// except that ExitInternal is refined by the exit code table.
func runnerExit(code int, err error) *exitError {
	ee := exitWith(err)
	if code != runner.ExitInternal {
		ee.code = code
	}
	return ee
}

// listenError says which address is busy and how to pick another.
func listenError(addr, flag string, err error) error {
	ee := exitWith(fmt.Errorf("listen on %s: %w", addr, err))
	ee.code = exitUnavailable
	if errors.Is(err, syscall.EADDRINUSE) {
		ee.msg = fmt.Sprintf("listen on %s: the address is in use by another process", addr)
		ee.hint = fmt.Sprintf("stop that process (ss -ltnp shows it), or pick another address: %s %s (port 0 picks a free one)", flag, nextPort(addr))
	}
	return ee
}

// nextPort is addr with its port plus one.
func nextPort(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	n, err := strconv.Atoi(port)
	if err != nil || n == 0 || n >= 65535 {
		return addr
	}
	return net.JoinHostPort(host, strconv.Itoa(n+1))
}
