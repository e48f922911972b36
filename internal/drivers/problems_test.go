//go:build drivers

package drivers

import (
	"strings"
	"testing"
)

// TestMatrixProblems checks the matrix's verdicts on made-up results: what
// must fail it does, known failures do not, and a known failure that
// passes does.
func TestMatrixProblems(t *testing.T) {
	m := newMatrix()
	add := func(variant, check, direct, proxy string) {
		if direct != "" {
			m.add("direct", result{Variant: variant, Check: check, Status: direct})
		}
		if proxy != "" {
			m.add("proxy", result{Variant: variant, Check: check, Status: proxy})
		}
	}
	add("a", "connect", "ok", "ok")
	add("a", "fence_replay", "n/a", "ok")
	add("a", "regressed", "ok", "fail")
	add("a", "broken", "fail", "fail")
	add("a", "known", "ok", "fail")
	add("a", "fixed", "ok", "ok")
	add("a", "wild", "ok", "fail")
	add("b", "wild", "ok", "ok")
	add("a", "lost", "ok", "")
	add("a", "dodged", "ok", "n/a")
	known := map[string]string{
		"a/known":   "a reason",
		"a/fixed":   "fixed since",
		"*/wild":    "every variant",
		"a/unknown": "never run",
	}
	got := strings.Join(m.problems(known), "\n")
	for _, want := range []string{
		"a/regressed: passes straight to PostgreSQL, fails through the proxy",
		"a/broken: fails straight to PostgreSQL (the check is broken)",
		"a/fixed: listed in knownProxyFailures as a/fixed",
		"b/wild: listed in knownProxyFailures as */wild",
		"a/lost: not run through the proxy",
		"a/dodged: ok straight to PostgreSQL but n/a through the proxy",
		"knownProxyFailures lists a/unknown, which no driver ran",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("problems lack %q:\n%s", want, got)
		}
	}
	for _, never := range []string{"a/connect", "a/fence_replay", "a/known", "a/wild"} {
		if strings.Contains(got, never+":") {
			t.Errorf("problems name %s, which is fine:\n%s", never, got)
		}
	}
	if n := len(m.problems(known)); n != 7 {
		t.Errorf("got %d problems, want 7:\n%s", n, got)
	}
}
