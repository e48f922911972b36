package proxy

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ctlconn"
	"github.com/pgfence/pgfence/session"
)

// Nobody pins a fence row (issue 18 §4).
//
// A gated transaction holds its job's fence row from the gate step until
// it ends, so a takeover of the job waits for it. A client that stops
// talking inside one — idle in the transaction, after an Execute with no
// Sync, in a COPY FROM STDIN that sends no data, on a suspended portal —
// would hold the row for ever: PostgreSQL's
// idle_in_transaction_session_timeout covers only the first of these. The
// watchdog ends such a session once it has been silent for the bound
// (FenceConfig.GateIdleTimeout): it closes the upstream connection, so
// PostgreSQL rolls the transaction back and releases the row at once, and
// the client is told why (FN012) when it next reads.
//
// A session is watched while it holds or may hold a fence row: it has a
// fence generation, or its transaction called a fence function, or — in a
// database with protected tables — ran anything that may lock rows a
// gated write would wait for while holding its fence row (a write, a
// locking read, LOCK, DDL, code the proxy cannot see into: fence_text.go,
// mayLock; issue 30, attacker D's M1), with fence metadata or without; its
// transaction is open (or a request is in flight); and the server is not
// working for it (nothing outstanding, or only a COPY waiting for the
// client's data). A client's message that asks the server for something
// new restarts the clock (asksWork): Flush, Sync, Describe, Close and
// empty COPY data do not, so a keepalive of them cannot pin the row.
// The watchdog looks every quarter of the bound, so a session is ended
// between one bound and one and a quarter after it fell silent.
//
// What the text shows is not all a statement locks: a read of a view
// defined FOR UPDATE, or one whose function or policy locks rows, looks
// like a plain read (round 2, attacker E's M2). So in a database with
// protected tables any transaction silent for the bound is also asked
// of the database: a session whose backend holds a relation lock
// stronger than ACCESS SHARE there (a FOR UPDATE/SHARE's ROW SHARE, a
// write's ROW EXCLUSIVE, LOCK TABLE) is ended as one the text showed,
// and one holding none is left alone. One query on a control connection
// (pg_locks, every candidate's backend at once) per look that has
// candidates; nothing when no transaction is silent that long.

// DefaultGateIdleTimeout is FenceConfig.GateIdleTimeout's default: well
// under the shortest lease TTL a job should use (30 s and more).
const DefaultGateIdleTimeout = 10 * time.Second

// watchdog ends gated sessions whose client fell silent.
type watchdog struct {
	bound time.Duration
	log   *zap.Logger
	base  *pgconn.Config               // the primary's DSN: locksHeld's control connection
	conn  ctlconn.Conn[*pgconn.PgConn] // locksHeld's, kept
	asked atomic.Int64                 // silent transactions asked about (locksHeld), answered

	mu       sync.Mutex
	sessions map[*fenceSession]gateConn

	stop chan struct{}
	done chan struct{}
}

func newWatchdog(bound time.Duration, base *pgconn.Config, log *zap.Logger) *watchdog {
	w := &watchdog{bound: bound, base: base, log: log, sessions: map[*fenceSession]gateConn{},
		stop: make(chan struct{}), done: make(chan struct{})}
	if bound <= 0 {
		close(w.done)
		return w
	}
	go w.run()
	return w
}

func (w *watchdog) add(h *fenceSession, s gateConn) {
	w.mu.Lock()
	w.sessions[h] = s
	w.mu.Unlock()
}

func (w *watchdog) remove(h *fenceSession) {
	w.mu.Lock()
	delete(w.sessions, h)
	w.mu.Unlock()
}

func (w *watchdog) close() {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	<-w.done
	w.conn.Close()
}

func (w *watchdog) run() {
	defer close(w.done)
	t := time.NewTicker(w.bound / 4)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case now := <-t.C:
			w.look(now)
		}
	}
}

// look ends the sessions silent past the bound that hold, or may hold,
// what a gated write waits for: those the text showed at once, the other
// silent transactions in databases with protected tables once the
// database says their backend holds a lock (locksHeld).
func (w *watchdog) look(now time.Time) {
	type candidate struct {
		h    *fenceSession
		s    gateConn
		msgs uint64
	}
	var asked map[uint32]candidate
	w.mu.Lock()
	for h, s := range w.sessions {
		d, shown := h.silentFor(s, now)
		if d < w.bound {
			continue
		}
		if shown {
			w.expire(h, s)
			continue
		}
		if pid := s.backendPID(); pid != 0 {
			if asked == nil {
				asked = map[uint32]candidate{}
			}
			asked[pid] = candidate{h, s, h.idle.clientMsgs.Load()}
		}
	}
	w.mu.Unlock()
	if len(asked) == 0 {
		return
	}
	pids := make([]uint32, 0, len(asked))
	for pid := range asked {
		pids = append(pids, pid)
	}
	held, err := w.locksHeld(pids)
	if err != nil {
		w.log.Warn("cannot ask the database which silent transactions hold locks; asking again at the next look", zap.Error(err))
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	defer w.asked.Add(int64(len(pids)))
	for _, pid := range held {
		c, ok := asked[pid]
		if !ok || w.sessions[c.h] == nil || c.h.idle.clientMsgs.Load() != c.msgs {
			continue // gone, or it spoke meanwhile
		}
		w.expire(c.h, c.s)
	}
}

// locksHeldSQL lists which of the backends $1 (a comma-separated list of
// pids) hold a relation lock stronger than ACCESS SHARE. Qualified
// throughout, on a pinned control connection (ownsql.go).
var locksHeldSQL = ownDrivenBy("watchdog: silent transactions' locks (in the primary DSN's database)", onControl, `SELECT DISTINCT l.pid::pg_catalog.text FROM pg_catalog.pg_locks AS l
WHERE l.pid OPERATOR(pg_catalog.=) ANY (pg_catalog.string_to_array($1::pg_catalog.text, ',')::pg_catalog.int4[])
  AND l.granted AND l.locktype OPERATOR(pg_catalog.=) 'relation' AND l.mode OPERATOR(pg_catalog.<>) 'AccessShareLock'`,
	"TestBypass/lockidle (it runs in the primary DSN's database, not a client's)")

// locksHeld asks the primary which of pids hold a relation lock stronger
// than ACCESS SHARE (locksHeldSQL). Relation locks of every database are
// in pg_locks, whichever database the control connection is in.
func (w *watchdog) locksHeld(pids []uint32) ([]uint32, error) {
	strs := make([]string, len(pids))
	for i, p := range pids {
		strs[i] = strconv.FormatUint(uint64(p), 10)
	}
	ctx, cancel := context.WithTimeout(context.Background(), w.bound)
	defer cancel()
	var held []uint32
	err := w.control(ctx, func(c *pgconn.PgConn) error {
		held = held[:0]
		res := c.ExecParams(ctx, locksHeldSQL, [][]byte{[]byte(strings.Join(strs, ","))}, nil, nil, nil).Read()
		if res.Err != nil {
			return res.Err
		}
		for _, row := range res.Rows {
			if p, err := strconv.ParseUint(string(row[0]), 10, 32); err == nil {
				held = append(held, uint32(p))
			}
		}
		return nil
	})
	return held, err
}

const watchdogAppName = "pgfence gate watchdog"

// control runs f on the watchdog's control connection, dialled when it
// has none.
func (w *watchdog) control(ctx context.Context, f func(c *pgconn.PgConn) error) error {
	return w.conn.Do(ctx, func(ctx context.Context) (*pgconn.PgConn, error) {
		return dialControl(ctx, w.base, "", watchdogAppName, w.log, nil)
	}, f)
}

// idleClock is the watchdog's view of one session (watchdog goroutine
// only, but clientMsgs).
type idleClock struct {
	clientMsgs atomic.Uint64 // client messages handled so far (client side)
	copyWait   atomic.Bool   // the server waits for the client's COPY data (server side)
	// openBatch: the client's last message was an extended-protocol one
	// with no Sync or Flush after it: the server answers nothing more
	// until the client sends one (client side).
	openBatch atomic.Bool
	// fenceCall: the request (fenceSession.seq) that last called a fence
	// function (which may lock a fence row), until a ReadyForQuery after
	// it says the transaction ended; 0: none.
	fenceCall atomic.Uint64

	seen  uint64    // clientMsgs at the last look
	since time.Time // when the session was last seen silent and holding; zero: not
	ended bool
}

// silentFor returns how long s has been silent while it may hold a fence
// row (0 when it is not holding, or talking), and whether what it ran
// showed that it may (shown); if not, it is a transaction in a database
// with protected tables, which the database is asked about (look).
func (h *fenceSession) silentFor(s gateConn, now time.Time) (time.Duration, bool) {
	c := &h.idle
	if c.ended {
		return 0, false
	}
	h.mu.Lock()
	_, fenced := h.st.Generation()
	fenced = fenced || h.st.Gate().Gated
	h.mu.Unlock()
	txOpen := s.TxStatus() != 'I' || s.inFlight() > 0
	// Busy: the server works for the client. Not while it waits for the
	// client's COPY data, nor while it waits for the client to take its
	// answers (round 3, H-M2: a client that pipelines and never reads
	// held its fence row for ever).
	// Nor while the client left its batch open (no Sync or Flush): the
	// server has nothing more to send until the client speaks (round 4,
	// I-M1).
	busy := s.outstanding() && !c.copyWait.Load() && !s.clientHoldsUp() && !c.openBatch.Load()
	msgs := c.clientMsgs.Load()
	fenced = fenced || c.fenceCall.Load() != 0
	watched := fenced || h.protects()
	if !watched || !txOpen || busy || msgs != c.seen || c.since.IsZero() {
		c.seen = msgs
		if watched && txOpen && !busy {
			c.since = now
		} else {
			c.since = time.Time{}
		}
		return 0, fenced
	}
	return now.Sub(c.since), fenced
}

// expire ends a session that held a fence row past the bound.
func (w *watchdog) expire(h *fenceSession, s gateConn) {
	h.idle.ended = true
	h.mu.Lock()
	gen := h.st.Gate().Gen
	if !h.st.Gate().Gated {
		gen, _ = h.st.Generation()
	}
	// What happened to the work follows what the server reported (its
	// CommandCompletes as the proxy applied them), never an assumption:
	// a COMMIT it completed before the client fell silent (no Sync
	// after it) committed (round 8, O-M1: the client was told its
	// committed transaction was rolled back, and one that believed it
	// could redo the work under a new lease).
	open := h.st.Tx() != session.Idle
	h.mu.Unlock()
	outcome := "the transaction was rolled back. Reconnect and retry"
	if !open {
		outcome = "no transaction was open: the last COMMIT the server completed for it committed, and nothing after it ran. Reconnect, and do not repeat the work that COMMIT answered"
	}
	what := fmt.Sprintf("job %q's fence row (token %d)", gen.JobKey, gen.Token)
	if gen.JobKey == "" {
		what = "a fence row, or locks on protected data a gated write waits for,"
	}
	msg := fmt.Sprintf("pgfence ended this session: its transaction held %s while the client was silent for %s (gate_idle_timeout), so a takeover could not proceed; %s; keep a gated transaction short, or raise gate_idle_timeout (keep it under the lease TTL)", what, w.bound, outcome)
	w.log.Info("gated transaction idle past the bound; ending the session",
		zap.Uint32("backend_pid", s.backendPID()), zap.String("user", h.user), zap.String("database", h.db),
		zap.String("job_key", gen.JobKey), zap.Int64("token", gen.Token), zap.Duration("gate_idle_timeout", w.bound))
	h.f.Stats.Codes.Add(fence.CodeGateTimeout)
	pid := s.backendPID()
	s.endWith(&ProtocolError{Code: fence.CodeGateTimeout, Msg: msg, Err: fmt.Errorf("gate idle timeout")})
	w.terminate(pid)
}

// terminateSQL ends a backend whose session the watchdog ended, on the
// control connection.
var terminateSQL = ownDrivenBy("watchdog: end the backend of a session it ended", onControl,
	`SELECT pg_catalog.pg_terminate_backend($1::pg_catalog.int4)`,
	"TestBypass/idle/pipelines_never_reads (a backend blocked writing answers its client never reads)")

// terminate ends backend pid on the server too: closing the proxy's end
// of the connection is not always enough — a backend blocked writing
// answers its client never reads (the proxy stopped reading them) can
// stay blocked with the transaction's locks, the fence row among them.
// A failure (a control role without pg_signal_backend, a superuser's
// backend) is logged; the closed connection then ends it when it can.
func (w *watchdog) terminate(pid uint32) {
	if pid == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), w.bound)
	defer cancel()
	err := w.control(ctx, func(c *pgconn.PgConn) error {
		return c.ExecParams(ctx, terminateSQL, [][]byte{[]byte(strconv.FormatUint(uint64(pid), 10))}, nil, nil, nil).Read().Err
	})
	if err != nil {
		w.log.Warn("could not end the backend of a session the watchdog ended", zap.Uint32("backend_pid", pid), zap.Error(err))
	}
}
