//go:build drivers

package drivers

import (
	"bufio"
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

var writeDoc = flag.Bool("write-doc", false, "rewrite the driver table in docs/compatibility.md")

// result is one check of one driver variant against one target.
type result struct {
	Variant string // "psycopg2", "pgjdbc prepareThreshold=0", "pgx exec"
	Check   string
	Status  string // "ok", "fail" or "n/a"
	Detail  string
}

// driver runs its checks against a target and returns one result per
// check and variant.
type driver struct {
	Name string
	Run  func(ctx context.Context, t *testing.T, tg target) ([]result, error)
}

// drivers are the matrix's drivers, in the table's column order.
var drivers = []driver{
	{"psycopg2", scriptDriver("/usr/bin/python3", "python/psycopg2_checks.py")},
	{"psycopg", scriptDriver("/usr/bin/python3", "python/psycopg3_checks.py")},
	{"node-postgres", scriptDriver("node", "node/checks.js")},
	{"pgjdbc", scriptDriver("java", "-cp", "/usr/share/java/postgresql.jar", "pgjdbc/Checks.java")},
	{"pgx", runPgx},
}

// scriptDriver runs a check script; its stdout has one line per check.
func scriptDriver(prog string, args ...string) func(ctx context.Context, t *testing.T, tg target) ([]result, error) {
	return func(ctx context.Context, t *testing.T, tg target) ([]result, error) {
		cmd := exec.CommandContext(ctx, prog, args...)
		cmd.Env = tg.Env()
		cmd.WaitDelay = 5 * time.Second
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		res, perr := parseResults(stdout.String())
		if perr != nil {
			return res, perr
		}
		if err != nil {
			return res, fmt.Errorf("%s %s: %v\n%s", prog, strings.Join(args, " "), err, lastLines(stderr.String(), 30))
		}
		if s := strings.TrimSpace(stderr.String()); s != "" {
			t.Logf("%s against %s, stderr:\n%s", args[len(args)-1], tg.Name, lastLines(s, 30))
		}
		return res, nil
	}
}

// parseResults reads the check lines of a script's output; other lines
// are ignored.
func parseResults(out string) ([]result, error) {
	var res []result
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		f := strings.SplitN(sc.Text(), "\t", 5)
		if f[0] != "check" {
			continue
		}
		if len(f) < 4 {
			return res, fmt.Errorf("malformed check line %q", sc.Text())
		}
		r := result{Variant: f[1], Check: f[2], Status: f[3]}
		if len(f) == 5 {
			r.Detail = f[4]
		}
		switch r.Status {
		case "ok", "fail", "n/a":
		default:
			return res, fmt.Errorf("check line %q: status %q, want ok, fail or n/a", sc.Text(), r.Status)
		}
		res = append(res, r)
	}
	return res, sc.Err()
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// TestDrivers is the driver matrix (issue 19 §6).
func TestDrivers(t *testing.T) {
	start := time.Now()
	srv := startServe(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var targets []target
	for _, name := range []string{"direct", "proxy"} {
		db, err := cluster.CreateDatabase(ctx, "drivers_"+name)
		if err != nil {
			t.Fatal(err)
		}
		port := cluster.Primary.Port
		if name == "proxy" {
			port = srv.Port
		}
		targets = append(targets, target{Name: name, Port: port, Database: db})
	}

	// Every driver against both targets at once: the checks mostly wait
	// on PostgreSQL, and each run has a database and job keys of its own.
	type run struct {
		driver, target string
		res            []result
		err            error
		took           time.Duration
	}
	runs := make([]run, 0, len(drivers)*len(targets))
	var wg sync.WaitGroup
	var mu sync.Mutex
	for _, d := range drivers {
		for _, tg := range targets {
			wg.Add(1)
			go func() {
				defer wg.Done()
				t0 := time.Now()
				res, err := d.Run(ctx, t, tg)
				mu.Lock()
				runs = append(runs, run{d.Name, tg.Name, res, err, time.Since(t0)})
				mu.Unlock()
			}()
		}
	}
	wg.Wait()

	m := newMatrix()
	for _, r := range runs {
		t.Logf("%s against %s: %d checks in %s", r.driver, r.target, len(r.res), r.took.Round(time.Millisecond))
		if r.err != nil {
			t.Errorf("%s against %s did not finish: %v", r.driver, r.target, r.err)
		}
		for _, x := range r.res {
			m.add(r.target, x)
		}
	}
	table := m.markdown()
	fmt.Printf("\nDriver matrix (direct / through pgfence serve), %s:\n\n%s\n", time.Since(start).Round(time.Second), table)
	for _, p := range m.problems(knownProxyFailures) {
		t.Error(p)
	}
	if t.Failed() {
		t.Logf("pgfence serve log (tail):\n%s", tailFile(srv.LogPath, 6000))
		t.Logf("primary log (tail):\n%s", tailFile(cluster.Primary.LogPath, 6000))
	}
	if *writeDoc {
		if err := replaceSection("../../docs/compatibility.md", "driver-matrix", table); err != nil {
			t.Fatal(err)
		}
	}
}

// matrix is the results by check, variant and target.
type matrix struct {
	cells map[[2]string]map[string]result // [variant, check] → target → result
}

func newMatrix() *matrix { return &matrix{cells: map[[2]string]map[string]result{}} }

func (m *matrix) add(tg string, r result) {
	k := [2]string{r.Variant, r.Check}
	if m.cells[k] == nil {
		m.cells[k] = map[string]result{}
	}
	m.cells[k][tg] = r
}

// order sorts variants by driver (the order of drivers), then as
// variantOrder lists them, then by name; checks as checkOrder lists them,
// then by name.
func (m *matrix) order() (variants, checks []string) {
	seenV, seenC := map[string]bool{}, map[string]bool{}
	for k := range m.cells {
		if !seenV[k[0]] {
			seenV[k[0]] = true
			variants = append(variants, k[0])
		}
		if !seenC[k[1]] {
			seenC[k[1]] = true
			checks = append(checks, k[1])
		}
	}
	rank := func(v string) int {
		for i, d := range drivers {
			if v == d.Name || strings.HasPrefix(v, d.Name+" ") {
				return i
			}
		}
		return len(drivers)
	}
	sort.SliceStable(variants, func(i, j int) bool {
		if ri, rj := rank(variants[i]), rank(variants[j]); ri != rj {
			return ri < rj
		}
		if vi, vj := variantIndex(variants[i]), variantIndex(variants[j]); vi != vj {
			return vi < vj
		}
		return variants[i] < variants[j]
	})
	sort.SliceStable(checks, func(i, j int) bool {
		if ci, cj := checkIndex(checks[i]), checkIndex(checks[j]); ci != cj {
			return ci < cj
		}
		return checks[i] < checks[j]
	})
	return variants, checks
}

func checkIndex(c string) int {
	for i, x := range checkOrder {
		if x == c {
			return i
		}
	}
	return len(checkOrder)
}

func variantIndex(v string) int {
	for i, x := range variantOrder {
		if x == v {
			return i
		}
	}
	return len(variantOrder)
}

// knownFailure returns the knownProxyFailures entry of a cell: its own
// ("variant/check") or the check's for every variant ("*/check").
func knownFailure(known map[string]string, variant, check string) (key, reason string, ok bool) {
	for _, k := range []string{variant + "/" + check, "*/" + check} {
		if r, ok := known[k]; ok {
			return k, r, true
		}
	}
	return "", "", false
}

// problems lists what fails the matrix: a check that fails straight to
// PostgreSQL, or is missing there; a check that fails (or is missing)
// through the proxy and is not a known proxy failure; a known proxy
// failure that passes (for a "*/check" entry: in any variant).
func (m *matrix) problems(known map[string]string) []string {
	var out []string
	variants, checks := m.order()
	seenKnown := map[string]bool{}
	for _, v := range variants {
		for _, c := range checks {
			cell, ok := m.cells[[2]string{v, c}]
			if !ok {
				continue
			}
			d, hasD := cell["direct"]
			p, hasP := cell["proxy"]
			key := v + "/" + c
			knownKey, reason, isKnown := knownFailure(known, v, c)
			if isKnown {
				seenKnown[knownKey] = true
			}
			switch {
			case !hasD:
				out = append(out, fmt.Sprintf("%s: not run straight to PostgreSQL", key))
			case d.Status == "fail":
				out = append(out, fmt.Sprintf("%s: fails straight to PostgreSQL (the check is broken): %s", key, d.Detail))
			case !hasP:
				out = append(out, fmt.Sprintf("%s: not run through the proxy", key))
			case p.Status == "n/a" && d.Status != "n/a":
				out = append(out, fmt.Sprintf("%s: %s straight to PostgreSQL but n/a through the proxy", key, d.Status))
			case p.Status == "fail" && !isKnown:
				out = append(out, fmt.Sprintf("%s: passes straight to PostgreSQL, fails through the proxy: %s", key, p.Detail))
			case p.Status != "fail" && isKnown:
				out = append(out, fmt.Sprintf("%s: listed in knownProxyFailures as %s (%s) but %s through the proxy: remove it from the list", key, knownKey, reason, p.Status))
			}
		}
	}
	var unrun []string
	for key := range known {
		if !seenKnown[key] {
			unrun = append(unrun, fmt.Sprintf("knownProxyFailures lists %s, which no driver ran", key))
		}
	}
	sort.Strings(unrun)
	return append(out, unrun...)
}

// markdown is the driver × check table: one row per check, one column per
// variant, each cell "direct / proxy" (✓ passed, ✗ failed, – not
// applicable to that driver), a known proxy failure marked with its
// footnote.
func (m *matrix) markdown() string {
	variants, checks := m.order()
	var b strings.Builder
	b.WriteString("| check |")
	for _, v := range variants {
		fmt.Fprintf(&b, " %s |", v)
	}
	b.WriteString("\n|---|")
	for range variants {
		b.WriteString("---|")
	}
	b.WriteString("\n")
	mark := func(r result, ok bool) string {
		switch {
		case !ok:
			return "?"
		case r.Status == "ok":
			return "✓"
		case r.Status == "fail":
			return "✗"
		default:
			return "–"
		}
	}
	for _, c := range checks {
		fmt.Fprintf(&b, "| %s |", c)
		for _, v := range variants {
			cell, ok := m.cells[[2]string{v, c}]
			if !ok {
				b.WriteString(" |")
				continue
			}
			d, hasD := cell["direct"]
			p, hasP := cell["proxy"]
			s := mark(d, hasD) + " " + mark(p, hasP)
			if _, _, known := knownFailure(knownProxyFailures, v, c); known {
				s += " ᴷ"
			}
			fmt.Fprintf(&b, " %s |", s)
		}
		b.WriteString("\n")
	}
	return b.String()
}

// replaceSection replaces the text between <!-- begin NAME --> and
// <!-- end NAME --> in path.
func replaceSection(path, name, body string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	begin, end := "<!-- begin "+name+" -->\n", "<!-- end "+name+" -->"
	i := bytes.Index(b, []byte(begin))
	j := bytes.Index(b, []byte(end))
	if i < 0 || j < i {
		return fmt.Errorf("%s: no %q … %q section", path, begin, end)
	}
	out := append(append(append([]byte{}, b[:i+len(begin)]...), body...), b[j:]...)
	return os.WriteFile(path, out, 0o644)
}
