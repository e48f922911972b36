//go:build drivers

package drivers

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// pgxSuiteSetup is what pgx's own tests expect of their database
// (testsetup/postgresql_setup.sql of the pgx module, less the roles for
// authentication methods, TLS and OAuth that this suite does not set up:
// those tests skip without their PGX_TEST_* variables).
const pgxSuiteSetup = `
CREATE EXTENSION hstore;
CREATE EXTENSION ltree;
CREATE DOMAIN uint64 AS numeric(20,0);
`

// pgxSuiteRoles are the cluster-wide roles pgx's tests use.
const pgxSuiteRoles = `
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = ' tricky, '' } " \ test user ') THEN
    CREATE USER " tricky, ' } "" \ test user " SUPERUSER PASSWORD 'secret';
  END IF;
END $$;
`

// knownPgxSuiteFailures are pgx tests that pass straight to PostgreSQL
// and fail through the proxy, "package TestName" → why. As in
// knownProxyFailures, each is either a proxy bug (with the part of issue
// 19 that fixes it) or a server-only feature the proxy refuses by design;
// a listed test that passes fails the suite.
var knownPgxSuiteFailures = map[string]string{}

// tempPath is a temporary directory in a test's name (pgconn's
// TestParseConfigSSLCertMode names subtests after their service file),
// different in every run.
var tempPath = regexp.MustCompile(`/tmp/[^/']+/[0-9]+/`)

// testEvent is a line of `go test -json`.
type testEvent struct {
	Action  string
	Package string
	Test    string
	Output  string
	Elapsed float64
}

// suiteResult is the outcome of each test ("pkg Test/sub" → pass, fail or
// skip; fail if any of its -count runs failed), how many of its runs
// failed, and the output of the failed ones.
type suiteResult struct {
	outcome map[string]string
	fails   map[string]int
	output  map[string]*strings.Builder
	took    time.Duration
}

// pgxSuiteSelection is the part of pgx's suite a run takes, from the
// environment, for reproducing one test quickly (the whole suite by
// default):
//
//	PGX_SUITE_RUN=regexp   go test's -run
//	PGX_SUITE_COUNT=n      go test's -count (1 by default)
//	PGX_SUITE_PKGS="./pgconn ./pgtype"   the packages (./... by default)
type pgxSuiteSelection struct {
	run   string
	count int
	pkgs  []string
}

func pgxSuiteSelectionFromEnv() (pgxSuiteSelection, error) {
	sel := pgxSuiteSelection{run: os.Getenv("PGX_SUITE_RUN"), count: 1, pkgs: strings.Fields(os.Getenv("PGX_SUITE_PKGS"))}
	if v := os.Getenv("PGX_SUITE_COUNT"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return sel, fmt.Errorf("PGX_SUITE_COUNT=%q: want a positive number of runs", v)
		}
		sel.count = n
	}
	if sel.run != "" {
		if _, err := regexp.Compile(sel.run); err != nil {
			return sel, fmt.Errorf("PGX_SUITE_RUN=%q: %v", sel.run, err)
		}
	}
	if len(sel.pkgs) == 0 {
		sel.pkgs = []string{"./..."}
	}
	return sel, nil
}

// whole says whether sel is the whole suite, run once: only then does
// the summary describe the suite (and may be written to the docs).
func (sel pgxSuiteSelection) whole() bool {
	return sel.run == "" && sel.count == 1 && len(sel.pkgs) == 1 && sel.pkgs[0] == "./..."
}

// args are go test's arguments for sel.
func (sel pgxSuiteSelection) args() []string {
	args := []string{"test", "-json", "-count=" + strconv.Itoa(sel.count), "-timeout", "20m"}
	if sel.run != "" {
		args = append(args, "-run", sel.run)
	}
	return append(args, sel.pkgs...)
}

// pgxModuleCopy copies the pgx module of go.mod (its source with its
// tests, from the module cache, where it is read-only) to a temporary
// directory.
func pgxModuleCopy(t *testing.T) (dir, version string) {
	t.Helper()
	out, err := exec.Command("go", "mod", "download", "-json", "github.com/jackc/pgx/v5").Output()
	if err != nil {
		t.Fatalf("go mod download github.com/jackc/pgx/v5: %v", err)
	}
	var mod struct{ Dir, Version string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		t.Fatalf("go mod download: %v (%s)", err, out)
	}
	dir = filepath.Join(t.TempDir(), "pgx")
	if out, err := exec.Command("cp", "-R", mod.Dir, dir).CombinedOutput(); err != nil {
		t.Fatalf("copy %s: %v\n%s", mod.Dir, err, out)
	}
	if out, err := exec.Command("chmod", "-R", "u+w", dir).CombinedOutput(); err != nil {
		t.Fatalf("chmod: %v\n%s", err, out)
	}
	cmd := exec.Command("go", "mod", "download")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go mod download in the pgx copy: %v\n%s", err, out)
	}
	return dir, mod.Version
}

// runPgxSuite runs sel of the pgx module's tests against dsn.
func runPgxSuite(ctx context.Context, dir, dsn string, sel pgxSuiteSelection) (*suiteResult, error) {
	start := time.Now()
	cmd := exec.CommandContext(ctx, "go", sel.args()...)
	cmd.Dir = dir
	var env []string
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); !strings.HasPrefix(k, "PG") {
			env = append(env, kv)
		}
	}
	cmd.Env = append(env, "PGX_TEST_DATABASE="+dsn, "PGX_TEST_TCP_CONN_STRING="+dsn, "GOFLAGS=-mod=mod")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	res := &suiteResult{outcome: map[string]string{}, fails: map[string]int{}, output: map[string]*strings.Builder{}}
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 4<<20), 4<<20)
	for sc.Scan() {
		var ev testEvent
		if json.Unmarshal(sc.Bytes(), &ev) != nil || ev.Test == "" {
			continue
		}
		key := ev.Package + " " + tempPath.ReplaceAllString(ev.Test, "/tmp/…/")
		switch ev.Action {
		case "fail":
			res.outcome[key] = "fail"
			res.fails[key]++
		case "pass", "skip":
			if res.outcome[key] != "fail" { // with -count=n, one failed run fails the test
				res.outcome[key] = ev.Action
			}
		case "output":
			b := res.output[key]
			if b == nil {
				b = &strings.Builder{}
				res.output[key] = b
			}
			if b.Len() < 8000 {
				b.WriteString(ev.Output)
			}
		}
	}
	err = cmd.Wait()
	res.took = time.Since(start)
	if len(res.outcome) == 0 {
		return res, fmt.Errorf("go test ran no test: %v\n%s", err, lastLines(stderr.String(), 30))
	}
	// A failing test makes go test exit 1: the outcomes say which.
	return res, nil
}

// runPgxBoth runs sel of pgx's tests against both targets (direct, then
// proxy) at once, each in a database of its own: the suite mostly waits
// (on pg_sleep, timeouts, PostgreSQL), so together they take little
// longer than one, and a test's two runs share the machine's load.
func runPgxBoth(ctx context.Context, t *testing.T, dir string, targets []target, sel pgxSuiteSelection) (direct, proxy *suiteResult) {
	t.Helper()
	results := make([]*suiteResult, len(targets))
	var wg sync.WaitGroup
	for i, tg := range targets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := runPgxSuite(ctx, dir, tg.DSN(), sel)
			if err != nil {
				t.Errorf("pgx suite against %s: %v", tg.Name, err)
				return
			}
			results[i] = res
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	return results[0], results[1]
}

// pgxRecheckRuns is how many times a test that failed through the proxy
// only is run again, direct and through the proxy at once.
const pgxRecheckRuns = 5

// pgxRecheckMax is how many top-level tests are run again at most; more
// failures than that are not timing but a broken proxy.
const pgxRecheckMax = 10

// recheckPgxFailures runs again, pgxRecheckRuns times, direct and through
// the proxy at once, each top-level test with a key in failing (a test or
// subtest that passed direct and failed through the proxy; broken[i] says
// how). A few of pgx's tests are timing-sensitive: pgconn's
// TestCancelRequestContextWatcherHandler/Stress_N needs a 10 ms query's
// answer within 1 s of its cancel, and on a loaded machine PostgreSQL
// itself (its backend, and the postmaster forking for the CancelRequest)
// can take longer, direct as well as through the proxy (docs/
// compatibility.md, pgx's own test suite). One such failure in the long
// run is no evidence against the proxy; the same test failing more often
// through the proxy than direct when both run at once is. A key stays
// broken when the proxy fails it in more reruns than direct, or it does
// not run again; the others are returned as flaky, logged with their first
// failure's output. Nothing is skipped: every failing key is run again.
func recheckPgxFailures(ctx context.Context, t *testing.T, dir string, targets []target, failing, broken []string) (stillBroken, flaky []string) {
	t.Helper()
	tops := map[string][]string{} // "pkg Top" → its failing keys
	var order []string
	for _, key := range failing {
		pkg, name, _ := strings.Cut(key, " ")
		top, _, _ := strings.Cut(name, "/")
		if tops[pkg+" "+top] == nil {
			order = append(order, pkg+" "+top)
		}
		tops[pkg+" "+top] = append(tops[pkg+" "+top], key)
	}
	if len(order) == 0 || len(order) > pgxRecheckMax {
		return broken, nil
	}
	why := map[string]string{}
	for i, key := range failing {
		why[key] = broken[i]
	}
	for _, pt := range order {
		pkg, top, _ := strings.Cut(pt, " ")
		sel := pgxSuiteSelection{run: pgxRecheckPattern(top, tops[pt]), count: pgxRecheckRuns, pkgs: []string{pkg}}
		d, p := runPgxBoth(ctx, t, dir, targets, sel)
		for _, key := range tops[pt] {
			again := fmt.Sprintf("run again %d times at once: %d failed through the proxy, %d direct", pgxRecheckRuns, p.fails[key], d.fails[key])
			if p.outcome[key] == "" || p.fails[key] > d.fails[key] {
				stillBroken = append(stillBroken, why[key]+"\n"+again)
				continue
			}
			t.Logf("flaky, not counted as a proxy failure: %s\n%s", why[key], again)
			flaky = append(flaky, fmt.Sprintf("- `%s`: %s", key, again))
		}
	}
	return stillBroken, flaky
}

// pgxRecheckPattern is the -run pattern for top-level test top and its
// failing keys: the failing subtests only where their names can be
// matched exactly, otherwise the whole test.
func pgxRecheckPattern(top string, keys []string) string {
	var subs []string
	for _, key := range keys {
		_, name, _ := strings.Cut(key, " ")
		_, sub, ok := strings.Cut(name, "/")
		switch {
		case !ok:
			continue // the top-level test itself (it fails with its subtests)
		case strings.ContainsAny(sub, "/…"):
			return "^" + regexp.QuoteMeta(top) + "$" // nested, or a temporary path in the name
		}
		subs = append(subs, regexp.QuoteMeta(sub))
	}
	if len(subs) == 0 {
		return "^" + regexp.QuoteMeta(top) + "$"
	}
	return "^" + regexp.QuoteMeta(top) + "$/^(" + strings.Join(subs, "|") + ")$"
}

// skipReasons lists the skipped tests with the message they skipped with.
func (r *suiteResult) skipReasons() []string {
	var out []string
	for key, o := range r.outcome {
		if o != "skip" {
			continue
		}
		why := ""
		if b := r.output[key]; b != nil {
			for _, line := range strings.Split(b.String(), "\n") {
				line = strings.TrimSpace(line)
				if line != "" && !strings.HasPrefix(line, "===") && !strings.HasPrefix(line, "---") {
					why = line
				}
			}
		}
		out = append(out, fmt.Sprintf("- `%s`: %s", key, why))
	}
	sort.Strings(out)
	return out
}

// count returns how many tests (top-level and subtests) had outcome o.
func (r *suiteResult) count(o string) int {
	n := 0
	for _, x := range r.outcome {
		if x == o {
			n++
		}
	}
	return n
}

// TestPgxSuite runs pgx's own test suite straight to PostgreSQL and
// through pgfence serve (issue 19 §7): every test that passes direct must
// pass through the proxy, unless knownPgxSuiteFailures says why not.
func TestPgxSuite(t *testing.T) {
	sel, err := pgxSuiteSelectionFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	if *writeDoc && !sel.whole() {
		t.Fatal("-write-doc describes the whole suite run once: unset PGX_SUITE_RUN, PGX_SUITE_COUNT and PGX_SUITE_PKGS")
	}
	dir, version := pgxModuleCopy(t)
	srv := startServe(t)
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Minute)
	defer cancel()
	admin, err := cluster.Primary.Connect(ctx, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, pgxSuiteRoles); err != nil {
		t.Fatal(err)
	}
	admin.Close(ctx)

	var targets []target
	for _, name := range []string{"direct", "proxy"} {
		db := "pgx_test_" + name
		if err := createPgxDatabase(ctx, db); err != nil {
			t.Fatal(err)
		}
		port := cluster.Primary.Port
		if name == "proxy" {
			port = srv.Port
		}
		targets = append(targets, target{Name: name, Port: port, Database: db})
	}
	d, p := runPgxBoth(ctx, t, dir, targets, sel)
	for _, r := range []struct {
		name string
		res  *suiteResult
	}{{"direct", d}, {"proxy", p}} {
		t.Logf("pgx %s suite against %s: %d passed, %d failed, %d skipped in %s", version, r.name,
			r.res.count("pass"), r.res.count("fail"), r.res.count("skip"), r.res.took.Round(time.Second))
	}
	var broken, known, stale []string
	var failing []string // keys of broken, in order
	for key, o := range d.outcome {
		if o != "pass" {
			continue
		}
		reason, isKnown := knownPgxSuiteFailures[key]
		switch po := p.outcome[key]; {
		case po == "pass" && isKnown:
			stale = append(stale, fmt.Sprintf("%s: listed in knownPgxSuiteFailures (%s) but passes through the proxy: remove it", key, reason))
		case po != "pass" && isKnown:
			known = append(known, key)
		case po != "pass":
			out := ""
			if b := p.output[key]; b != nil {
				out = lastLines(b.String(), 15)
			}
			runs := ""
			if sel.count > 1 {
				runs = fmt.Sprintf(" (%d of %d runs)", p.fails[key], sel.count)
			}
			broken = append(broken, fmt.Sprintf("%s: passes direct, %s through the proxy%s:\n%s", key, outcomeWord(po), runs, out))
			failing = append(failing, key)
		}
	}
	broken, flaky := recheckPgxFailures(ctx, t, dir, targets, failing, broken)
	for key := range knownPgxSuiteFailures {
		if d.outcome[key] != "pass" {
			stale = append(stale, fmt.Sprintf("%s: listed in knownPgxSuiteFailures but %s direct", key, outcomeWord(d.outcome[key])))
		}
	}
	sort.Strings(broken)
	sort.Strings(flaky)
	sort.Strings(known)
	sort.Strings(stale)
	what := "`go test ./...` of the module"
	if !sel.whole() {
		what = "`go test " + strings.Join(sel.args()[2:], " ") + "` of the module" // less -json
	}
	summary := fmt.Sprintf("pgx %s's own tests (top-level tests and subtests, %s): "+
		"%d pass straight to PostgreSQL (%d fail, %d skip there); through pgfence serve %d of those pass, "+
		"%d are known proxy failures, %d fail unexpectedly. Took %s direct, %s through the proxy.\n",
		version, what, d.count("pass"), d.count("fail"), d.count("skip"),
		d.count("pass")-len(broken)-len(flaky)-len(known), len(known), len(broken),
		d.took.Round(time.Second), p.took.Round(time.Second))
	if len(flaky) > 0 {
		summary += fmt.Sprintf("\nFailed through the proxy in this run, then passed as often through the proxy as direct when run again "+
			"%d times both ways at once (timing under the machine's load, not the proxy: see recheckPgxFailures):\n\n%s\n",
			pgxRecheckRuns, strings.Join(flaky, "\n"))
	}
	if skips := d.skipReasons(); len(skips) > 0 {
		summary += "\nSkipped straight to PostgreSQL (and so not compared):\n\n" + strings.Join(skips, "\n") + "\n"
	}
	fmt.Printf("\n%s\n", summary)
	for _, s := range append(broken, stale...) {
		t.Error(s)
	}
	if *writeDoc {
		if err := replaceSection("../../docs/compatibility.md", "pgx-suite", summary); err != nil {
			t.Fatal(err)
		}
	}
}

func outcomeWord(o string) string {
	if o == "" {
		return "not run"
	}
	return map[string]string{"pass": "passes", "fail": "fails", "skip": "skips"}[o]
}

func createPgxDatabase(ctx context.Context, name string) error {
	admin, err := cluster.Primary.Connect(ctx, "postgres")
	if err != nil {
		return err
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, fmt.Sprintf("DROP DATABASE IF EXISTS %q WITH (FORCE)", name)); err != nil {
		return err
	}
	if _, err := admin.Exec(ctx, fmt.Sprintf("CREATE DATABASE %q TEMPLATE template0", name)); err != nil {
		return err
	}
	conn, err := cluster.Primary.Connect(ctx, name)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, pgxSuiteSetup)
	return err
}
