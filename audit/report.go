package audit

import (
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"
)

// MarshalJSON adds "ok" to the report's fields.
func (r *Report) MarshalJSON() ([]byte, error) {
	type plain Report
	return json.Marshal(struct {
		OK bool `json:"ok"`
		*plain
	}{r.OK(), (*plain)(r)})
}

// WriteText writes the report for people: the window, the checks, the
// operations by outcome, then every violation with the rows that show it.
func (r *Report) WriteText(w io.Writer) error {
	var b strings.Builder
	win := "whole history"
	if r.Since != nil || r.Until != nil {
		win = fmt.Sprintf("[%s, %s)", timeOr(r.Since, "-inf"), timeOr(r.Until, "+inf"))
	}
	fmt.Fprintf(&b, "pgfence audit of %s\n", win)
	for _, c := range r.Checks {
		fmt.Fprintf(&b, "  check %d: %s\n", c, checkTitles[c])
	}
	for _, s := range r.Skipped {
		fmt.Fprintf(&b, "  skipped: %s\n", s)
	}
	fmt.Fprintf(&b, "operations by outcome (%s):%s\n", r.OutcomeSource, pairs(r.Outcomes))
	fmt.Fprintf(&b, "counted:%s\n", pairs(r.Counts))
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "note: %s\n", n)
	}
	if r.OK() {
		b.WriteString("OK: no violations\n")
		_, err := io.WriteString(w, b.String())
		return err
	}
	var omitted int64
	for _, n := range r.Omitted {
		omitted += n
	}
	fmt.Fprintf(&b, "VIOLATIONS: %d\n", int64(len(r.Violations))+omitted)
	for _, v := range r.Violations {
		fmt.Fprintf(&b, "[check %d] %s\n", v.Check, v.Description)
		for _, row := range v.Rows {
			fmt.Fprintf(&b, "    %s:", row.Source)
			for _, f := range row.Fields {
				fmt.Fprintf(&b, " %s=%s", f.Name, f.Value)
			}
			b.WriteString("\n")
		}
	}
	for _, c := range sortedKeys(r.Omitted) {
		fmt.Fprintf(&b, "[check %d] ... and %d more not shown\n", c, r.Omitted[c])
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func timeOr(t *time.Time, def string) string {
	if t == nil {
		return def
	}
	return t.UTC().Format(time.RFC3339Nano)
}

func pairs(m map[string]int64) string {
	if len(m) == 0 {
		return " none"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%d", strings.ReplaceAll(k, " ", "_"), m[k])
	}
	return b.String()
}

func sortedKeys(m map[int]int64) []int {
	keys := make([]int, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Ints(keys)
	return keys
}
