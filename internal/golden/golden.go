// Package golden keeps a test's expected output in a file of testdata: the
// test renders what it checks as text, and Check compares the text with
// the file, or writes the file instead when the test binary runs with
// -update (then review the diff before committing it). The classifier's
// and the planner's golden tests (rewrite, rewrite/plan) share it.
//
// It is for tests only; it knows nothing of what the text says.
package golden

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata with the tests' output instead of comparing with them")

// Update reports whether the test binary runs with -update.
func Update() bool { return *update }

// Files returns the inputs matching pattern (filepath.Glob), failing t
// when there are none: a golden test that reads no input checks nothing.
func Files(t testing.TB, pattern string) []string {
	t.Helper()
	files, err := filepath.Glob(pattern)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatalf("no golden inputs match %s", pattern)
	}
	return files
}

// Check compares got with the contents of the file at path, failing t
// with the first lines that differ; with -update it writes got to path
// instead.
func Check(t testing.TB, path, got string) {
	t.Helper()
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run the test with -update to write it, then review it)", err)
	}
	if got != string(want) {
		t.Errorf("the output differs from %s (run the test with -update and review the diff):\n%s", path, lineDiff(string(want), got))
	}
}

// lineDiff shows the first differing lines of two texts.
func lineDiff(want, got string) string {
	wl, gl := strings.Split(want, "\n"), strings.Split(got, "\n")
	var b strings.Builder
	n := 0
	for i := 0; i < len(wl) || i < len(gl); i++ {
		var w, g string
		if i < len(wl) {
			w = wl[i]
		}
		if i < len(gl) {
			g = gl[i]
		}
		if w != g {
			fmt.Fprintf(&b, "line %d:\n  got:  %s\n  want: %s\n", i+1, g, w)
			if n++; n == 10 {
				break
			}
		}
	}
	return b.String()
}
