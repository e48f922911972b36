package proxy

import (
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// The per-database counters of the console's SHOW STATS, SHOW
// STATS_TOTALS, SHOW STATS_AVERAGES and SHOW TOTALS, counted as PgBouncer
// counts them (src/stats.c, src/client.c, src/server.c):
//
//   - a query is a request from the moment the client sends it with
//     nothing in flight until the ReadyForQuery that leaves nothing in
//     flight (pipelined requests count as one, as in PgBouncer); its time
//     is query_time;
//   - a transaction starts with the first query while none is open and
//     ends at a ReadyForQuery with status idle; its time is xact_time;
//   - received and sent are the bytes of the client's messages and of the
//     server's (the gate's injected statements and their answers
//     included);
//   - wait_time is the time clients waited for PAUSE to end (PgBouncer:
//     for a server);
//   - server_assignment_count counts sessions opened (in session mode a
//     client gets its server once).
//
// Each session counts into its own atomics, written by the goroutine or
// loop thread relaying it, so the relay never contends on a shared line;
// a session's counts move to its database's totals when it ends. The
// clock is read twice per query (a vDSO call; docs/proxy.md, Performance).

// monoBase is the origin of monoNow.
var monoBase = time.Now()

// monoNow returns monotonic nanoseconds since the process started, >= 1
// (0 means "not started" in the counters).
func monoNow() int64 { return int64(time.Since(monoBase)) + 1 }

// monoAt is monoNow at t (a time.Now reading: monotonic).
func monoAt(t time.Time) int64 { return int64(t.Sub(monoBase)) + 1 }

// sessionStats are one session's counters.
type sessionStats struct {
	queries, xacts  atomic.Int64
	recv, sent      atomic.Int64 // bytes
	queryNs, xactNs atomic.Int64
	waitNs          atomic.Int64
	// qStart and xStart are the monoNow of the open query's and
	// transaction's start, 0 when none is open.
	qStart, xStart atomic.Int64
	lastRequest    atomic.Int64 // wall clock of the latest request, unix ns
}

// beginQuery records a request sent with nothing in flight. Client side.
func (st *sessionStats) beginQuery() {
	now := time.Now()
	m := int64(now.Sub(monoBase)) + 1
	st.lastRequest.Store(now.UnixNano())
	if !st.qStart.CompareAndSwap(0, m) {
		return // the server side has not closed the previous one yet: one query
	}
	st.queries.Add(1)
	if st.xStart.CompareAndSwap(0, m) {
		st.xacts.Add(1)
	}
}

// endQuery records that nothing is in flight any more, with the
// transaction status txStatus. Either side.
func (st *sessionStats) endQuery(txStatus byte) {
	qs := st.qStart.Swap(0)
	if qs == 0 {
		return
	}
	now := monoNow()
	st.queryNs.Add(now - qs)
	if txStatus == 'I' {
		if xs := st.xStart.Swap(0); xs != 0 {
			st.xactNs.Add(now - xs)
		}
	}
}

// dbTotals are counters summed over sessions, PgBouncer's PgStats.
type dbTotals struct {
	assignments, queries, xacts, recv, sent int64
	queryUs, xactUs, waitUs                 int64
}

func (t *dbTotals) add(o dbTotals) {
	t.assignments += o.assignments
	t.queries += o.queries
	t.xacts += o.xacts
	t.recv += o.recv
	t.sent += o.sent
	t.queryUs += o.queryUs
	t.xactUs += o.xactUs
	t.waitUs += o.waitUs
}

func (t dbTotals) sub(o dbTotals) dbTotals {
	return dbTotals{t.assignments - o.assignments, t.queries - o.queries, t.xacts - o.xacts, t.recv - o.recv, t.sent - o.sent,
		t.queryUs - o.queryUs, t.xactUs - o.xactUs, t.waitUs - o.waitUs}
}

// totals returns the session's counters so far (its open query and
// transaction not yet timed).
func (st *sessionStats) totals() dbTotals {
	return dbTotals{
		queries: st.queries.Load(), xacts: st.xacts.Load(),
		recv: st.recv.Load(), sent: st.sent.Load(),
		queryUs: st.queryNs.Load() / 1000, xactUs: st.xactNs.Load() / 1000, waitUs: st.waitNs.Load() / 1000,
	}
}

// statsPeriod is PgBouncer's default stats_period: the averages are
// rates over the period before the last one ended, and up to now.
const statsPeriod = 60 * time.Second

// dbStats keeps the totals of ended sessions and the snapshots the
// averages are computed from.
type dbStats struct {
	mu    sync.Mutex
	ended map[string]*dbTotals // by database: sessions that ended, and assignments of all
	// newer is the snapshot taken at newerAt, older the one before it
	// (at olderAt); the averages are (now - older) / (now - olderAt).
	newer, older     map[string]dbTotals
	newerAt, olderAt time.Time
}

// assigned counts a session opened on db.
func (d *dbStats) assigned(db string) {
	d.mu.Lock()
	d.get(db).assignments++
	d.mu.Unlock()
}

// get returns db's totals of ended sessions. d.mu held.
func (d *dbStats) get(db string) *dbTotals {
	if d.ended == nil {
		d.ended = map[string]*dbTotals{}
	}
	t := d.ended[db]
	if t == nil {
		t = &dbTotals{}
		d.ended[db] = t
	}
	return t
}

// sessionEnded moves a session's counters to its database's totals and
// marks it ended, at once for statsByDB.
func (d *dbStats) sessionEnded(sess *Session) {
	d.mu.Lock()
	d.get(sess.Database).add(sess.info.stats.totals())
	sess.info.ended.Store(true)
	d.mu.Unlock()
}

// waited counts a new client's wait for RESUME on db.
func (d *dbStats) waited(db string, ns int64) {
	d.mu.Lock()
	d.get(db).waitUs += ns / 1000
	d.mu.Unlock()
}

// statsByDB returns the totals by database: ended sessions plus the open
// ones.
func (s *Server) statsByDB() map[string]dbTotals {
	d := &s.ops.dbStats
	out := map[string]dbTotals{}
	d.mu.Lock()
	defer d.mu.Unlock()
	for db, t := range d.ended {
		out[db] = *t
	}
	for _, ss := range s.sessions() {
		if ss.info.ended.Load() {
			continue
		}
		t := out[ss.Database]
		t.add(ss.info.stats.totals())
		out[ss.Database] = t
	}
	return out
}

// statsSnapshot returns the current totals and the snapshot the averages
// start from, with the seconds between them, rotating the snapshots once
// a stats period has passed since the last rotation (PgBouncer rotates on
// a timer; pgfence when the stats are read, so an idle console costs
// nothing).
func (s *Server) statsSnapshot() (cur, old map[string]dbTotals, secs float64) {
	cur = s.statsByDB()
	d := &s.ops.dbStats
	now := time.Now()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.newerAt.IsZero() {
		d.newer, d.newerAt = map[string]dbTotals{}, s.ops.started
	}
	if now.Sub(d.newerAt) >= statsPeriod {
		d.older, d.olderAt = d.newer, d.newerAt
		d.newer, d.newerAt = maps.Clone(cur), now
	}
	old, since := d.older, d.olderAt
	if old == nil {
		old, since = map[string]dbTotals{}, s.ops.started
	}
	return cur, old, now.Sub(since).Seconds()
}

// averages returns PgBouncer's averages of cur over old across secs:
// rates per second for counts and bytes, microseconds per query,
// transaction or assignment for the times.
func averages(cur, old dbTotals, secs float64) dbTotals {
	d := cur.sub(old)
	var a dbTotals
	if secs <= 0 {
		return a
	}
	rate := func(n int64) int64 { return int64(float64(n) / secs) }
	per := func(n, by int64) int64 {
		if by <= 0 {
			return 0
		}
		return n / by
	}
	a.assignments, a.queries, a.xacts = rate(d.assignments), rate(d.queries), rate(d.xacts)
	a.recv, a.sent = rate(d.recv), rate(d.sent)
	a.queryUs, a.xactUs, a.waitUs = per(d.queryUs, d.queries), per(d.xactUs, d.xacts), per(d.waitUs, d.assignments)
	return a
}

// sortedDBs returns the keys of m in order.
func sortedDBs(m map[string]dbTotals) []string {
	return slices.Sorted(maps.Keys(m))
}
