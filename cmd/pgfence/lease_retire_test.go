package main

import (
	"strings"
	"testing"
)

// TestLeaseRetire: retire of a live lease needs the holder's token or
// --force; a stale token exits 76 (issue 17 §5).
func TestLeaseRetire(t *testing.T) {
	db := cluster.NewDatabase(t)
	dsn := cluster.Primary.DSN(db)
	acquire := func(holder string) map[string]string {
		return kv(t, mustRun(t, "lease", "acquire", "--database", dsn, "--job", "report", "--holder", holder, "--ttl", "1m"))
	}
	a := acquire("alice")
	_, err := pgfence(t, "lease", "retire", "--database", dsn, "--job", "report")
	wantExit(t, err, exitTempFail)
	if !strings.Contains(err.Error(), "--force") {
		t.Fatalf("retire of a live lease: %v, want a hint at --force", err)
	}
	// The holder ends its own job with its token.
	if out := mustRun(t, "lease", "retire", "--database", dsn, "--job", "report", "--token", a["token"]); !strings.Contains(out, "retired=true") {
		t.Fatalf("retire --token: %q", out)
	}
	b := acquire("bob")
	_, err = pgfence(t, "lease", "retire", "--database", dsn, "--job", "report", "--token", a["token"])
	wantExit(t, err, exitLeaseLost)
	if out := mustRun(t, "lease", "retire", "--database", dsn, "--job", "report", "--force"); !strings.Contains(out, "retired=true") {
		t.Fatalf("retire --force: %q", out)
	}
	_, err = pgfence(t, "lease", "renew", "--database", dsn, "--job", "report", "--token", b["token"])
	if err == nil {
		t.Fatal("renew after a forced retire succeeded")
	}
}
