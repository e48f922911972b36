package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/session"
)

// LSN is a WAL position (pg_lsn) as its 64-bit value.
type LSN uint64

func (l LSN) String() string { return fmt.Sprintf("%X/%X", uint64(l)>>32, uint32(l)) }

// parseLSN reads "X/Y"; the empty string (NULL) is 0.
func parseLSN(s string) (LSN, error) {
	if s == "" {
		return 0, nil
	}
	v, err := session.ParseLSN(s)
	if err != nil {
		return 0, fmt.Errorf("parse lsn %q: %w", s, err)
	}
	return LSN(v), nil
}

// takeoverChannel is the channel fence.acquire and fence.retire notify.
const takeoverChannel = "pgfence_takeover"

// takeover is the latest generation of one job the proxy knows, with a
// primary WAL position at or after the end of its commit record.
type takeover struct {
	epoch, token int64
	lsn          LSN
}

// takeovers is what one database's watcher learned from pgfence_takeover
// (DESIGN §6): per job the latest takeover and its position, the largest
// takeover position, and the floor: the primary's position when the
// watcher last (re)connected, which covers every takeover before it.
// Readers need no lock for the hot path: floor and max are atomics.
type takeovers struct {
	floor atomic.Uint64
	max   atomic.Uint64
	seen  atomic.Int64 // notifications recorded (tests observe it)

	mu   sync.RWMutex
	jobs map[string]takeover
}

// lookup returns the latest takeover of job known.
func (t *takeovers) lookup(job string) (takeover, bool) {
	t.mu.RLock()
	tk, ok := t.jobs[job]
	t.mu.RUnlock()
	return tk, ok
}

// record keeps tk for job when it is newer than what is known. fromNotify
// says it came from a notification (it then raises max).
func (t *takeovers) record(job string, tk takeover, fromNotify bool) {
	t.mu.Lock()
	if t.jobs == nil {
		t.jobs = map[string]takeover{}
	}
	if old, ok := t.jobs[job]; !ok || tk.token > old.token || tk.token == old.token && tk.lsn < old.lsn {
		t.jobs[job] = tk
	}
	t.mu.Unlock()
	if fromNotify {
		for {
			m := t.max.Load()
			if uint64(tk.lsn) <= m || t.max.CompareAndSwap(m, uint64(tk.lsn)) {
				break
			}
		}
		t.seen.Add(1)
	}
}

// all is the position a reader without fence metadata needs: every
// takeover seen, and everything before the watcher started.
func (t *takeovers) all() LSN { return LSN(max(t.floor.Load(), t.max.Load())) }

// takeoverNote is a pgfence_takeover payload.
type takeoverNote struct {
	JobKey  string `json:"job_key"`
	Epoch   int64  `json:"epoch"`
	Token   int64  `json:"token"`
	Retired bool   `json:"retired"`
}

// insertLSNQuery is the primary's WAL insert position, the end of every
// record inserted so far, committed or not. Once a pgfence_takeover
// notification has been delivered, the notifying transaction's commit
// record has been inserted (a listener reads a notification only after
// its transaction is seen committed, which is after the commit record is
// inserted), so the position is at or after the end of that record even
// when the transaction ran with synchronous_commit off and nothing has
// written or flushed it yet. The write position (pg_current_wal_lsn) gives
// no such promise: it can precede an asynchronous commit's record.
//
// The insert position of an empty new page points past the page header,
// where no record can end, while a replica that has replayed everything
// reports the page boundary (the end of the last record). The query
// reports the boundary then, or a replica that has replayed everything
// would look one header behind until more WAL comes.
var insertLSNQuery = own("wal insert position", onControl, `SELECT (CASE
  WHEN ((l OPERATOR(pg_catalog.-) '0/0'::pg_catalog.pg_lsn) OPERATOR(pg_catalog.%) (SELECT s.setting::pg_catalog.numeric
      FROM pg_catalog.pg_settings AS s WHERE s.name OPERATOR(pg_catalog.=) 'wal_segment_size'::pg_catalog.text))
    OPERATOR(pg_catalog.=) '40'::pg_catalog.numeric THEN l OPERATOR(pg_catalog.-) '40'::pg_catalog.numeric
  WHEN ((l OPERATOR(pg_catalog.-) '0/0'::pg_catalog.pg_lsn) OPERATOR(pg_catalog.%) pg_catalog.current_setting('wal_block_size')::pg_catalog.numeric)
    OPERATOR(pg_catalog.=) '24'::pg_catalog.numeric THEN l OPERATOR(pg_catalog.-) '24'::pg_catalog.numeric
  ELSE l END)::pg_catalog.text
FROM pg_catalog.pg_current_wal_insert_lsn() AS l`)

// insertLSN runs insertLSNQuery.
func insertLSN(ctx context.Context, conn *pgconn.PgConn) (LSN, error) {
	return queryLSN(ctx, conn, insertLSNQuery)
}

// writeLSN asks the primary for its WAL write position: how far WAL can
// have reached replicas, for the replay lag (not for takeovers: see
// insertLSNQuery).
func writeLSN(ctx context.Context, conn *pgconn.PgConn) (LSN, error) {
	return queryLSN(ctx, conn, writeLSNQuery)
}

// writeLSNQuery is the primary's WAL write position.
var writeLSNQuery = own("poller: primary's wal write position", onControl, "SELECT pg_catalog.pg_current_wal_lsn()::pg_catalog.text")

// replayQuery is a replica's replay position and whether it is one.
var replayQuery = own("poller: replica's replay position", onControl,
	"SELECT coalesce(pg_catalog.pg_last_wal_replay_lsn()::pg_catalog.text, ''), pg_catalog.pg_is_in_recovery()::pg_catalog.text")

func queryLSN(ctx context.Context, conn *pgconn.PgConn, sql string) (LSN, error) {
	var v string
	rr := conn.ExecParams(ctx, sql, nil, nil, nil, nil)
	for rr.NextRow() {
		v = string(rr.Values()[0])
	}
	if _, err := rr.Close(); err != nil {
		return 0, fmt.Errorf("wal position: %w", err)
	}
	return parseLSN(v)
}

// recordNotes stamps the pending notifications with the primary's insert
// position, now that they have been delivered (insertLSNQuery).
func (t *takeovers) recordNotes(ctx context.Context, conn *pgconn.PgConn, notes []string, log *zap.Logger) error {
	if len(notes) == 0 {
		return nil
	}
	lsn, err := insertLSN(ctx, conn)
	if err != nil {
		return err
	}
	for _, p := range notes {
		var n takeoverNote
		if err := json.Unmarshal([]byte(p), &n); err != nil || n.JobKey == "" {
			log.Warn("ignoring malformed takeover notification", zap.String("payload", p), zap.Error(err))
			continue
		}
		t.record(n.JobKey, takeover{epoch: n.Epoch, token: n.Token, lsn: lsn}, true)
		log.Debug("takeover seen", zap.String("job_key", n.JobKey), zap.Int64("token", n.Token), zap.Stringer("lsn", lsn))
	}
	return nil
}

// ---------------------------------------------------------------------------
// Replica positions and health

// Defaults for read routing.
const (
	DefaultReplicaPoll   = 50 * time.Millisecond
	DefaultReplicaMaxLag = 10 * time.Second
	DefaultReadWait      = time.Second
)

// replica is one configured replica: its control connection's latest
// observations. The poller goroutine writes; sessions read atomics only.
type replica struct {
	idx  int
	cfg  *pgconn.Config
	addr string

	healthy atomic.Bool
	replay  atomic.Uint64 // pg_last_wal_replay_lsn()
	lagNs   atomic.Int64  // replay lag in time (see poll)
	lagB    atomic.Int64  // replay lag in bytes behind the primary's last sample
	errMsg  atomic.Pointer[string]

	kick    chan struct{}                 // ask for a poll now
	sampled atomic.Pointer[chan struct{}] // closed after the next poll
}

// replicas polls every replica's replay position and the primary's WAL
// position, and decides health: up, in recovery, and replay lag under
// maxLag. The pollers connect (with the DSNs' credentials) to a database
// that has client sessions, db's choice, and hold no connection while no
// database has any: the proxy never sits idle in a database nobody uses
// through it, where it would block DROP DATABASE, ALTER DATABASE ...
// RENAME and CREATE DATABASE ... TEMPLATE.
type replicas struct {
	stats   RouteStats
	list    []*replica
	primary *pgconn.Config
	poll    time.Duration
	maxLag  time.Duration
	db      func(prev string, failed bool) string // catalogs.sessionDB
	log     *zap.Logger

	next atomic.Uint32 // round robin for new replica connections

	primaryLSN atomic.Uint64
	samplesMu  sync.Mutex
	samples    []lsnSample // recent (time, primary LSN), oldest first

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

type lsnSample struct {
	at  time.Time
	lsn LSN
}

func newReplicas(primary *pgconn.Config, cfgs []*pgconn.Config, poll, maxLag time.Duration, db func(prev string, failed bool) string, log *zap.Logger) *replicas {
	ctx, cancel := context.WithCancel(context.Background())
	rs := &replicas{primary: primary, poll: poll, maxLag: maxLag, db: db, log: log, ctx: ctx, cancel: cancel}
	for i, c := range cfgs {
		r := &replica{idx: i, cfg: c, addr: fmt.Sprintf("%s:%d", c.Host, c.Port), kick: make(chan struct{}, 1)}
		ch := make(chan struct{})
		r.sampled.Store(&ch)
		msg := "not polled yet"
		r.errMsg.Store(&msg)
		rs.list = append(rs.list, r)
	}
	rs.wg.Add(1 + len(rs.list))
	go func() { defer rs.wg.Done(); rs.pollPrimary() }()
	for _, r := range rs.list {
		go func() { defer rs.wg.Done(); rs.pollReplica(r) }()
	}
	return rs
}

func (rs *replicas) close() {
	rs.cancel()
	rs.wg.Wait()
}

// pick returns a healthy replica for a new connection, round robin, or nil.
func (rs *replicas) pick() *replica {
	n := len(rs.list)
	start := int(rs.next.Add(1))
	for i := range n {
		if r := rs.list[(start+i)%n]; r.healthy.Load() {
			return r
		}
	}
	return nil
}

// refresh asks r for a new poll and waits for it (or ctx). It reports the
// replay position then.
func (r *replica) refresh(ctx context.Context) (LSN, error) {
	ch := *r.sampled.Load()
	select {
	case r.kick <- struct{}{}:
	default:
	}
	select {
	case <-ch:
		return LSN(r.replay.Load()), nil
	case <-ctx.Done():
		return LSN(r.replay.Load()), ctx.Err()
	}
}

// pollConn is a poller's connection, kept in a database that has client
// sessions (replicas.db) and moved or closed when that one has none.
type pollConn struct {
	cfg    *pgconn.Config
	conn   *pgconn.PgConn
	db     string
	failed bool // the last connection attempt or poll failed
}

// use returns the connection to poll with, connecting when needed; nil
// while no database has sessions or when connecting failed (err).
func (pc *pollConn) use(rs *replicas) (*pgconn.PgConn, error) {
	db := rs.db(pc.db, pc.failed)
	if db != pc.db {
		pc.close()
		pc.db = db
	}
	if db == "" || pc.conn != nil {
		return pc.conn, nil
	}
	ctx, cancel := context.WithTimeout(rs.ctx, 5*time.Second)
	defer cancel()
	c, err := dialControl(ctx, pc.cfg, db, pollerAppName, rs.log, nil)
	if pc.failed = err != nil; err != nil {
		return nil, err
	}
	pc.conn = c
	return c, nil
}

// fail drops the connection after a failed poll.
func (pc *pollConn) fail() {
	pc.close()
	pc.failed = true
}

func (pc *pollConn) close() {
	if pc.conn != nil {
		pc.conn.Close(context.Background())
		pc.conn = nil
	}
}

func (rs *replicas) pollPrimary() {
	pc := &pollConn{cfg: rs.primary}
	defer pc.close()
	t := time.NewTicker(rs.poll)
	defer t.Stop()
	for {
		conn, err := pc.use(rs)
		if err != nil && rs.ctx.Err() == nil {
			rs.log.Debug("replica lag: cannot reach the primary", zap.Error(err))
		}
		if conn != nil {
			ctx, cancel := context.WithTimeout(rs.ctx, 5*time.Second)
			lsn, err := writeLSN(ctx, conn)
			cancel()
			if err != nil {
				pc.fail()
			} else {
				pc.failed = false
				now := time.Now()
				rs.primaryLSN.Store(uint64(lsn))
				rs.samplesMu.Lock()
				rs.samples = append(rs.samples, lsnSample{now, lsn})
				// Keep twice the lag bound of history.
				cut := 0
				for cut < len(rs.samples)-1 && now.Sub(rs.samples[cut].at) > 2*rs.maxLag {
					cut++
				}
				rs.samples = append(rs.samples[:0], rs.samples[cut:]...)
				rs.samplesMu.Unlock()
			}
		}
		select {
		case <-rs.ctx.Done():
			return
		case <-t.C:
		}
	}
}

// lag is how long ago the primary was at a position the replica has not
// replayed yet (0 when it has replayed the latest sample), and the bytes
// behind the latest sample.
func (rs *replicas) lag(replay LSN, now time.Time) (time.Duration, int64) {
	rs.samplesMu.Lock()
	defer rs.samplesMu.Unlock()
	if len(rs.samples) == 0 {
		return 0, 0
	}
	last := rs.samples[len(rs.samples)-1]
	var bytes int64
	if last.lsn > replay {
		bytes = int64(last.lsn - replay)
	}
	for _, s := range rs.samples {
		if s.lsn > replay {
			return now.Sub(s.at), bytes
		}
	}
	return 0, bytes
}

func (rs *replicas) pollReplica(r *replica) {
	log := rs.log.With(zap.String("replica", r.addr))
	pc := &pollConn{cfg: r.cfg}
	defer pc.close()
	setDown := func(why string) {
		if r.healthy.Swap(false) {
			log.Warn("replica out of rotation", zap.String("reason", why))
		}
		r.errMsg.Store(&why)
	}
	t := time.NewTicker(rs.poll)
	defer t.Stop()
	failures := 0
	for {
		var conn *pgconn.PgConn
		if pc.conn != nil || failures%max(1, int(time.Second/rs.poll)) == 0 {
			var err error
			if conn, err = pc.use(rs); err != nil {
				setDown("cannot connect: " + err.Error())
			}
		}
		switch {
		case conn != nil:
			ctx, cancel := context.WithTimeout(rs.ctx, 5*time.Second)
			rr := conn.ExecParams(ctx, replayQuery, nil, nil, nil, nil)
			var lsnText, rec string
			for rr.NextRow() {
				lsnText, rec = string(rr.Values()[0]), string(rr.Values()[1])
			}
			_, err := rr.Close()
			cancel()
			var lsn LSN
			if err == nil {
				lsn, err = parseLSN(lsnText)
			}
			switch {
			case err != nil:
				pc.fail()
				failures = 1
				setDown("poll failed: " + err.Error())
			case rec != "true":
				setDown("not in recovery (promoted?)")
			default:
				failures = 0
				pc.failed = false
				for {
					old := r.replay.Load()
					if uint64(lsn) <= old || r.replay.CompareAndSwap(old, uint64(lsn)) {
						break
					}
				}
				lag, bytes := rs.lag(lsn, time.Now())
				r.lagNs.Store(int64(lag))
				r.lagB.Store(bytes)
				if lag > rs.maxLag {
					setDown(fmt.Sprintf("replay lag %s over the bound %s", lag.Round(time.Millisecond), rs.maxLag))
				} else if !r.healthy.Swap(true) {
					log.Info("replica in rotation", zap.Stringer("replay_lsn", lsn))
					ok := ""
					r.errMsg.Store(&ok)
				}
			}
		case pc.db == "":
			// No client sessions: nobody reads; the last state stands.
			failures = 0
		default:
			failures++
		}
		// Wake the waiters of this poll.
		ch := make(chan struct{})
		close(*r.sampled.Swap(&ch))
		select {
		case <-rs.ctx.Done():
			return
		case <-t.C:
		case <-r.kick:
		}
	}
}

// status reports the replicas for SHOW UPSTREAMS and the metrics.
func (rs *replicas) status(context.Context) []UpstreamStatus {
	out := make([]UpstreamStatus, 0, len(rs.list))
	for _, r := range rs.list {
		us := UpstreamStatus{Role: "replica", Addr: r.addr, Healthy: r.healthy.Load(),
			ReplayLag: time.Duration(r.lagNs.Load()), LagBytes: r.lagB.Load(), LagKnown: r.replay.Load() != 0}
		if e := r.errMsg.Load(); e != nil {
			us.Error = *e
		}
		out = append(out, us)
	}
	return out
}

// The Server's replica set: set up, closed, counted, and asked where a
// CancelRequest goes.

// initReplicas sets up read routing when replicas are configured, reads
// may use them, and the interceptor routes reads (ReadRouter: the write
// gate classifies statements). The pollers start at once; they connect in
// the background.
func (s *Server) initReplicas() {
	if len(s.replicas) == 0 || s.cfg.NoReplicaReads {
		return
	}
	rr, ok := s.cfg.Interceptor.(ReadRouter)
	if !ok {
		return
	}
	s.rs = newReplicas(s.primary, s.replicas, s.cfg.ReplicaPoll, s.cfg.ReplicaMaxLag, rr.RouteReads(), s.log.Named("replicas"))
	s.SetReplicaStatus(s.rs.status)
}

func (s *Server) closeReplicas() {
	if s.rs != nil {
		s.rs.close()
	}
}

// RouteStats returns the read-routing counters (nil without read routing).
func (s *Server) RouteStats() *RouteStats {
	if s.rs == nil {
		return nil
	}
	return &s.rs.stats
}

// cancelRoute redirects a CancelRequest to the session's replica backend
// while the session's requests run there.
func (s *Server) cancelRoute(pid uint32, t cancelTarget) cancelTarget {
	if s.rs == nil {
		return t
	}
	s.mu.Lock()
	var sess *Session
	for _, ss := range s.conns {
		if ss != nil && ss.cancelPID == pid {
			sess = ss
			break
		}
	}
	s.mu.Unlock()
	if sess == nil {
		return t
	}
	if rt, ok := sess.replicaCancelTarget(); ok {
		return rt
	}
	return t
}
