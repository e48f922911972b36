package chaos

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/audit"
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// Fault is a kind of fault the nemesis injects.
type Fault string

const (
	// FaultZombie stops a worker and its `pgfence run` (SIGSTOP) until its
	// lease expired and another worker took the job over, then continues
	// the worker alone, which tries to commit with its old token, and
	// then its runner, which finds the lease lost and stops the worker.
	FaultZombie Fault = "zombie"
	// FaultProxyKill kills a `pgfence serve` with SIGKILL and starts it
	// again on the same address.
	FaultProxyKill Fault = "proxy-kill"
	// FaultTerminate runs pg_terminate_backend on workers' connections.
	FaultTerminate Fault = "terminate-backend"
	// FaultCutCommit cuts a worker's connection after its COMMIT reached
	// the proxy and before the answer came back (a lost commit response).
	FaultCutCommit Fault = "cut-commit"
	// FaultReplayPause pauses WAL replay on the replica, and resumes it
	// one to four seconds later.
	FaultReplayPause Fault = "replay-pause"
	// FaultPrimaryRestart restarts the primary with a fast shutdown
	// (pg_ctl restart -m fast): every session and transaction is ended.
	FaultPrimaryRestart Fault = "primary-restart"
	// FaultFailover kills the primary (immediate shutdown) and promotes
	// the replica, once per run, between 35% and 55% of its duration, in
	// the run's FailoverMode: in async mode after the replica was detached
	// long enough to lack a takeover and commits of the old primary. See
	// nemesis.failover. It is not in AllFaults: a run has it only when
	// asked (Config.Faults or Config.Failover), since it ends the cluster
	// as it was (the proxies lose their replica).
	FaultFailover Fault = "failover"
)

// AllFaults is every fault kind a run injects by default, in the order
// the summary prints them.
var AllFaults = []Fault{FaultZombie, FaultProxyKill, FaultTerminate, FaultCutCommit, FaultReplayPause, FaultPrimaryRestart}

// KnownFaults is every fault kind: AllFaults and FaultFailover.
var KnownFaults = append(append([]Fault{}, AllFaults...), FaultFailover)

// ParseFaults parses a comma-separated list of fault kinds.
func ParseFaults(s string) ([]Fault, error) {
	var out []Fault
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		ok := false
		for _, k := range KnownFaults {
			if Fault(f) == k {
				out, ok = append(out, k), true
			}
		}
		if !ok {
			return nil, fmt.Errorf("unknown fault %q (kinds: %v)", f, KnownFaults)
		}
	}
	return out, nil
}

// nemesis injects faults on a seeded schedule: the kinds in a shuffled
// rotation (so that each kind comes once in every len(Faults) faults; the
// first is a zombie),
// separated by random gaps. A fault that cannot be injected at its turn
// (no worker holds a lease, no worker is connected) is tried again at the
// next turn and is not counted.
type nemesis struct {
	h   *harness
	db  *db
	rng *rand.Rand

	wg           sync.WaitGroup
	mu           sync.Mutex
	zombie       bool          // a zombie is in progress
	zombieHolder string        // its holder
	paused       bool          // replay is paused
	noReplica    bool          // after the failover: the proxies have no replica, replay is not paused
	fo           failoverState // FaultFailover
	zombies      []zombieEvent // with their outcome known
	failures     []string
}

type zombieEvent struct {
	holder  string
	job     string
	token   int64
	stopped time.Time
	resumed time.Time // zero: no worker process to continue
}

func (n *nemesis) run(ctx context.Context) {
	defer n.wg.Wait()
	var kinds []Fault
	for _, f := range n.h.cfg.Faults {
		if f == FaultFailover {
			// Once, at its time, not in the rotation.
			d := n.h.cfg.Duration
			n.fo.at = time.Now().Add(d*35/100 + time.Duration(n.rng.Int64N(int64(d)/5+1)))
			continue
		}
		kinds = append(kinds, f)
	}
	if len(kinds) == 0 {
		kinds = []Fault{FaultZombie}
	}
	var queue []Fault
	gap := n.h.cfg.FaultGap
	first := true
	for {
		sleepCtx(ctx, gap/2+time.Duration(n.rng.Int64N(int64(gap)+1)))
		if ctx.Err() != nil {
			return
		}
		if !n.fo.at.IsZero() && !n.fo.done && !time.Now().Before(n.fo.at) {
			n.fo.done = true
			if err := n.failover(ctx); err != nil {
				n.h.log.Warn("failover failed", zap.Error(err))
				n.mu.Lock()
				n.fo.stats.Failed = err.Error()
				n.failures = append(n.failures, fmt.Sprintf("%s: %v", FaultFailover, err))
				n.mu.Unlock()
			}
			// The proxies have no replica any more.
			kinds = slices.DeleteFunc(kinds, func(f Fault) bool { return f == FaultReplayPause })
			queue = slices.DeleteFunc(queue, func(f Fault) bool { return f == FaultReplayPause })
			if len(kinds) == 0 {
				kinds = []Fault{FaultZombie}
			}
			continue
		}
		if len(queue) == 0 {
			queue = append([]Fault{}, kinds...)
			n.rng.Shuffle(len(queue), func(i, j int) { queue[i], queue[j] = queue[j], queue[i] })
			if first {
				// The run opens with a zombie, the fault it exists for: a
				// zombie needs a takeover while workers still compete, so
				// one started near the end of a short run may find none.
				if i := slices.Index(queue, FaultZombie); i > 0 {
					queue[0], queue[i] = queue[i], queue[0]
				}
				first = false
			}
		}
		f := queue[0]
		ok, err := n.inject(ctx, f)
		if err != nil && ctx.Err() == nil {
			n.h.log.Warn("fault failed", zap.String("fault", string(f)), zap.Error(err))
			n.mu.Lock()
			n.failures = append(n.failures, fmt.Sprintf("%s: %v", f, err))
			n.mu.Unlock()
		}
		queue = queue[1:]
		if !ok {
			// Its turn comes again after the others.
			queue = append(queue, f)
		}
	}
}

// inject injects one fault; ok means it was injected (or, for the
// asynchronous ones, started).
func (n *nemesis) inject(ctx context.Context, f Fault) (bool, error) {
	h := n.h
	switch f {
	case FaultZombie:
		return n.startZombie(ctx)
	case FaultProxyKill:
		p := h.proxies[n.rng.IntN(len(h.proxies))]
		p.kill()
		h.count(func(s *Summary) { s.Faults[f]++ })
		// Stays down for a moment, long enough for clients to notice.
		sleepCtx(ctx, time.Duration(100+n.rng.IntN(400))*time.Millisecond)
		return true, p.start(context.WithoutCancel(ctx))
	case FaultTerminate:
		var k int
		err := n.db.do(ctx, func(c *pgx.Conn) error {
			return c.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM (
			SELECT pid FROM pg_stat_activity
			 WHERE datname = current_database() AND application_name = 'chaos-worker' AND pid <> pg_backend_pid()
			 ORDER BY random() LIMIT $1) w`, 1+n.rng.IntN(3)).Scan(&k)
		})
		if err != nil || k == 0 {
			return false, err
		}
		h.count(func(s *Summary) { s.Faults[f]++ })
		return true, nil
	case FaultCutCommit:
		s := h.slots[n.rng.IntN(len(h.slots))]
		s.armed.Store(true)
		t := time.NewTimer(3 * time.Second)
		defer t.Stop()
		select {
		case <-s.relay.Fired():
			h.count(func(s *Summary) { s.Faults[f]++ })
			return true, nil
		case <-t.C:
		case <-ctx.Done():
		}
		if !s.armed.CompareAndSwap(true, false) {
			// Fired just now.
			<-s.relay.Fired()
			h.count(func(s *Summary) { s.Faults[f]++ })
			return true, nil
		}
		return false, nil
	case FaultReplayPause:
		n.mu.Lock()
		if n.paused || n.noReplica {
			n.mu.Unlock()
			return false, nil
		}
		n.paused = true
		n.mu.Unlock()
		if err := h.c.PauseReplay(ctx); err != nil {
			n.mu.Lock()
			n.paused = false
			n.mu.Unlock()
			return false, err
		}
		h.count(func(s *Summary) { s.Faults[f]++ })
		d := time.Second + time.Duration(n.rng.Int64N(int64(3*time.Second)))
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			sleepCtx(ctx, d)
			n.resumeReplay(context.WithoutCancel(ctx))
		}()
		return true, nil
	case FaultPrimaryRestart:
		if err := h.c.Primary.Restart(context.WithoutCancel(ctx)); err != nil {
			return false, err
		}
		h.count(func(s *Summary) { s.Faults[f]++ })
		return true, nil
	}
	return false, fmt.Errorf("unknown fault %q", f)
}

func (n *nemesis) resumeReplay(ctx context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.paused {
		return nil
	}
	if err := n.h.c.ResumeReplay(ctx); err != nil {
		return err
	}
	n.paused = false
	return nil
}

// heal undoes what the nemesis left broken at the end of the run: replay
// paused, a proxy down (every proxy must answer for the readers' last
// reads to have been possible; they are stopped right after).
func (n *nemesis) heal(ctx context.Context) error {
	n.wg.Wait()
	return n.resumeReplay(ctx)
}

// startZombie stops a worker holding a live lease, with its runner, and
// continues it in the background once another worker took the job over.
// It waits up to three seconds for such a worker.
func (n *nemesis) startZombie(ctx context.Context) (bool, error) {
	n.mu.Lock()
	busy := n.zombie
	n.mu.Unlock()
	if busy {
		return false, nil
	}
	wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	started := false
	err := poll(wctx, 50*time.Millisecond, func() (bool, error) {
		started = n.tryZombie(ctx, wctx)
		return started, nil
	})
	if !started && wctx.Err() != nil {
		return false, nil
	}
	return started, err
}

// tryZombie stops a worker if one holds a live lease; its zombie lives on
// in ctx, the run's.
func (n *nemesis) tryZombie(ctx, probe context.Context) bool {
	h := n.h
	for _, i := range n.rng.Perm(len(h.slots)) {
		sp := h.slots[i].current()
		if sp == nil || sp.exited() || len(sp.children()) == 0 {
			continue
		}
		var job string
		var token int64
		err := n.db.do(probe, func(c *pgx.Conn) error {
			return c.QueryRow(probe, `SELECT job_key, token FROM fence.leases
				WHERE holder = $1 AND expires_at > clock_timestamp()`, sp.holder).Scan(&job, &token)
		})
		if err != nil {
			n.h.log.Debug("zombie candidate without a live lease", zap.String("holder", sp.holder), zap.Error(err))
			continue
		}
		if err := sp.signalGroup(syscall.SIGSTOP); err != nil {
			continue
		}
		if !sp.betweenCommits(probe) {
			// Stopped inside an attempt, or with its commits all made: its
			// commit may land before the takeover (legitimately) and it
			// may never try again, so it would show nothing about the
			// fence. Another worker, or another turn.
			sp.signalGroup(syscall.SIGCONT)
			continue
		}
		n.h.log.Info("zombie: stopped", zap.String("holder", sp.holder), zap.String("job", job), zap.Int64("token", token))
		n.mu.Lock()
		n.zombie, n.zombieHolder = true, sp.holder
		n.mu.Unlock()
		n.wg.Add(1)
		stoppedAt := time.Now()
		go func() {
			defer n.wg.Done()
			n.zombieLife(ctx, sp, zombieEvent{holder: sp.holder, job: job, token: token, stopped: stoppedAt})
		}()
		return true
	}
	return false
}

func (n *nemesis) zombieLife(ctx context.Context, sp *slotProc, z zombieEvent) {
	h := n.h
	defer func() {
		sp.signalGroup(syscall.SIGCONT)
		n.mu.Lock()
		n.zombie, n.zombieHolder = false, ""
		n.mu.Unlock()
	}()
	// Past its lease: until the job's fence has moved on (another worker
	// took over), unless the workload ends first. Bounded, in case no one
	// wants the job. Never while a failover is under way: a zombie
	// stopped before the primary is killed is continued after the
	// promotion, once the new primary's fence has moved on.
	tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	err := poll(tctx, 20*time.Millisecond, func() (bool, error) {
		n.mu.Lock()
		failing := n.fo.inFlight
		n.mu.Unlock()
		if failing {
			return false, nil
		}
		var max int64
		err := n.db.do(tctx, func(c *pgx.Conn) error {
			return c.QueryRow(tctx, "SELECT max_issued_token FROM fence.fences WHERE job_key = $1", z.job).Scan(&max)
		})
		return err == nil && max > z.token, nil
	})
	if err != nil {
		h.log.Info("zombie: no takeover", zap.String("holder", z.holder), zap.Error(err))
		return
	}
	// Continue the worker alone: its runner, still stopped, cannot stop
	// it. Then wait until it has recorded a definite answer, or exited;
	// this part runs to its end even when the workload ends meanwhile.
	wctx, cancel2 := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel2()
	kids := sp.children()
	size := fileSize(sp.records)
	z.resumed = time.Now()
	h.log.Info("zombie: continued after the takeover", zap.String("holder", z.holder))
	for _, pid := range kids {
		syscall.Kill(pid, syscall.SIGCONT)
	}
	if len(kids) > 0 {
		// Until its first definite answer (a connection error is retried).
		poll(wctx, 10*time.Millisecond, func() (bool, error) {
			for _, a := range recordLines(sp.records, size, false) {
				if definite(a.Outcome) {
					return true, nil
				}
			}
			return !alive(kids[0]), nil
		})
	} else {
		z.resumed = time.Time{}
	}
	n.mu.Lock()
	n.zombies = append(n.zombies, z)
	n.mu.Unlock()
	h.count(func(s *Summary) { s.Faults[FaultZombie]++; s.Zombies++ })
}

// zombieStats counts, from the records, the zombies that tried to commit
// again after they were continued, and those that were refused.
func (n *nemesis) zombieStats(attempts []Attempt) {
	n.mu.Lock()
	defer n.mu.Unlock()
	s := n.h.sum
	for _, z := range n.zombies {
		if z.resumed.IsZero() {
			continue
		}
		tried, refused, committed := false, false, false
		refusedCode := ""
		for _, a := range attempts {
			// Only attempts begun once it was continued: the worker was
			// stopped between attempts (betweenCommits), so any attempt of
			// its token that commits now commits past the takeover.
			if a.Worker != z.holder || a.Token != z.token || a.Began.Before(z.resumed) {
				continue
			}
			tried = true
			switch a.Outcome {
			case audit.OutcomeStale:
				refused = true
				if refusedCode == "" {
					refusedCode = a.Code
				}
			case audit.OutcomeCommitted:
				committed = true
			}
		}
		if tried {
			s.ZombiesResumed++
		}
		switch {
		case committed:
			// The fence failed: a stopped holder committed with its old
			// token after another took the job over.
			s.ZombiesCommitted++
			s.Anomalies = append(s.Anomalies, fmt.Sprintf("zombie %s of job %s committed with token %d after it was resumed at %s, past the takeover",
				z.holder, z.job, z.token, z.resumed.Format(time.RFC3339Nano)))
		case refused:
			s.ZombiesRefused++
		case tried:
			s.ZombiesFaulted++
		}
		if fo := &n.fo.stats; !fo.Killed.IsZero() && z.stopped.Before(fo.Killed) && z.resumed.After(fo.Promoted) {
			fo.ZombiesAcross++
			switch {
			case refused && refusedCode == fence.CodeFailover:
				fo.ZombiesAcrossFN15++
			case refused && refusedCode == fence.CodeStale:
				fo.ZombiesAcrossFN01++
			}
		}
	}
	s.FaultErrors = append(s.FaultErrors, n.failures...)
}

// definite reports whether outcome is an answer the worker does not retry.
func definite(outcome string) bool {
	return outcome != "" && outcome != audit.OutcomeError && outcome != audit.OutcomeUnknown
}

// betweenCommits waits until every process of the stopped slot is stopped
// and reports whether its worker is between two attempts with a commit
// still to make: its last record line is a definite answer (or it has not
// started), it was not refused, and it has fewer steps answered than it
// makes. A worker stopped there begins its next attempt only once
// continued, after the takeover, where it must be refused.
func (sp *slotProc) betweenCommits(ctx context.Context) bool {
	lines, ok := sp.stoppedRecords(ctx)
	if !ok {
		return false
	}
	if n := len(lines); n > 0 && !definite(lines[n-1].Outcome) {
		return false
	}
	return sp.left(lines) > 0
}

// commitsLeft waits until every process of the stopped slot is stopped and
// reports how many steps its worker has still to commit, counting one it
// may be inside (its commit may have been made: that step's retry is a
// replay), or -1 when it was refused.
func (sp *slotProc) commitsLeft(ctx context.Context) int {
	lines, ok := sp.stoppedRecords(ctx)
	if !ok {
		return -1
	}
	return sp.left(lines)
}

// stoppedRecords waits until every process of the stopped slot is
// stopped and returns its worker's record lines.
func (sp *slotProc) stoppedRecords(ctx context.Context) ([]Attempt, bool) {
	pids := append([]int{sp.cmd.Process.Pid}, sp.children()...)
	if poll(ctx, time.Millisecond, func() (bool, error) { return stopped(pids), nil }) != nil {
		return nil, false
	}
	return recordLines(sp.records, 0, true), true
}

// left is how many steps the worker of lines has not had a definite
// answer for, or -1 when it was refused (stale or expired).
func (sp *slotProc) left(lines []Attempt) int {
	answered := map[string]bool{}
	for _, a := range lines {
		switch {
		case a.Outcome == audit.OutcomeStale || a.Outcome == audit.OutcomeExpired:
			return -1
		case definite(a.Outcome) && !a.Probe:
			answered[a.Step] = true
		}
	}
	return sp.steps - len(answered)
}

// stopped reports whether every thread of every live pid is stopped.
func stopped(pids []int) bool {
	for _, pid := range pids {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
		for _, t := range tasks {
			b, err := os.ReadFile(t)
			if err != nil {
				continue // gone
			}
			i := bytes.LastIndexByte(b, ')')
			if i < 0 || i+2 >= len(b) {
				continue
			}
			switch b[i+2] {
			case 'T', 't', 'Z', 'X':
			default:
				return false
			}
		}
	}
	return true
}

// recordLines reads the lines of path from byte offset on, with the
// markers written before each attempt if markers is set.
func recordLines(path string, offset int64, markers bool) []Attempt {
	b, err := os.ReadFile(path)
	if err != nil || int64(len(b)) <= offset {
		return nil
	}
	return parseRecords(b[offset:], markers)
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// alive reports whether pid runs (an exited child its stopped parent has
// not reaped yet is not alive).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := strings.LastIndexByte(string(b), ')')
	return i > 0 && i+2 < len(b) && b[i+2] != 'Z'
}

// poll calls cond every interval until it is true or ctx ends.
func poll(ctx context.Context, interval time.Duration, cond func() (bool, error)) error {
	return pgtest.PollEvery(ctx, interval, cond)
}
