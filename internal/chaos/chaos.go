package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/audit"
	"github.com/pgfence/pgfence/internal/cutrelay"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// Config describes one chaos run. Zero values take the documented
// defaults.
type Config struct {
	// Duration is how long workers run and the nemesis injects faults.
	// Zero means 5 minutes.
	Duration time.Duration
	// Seed drives every random choice of the harness (job picks, fault
	// schedule, worker payloads). Zero means a seed from the clock; the
	// summary prints the seed used.
	Seed uint64
	// Workers is the number of worker slots, each running one `pgfence
	// run` after another. Zero means 6.
	Workers int
	// Jobs is the number of job keys the workers compete for. Zero means 3.
	Jobs int
	// Readers is the number of readers. Zero means 3 (one per read
	// policy: primary, wait, pending).
	Readers int
	// TTL is the lease TTL of each `pgfence run`. Zero means 2s, or 8s
	// with the failover fault: a lease must outlive the kill, the
	// promotion and the reconnection (one to three seconds here, more on
	// a loaded machine) for its holder to learn of the failover (FN015 in
	// async mode); a shorter one only expires. In sync mode 12s: the
	// nemesis stops a holder (its run too, so it renews nothing) from
	// before the kill until the promotion, and its lease must outlive
	// that on a loaded machine; a longer TTL keeps jobs whose release the
	// kill cut off from the other workers for as long.
	TTL time.Duration
	// Faults are the kinds the nemesis injects, in a seeded shuffled
	// rotation. Nil means every kind.
	Faults []Fault
	// FaultGap bounds the pause between two faults: uniform in
	// [FaultGap/2, FaultGap*3/2]. Zero means 2s.
	FaultGap time.Duration
	// Failover is the replication mode of the failover fault. Set, it
	// adds FaultFailover to Faults; empty with FaultFailover in Faults
	// means FailoverAsync. FailoverSync needs every node of Cluster to
	// set synchronous_standby_names = '*' (Run starts its own cluster so)
	// and sets the database's failover_mode to sync. A run with the
	// failover needs a Cluster of its own: it ends with another primary.
	Failover FailoverMode

	// Pgfence is the pgfence binary (serve and run). Required.
	Pgfence string
	// Self is the binary whose `worker` subcommand runs Work. Required.
	Self string
	// Cluster is a running primary with a replica; nil starts one (and
	// closes it at the end).
	Cluster *pgtest.Cluster
	// Database is a migrated database of Cluster; empty creates "chaos".
	Database string
	// Dir keeps the records and logs; empty means a temporary directory,
	// removed when the run found no violation.
	Dir string
	// Log receives progress; nil means none.
	Log *zap.Logger
}

func (c *Config) setDefaults() error {
	if c.Duration == 0 {
		c.Duration = 5 * time.Minute
	}
	if c.Seed == 0 {
		c.Seed = uint64(time.Now().UnixNano())
	}
	if c.Workers == 0 {
		c.Workers = 6
	}
	if c.Jobs == 0 {
		c.Jobs = 3
	}
	if c.Readers == 0 {
		c.Readers = 3
	}
	if c.TTL == 0 {
		c.TTL = 2 * time.Second
		if c.hasFailover() || c.Failover != "" {
			c.TTL = 8 * time.Second
		}
		if c.Failover == FailoverSync {
			c.TTL = 12 * time.Second
		}
	}
	if c.Faults == nil {
		c.Faults = AllFaults
	}
	if c.Failover != "" && !c.hasFailover() {
		c.Faults = append(append([]Fault{}, c.Faults...), FaultFailover)
	}
	if c.hasFailover() && c.Failover == "" {
		c.Failover = FailoverAsync
	}
	if c.FaultGap == 0 {
		c.FaultGap = 2 * time.Second
	}
	if c.Log == nil {
		c.Log = zap.NewNop()
	}
	if c.Pgfence == "" || c.Self == "" {
		return errors.New("chaos: the pgfence binary and the worker binary are required")
	}
	return nil
}

// schema is the workload: three protected tables written in one
// transaction, and the consumer's own unprotected tables. The outbox
// stamps each event with the session's generation by column default.
const schema = `
CREATE TABLE results (job_key text PRIMARY KEY, token bigint NOT NULL, step text NOT NULL, payload text NOT NULL);
CREATE TABLE ledger (id bigserial PRIMARY KEY, job_key text NOT NULL, epoch bigint NOT NULL, token bigint NOT NULL,
  step text NOT NULL, payload text NOT NULL);
CREATE TABLE outbox (id bigserial PRIMARY KEY, job_key text NOT NULL,
  epoch bigint NOT NULL DEFAULT current_setting('fence.epoch')::bigint,
  token bigint NOT NULL DEFAULT current_setting('fence.token')::bigint,
  step text NOT NULL, payload text NOT NULL);
CREATE TABLE consumed (id bigint PRIMARY KEY, accepted boolean NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE applied (job_key text PRIMARY KEY, epoch bigint NOT NULL, token bigint NOT NULL, payload text NOT NULL);
SELECT fence.protect('results', 'job_key');
SELECT fence.protect('ledger', 'job_key');
SELECT fence.protect('outbox', 'job_key');
`

// steps a worker may commit under one token (see Work).
var workerSteps = []string{"", "s1", "s2"}

// Run runs the chaos workload against a primary and a streaming replica
// behind two `pgfence serve` processes while the nemesis injects faults,
// then stops everything, waits for the replica to replay, and audits the
// history with the workers' and readers' records. An error means the run
// itself failed; violations are in the summary.
func Run(ctx context.Context, cfg Config) (_ *Summary, err error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	log := cfg.Log
	ownDir := cfg.Dir == ""
	if ownDir {
		if cfg.Dir, err = os.MkdirTemp("", "pgfence-chaos-"); err != nil {
			return nil, err
		}
	}
	recDir := filepath.Join(cfg.Dir, "records")
	if err := os.MkdirAll(recDir, 0o755); err != nil {
		return nil, err
	}
	c := cfg.Cluster
	if c == nil {
		log.Info("starting a primary and a streaming replica")
		opts := pgtest.Options{Replica: true}
		if cfg.Failover == FailoverSync {
			opts.Settings = syncSettings
		}
		if c, err = pgtest.Start(ctx, opts); err != nil {
			return nil, err
		}
		defer c.Close()
	}
	if c.Replica == nil {
		return nil, errors.New("chaos: the cluster needs a replica")
	}
	db := cfg.Database
	if db == "" {
		db = "chaos"
		if err := createDatabase(ctx, c, db); err != nil {
			return nil, err
		}
	}
	if err := setupSchema(ctx, c, db, cfg.Failover); err != nil {
		return nil, err
	}

	h := &harness{cfg: cfg, log: log, c: c, db: db, recDir: recDir,
		sum: &Summary{Seed: cfg.Seed, Duration: cfg.Duration, Workers: cfg.Workers, Jobs: cfg.Jobs,
			Outcomes: map[string]int{}, Faults: map[Fault]int{}}}
	for i := 0; i < cfg.Jobs; i++ {
		h.jobs = append(h.jobs, "job-"+strconv.Itoa(i))
	}

	primary, replica := c.Primary.DSN("postgres"), c.Replica.DSN("postgres")
	h.primaryDSN = c.Primary.DSN(db)
	if cfg.hasFailover() {
		// Everyone follows the promotion: the proxies, the runners, the
		// readers, the consumer and the nemesis connect to whichever
		// node accepts writes.
		primary = multiHostDSN("postgres", c.Primary, c.Replica)
		h.primaryDSN = multiHostDSN(db, c.Primary, c.Replica)
	}
	for i := 0; i < 2; i++ {
		p, err := newProxyProc(fmt.Sprintf("proxy%d", i), cfg.Pgfence, primary, replica, db,
			filepath.Join(cfg.Dir, fmt.Sprintf("proxy%d.log", i)))
		if err != nil {
			return nil, err
		}
		h.proxies = append(h.proxies, p)
		defer p.stop()
		if err := p.start(ctx); err != nil {
			return nil, err
		}
	}
	for i := 0; i < cfg.Workers; i++ {
		sl := &slot{id: i}
		// Armed by the nemesis, the relay cuts the next COMMIT's answer.
		r, err := cutrelay.Start(h.proxies[i%2].addr, func(typ byte, body []byte) bool {
			return cutrelay.IsCommitQuery(typ, body) && sl.armed.CompareAndSwap(true, false)
		})
		if err != nil {
			return nil, err
		}
		defer r.Close()
		sl.relay = r
		h.slots = append(h.slots, sl)
	}
	log.Info("running", zap.Uint64("seed", cfg.Seed), zap.Duration("duration", cfg.Duration),
		zap.String("dir", cfg.Dir))

	// The workload and the nemesis run for Duration.
	wctx, stop := context.WithTimeout(ctx, cfg.Duration)
	defer stop()
	var wg sync.WaitGroup
	seeds := rand.New(rand.NewPCG(cfg.Seed, 0x9e3779b97f4a7c15))
	for _, s := range h.slots {
		wg.Add(1)
		go func(s *slot, seed uint64) { defer wg.Done(); h.runSlot(wctx, s, seed) }(s, seeds.Uint64())
	}
	rd := &readers{h: h}
	for i := 0; i < cfg.Readers; i++ {
		wg.Add(1)
		go func(i int, seed uint64) { defer wg.Done(); rd.run(wctx, i, seed) }(i, seeds.Uint64())
	}
	cons := &consumer{h: h, db: newDB(h.primaryDSN)}
	defer cons.db.close()
	consDone := make(chan struct{})
	cctx, stopConsumer := context.WithCancel(ctx)
	defer stopConsumer()
	go func(seed uint64) { defer close(consDone); cons.run(cctx, seed) }(seeds.Uint64())
	nem := &nemesis{h: h, db: newDB(h.primaryDSN), rng: rand.New(rand.NewPCG(seeds.Uint64(), 1))}
	defer nem.db.close()
	nemDone := make(chan struct{})
	go func() { defer close(nemDone); nem.run(wctx) }()

	<-wctx.Done()
	log.Info("stopping the workload")
	<-nemDone
	wg.Wait()
	// The nemesis is done: everything it broke is running again.
	fctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := nem.heal(fctx); err != nil {
		return nil, err
	}
	if err := cons.drain(fctx); err != nil {
		return nil, err
	}
	stopConsumer()
	<-consDone
	for _, p := range h.proxies {
		p.stop()
	}
	if c.Replica != nil { // nil only after a failover that failed half-way
		if err := c.WaitReplicaCaughtUp(fctx); err != nil {
			return nil, fmt.Errorf("wait for replay: %w", err)
		}
	}
	if err := h.finish(fctx, rd, cons, nem); err != nil {
		return nil, err
	}
	if ownDir && h.sum.OK() {
		os.RemoveAll(cfg.Dir)
	} else {
		h.sum.Dir = cfg.Dir
	}
	return h.sum, nil
}

func createDatabase(ctx context.Context, c *pgtest.Cluster, db string) error {
	admin, err := c.Primary.Connect(ctx, "postgres")
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{db}.Sanitize()); err != nil {
		return fmt.Errorf("create database: %w", err)
	}
	conn, err := c.Primary.Connect(ctx, db)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if err := migrations.Apply(ctx, conn); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	return nil
}

func setupSchema(ctx context.Context, c *pgtest.Cluster, db string, mode FailoverMode) error {
	conn, err := c.Primary.Connect(ctx, db)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, schema); err != nil {
		return fmt.Errorf("chaos schema: %w", err)
	}
	// A worker stopped inside a transaction must not hold its job's fence
	// row (and with it every takeover) for as long as it is stopped: its
	// backend gives up the transaction after a second, as a production
	// database should be configured to.
	if _, err := conn.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{db}.Sanitize()+
		" SET idle_in_transaction_session_timeout = '1s'"); err != nil {
		return err
	}
	if mode == FailoverSync {
		if _, err := conn.Exec(ctx, "SELECT fence.set_failover_mode('sync')"); err != nil {
			return fmt.Errorf("failover mode: %w", err)
		}
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return c.WaitReplicaCaughtUp(wctx)
}

// harness is the state shared by the parts of a run.
type harness struct {
	cfg     Config
	log     *zap.Logger
	c       *pgtest.Cluster
	db      string
	recDir  string
	jobs    []string
	proxies []*proxyProc
	slots   []*slot
	// primaryDSN is the chaos database on the primary: with the failover
	// fault, a DSN that lists both nodes (multiHostDSN).
	primaryDSN string
	// failoverGen is odd while a failover is under way: a read that saw
	// it change straddled the failover.
	failoverGen atomic.Int64

	mu  sync.Mutex
	sum *Summary
}

func (h *harness) count(f func(s *Summary)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	f(h.sum)
}

// slot is one worker slot: it runs `pgfence run` for a random job, again
// and again, every worker connecting through the slot's relay.
type slot struct {
	id    int
	relay *cutrelay.Relay
	armed atomic.Bool // the relay cuts the next COMMIT (cut-commit fault)

	mu  sync.Mutex
	cur *slotProc
	n   int
}

func (s *slot) current() *slotProc {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

func (h *harness) runSlot(ctx context.Context, s *slot, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, uint64(s.id)))
	logf, err := os.OpenFile(filepath.Join(h.cfg.Dir, fmt.Sprintf("slot%d.log", s.id)), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		h.log.Error("slot log", zap.Error(err))
		return
	}
	defer logf.Close()
	for ctx.Err() == nil {
		job := h.jobs[rng.IntN(len(h.jobs))]
		s.mu.Lock()
		s.n++
		holder := fmt.Sprintf("w%d.%d", s.id, s.n)
		s.mu.Unlock()
		records := filepath.Join(h.recDir, holder+".jsonl")
		steps := 1 + rng.IntN(len(workerSteps))
		dsn := fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&application_name=chaos-worker", s.relay.Addr(), h.db)
		level := "error"
		if h.cfg.hasFailover() {
			// Its failover restarts are logged as warnings (counted in
			// failoverStats).
			level = "warn"
		}
		cmd := exec.Command(h.cfg.Pgfence, "run", "--job", job, "--ttl", h.cfg.TTL.String(), "--holder", holder,
			"--database", h.primaryDSN, "--grace", "2s", "--log-level", level, "--",
			h.cfg.Self, "worker", "--name", holder, "--records", records, "--steps", strconv.Itoa(steps),
			"--seed", strconv.FormatUint(rng.Uint64(), 10),
			"--primary", h.primaryDSN+"&application_name=chaos-worker")
		cmd.Env = append(os.Environ(), "DATABASE_URL="+dsn)
		cmd.Stdout, cmd.Stderr = logf, logf
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			h.log.Error("start pgfence run", zap.Error(err))
			return
		}
		sp := &slotProc{holder: holder, records: records, steps: steps, cmd: cmd, done: make(chan struct{})}
		var code int
		go func() {
			err := cmd.Wait()
			code = exitCodeOf(cmd, err)
			close(sp.done)
		}()
		s.mu.Lock()
		s.cur = sp
		s.mu.Unlock()
		select {
		case <-sp.done:
		case <-ctx.Done():
			sp.terminate(5 * time.Second)
		}
		s.mu.Lock()
		s.cur = nil
		s.mu.Unlock()
		h.count(func(sum *Summary) {
			if sum.Runs == nil {
				sum.Runs = map[int]int{}
			}
			sum.Runs[code]++
		})
		if code == 75 || code == 69 || code == 70 {
			// Lease held by another, the database unreachable (69), or
			// another failure to start.
			sleepCtx(ctx, time.Duration(50+rng.IntN(200))*time.Millisecond)
		}
	}
}

func exitCodeOf(cmd *exec.Cmd, err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return cmd.ProcessState.ExitCode()
}

// finish reads the records, runs the checker and fills the summary.
func (h *harness) finish(ctx context.Context, rd *readers, cons *consumer, nem *nemesis) error {
	attempts, err := readAttempts(h.recDir)
	if err != nil {
		return err
	}
	sum := h.sum
	sum.Attempts = len(attempts)
	for _, a := range attempts {
		sum.Outcomes[a.Outcome]++
		switch {
		case a.Probe && (a.Outcome == audit.OutcomeCommitted || a.Outcome == audit.OutcomeReplayed):
			sum.Anomalies = append(sum.Anomalies, fmt.Sprintf("worker %s: a different payload under job %s token %d step %q was answered %s, want conflict",
				a.Worker, a.Job, a.Token, a.Step, a.Outcome))
		case !a.Probe && a.Outcome == audit.OutcomeConflict:
			sum.Anomalies = append(sum.Anomalies, fmt.Sprintf("worker %s: a retry with the same payload under job %s token %d step %q was answered conflict",
				a.Worker, a.Job, a.Token, a.Step))
		}
	}
	nem.zombieStats(attempts)
	if h.cfg.hasFailover() {
		nem.mu.Lock()
		st := nem.fo.stats
		nem.mu.Unlock()
		if st.Mode == "" {
			st.Mode, st.Failed = h.cfg.Failover, "its time did not come before the run ended"
		}
		sum.Failover = &st
	}
	sum.Reads = rd.stats()
	sum.Consumer = cons.stats()

	conn, err := h.c.Primary.Connect(ctx, h.db)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "SET idle_in_transaction_session_timeout = 0"); err != nil {
		return err
	}
	var results []audit.ResultTable
	for _, t := range []string{"results", "ledger", "outbox"} {
		results = append(results, audit.ResultTable{Table: t, JobKeyColumn: "job_key", TokenColumn: "token",
			Steps: workerSteps, Upsert: t == "results"})
	}
	rep, err := audit.Run(ctx, conn, audit.Options{
		Results: results,
		Clients: clientRecords(attempts),
		Reads:   rd.records(),
	})
	if err != nil {
		return err
	}
	sum.Report = rep
	if sum.Failover != nil {
		sum.Failover.ReadsNotChecked = sum.Reads.AcrossFailover
	}
	return h.failoverStats(ctx, conn, attempts, rep)
}

// Summary is what a run did and what the checker found.
type Summary struct {
	Seed     uint64
	Duration time.Duration
	Workers  int
	Jobs     int
	// Attempts are the workers' recorded attempts, by outcome.
	Attempts int
	Outcomes map[string]int
	// Runs counts `pgfence run` exits by code.
	Runs map[int]int
	// Zombies counts workers stopped past their lease until another took
	// over; ZombiesResumed those that tried to commit again with the old
	// token once continued; of those, ZombiesRefused were refused (stale),
	// ZombiesFaulted only met errors of the faults injected meanwhile
	// (neither refused nor committed), and ZombiesCommitted committed
	// after the takeover: each is an anomaly, the fence failed.
	Zombies, ZombiesResumed, ZombiesRefused, ZombiesFaulted, ZombiesCommitted int
	Faults                                                                    map[Fault]int
	// Failover is what the failover fault did (nil: not in the run).
	Failover *FailoverStats
	// FaultErrors counts faults the nemesis failed to inject or undo.
	FaultErrors []string
	Reads       ReadStats
	Consumer    ConsumerStats
	// Anomalies are answers a careful client must never get, found by the
	// harness itself (the checker cannot see them in the database).
	Anomalies []string
	Report    *audit.Report
	// Dir holds the records and the logs of the processes, when kept (a
	// Config.Dir given, or violations found).
	Dir string
}

// OK reports whether the checker found no violation and the harness no
// anomaly.
func (s *Summary) OK() bool {
	return s.Report != nil && s.Report.OK() && len(s.Anomalies) == 0
}

// Violations is the number of violations the checker reported (with
// those beyond its detail limit) plus the harness's anomalies.
func (s *Summary) Violations() int {
	n := len(s.Anomalies)
	if s.Report != nil {
		n += len(s.Report.Violations)
		for _, o := range s.Report.Omitted {
			n += int(o)
		}
	}
	return n
}

// WriteText writes the summary for people.
func (s *Summary) WriteText(w io.Writer) error {
	var b []byte
	p := func(format string, args ...any) { b = fmt.Appendf(b, format, args...) }
	p("pgfence chaos: seed %d, %s, %d workers on %d jobs\n", s.Seed, s.Duration, s.Workers, s.Jobs)
	p("attempts %d: committed %d, replayed %d, conflict %d, stale %d, expired %d, error %d, unknown %d\n",
		s.Attempts, s.Outcomes["committed"], s.Outcomes["replayed"], s.Outcomes["conflict"], s.Outcomes["stale"],
		s.Outcomes["expired"], s.Outcomes["error"], s.Outcomes["unknown"])
	p("pgfence run exits:")
	for _, code := range sortedInts(s.Runs) {
		p(" %d×%d", code, s.Runs[code])
	}
	p("\nzombies %d: resumed and tried again %d: refused %d, only fault errors %d, committed %d (must be 0)\n",
		s.Zombies, s.ZombiesResumed, s.ZombiesRefused, s.ZombiesFaulted, s.ZombiesCommitted)
	p("faults:")
	for _, f := range AllFaults {
		p(" %s %d,", f, s.Faults[f])
	}
	if s.Failover != nil {
		p(" %s %d,", FaultFailover, s.Faults[FaultFailover])
	}
	b = b[:len(b)-1]
	if len(s.FaultErrors) > 0 {
		p(" (%d failed to inject)", len(s.FaultErrors))
	}
	p("\nreads %d: replica %d, primary %d, pending (FN007) %d, errors %d\n",
		s.Reads.Recorded, s.Reads.Replica, s.Reads.Primary, s.Reads.Pending, s.Reads.Errors)
	p("consumer: events accepted %d, rejected %d\n", s.Consumer.Accepted, s.Consumer.Rejected)
	if s.Failover != nil {
		s.Failover.writeText(p)
	}
	for _, e := range s.FaultErrors {
		p("fault failed: %s\n", e)
	}
	for _, a := range s.Anomalies {
		p("anomaly: %s\n", a)
	}
	if _, err := w.Write(b); err != nil {
		return err
	}
	if s.Report != nil {
		if err := s.Report.WriteText(w); err != nil {
			return err
		}
	}
	if s.Dir != "" {
		if _, err := fmt.Fprintf(w, "records and logs: %s\n", s.Dir); err != nil {
			return err
		}
	}
	verdict := "OK: zero violations"
	if !s.OK() {
		verdict = fmt.Sprintf("FAILED: %d violations", s.Violations())
	}
	_, err := fmt.Fprintf(w, "violations: %d\n%s\n", s.Violations(), verdict)
	return err
}

func sortedInts(m map[int]int) []int {
	var ks []int
	for k := range m {
		ks = append(ks, k)
	}
	for i := 1; i < len(ks); i++ {
		for j := i; j > 0 && ks[j] < ks[j-1]; j-- {
			ks[j], ks[j-1] = ks[j-1], ks[j]
		}
	}
	return ks
}
