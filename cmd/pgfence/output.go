package main

// How every command prints its result (docs/cli.md, "Output"): on stdout,
// as text, or with --json as JSON (one object or array). Errors are
// printed by execute (exit.go), on stderr; a command that fails prints
// nothing here.

import (
	"encoding/json"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"

	"github.com/spf13/cobra"
)

// output is what a command prints when it succeeds: with --json, json as
// one line of JSON (indented over several when indent: the audit report,
// read by people too); else what text writes.
type output struct {
	json   any
	text   func(w io.Writer) error
	indent bool
}

// print writes o to w, as JSON when asJSON.
func (o output) print(w io.Writer, asJSON bool) error {
	if !asJSON {
		return o.text(w)
	}
	enc := json.NewEncoder(w)
	if o.indent {
		enc.SetIndent("", "  ")
	}
	return enc.Encode(o.json)
}

// printResult prints o on cmd's stdout, as --json says.
func printResult(cmd *cobra.Command, o output) error {
	return o.print(cmd.OutOrStdout(), jsonFlag(cmd))
}

// jsonFlag reports the root --json flag.
func jsonFlag(cmd *cobra.Command) bool {
	f := cmd.Flag("json")
	return f != nil && f.Value.String() == "true"
}

// textf is an output's text of one formatted line.
func textf(format string, args ...any) func(io.Writer) error {
	return func(w io.Writer) error {
		_, err := fmt.Fprintf(w, format+"\n", args...)
		return err
	}
}

// field is one key=value line of keyValues.
type field struct {
	key   string
	value any
}

var shellSafe = regexp.MustCompile(`^[A-Za-z0-9_.:+@/-]*$`)

// keyValues is the output of the lease commands: key=value lines a shell
// can eval, in order (values quoted where needed, times in RFC 3339); with
// --json one object of them.
func keyValues(fields ...field) output {
	obj := make(map[string]any, len(fields))
	for _, f := range fields {
		obj[f.key] = f.value
	}
	return output{json: obj, text: func(w io.Writer) error {
		var b strings.Builder
		for _, f := range fields {
			var s string
			switch v := f.value.(type) {
			case time.Time:
				s = v.UTC().Format(time.RFC3339Nano)
			case int64:
				s = strconv.FormatInt(v, 10)
			case bool:
				s = strconv.FormatBool(v)
			default:
				s = fmt.Sprint(v)
			}
			switch {
			case shellSafe.MatchString(s):
			case strings.IndexFunc(s, unicode.IsControl) >= 0:
				// Written as escapes, so that a worker's holder name
				// cannot forge lines or drive the reader's terminal
				// (round 25, BC-L4): bash's $'...' reads them back.
				s = ansiQuote(s)
			default:
				s = "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
			}
			fmt.Fprintf(&b, "%s=%s\n", f.key, s)
		}
		_, err := io.WriteString(w, b.String())
		return err
	}}
}

// listing is the output of a list command: with --json the rows as an
// array ([] when there are none); as text a table of cells(row) under
// header, or the line none when there are no rows.
func listing[T any](rows []T, none string, header []string, cells func(T) []string) output {
	if rows == nil {
		rows = []T{}
	}
	return output{json: rows, text: func(w io.Writer) error {
		if len(rows) == 0 {
			_, err := fmt.Fprintln(w, none)
			return err
		}
		lines := [][]string{header}
		for _, r := range rows {
			cs := cells(r)
			for i, c := range cs {
				cs[i] = printable(c)
			}
			lines = append(lines, cs)
		}
		return writeTable(w, lines)
	}}
}

// writeTable writes lines as columns aligned with spaces.
func writeTable(w io.Writer, lines [][]string) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, l := range lines {
		fmt.Fprintln(tw, strings.Join(l, "\t"))
	}
	return tw.Flush()
}

// orDash is s, or "-" when it is empty.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// intOrDash is n, or "-" when there is none (or the role may not see it).
func intOrDash(n *int64) string {
	if n == nil {
		return "-"
	}
	return strconv.FormatInt(*n, 10)
}

// timeOrDash is t in RFC 3339, or "-".
func timeOrDash(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

// msOrDash is a duration in milliseconds rounded to the second, or "-".
func msOrDash(ms *int64) string {
	if ms == nil {
		return "-"
	}
	return (time.Duration(*ms) * time.Millisecond).Round(time.Second).String()
}

// printable is s with each control character replaced by '?', as
// PostgreSQL shows an application_name: a value a worker chose (a lease's
// holder) cannot forge rows of a table or drive the terminal.
func printable(s string) string {
	if strings.IndexFunc(s, unicode.IsControl) < 0 {
		return s
	}
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return '?'
		}
		return r
	}, s)
}

// ansiQuote quotes s for bash as $'...', control characters, quotes and
// backslashes escaped.
func ansiQuote(s string) string {
	var b strings.Builder
	b.WriteString("$'")
	for _, r := range s {
		switch {
		case r == '\\' || r == '\'':
			b.WriteByte('\\')
			b.WriteRune(r)
		case unicode.IsControl(r) && r < 0x80:
			fmt.Fprintf(&b, "\\x%02x", r)
		case unicode.IsControl(r):
			fmt.Fprintf(&b, "\\u%04x", r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('\'')
	return b.String()
}
