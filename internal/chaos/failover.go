package chaos

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/audit"
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// FailoverMode is the replication mode a run's failover fault happens
// under (docs/failover.md, "What holds, per replication mode").
type FailoverMode string

const (
	// FailoverAsync: asynchronous streaming replication, failover_mode
	// async. The replica is detached before the failover, so the promoted
	// node lacks the old primary's last takeovers and commits.
	FailoverAsync FailoverMode = "async"
	// FailoverSync: synchronous_standby_names = '*' on every node and
	// failover_mode sync: every acknowledged commit is on the replica
	// when it is promoted.
	FailoverSync FailoverMode = "sync"
)

// ParseFailoverMode parses "async" or "sync".
func ParseFailoverMode(s string) (FailoverMode, error) {
	switch m := FailoverMode(s); m {
	case FailoverAsync, FailoverSync:
		return m, nil
	}
	return "", fmt.Errorf("unknown failover mode %q (async or sync)", s)
}

// syncSettings are the postgresql.conf settings of every node in sync
// mode: the replica is a synchronous standby (commits wait for it), and
// streams again within a moment of losing its primary (a restart of the
// primary; the default is 5 s, during which every commit waits and every
// lease of the run's 5 s TTL would expire).
var syncSettings = map[string]string{"synchronous_standby_names": "'*'", "wal_retrieve_retry_interval": "'100ms'"}

// hasFailover reports whether the run injects the failover fault.
func (c *Config) hasFailover() bool {
	for _, f := range c.Faults {
		if f == FaultFailover {
			return true
		}
	}
	return false
}

// multiHostDSN is a DSN for db that lists every node and connects to the
// one that accepts writes (pgx tries them in order), so that a connection
// opened after a promotion reaches the new primary.
func multiHostDSN(db string, nodes ...*pgtest.Node) string {
	var hosts []string
	for _, n := range nodes {
		hosts = append(hosts, n.Addr())
	}
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&target_session_attrs=read-write", strings.Join(hosts, ","), db)
}

// FailoverStats is what the failover fault did, and what the workers saw
// of it.
type FailoverStats struct {
	Mode FailoverMode
	// Failed is why the failover was not made (empty: it was).
	Failed string
	// Killed is when the primary was killed; Promoted when the replica
	// accepted writes.
	Killed, Promoted time.Time
	// HeldBack is how long the replica had been detached when the primary
	// was killed (async). LostTokens and LostCommits are the tokens
	// (takeovers) and receipts (commits) the old primary had just before
	// it was killed that the new primary lacks.
	HeldBack                time.Duration
	LostTokens, LostCommits int64
	// The old primary's clock, tokens and receipts just before the kill.
	cut                   time.Time
	oldTokens, oldCommits int64
	// ZombiesAcross are zombies stopped before the primary was killed and
	// continued after the promotion; ZombiesAcrossFN15 and
	// ZombiesAcrossFN01 those refused FN015 (async: the era voids them,
	// their takeover lost or not) and FN001 (sync: the takeover survived).
	ZombiesAcross                        int
	ZombiesAcrossFN15, ZombiesAcrossFN01 int
	// Voided are runs (`pgfence run`) that learnt their generation was
	// void (FN015, from a renewal or after their command failed) and set
	// out to acquire the job again (--failover-restarts; their log says
	// so). Restarted are those that got it (their records show a second
	// token; the others found the job taken by another run, which is free
	// at once after the failover), RestartedCommitted those that committed
	// under the new token.
	Voided, Restarted, RestartedCommitted int
	// The era the promotion began (fence.eras), read at the end: every
	// token issued before it is at most TokenFloor.
	Era, Timeline    int32
	TokenFloor       int64
	Lossless, NewEra bool
	Refused          int // attempts answered FN015
	// CommittedBefore are first commits (not replays) begun after the
	// kill under a token issued before it: live holders committing on in
	// sync mode; in async mode each is an anomaly.
	CommittedBefore int
	ReadsNotChecked int // async: reads whose generation was learnt before the failover and answered after it
	// AcknowledgedLost are the commits the checker found absent and
	// explained by a lossy era (audit check 3).
	AcknowledgedLost int64
}

// failoverState is the nemesis's part of a failover.
type failoverState struct {
	done     bool      // made (or failed): only one per run
	at       time.Time // when it is due
	inFlight bool      // between the start of the fault and the promotion: zombies wait
	stats    FailoverStats
}

// failover injects FaultFailover: in async mode it detaches the replica
// (its WAL receiver stops) and lets the workload go on against the old
// primary alone until that primary has issued a token and committed
// under it (a takeover and a commit the replica will lack); in both modes
// it then kills the primary (an immediate shutdown, as a crash) and
// promotes the replica (pgtest's Cluster.Failover). Workers, the proxies
// and the harness follow through their multi-host DSNs. In sync mode the
// new primary's synchronous_standby_names is cleared at once, as Patroni
// does without a standby (fence.acquire then fails with 55000 until one is
// back). A new replica of the new primary is then made (pg_basebackup),
// and in sync mode made synchronous: the cluster is whole again, but the
// proxies do not know the new replica (their replica was the node
// promoted, which they take out of rotation), so readers read on the
// primary, and replay-pause is not injected any more.
func (n *nemesis) failover(ctx context.Context) error {
	h := n.h
	runCtx := ctx                    // a zombie lives in the run's context
	ctx = context.WithoutCancel(ctx) // once begun, the failover runs to its end
	mode := h.cfg.Failover
	h.failoverGen.Add(1)
	promoted := false
	defer func() {
		if !promoted {
			h.failoverGen.Add(1)
		}
	}()
	// The promoted node must have replayed everything it received.
	if err := n.resumeReplay(ctx); err != nil {
		return err
	}
	n.mu.Lock()
	n.fo.inFlight = true
	n.noReplica = true
	busy := n.zombie
	n.mu.Unlock()
	defer func() {
		n.mu.Lock()
		n.fo.inFlight = false
		n.mu.Unlock()
	}()
	st := &n.fo.stats // written here only, read at the end
	st.Mode = mode
	if !busy {
		// A zombie stopped now is continued only after the promotion: in
		// async mode its takeover, if any, is lost with the old primary.
		if _, err := n.startZombie(runCtx); err != nil {
			h.log.Info("failover: no zombie", zap.Error(err))
		}
	}
	var detached time.Time
	if mode == FailoverAsync {
		if err := h.c.DetachReplica(ctx); err != nil {
			return err
		}
		detached = time.Now()
		var t0 int64
		err := n.db.do(ctx, func(c *pgx.Conn) error {
			return c.QueryRow(ctx, "SELECT coalesce(max(token), 0) FROM fence.issuance").Scan(&t0)
		})
		if err != nil {
			return fmt.Errorf("failover: tokens at the detach: %w", err)
		}
		// Until the old primary alone has issued a token (a takeover) and
		// committed under it, bounded: the workload decides.
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		poll(wctx, 50*time.Millisecond, func() (bool, error) {
			var k int64
			err := n.db.do(wctx, func(c *pgx.Conn) error {
				return c.QueryRow(wctx, "SELECT count(*) FROM fence.receipts WHERE token > $1", t0).Scan(&k)
			})
			return err == nil && k >= 2, nil
		})
		cancel()
		// A moment more for the answers to reach the workers.
		sleepCtx(ctx, 200*time.Millisecond)
	}
	// Kill it while a holder (not the zombie) has a commit still to make
	// under a live lease: in async mode it must then be refused FN015 and
	// its run acquire again; in sync mode it must commit on. Bounded: the
	// workload decides.
	// In sync mode that holder is stopped (SIGSTOP, the run and its
	// worker) with two commits left until the promotion: a holder found
	// mid-work may otherwise make its last commit and release before the
	// kill (a CI run failed so), and then no holder from before the
	// failover has a commit to make after it.
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	var why []string
	var held *slotProc
	if poll(wctx, 20*time.Millisecond, func() (bool, error) {
		var mid []*slotProc
		mid, why = n.holderMidWork(wctx)
		if mode != FailoverSync {
			return len(mid) > 0, nil
		}
		for _, sp := range mid {
			if err := sp.signalGroup(syscall.SIGSTOP); err != nil {
				continue
			}
			// Two commits left: one it may be inside (made before the
			// kill, its retry is a replay) and one it begins after.
			if sp.commitsLeft(wctx) >= 2 {
				held = sp
				return true, nil
			}
			sp.signalGroup(syscall.SIGCONT)
			why = append(why, sp.holder+": fewer than two commits left")
		}
		return false, nil
	}) != nil {
		h.log.Info("failover: no holder with a commit to make", zap.Strings("candidates", why))
	}
	cancel()
	if held != nil {
		h.log.Info("failover: holder stopped until the promotion", zap.String("holder", held.holder))
		defer held.signalGroup(syscall.SIGCONT) // on an error before the promotion
	}
	err := n.db.do(ctx, func(c *pgx.Conn) error {
		return c.QueryRow(ctx, `SELECT clock_timestamp(), (SELECT count(*) FROM fence.issuance),
			(SELECT count(*) FROM fence.receipts)`).Scan(&st.cut, &st.oldTokens, &st.oldCommits)
	})
	if err != nil {
		return fmt.Errorf("failover: count before the kill: %w", err)
	}
	st.Killed = time.Now()
	if !detached.IsZero() {
		st.HeldBack = st.Killed.Sub(detached)
	}
	if err := h.c.Failover(ctx); err != nil {
		return err
	}
	st.Promoted = time.Now()
	promoted = true
	if held != nil {
		held.signalGroup(syscall.SIGCONT)
	}
	h.failoverGen.Add(1)
	h.log.Info("failover: promoted", zap.String("mode", string(mode)), zap.Duration("took", st.Promoted.Sub(st.Killed)),
		zap.Int64("lost_tokens", st.LostTokens), zap.Int64("lost_commits", st.LostCommits))
	h.count(func(s *Summary) { s.Faults[FaultFailover]++ })
	n.mu.Lock()
	n.fo.inFlight = false
	n.mu.Unlock()

	admin := func(sqls ...string) error {
		conn, err := h.c.Primary.Connect(ctx, "postgres")
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		for _, s := range sqls {
			if _, err := conn.Exec(ctx, s); err != nil {
				return fmt.Errorf("%s: %w", s, err)
			}
		}
		return nil
	}
	var opts pgtest.Options
	if mode == FailoverSync {
		// No standby: stop waiting for one (Patroni's synchronous_mode
		// without strict); acquires fail closed meanwhile (55000).
		if err := admin("ALTER SYSTEM SET synchronous_standby_names = ''", "SELECT pg_reload_conf()"); err != nil {
			return fmt.Errorf("failover: clear the synchronous standby: %w", err)
		}
		opts.Settings = syncSettings
	}
	if err := h.c.AddReplica(ctx, opts); err != nil {
		return fmt.Errorf("failover: new replica: %w", err)
	}
	if mode == FailoverSync {
		if err := admin("ALTER SYSTEM RESET synchronous_standby_names", "SELECT pg_reload_conf()"); err != nil {
			return fmt.Errorf("failover: restore the synchronous standby: %w", err)
		}
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		err := poll(wctx, 20*time.Millisecond, func() (bool, error) {
			var k int
			err := n.db.do(wctx, func(c *pgx.Conn) error {
				return c.QueryRow(wctx, "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'").Scan(&k)
			})
			return err == nil && k > 0, nil
		})
		if err != nil {
			return fmt.Errorf("failover: the new replica is not a synchronous standby: %w", err)
		}
	}
	h.log.Info("failover: new replica", zap.Duration("since_kill", time.Since(st.Killed)))
	return nil
}

// holderMidWork returns the workers, other than a stopped zombie, that
// hold a lease with more than 3/5 of its TTL left (so it outlives the kill
// and the promotion: its run learns what became of it) and have commits
// still to make; when there are none, why.
func (n *nemesis) holderMidWork(ctx context.Context) ([]*slotProc, []string) {
	n.mu.Lock()
	zombie := n.zombieHolder
	n.mu.Unlock()
	var why []string
	candidates := map[string]*slotProc{}
	for _, s := range n.h.slots {
		sp := s.current()
		if sp == nil || sp.exited() || sp.holder == zombie {
			why = append(why, fmt.Sprintf("slot %d: none or zombie", s.id))
			continue
		}
		answered := map[string]bool{}
		refused := false
		for _, a := range recordLines(sp.records, 0, false) {
			switch {
			case a.Outcome == audit.OutcomeStale || a.Outcome == audit.OutcomeExpired:
				refused = true
			case definite(a.Outcome) && !a.Probe:
				answered[a.Step] = true
			}
		}
		if refused || len(answered) >= sp.steps {
			why = append(why, fmt.Sprintf("%s: refused %v, %d of %d steps", sp.holder, refused, len(answered), sp.steps))
			continue
		}
		candidates[sp.holder] = sp
	}
	if len(candidates) == 0 {
		return nil, why
	}
	// A lease renewed on time has at least two thirds of its TTL left.
	minLeft := n.h.cfg.TTL * 3 / 5
	var live []string
	err := n.db.do(ctx, func(c *pgx.Conn) error {
		rows, err := c.Query(ctx, `SELECT holder FROM fence.leases WHERE expires_at > clock_timestamp() + make_interval(secs => $1)`,
			minLeft.Seconds())
		if err != nil {
			return err
		}
		live, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	var mid []*slotProc
	for _, l := range live {
		if sp := candidates[l]; sp != nil {
			mid = append(mid, sp)
		}
	}
	if len(mid) > 0 {
		return mid, nil
	}
	return nil, append(why, fmt.Sprintf("candidates %v, leases with %s left %v (%v)", candidates, minLeft, live, err))
}

// voidedLog begins the warning `pgfence run` logs when it acquires the
// lease again after FN015 (internal/runner, logRestart).
const voidedLog = "failover: the lease's generation is void (FN015) and the job is free; acquiring the lease again"

// failoverStats completes the failover's figures from the records and the
// new primary's eras, and reports what must not happen as anomalies: in
// async mode a commit begun after the kill under a generation issued
// before it (the era voids them: the fence failed) or a promotion that
// began no lossy era; in sync mode any FN015 or a lossy era.
func (h *harness) failoverStats(ctx context.Context, conn *pgx.Conn, attempts []Attempt, rep *audit.Report) error {
	st := h.sum.Failover
	if st == nil || st.Failed != "" {
		return nil
	}
	// The era is made by the first transaction on the new timeline that
	// checks a generation; when the run ended before any did (a slow new
	// replica in sync mode holds every acquire back), make it now.
	if _, err := conn.Exec(ctx, "SELECT fence.current_era()"); err != nil {
		return fmt.Errorf("current era: %w", err)
	}
	var eras int
	err := conn.QueryRow(ctx, `SELECT e.era, e.timeline, e.token_floor, e.lossless, (SELECT count(*) FROM fence.eras)
		FROM fence.eras e ORDER BY e.era DESC LIMIT 1`).Scan(&st.Era, &st.Timeline, &st.TokenFloor, &st.Lossless, &eras)
	if err != nil {
		return fmt.Errorf("eras: %w", err)
	}
	st.NewEra = eras > 1 && st.Timeline > 1
	var keptTokens, keptCommits int64
	err = conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM fence.issuance WHERE issued_at <= $1),
		(SELECT count(*) FROM fence.receipts WHERE committed_at <= $1)`, st.cut).Scan(&keptTokens, &keptCommits)
	if err != nil {
		return fmt.Errorf("kept: %w", err)
	}
	st.LostTokens, st.LostCommits = max(0, st.oldTokens-keptTokens), max(0, st.oldCommits-keptCommits)
	tokens := map[string][]int64{} // holder → tokens, in order
	for _, a := range attempts {
		if ts := tokens[a.Worker]; len(ts) == 0 || ts[len(ts)-1] != a.Token {
			tokens[a.Worker] = append(ts, a.Token)
		}
		if a.Code == fence.CodeFailover {
			st.Refused++
		}
		if a.Outcome == audit.OutcomeCommitted && !a.Began.Before(st.Killed) && a.Token <= st.TokenFloor {
			st.CommittedBefore++
			if st.Mode == FailoverAsync {
				h.sum.Anomalies = append(h.sum.Anomalies, fmt.Sprintf("worker %s: job %s token %d step %q, issued before the asynchronous failover, committed after it (began %s, the primary killed at %s)",
					a.Worker, a.Job, a.Token, a.Step, a.Began.Format(time.RFC3339Nano), st.Killed.Format(time.RFC3339Nano)))
			}
		}
	}
	// A holder (one pgfence run) with two tokens acquired again after
	// FN015: nothing else makes a run acquire twice.
	again := map[string]bool{}
	for _, a := range attempts {
		if ts := tokens[a.Worker]; len(ts) > 1 && a.Token > ts[0] && a.Outcome == audit.OutcomeCommitted {
			again[a.Worker] = true
		}
	}
	for _, ts := range tokens {
		if len(ts) > 1 {
			st.Restarted++
		}
	}
	st.RestartedCommitted = len(again)
	logs, _ := filepath.Glob(filepath.Join(h.cfg.Dir, "slot*.log"))
	for _, name := range logs {
		b, err := os.ReadFile(name)
		if err != nil {
			return err
		}
		st.Voided += bytes.Count(b, []byte(voidedLog))
	}
	if rep != nil {
		st.AcknowledgedLost = rep.Counts["acknowledged commits lost in an asynchronous failover"]
	}
	bad := func(format string, args ...any) {
		h.sum.Anomalies = append(h.sum.Anomalies, fmt.Sprintf(format, args...))
	}
	switch st.Mode {
	case FailoverAsync:
		if !st.NewEra || st.Lossless {
			bad("the asynchronous failover began no lossy era (era %d, timeline %d, lossless %v)", st.Era, st.Timeline, st.Lossless)
		}
	case FailoverSync:
		if !st.NewEra || !st.Lossless {
			bad("the synchronous failover began no lossless era (era %d, timeline %d, lossless %v)", st.Era, st.Timeline, st.Lossless)
		}
		if st.Refused > 0 || st.Voided > 0 {
			bad("after a synchronous failover, which voids no generation, %d attempts were refused FN015 and %d runs found their generation void", st.Refused, st.Voided)
		}
	}
	return nil
}

// writeText adds the failover's lines to the summary.
func (st *FailoverStats) writeText(p func(format string, args ...any)) {
	if st.Failed != "" {
		p("failover (%s): not made: %s\n", st.Mode, st.Failed)
		return
	}
	p("failover (%s): primary killed at %s, replica promoted in %s", st.Mode,
		st.Killed.UTC().Format("15:04:05.000"), st.Promoted.Sub(st.Killed).Round(time.Millisecond))
	if st.Mode == FailoverAsync {
		p(", after %s with the replica detached", st.HeldBack.Round(time.Millisecond))
	}
	p("; the new primary lacks %d tokens and %d commits of the old one", st.LostTokens, st.LostCommits)
	lossy := "lossy"
	if st.Lossless {
		lossy = "lossless"
	}
	p("\n  era %d (timeline %d, %s); attempts answered FN015 %d; runs that learnt FN015 and acquired again %d (got the job %d, committed under the new token %d); first commits after the kill under a generation from before it %d",
		st.Era, st.Timeline, lossy, st.Refused, st.Voided, st.Restarted, st.RestartedCommitted, st.CommittedBefore)
	if st.Mode == FailoverAsync {
		p(" (must be 0)")
	}
	p("\n  acknowledged commits lost (explained by the era) %d; zombies across the failover %d (refused FN015 %d, FN001 %d); reads across it not checked %d\n",
		st.AcknowledgedLost, st.ZombiesAcross, st.ZombiesAcrossFN15, st.ZombiesAcrossFN01, st.ReadsNotChecked)
}
