//go:build drivers

package drivers

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"
)

// knownNodeSuiteFailures are node-postgres test files that pass straight
// to PostgreSQL and fail through the proxy, file → why (as
// knownPgxSuiteFailures).
var knownNodeSuiteFailures = map[string]string{}

// flakyNodeSuiteFiles are test files whose outcome through the proxy
// depends on timing, file → why: they are run and reported, not compared.
var flakyNodeSuiteFiles = map[string]string{
	// client.connect(); client.end() at once can put node-postgres's
	// Terminate ("X\0\0\0\4") on the wire before its startup packet.
	// PostgreSQL reads it as a startup packet of length 0x58000000 and
	// closes the connection without a word (ProcessStartupPacket reports
	// "invalid length of startup packet" as COMMERROR: to the log only).
	// The proxy answers an ErrorResponse (08P01 "invalid startup packet
	// length 1476395008", proxy/startup.go:51 through Server.refuse), which
	// the client emits as an unhandled 'error' when it arrives before the
	// socket is gone.
	"test/integration/client/quick-disconnect-tests.js": "an invalid startup packet gets an ErrorResponse where PostgreSQL sends nothing (proxy/startup.go:51)",
}

// nodeFileResult is one integration test file: node-postgres's suite runs
// a file's tests in order and stops at the first failure.
type nodeFileResult struct {
	ok     bool
	passed int // tests marked ✔
	out    string
}

// nodeSuiteCopy copies packages/pg of the node-postgres checkout at root
// to a temporary directory, with the modules its tests need
// (nodesuite/package-lock.json) installed beside it.
func nodeSuiteCopy(t *testing.T, root string) string {
	t.Helper()
	pkg := filepath.Join(root, "packages", "pg")
	if _, err := os.Stat(filepath.Join(pkg, "test", "integration")); err != nil {
		t.Fatalf("NODE_PG_SRC=%s is not a node-postgres checkout (no packages/pg/test/integration): %v", root, err)
	}
	dir := t.TempDir()
	for _, f := range []string{"package.json", "package-lock.json"} {
		b, err := os.ReadFile(filepath.Join("nodesuite", f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	npm := exec.Command("npm", "ci", "--no-audit", "--no-fund", "--loglevel=error")
	npm.Dir = dir
	if out, err := npm.CombinedOutput(); err != nil {
		t.Fatalf("npm ci: %v\n%s", err, out)
	}
	// Node resolves the tests' modules from dir/node_modules, a level up.
	if out, err := exec.Command("cp", "-R", pkg, filepath.Join(dir, "pg")).CombinedOutput(); err != nil {
		t.Fatalf("copy %s: %v\n%s", pkg, err, out)
	}
	return filepath.Join(dir, "pg")
}

// TestNodePgSuite runs node-postgres's own integration tests
// (packages/pg/test/integration; the npm package ships no tests) straight
// to PostgreSQL and through pgfence serve. NODE_PG_SRC names a checkout of
// github.com/brianc/node-postgres; see docs/compatibility.md.
func TestNodePgSuite(t *testing.T) {
	root := os.Getenv("NODE_PG_SRC")
	if root == "" {
		t.Fatal("set NODE_PG_SRC to a checkout of github.com/brianc/node-postgres (docs/compatibility.md)")
	}
	src := nodeSuiteCopy(t, root)
	var files []string
	err := filepath.Walk(filepath.Join(src, "test", "integration"), func(path string, fi os.FileInfo, err error) error {
		if err == nil && strings.HasSuffix(path, "-tests.js") {
			rel, _ := filepath.Rel(src, path)
			files = append(files, rel)
		}
		return err
	})
	if err != nil || len(files) == 0 {
		t.Fatalf("no test files under %s/test/integration: %v", src, err)
	}
	sort.Strings(files)
	srv := startServe(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()

	// One run after the other: some tests cancel or terminate every
	// backend whose query looks like theirs, the other run's too.
	results := map[string]map[string]nodeFileResult{}
	took := map[string]time.Duration{}
	for _, name := range []string{"direct", "proxy"} {
		db := "node_pg_" + name
		if err := createPgxDatabase(ctx, db); err != nil { // extensions do no harm
			t.Fatal(err)
		}
		port := cluster.Primary.Port
		if name == "proxy" {
			port = srv.Port
		}
		tg := target{Name: name, Port: port, Database: db}
		func() {
			start := time.Now()
			res := map[string]nodeFileResult{}
			for _, f := range files {
				fctx, fcancel := context.WithTimeout(ctx, 2*time.Minute)
				cmd := exec.CommandContext(fctx, "node", f)
				cmd.Dir = src
				cmd.Env = tg.Env()
				out, err := cmd.CombinedOutput()
				fcancel()
				res[f] = nodeFileResult{ok: err == nil, passed: strings.Count(string(out), "✔"), out: string(out)}
			}
			results[name], took[name] = res, time.Since(start)
		}()
	}
	d, p := results["direct"], results["proxy"]
	count := func(r map[string]nodeFileResult) (files, tests int) {
		for _, x := range r {
			if x.ok {
				files++
			}
			tests += x.passed
		}
		return
	}
	df, dt := count(d)
	pf, pt := count(p)
	var broken, known []string
	for _, f := range files {
		reason, isKnown := knownNodeSuiteFailures[f]
		switch {
		case !d[f].ok:
			continue
		case flakyNodeSuiteFiles[f] != "":
			t.Logf("%s (timing-dependent through the proxy, not compared: %s): %s through the proxy", f, flakyNodeSuiteFiles[f], map[bool]string{true: "passed", false: "failed"}[p[f].ok])
		case p[f].ok && isKnown:
			t.Errorf("%s: listed in knownNodeSuiteFailures (%s) but passes through the proxy: remove it", f, reason)
		case !p[f].ok && isKnown:
			known = append(known, f)
		case !p[f].ok:
			broken = append(broken, fmt.Sprintf("%s: passes direct (%d tests), fails through the proxy after %d:\n%s", f, d[f].passed, p[f].passed, lastLines(p[f].out, 20)))
		}
	}
	fmt.Printf("\nnode-postgres's integration tests: %d of %d files pass straight to PostgreSQL (%d tests), %d through pgfence serve (%d tests); %d known proxy failures, %d unexpected. Took %s direct, %s through the proxy.\n",
		df, len(files), dt, pf, pt, len(known), len(broken), took["direct"].Round(time.Second), took["proxy"].Round(time.Second))
	for f, x := range d {
		if !x.ok {
			t.Logf("fails direct (not compared): %s\n%s", f, lastLines(x.out, 6))
		}
	}
	for _, s := range broken {
		t.Error(s)
	}
}
