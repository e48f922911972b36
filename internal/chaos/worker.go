package chaos

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/audit"
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// WorkerConfig is one worker process: it runs under `pgfence run`, which
// puts its generation in PGOPTIONS and PGFENCE_JOB_KEY/EPOCH/TOKEN.
type WorkerConfig struct {
	Name    string // recorded with every attempt
	DSN     string // the proxy (through the harness's relay)
	Records string // JSON-lines file the attempts are appended to
	Seed    uint64
	// Steps is how many commits the worker makes under its token (each
	// its own fence.step); zero means 1 to 3, chosen by Seed.
	Steps int
	// Primary is the database's primary, used only by a broken build
	// (see broken.go).
	Primary string
}

// Worker exit codes other than 0 (all commits done).
const (
	ExitStale   = 3   // the token was refused: another holder took over
	ExitGaveUp  = 4   // no definite outcome within a minute of retries
	ExitStopped = 143 // SIGTERM (from pgfence run) before the work was done
)

// generation is the worker's lease, from the environment pgfence run set.
type generation struct {
	job          string
	epoch, token int64
}

func generationFromEnv() (generation, error) {
	g := generation{job: os.Getenv("PGFENCE_JOB_KEY")}
	var err1, err2 error
	g.epoch, err1 = strconv.ParseInt(os.Getenv("PGFENCE_EPOCH"), 10, 64)
	g.token, err2 = strconv.ParseInt(os.Getenv("PGFENCE_TOKEN"), 10, 64)
	if g.job == "" || err1 != nil || err2 != nil {
		return g, errors.New("worker: PGFENCE_JOB_KEY, PGFENCE_EPOCH and PGFENCE_TOKEN must be set (run it under pgfence run)")
	}
	return g, nil
}

// Work is the worker program: it commits Steps results under its token
// through the proxy, each a transaction that upserts the job's result,
// appends a ledger row and an outbox event, and retries after a failure
// the way a careful client does: the same step with the same payload, so
// that a commit whose answer was lost is answered as a replay. Once in a
// while it probes the receipt with a different payload under a step that
// already committed, which must be refused as a conflict. It returns the
// process exit code.
func Work(ctx context.Context, cfg WorkerConfig) (int, error) {
	g, err := generationFromEnv()
	if err != nil {
		return 2, err
	}
	rec, err := openRecorder(cfg.Records)
	if err != nil {
		return 2, err
	}
	defer rec.close()
	rng := rand.New(rand.NewPCG(cfg.Seed, uint64(g.token)))
	steps := cfg.Steps
	if steps <= 0 {
		steps = 1 + rng.IntN(3)
	}
	w := &worker{cfg: cfg, g: g, rec: rec, rng: rng}
	defer w.closeConn()
	for i := 0; i < steps; i++ {
		// Think before each commit, not after the last: a worker stopped
		// while it holds a lease has a commit still to make.
		sleepCtx(ctx, time.Duration(30+rng.IntN(200))*time.Millisecond)
		step := ""
		if i > 0 {
			step = "s" + strconv.Itoa(i)
		}
		payload := fmt.Sprintf("%s/%d/%s/%08x", g.job, g.token, step, rng.Uint32())
		out, err := w.commit(ctx, step, payload, false)
		if ctx.Err() != nil {
			// Told to stop (pgfence run lost the lease, or the run ends).
			return ExitStopped, nil
		}
		if err != nil {
			return ExitGaveUp, err
		}
		switch out {
		case audit.OutcomeStale, audit.OutcomeExpired:
			return ExitStale, nil
		case audit.OutcomeConflict:
			// A careful worker never changes a step's payload, so a
			// conflict here means the history is broken: the checker
			// sees it in the records.
			return ExitGaveUp, fmt.Errorf("step %q: conflict on a first commit", step)
		}
		if rng.IntN(8) == 0 {
			// A careless retry with other content: must be FN003.
			if _, err := w.commit(ctx, step, payload+"/changed", true); err != nil {
				if ctx.Err() != nil {
					return ExitStopped, nil
				}
				return ExitGaveUp, err
			}
		}
	}
	return 0, nil
}

type worker struct {
	cfg  WorkerConfig
	g    generation
	rec  *recorder
	rng  *rand.Rand
	conn *pgx.Conn

	mu      sync.Mutex
	notices []string
}

func (w *worker) closeConn() {
	if w.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		w.conn.Close(ctx)
		cancel()
		w.conn = nil
	}
}

func (w *worker) connect(ctx context.Context) error {
	if w.conn != nil && !w.conn.IsClosed() {
		return nil
	}
	w.closeConn()
	cfg, err := pgx.ParseConfig(w.cfg.DSN)
	if err != nil {
		return err
	}
	cfg.ConnectTimeout = 3 * time.Second
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		w.mu.Lock()
		w.notices = append(w.notices, n.Code)
		w.mu.Unlock()
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	c, err := pgx.ConnectConfig(cctx, cfg)
	if err != nil {
		return err
	}
	w.conn = c
	return nil
}

func (w *worker) takeNotices() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := w.notices
	w.notices = nil
	return n
}

// digestMode: half of the generations send their own digest
// (fence.payload_digest), the others let the proxy compute the v1 digest
// of the statements. The choice is fixed per (token, step), so a retry
// sends exactly what the first attempt sent.
func (w *worker) clientDigest(step string) bool {
	h := sha256.Sum256([]byte(strconv.FormatInt(w.g.token, 10) + "/" + step))
	return h[0]&1 == 0
}

// commit makes one commit of step with payload and retries it until the
// outcome is definite; it returns that outcome.
func (w *worker) commit(ctx context.Context, step, payload string, probe bool) (string, error) {
	var digest string
	if w.clientDigest(step) {
		d := sha256.Sum256([]byte(payload))
		digest = hex.EncodeToString(d[:])
	}
	deadline := time.Now().Add(60 * time.Second)
	for retry := 0; ; retry++ {
		if ctx.Err() != nil {
			return "", ctx.Err()
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("step %q: no definite outcome after %d attempts", step, retry)
		}
		a := Attempt{
			Worker: w.cfg.Name, Job: w.g.job, Epoch: w.g.epoch, Token: w.g.token, Step: step,
			Digest: digest, Probe: probe, Retry: retry, Began: time.Now(),
		}
		if err := w.rec.add(a); err != nil {
			return "", err
		}
		a.Outcome, a.Code, a.Detail = w.attempt(ctx, step, payload, digest)
		a.At = time.Now()
		if err := w.rec.add(a); err != nil {
			return "", err
		}
		out := a.Outcome
		switch out {
		case audit.OutcomeError, audit.OutcomeUnknown:
			// The same step, the same payload, on a new connection, after
			// a pause that grows while the proxy or the primary is down.
			w.closeConn()
			pause := min(20*time.Millisecond<<min(retry, 5), 500*time.Millisecond)
			sleepCtx(ctx, pause+time.Duration(w.rng.Int64N(int64(pause))))
			continue
		}
		return out, nil
	}
}

const (
	upsertResult = `INSERT INTO results (job_key, token, step, payload) VALUES ($1, $2, $3, $4)
ON CONFLICT (job_key) DO UPDATE SET token = excluded.token, step = excluded.step, payload = excluded.payload
WHERE results.token <= excluded.token`
	insertLedger = `INSERT INTO ledger (job_key, epoch, token, step, payload) VALUES ($1, $2, $3, $4, $5)`
	// The outbox event's generation comes from the session's GUCs.
	insertOutbox = `INSERT INTO outbox (job_key, step, payload) VALUES ($1, $2, $3)`
)

// attempt runs the transaction once and classifies what the worker saw.
func (w *worker) attempt(ctx context.Context, step, payload, digest string) (outcome, code, detail string) {
	if brokenBuild {
		return w.attemptBroken(ctx, step, payload, digest)
	}
	if err := w.connect(ctx); err != nil {
		return audit.OutcomeError, pgtest.SQLState(err), "connect: " + err.Error()
	}
	c := w.conn
	actx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	// Session settings, before the transaction: the step and (maybe) the
	// client's own digest.
	set := "SET fence.step = '" + step + "'"
	if digest != "" {
		set += "; SET fence.payload_digest = '" + digest + "'"
	} else {
		set += "; RESET fence.payload_digest"
	}
	if _, err := c.Exec(actx, set); err != nil {
		return classifyBefore(err)
	}
	w.takeNotices()
	tx, err := c.Begin(actx)
	if err != nil {
		return classifyBefore(err)
	}
	defer tx.Rollback(context.WithoutCancel(actx))
	if _, err := tx.Exec(actx, upsertResult, w.g.job, w.g.token, step, payload); err != nil {
		return classifyBefore(err)
	}
	if _, err := tx.Exec(actx, insertLedger, w.g.job, w.g.epoch, w.g.token, step, payload); err != nil {
		return classifyBefore(err)
	}
	if _, err := tx.Exec(actx, insertOutbox, w.g.job, step, payload); err != nil {
		return classifyBefore(err)
	}
	if err := tx.Commit(actx); err != nil {
		return classifyCommit(c, err)
	}
	for _, n := range w.takeNotices() {
		if n == fence.CodeReplay {
			return audit.OutcomeReplayed, fence.CodeReplay, ""
		}
	}
	return audit.OutcomeCommitted, "", ""
}

// classifyBefore classifies an error before COMMIT was sent: nothing was
// committed, whatever the error.
func classifyBefore(err error) (string, string, string) {
	code := pgtest.SQLState(err)
	if o, ok := fenceOutcome(code); ok {
		return o, code, ""
	}
	return audit.OutcomeError, code, err.Error()
}

// classifyCommit classifies an error answering COMMIT. An ordinary ERROR
// on a live connection is definite (nothing committed); a lost connection,
// a FATAL or a timeout leaves the outcome unknown: the commit may have gone
// through before the answer was lost.
func classifyCommit(c *pgx.Conn, err error) (string, string, string) {
	code := pgtest.SQLState(err)
	if o, ok := fenceOutcome(code); ok {
		return o, code, ""
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Severity == "ERROR" && !c.IsClosed() {
		return audit.OutcomeError, code, err.Error()
	}
	return audit.OutcomeUnknown, code, err.Error()
}

func fenceOutcome(code string) (string, bool) {
	switch code {
	case fence.CodeStale, fence.CodeRetired, fence.CodeFailover:
		// FN015: the generation was void after a failover; nothing
		// committed. The worker stops; pgfence run acquires again.
		return audit.OutcomeStale, true
	case fence.CodeConflict:
		return audit.OutcomeConflict, true
	case fence.CodeExpired:
		return audit.OutcomeExpired, true
	}
	return "", false
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
