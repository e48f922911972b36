package proxy

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
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

// DefaultGateIdleTimeout is FenceConfig.GateIdleTimeout's default: well
// under the shortest lease TTL a job should use (30 s and more).
const DefaultGateIdleTimeout = 10 * time.Second

// watchdog ends gated sessions whose client fell silent.
type watchdog struct {
	bound time.Duration
	log   *zap.Logger

	mu       sync.Mutex
	sessions map[*fenceSession]gateConn

	stop chan struct{}
	done chan struct{}
}

func newWatchdog(bound time.Duration, log *zap.Logger) *watchdog {
	w := &watchdog{bound: bound, log: log, sessions: map[*fenceSession]gateConn{},
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
			w.mu.Lock()
			for h, s := range w.sessions {
				if h.silentFor(s, now) >= w.bound {
					w.expire(h, s)
				}
			}
			w.mu.Unlock()
		}
	}
}

// idleClock is the watchdog's view of one session (watchdog goroutine
// only, but clientMsgs).
type idleClock struct {
	clientMsgs atomic.Uint64 // client messages handled so far (client side)
	copyWait   atomic.Bool   // the server waits for the client's COPY data (server side)
	// fenceCall: the request (fenceSession.seq) that last called a fence
	// function (which may lock a fence row), until a ReadyForQuery after
	// it says the transaction ended; 0: none.
	fenceCall atomic.Uint64

	seen  uint64    // clientMsgs at the last look
	since time.Time // when the session was last seen silent and holding; zero: not
	ended bool
}

// silentFor returns how long s has been silent while it may hold a fence
// row (0 when it is not holding, or talking).
func (h *fenceSession) silentFor(s gateConn, now time.Time) time.Duration {
	c := &h.idle
	if c.ended {
		return 0
	}
	h.mu.Lock()
	_, fenced := h.st.Generation()
	fenced = fenced || h.st.Gate().Gated
	h.mu.Unlock()
	txOpen := s.TxStatus() != 'I' || s.inFlight() > 0
	busy := s.outstanding() && !c.copyWait.Load()
	msgs := c.clientMsgs.Load()
	fenced = fenced || c.fenceCall.Load() != 0
	if !fenced || !txOpen || busy || msgs != c.seen || c.since.IsZero() {
		c.seen = msgs
		if fenced && txOpen && !busy {
			c.since = now
		} else {
			c.since = time.Time{}
		}
		return 0
	}
	return now.Sub(c.since)
}

// expire ends a session that held a fence row past the bound.
func (w *watchdog) expire(h *fenceSession, s gateConn) {
	h.idle.ended = true
	h.mu.Lock()
	gen := h.st.Gate().Gen
	if !h.st.Gate().Gated {
		gen, _ = h.st.Generation()
	}
	h.mu.Unlock()
	what := fmt.Sprintf("job %q's fence row (token %d)", gen.JobKey, gen.Token)
	if gen.JobKey == "" {
		what = "a fence row, or locks on protected data a gated write waits for,"
	}
	msg := fmt.Sprintf("pgfence ended this session: its transaction held %s while the client was silent for %s (gate_idle_timeout), so a takeover could not proceed; the transaction was rolled back. Reconnect and retry; keep a gated transaction short, or raise gate_idle_timeout (keep it under the lease TTL)", what, w.bound)
	w.log.Info("gated transaction idle past the bound; ending the session",
		zap.Uint32("backend_pid", s.backendPID()), zap.String("user", h.user), zap.String("database", h.db),
		zap.String("job_key", gen.JobKey), zap.Int64("token", gen.Token), zap.Duration("gate_idle_timeout", w.bound))
	h.f.Stats.Codes.Add(fence.CodeGateTimeout)
	s.endWith(&ProtocolError{Code: fence.CodeGateTimeout, Msg: msg, Err: fmt.Errorf("gate idle timeout")})
}
