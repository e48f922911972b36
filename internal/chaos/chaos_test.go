package chaos

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/audit"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// cluster is the package's primary and streaming replica. The chaos runs
// restart its primary and pause its replay; they run one after another.
var cluster *pgtest.Cluster

func TestMain(m *testing.M) {
	os.Exit(pgtest.Run(m, pgtest.Options{Replica: true}, migrations.Prepare, &cluster))
}

var (
	binMu  sync.Mutex
	binDir string
	built  = map[string]string{}
)

// build builds pkg (with tags) once per test binary and returns its path.
func build(t *testing.T, name, pkg string, tags ...string) string {
	t.Helper()
	binMu.Lock()
	defer binMu.Unlock()
	key := name + "/" + strings.Join(tags, ",")
	if p, ok := built[key]; ok {
		return p
	}
	if binDir == "" {
		d, err := os.MkdirTemp("", "pgfence-chaos-bin-")
		if err != nil {
			t.Fatal(err)
		}
		binDir = d
	}
	out := filepath.Join(binDir, strings.ReplaceAll(key, "/", "-"))
	args := []string{"build", "-o", out}
	if len(tags) > 0 {
		args = append(args, "-tags", strings.Join(tags, ","))
	}
	cmd := exec.Command("go", append(args, pkg)...)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
	built[key] = out
	return out
}

func runChaos(t *testing.T, cfg Config) *Summary {
	t.Helper()
	cfg.Pgfence = build(t, "pgfence", "github.com/pgfence/pgfence/cmd/pgfence")
	if cfg.Self == "" {
		cfg.Self = build(t, "chaos", "github.com/pgfence/pgfence/internal/chaos/cmd")
	}
	cfg.Cluster = cluster
	cfg.Database = cluster.NewDatabase(t)
	cfg.Dir = t.TempDir()
	if d := os.Getenv("PGFENCE_CHAOS_DIR"); d != "" {
		// Keep the records and logs for a look afterwards.
		cfg.Dir = filepath.Join(d, t.Name())
	}
	cfg.Log = zaptest.NewLogger(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	sum, err := Run(ctx, cfg)
	if err != nil {
		t.Fatalf("chaos run: %v", err)
	}
	var b strings.Builder
	sum.WriteText(&b)
	t.Logf("chaos run took %s:\n%s", time.Since(start).Round(time.Millisecond), b.String())
	return sum
}

// TestChaosShort is the chaos run in make test: every fault kind at least
// once, real work done, and the checker finds nothing.
func TestChaosShort(t *testing.T) {
	sum := runChaos(t, Config{Duration: 25 * time.Second, Seed: 7, FaultGap: 1200 * time.Millisecond})
	if !sum.OK() {
		t.Errorf("got %d violations, want none", sum.Violations())
	}
	if n := sum.Outcomes[audit.OutcomeCommitted]; n == 0 {
		t.Errorf("got %d commits, want some", n)
	}
	if sum.ZombiesCommitted != 0 {
		t.Errorf("%d resumed zombies committed with their old token", sum.ZombiesCommitted)
	}
	if sum.ZombiesRefused == 0 {
		t.Errorf("got %d zombie resumptions refused (of %d zombies, %d resumed), want at least one",
			sum.ZombiesRefused, sum.Zombies, sum.ZombiesResumed)
	}
	for _, f := range AllFaults {
		if sum.Faults[f] == 0 {
			t.Errorf("fault %s was never injected", f)
		}
	}
	if sum.Reads.Recorded == 0 {
		t.Errorf("no read was recorded")
	}
	if sum.Consumer.Accepted == 0 {
		t.Errorf("the consumer accepted no event")
	}
}

// TestChaosBrokenBuildIsCaught proves that the checker can fail: workers
// built with the tag pgfence_chaos_broken skip the fence (broken.go), and
// the zombies they become after a takeover commit with stale tokens.
func TestChaosBrokenBuildIsCaught(t *testing.T) {
	self := build(t, "chaos", "github.com/pgfence/pgfence/internal/chaos/cmd", "pgfence_chaos_broken")
	sum := runChaos(t, Config{Duration: 10 * time.Second, Seed: 11, Self: self,
		Faults: []Fault{FaultZombie}, FaultGap: time.Second})
	if sum.Zombies == 0 {
		t.Fatalf("no zombie was made: the broken build was not exercised")
	}
	if sum.Report == nil || sum.Report.OK() {
		t.Fatalf("the checker reported no violation for a build that skips the fence")
	}
	if len(sum.Report.ViolationsOf(audit.CheckStaleCommit))+len(sum.Report.ViolationsOf(audit.CheckReceipts)) == 0 {
		t.Fatalf("violations reported, but none of check 1 or 2: %+v", sum.Report.Violations)
	}
}
