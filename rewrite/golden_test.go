package rewrite

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/golden"
)

const goldenDir = "../testdata/classify"

// TestGolden classifies every line of testdata/classify/*.sql (one query
// string per line; blank lines and lines starting with "--" are skipped) and
// compares the rendering with the matching .golden file. Run with -update
// to regenerate, then review the diff.
func TestGolden(t *testing.T) {
	total := 0
	for _, file := range golden.Files(t, filepath.Join(goldenDir, "*.sql")) {
		t.Run(filepath.Base(file), func(t *testing.T) {
			cases := readCases(t, file)
			total += len(cases)
			var b strings.Builder
			for _, c := range cases {
				b.WriteString(renderCase(c))
				b.WriteString("\n")
			}
			golden.Check(t, strings.TrimSuffix(file, ".sql")+".golden", b.String())
		})
	}
	if total < 60 {
		t.Errorf("got %d golden cases, want at least 60", total)
	}
}

func readCases(t *testing.T, file string) []string {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var cases []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "--") {
			continue
		}
		cases = append(cases, line)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return cases
}

// renderCase is the golden form of one query string's classification.
func renderCase(sql string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "== %s\n", sql)
	res, err := Classify(sql)
	if err != nil {
		fmt.Fprintf(&b, "error: %v\n", err)
		return b.String()
	}
	for i, s := range res.Stmts {
		renderStmt(&b, "", fmt.Sprintf("%d", i+1), s)
	}
	return b.String()
}

func renderStmt(b *strings.Builder, indent, label string, s *Stmt) {
	fmt.Fprintf(b, "%s%s: %s", indent, label, s.Kind)
	if s.Name != "" {
		fmt.Fprintf(b, " name=%q", s.Name)
	}
	var attrs []string
	for _, a := range []struct {
		on   bool
		name string
	}{
		{s.All, "all"}, {s.Chain, "chain"}, {s.ReadOnly, "read-only"}, {s.ReadWrite, "read-write"},
		{s.Deferrable, "deferrable"}, {s.Explain, "explain"}, {s.Analyze, "analyze"},
		{s.Opaque, "opaque"}, {s.LockingRead, "locking"}, {s.CallsFence, "calls-fence"},
		{s.PrimaryOnlyFuncs, "primary-only"}, {s.UnknownGUCWrite, "unknown-guc-write"},
		{s.Temp, "temp"},
	} {
		if a.on {
			attrs = append(attrs, a.name)
		}
	}
	if s.Isolation != "" {
		attrs = append(attrs, "isolation="+s.Isolation)
	}
	if len(attrs) > 0 {
		fmt.Fprintf(b, " [%s]", strings.Join(attrs, " "))
	}
	b.WriteString("\n")
	if len(s.WriteTargets) > 0 {
		fmt.Fprintf(b, indent+"   writes: %s\n", relList(s.WriteTargets))
	}
	if len(s.ReadRelations) > 0 {
		fmt.Fprintf(b, indent+"   reads: %s\n", relList(s.ReadRelations))
	}
	if s.Params > 0 {
		fmt.Fprintf(b, indent+"   params: %d\n", s.Params)
	}
	if len(s.Builtins) > 0 {
		fmt.Fprintf(b, indent+"   built-ins by name: %s\n", strings.Join(s.Builtins, ", "))
	}
	if s.Executes != "" {
		fmt.Fprintf(b, indent+"   executes: %s\n", s.Executes)
	}
	for _, g := range s.GUCs {
		fmt.Fprintf(b, indent+"   guc: %s\n", renderGUC(g))
	}
	if s.Writes() {
		fmt.Fprintf(b, indent+"   canonical: %s\n", s.Canonical())
	}
	if s.canon != nil && s.canon.err != nil {
		fmt.Fprintf(b, indent+"   deparse error: %v\n", s.canon.err)
	}
	if s.Inner != nil {
		renderStmt(b, indent+"   ", "inner", s.Inner)
	}
}

func relList(rs []RelName) string {
	parts := make([]string, len(rs))
	for i, r := range rs {
		parts[i] = r.String()
	}
	return strings.Join(parts, ", ")
}

func renderGUC(g GUC) string {
	var b strings.Builder
	switch g.Op {
	case GUCSet:
		b.WriteString("set")
	case GUCReset:
		b.WriteString("reset")
	case GUCResetAll:
		b.WriteString("reset-all")
	case GUCCurrent:
		b.WriteString("from-current")
	}
	if g.Local {
		b.WriteString(" local")
	}
	if g.Func {
		b.WriteString(" set_config")
	}
	if g.NameParam > 0 {
		fmt.Fprintf(&b, " name=$%d", g.NameParam)
	} else if g.Name != "" {
		fmt.Fprintf(&b, " name=%s", g.Name)
	}
	if g.ValueParam > 0 {
		fmt.Fprintf(&b, " value=$%d", g.ValueParam)
	} else if g.Op == GUCSet {
		fmt.Fprintf(&b, " value=%q", g.Value)
	}
	if g.LocalParam > 0 {
		fmt.Fprintf(&b, " local=$%d", g.LocalParam)
	}
	if g.NArgs > 1 {
		fmt.Fprintf(&b, " nargs=%d", g.NArgs)
	}
	if g.Unknown {
		b.WriteString(" unknown")
	}
	if g.Conditional {
		b.WriteString(" conditional")
	}
	return b.String()
}
