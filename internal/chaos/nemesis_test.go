package chaos

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/pgfence/pgfence/audit"
)

// TestBetweenCommits checks the nemesis's choice of zombies: a stopped
// worker is one only between two attempts with a step still to commit,
// judged from its record file once every process of its group is stopped.
func TestBetweenCommits(t *testing.T) {
	// A runner with a child, as `pgfence run` and its worker.
	cmd := exec.Command("sh", "-c", "sleep 60 & wait")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		cmd.Wait()
	})
	sp := &slotProc{holder: "w0.1", records: filepath.Join(t.TempDir(), "w0.1.jsonl"), cmd: cmd}
	deadline := time.Now().Add(5 * time.Second)
	for len(sp.children()) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the runner's child did not start")
		}
		time.Sleep(time.Millisecond)
	}

	begun := func(step string, probe bool) Attempt {
		return Attempt{Worker: "w0.1", Step: step, Probe: probe, Began: time.Now()}
	}
	done := func(step string, probe bool, outcome string) Attempt {
		a := begun(step, probe)
		a.Outcome, a.At = outcome, time.Now()
		return a
	}
	cases := []struct {
		name  string
		steps int
		lines []Attempt
		want  bool
	}{
		{"not started yet", 1, nil, true},
		{"inside its first attempt", 2, []Attempt{begun("", false)}, false},
		{"after its only commit", 1, []Attempt{begun("", false), done("", false, audit.OutcomeCommitted)}, false},
		{"between two commits", 2, []Attempt{begun("", false), done("", false, audit.OutcomeCommitted)}, true},
		{"after a replay, a step to go", 2, []Attempt{begun("", false), done("", false, audit.OutcomeReplayed)}, true},
		{"waiting to retry after an error", 2, []Attempt{begun("", false), done("", false, audit.OutcomeError)}, false},
		{"waiting to retry after an unknown outcome", 2, []Attempt{begun("", false), done("", false, audit.OutcomeUnknown)}, false},
		{"refused: about to exit", 3, []Attempt{begun("", false), done("", false, audit.OutcomeStale)}, false},
		{"after a probe, a step to go", 2, []Attempt{
			begun("", false), done("", false, audit.OutcomeCommitted),
			begun("", true), done("", true, audit.OutcomeConflict)}, true},
		{"after a probe of its last step", 1, []Attempt{
			begun("", false), done("", false, audit.OutcomeCommitted),
			begun("", true), done("", true, audit.OutcomeConflict)}, false},
		{"a retry answered, a step to go", 2, []Attempt{
			begun("", false), done("", false, audit.OutcomeUnknown),
			begun("", false), done("", false, audit.OutcomeReplayed)}, true},
		{"inside its second step", 3, []Attempt{
			begun("", false), done("", false, audit.OutcomeCommitted), begun("s1", false)}, false},
	}

	// Running: betweenCommits waits for the stop and gives up with ctx.
	writeRecords(t, sp.records, nil)
	sp.steps = 1
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	if sp.betweenCommits(ctx) {
		t.Fatal("betweenCommits said yes for a slot that was never stopped")
	}
	cancel()

	if err := sp.signalGroup(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	for _, c := range cases {
		writeRecords(t, sp.records, c.lines)
		sp.steps = c.steps
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		got := sp.betweenCommits(ctx)
		cancel()
		if got != c.want {
			t.Errorf("%s: betweenCommits = %v, want %v", c.name, got, c.want)
		}
	}
}

func writeRecords(t *testing.T, path string, lines []Attempt) {
	t.Helper()
	var b []byte
	for _, a := range lines {
		j, err := json.Marshal(a)
		if err != nil {
			t.Fatal(err)
		}
		b = append(append(b, j...), '\n')
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}
