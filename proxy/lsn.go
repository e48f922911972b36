package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

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

// takeover is the latest generation of one job the proxy has read from
// the primary's fence row (fence.fences), with a primary WAL position at
// or after the end of the commit that made the row so.
type takeover struct {
	epoch, token int64
	retired      bool
	lsn          LSN
}

// Bounds of what the takeover tracker holds, whatever is notified.
const (
	// maxPendingJobs and maxPendingBytes bound the job keys waiting to be
	// read (notified or hinted); readers' hints get half of them, so that
	// they cannot crowd out notifications.
	maxPendingJobs  = 1024
	maxPendingBytes = 256 << 10
	// maxKnownJobs and maxKnownBytes bound the jobs known; past them an
	// arbitrary one is forgotten (its readers fall back to the replica's
	// fence row until it is read again).
	maxKnownJobs  = 65536
	maxKnownBytes = 8 << 20
	// maxJobKeyLen is fence.fences' limit on a job key (characters): a
	// longer key names no job.
	maxJobKeyLen = 200
	// hintEvery spaces the reads that readers' hints ask for.
	hintEvery = 20 * time.Millisecond
)

// The freshness barrier. Notifications reach the watcher in commit order,
// but nothing bounds how late: any login may queue a flood of them ahead
// of a real takeover (NOTIFY needs no privilege; round 14, attacker AA's
// break 1), and PostgreSQL stops a listener at a queue entry whose
// transaction has not finished committing (one stuck in its synchronous
// replication wait stalls every listener). So what the tracker has heard
// is trusted only as of a time the watcher proves: it NOTIFYs, on its own
// connection, a channel only it listens to (marker, fence_catalog.go),
// and when that marker comes back every notification of every
// transaction that committed before it was sent has come back before it
// (a transaction committed earlier queued its entries earlier, and the
// listener reads the queue in order), so every takeover acknowledged
// before that time is in the tracker once the jobs then pending are read.
// A read whose answer rests on the tracker (every takeover seen, a job's
// latest generation, the read set, which DDL notifications drop) is
// judged by it only while it is fresh as of freshWithin ago; otherwise
// the proxy does not know which takeovers it needs, and no replica serves
// it (the read policy decides, as for a replica that is behind). Markers
// are sent on demand only: a read that finds the tracker older than
// freshAsk asks for one, so under steady reads one tiny NOTIFY
// transaction per database is committed about every freshAsk, and an
// idle database gets none.
const (
	// freshWithin is how old the tracker may be for a read to be judged
	// by it: the window in which a takeover committed elsewhere may not be
	// known yet, whatever delays notifications. One replica poll
	// (DefaultReplicaPoll): the replay positions a read is compared with
	// are that old too.
	freshWithin = 50 * time.Millisecond
	// freshAsk: a read that finds the tracker older than this asks for a
	// marker, early enough that under steady reads it stays fresh.
	freshAsk = 40 * time.Millisecond
)

// takeovers is what one database's watcher knows of takeovers (DESIGN
// §6): per job the latest generation and its position, the largest
// position of a takeover it was notified of, and the floor: the primary's
// position when the watcher last (re)connected, which covers every
// takeover before it. Readers need no lock for the hot path: floor and
// max are atomics.
//
// A pgfence_takeover notification is a hint and nothing more: any login
// may NOTIFY any payload. It names a job whose fence row the watcher then
// reads on its own connection (verify), and only what that row says is
// recorded: never a token, an epoch or a position from a payload. A
// reader whose generation the proxy does not know asks for the same
// (hint). Pending job keys are coalesced and bounded; so are the jobs
// known.
type takeovers struct {
	floor atomic.Uint64
	max   atomic.Uint64
	// warned: the last read of fence.fences failed, and said so once.
	warned atomic.Bool
	// verified counts the reads of fence.fences that completed (tests
	// observe it).
	verified atomic.Uint64
	// heard counts the pgfence_takeover notifications taken (tests
	// observe it).
	heard atomic.Uint64

	mu    sync.RWMutex
	jobs  map[string]takeover
	bytes int // of the keys in jobs

	pmu      sync.Mutex
	pending  map[string]bool // job key → a notification named it (else only a reader's hint)
	pbytes   int
	hinted   int // pending keys from hints only, and their bytes
	hbytes   int
	dropped  bool // notifications were dropped: the next read covers them by position
	ignored  int  // payloads naming no job since the last read
	lastHint time.Time
	hintWait bool // a delayed kick is armed
	kick     chan struct{}

	// The freshness barrier (freshWithin). fresh: the send time (Unix
	// nanoseconds) of the last marker whose notifications before it are
	// all in the tracker; 0: none. markAsk: a reader asked for a marker.
	// markSent: the send time of the marker in flight; 0: none. freshCh
	// is closed each time fresh is published. marks counts the markers
	// sent (tests, stats).
	fresh    atomic.Int64
	markAsk  atomic.Bool
	markSent atomic.Int64
	freshCh  atomic.Pointer[chan struct{}]
	marks    atomic.Uint64
}

// current reports whether the tracker is fresh enough, at now, for a read
// to be judged by it (freshWithin), and asks the watcher for a marker
// when it is getting old (freshAsk). Any goroutine; two atomic loads on
// the common path.
func (t *takeovers) current(now time.Time) bool {
	f := t.fresh.Load()
	age := now.UnixNano() - f
	if f == 0 || age > int64(freshAsk) {
		t.ask()
	}
	return f != 0 && age <= int64(freshWithin)
}

// ask asks the watcher for a marker (it sends one unless one is in
// flight).
func (t *takeovers) ask() {
	if !t.markAsk.Swap(true) {
		t.wake()
	}
}

// waitable reports whether a marker may make the tracker fresh soon: none
// is in flight (one is sent when asked), or the one in flight was sent
// within freshWithin. A marker older than that is held up behind
// something (a flood, a stalled commit): waiting for it would only delay
// the read.
func (t *takeovers) waitable(now time.Time) bool {
	s := t.markSent.Load()
	return s == 0 || now.UnixNano()-s <= int64(freshWithin)
}

// published returns a channel closed when fresh is next published.
func (t *takeovers) published() <-chan struct{} {
	for {
		if p := t.freshCh.Load(); p != nil {
			return *p
		}
		ch := make(chan struct{})
		t.freshCh.CompareAndSwap(nil, &ch)
	}
}

// publish records that every notification sent before sent is in the
// tracker (the watcher, after reading the jobs pending when the marker
// sent then came back), and wakes the readers waiting for it.
func (t *takeovers) publish(sent time.Time) {
	if n := sent.UnixNano(); n > t.fresh.Load() {
		t.fresh.Store(n)
	}
	ch := make(chan struct{})
	if old := t.freshCh.Swap(&ch); old != nil {
		close(*old)
	}
}

// waitFresh waits until the tracker is current (asking for markers as it
// goes), ctx ends or done is closed; it reports whether it is current.
func (t *takeovers) waitFresh(ctx context.Context, done <-chan struct{}) bool {
	for {
		ch := t.published()
		if t.current(time.Now()) {
			return true
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return false
		case <-done:
			return false
		}
	}
}

// lookup returns the latest takeover of job known.
func (t *takeovers) lookup(job string) (takeover, bool) {
	t.mu.RLock()
	tk, ok := t.jobs[job]
	t.mu.RUnlock()
	return tk, ok
}

// update records what job's fence row showed at lsn and returns the
// job's takeover now and whether the row was new to the tracker (a newer
// token, or the epoch or retirement changed). A token already known keeps
// its earlier, smaller position.
func (t *takeovers) update(job string, row takeover) (takeover, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.jobs == nil {
		t.jobs = map[string]takeover{}
	}
	old, ok := t.jobs[job]
	switch {
	case ok && row.token < old.token:
		return old, false // a read older than what is known (cannot happen: rows only grow)
	case ok && row.token == old.token:
		if row.epoch == old.epoch && row.retired == old.retired {
			return old, false
		}
		row.lsn = old.lsn
		t.jobs[job] = row
		return row, true
	}
	if !ok {
		for k := range t.jobs {
			if len(t.jobs) < maxKnownJobs && t.bytes+len(job) <= maxKnownBytes {
				break
			}
			delete(t.jobs, k)
			t.bytes -= len(k)
		}
		t.bytes += len(job)
	}
	t.jobs[job] = row
	return row, true
}

// raise makes max at least lsn.
func (t *takeovers) raise(lsn LSN) {
	for {
		m := t.max.Load()
		if uint64(lsn) <= m || t.max.CompareAndSwap(m, uint64(lsn)) {
			return
		}
	}
}

// all is the position a reader without fence metadata needs: every
// takeover seen, and everything before the watcher started.
func (t *takeovers) all() LSN { return LSN(max(t.floor.Load(), t.max.Load())) }

// takeoverNote is the part of a pgfence_takeover payload the proxy reads:
// the job it names. (Migration 012 sends the job key and epoch; older
// schemas also a token, which is ignored.)
type takeoverNote struct {
	JobKey string `json:"job_key"`
}

// note takes a pgfence_takeover payload (on the watcher's goroutine, as
// pgconn receives it). It reports whether the payload named a job key.
func (t *takeovers) note(payload string) bool {
	t.heard.Add(1)
	var n takeoverNote
	if err := json.Unmarshal([]byte(payload), &n); err != nil || !possibleJobKey(n.JobKey) {
		t.pmu.Lock()
		t.ignored++
		t.pmu.Unlock()
		return false
	}
	t.add(n.JobKey, true)
	return true
}

// possibleJobKey: fence.fences can have a row for key (text has no NUL,
// and what the proxy sends is UTF-8).
func possibleJobKey(key string) bool {
	return key != "" && len(key) <= 4*maxJobKeyLen && utf8.ValidString(key) &&
		utf8.RuneCountInString(key) <= maxJobKeyLen && !strings.ContainsRune(key, 0)
}

// isASCII reports whether s is all ASCII.
func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

// hint asks the watcher to read job's fence row (a reader carries a
// generation of job the proxy does not know). The reads are spaced by
// hintEvery; hints of the same job coalesce. Any goroutine.
func (t *takeovers) hint(job string) {
	if !possibleJobKey(job) || !t.add(job, false) {
		return
	}
	t.pmu.Lock()
	defer t.pmu.Unlock()
	if t.hintWait {
		return
	}
	if wait := time.Until(t.lastHint.Add(hintEvery)); wait > 0 {
		t.hintWait = true
		time.AfterFunc(wait, func() {
			t.pmu.Lock()
			t.hintWait = false
			t.lastHint = time.Now()
			t.pmu.Unlock()
			t.wake()
		})
		return
	}
	t.lastHint = time.Now()
	t.wake()
}

// wake tells the watcher there is something to read.
func (t *takeovers) wake() {
	select {
	case t.kick <- struct{}{}:
	default:
	}
}

// add makes job pending and reports whether it was not already. A full
// set drops the key: a notification's is covered by position instead
// (dropped), a hint's is asked again by its reader's next read. Hints
// hold at most half the set.
func (t *takeovers) add(job string, notified bool) bool {
	t.pmu.Lock()
	defer t.pmu.Unlock()
	if n, ok := t.pending[job]; ok {
		if notified && !n {
			t.pending[job] = true
			t.hinted--
			t.hbytes -= len(job)
		}
		return false
	}
	full := len(t.pending) >= maxPendingJobs || t.pbytes+len(job) > maxPendingBytes
	if !notified {
		full = full || t.hinted >= maxPendingJobs/2 || t.hbytes+len(job) > maxPendingBytes/2
	}
	if full {
		if notified {
			t.dropped = true
		}
		return false
	}
	if t.pending == nil {
		t.pending = map[string]bool{}
	}
	t.pending[job] = notified
	t.pbytes += len(job)
	if !notified {
		t.hinted++
		t.hbytes += len(job)
	}
	return true
}

// hasPending reports whether a read is due.
func (t *takeovers) hasPending() bool {
	t.pmu.Lock()
	defer t.pmu.Unlock()
	return len(t.pending) > 0 || t.dropped
}

// take empties the pending set.
func (t *takeovers) take() (jobs map[string]bool, dropped bool, ignored int) {
	t.pmu.Lock()
	defer t.pmu.Unlock()
	jobs, dropped, ignored = t.pending, t.dropped, t.ignored
	t.pending, t.pbytes, t.hinted, t.hbytes, t.dropped, t.ignored = nil, 0, 0, 0, false, 0
	return jobs, dropped, ignored
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

// verifyQuery reads the fence rows of the jobs in $1 (a text array) and,
// evaluated after the statement's snapshot was taken, the primary's insert
// position: every row it returns was committed before that position
// (insertLSNQuery). Qualified throughout: it runs on the watcher's own
// connection, under the database's settings.
var verifyQuery = own("takeover verification", onControl, `SELECT l.lsn, f.job_key, f.epoch::pg_catalog.text, f.max_issued_token::pg_catalog.text,
  (f.retired_at IS NOT NULL)::pg_catalog.text
FROM (`+insertLSNQuery+`) AS l(lsn)
LEFT JOIN fence.fences AS f ON f.job_key OPERATOR(pg_catalog.=) ANY ($1::pg_catalog.text[])`)

// verify reads the fence rows of the pending jobs on the watcher's
// connection and records what they say (update), at the position read with
// them. A job a notification named raises max to the position of its
// latest takeover: its own, or the one just read if the row changed.
// A notification dropped for want of room raises max to the position read
// now, which covers every takeover committed before it. Without the
// fence schema (schema false), or when the rows cannot be read (no
// privilege), only max is raised: readers with fence metadata then fall
// back to the replica's fence row.
func (t *takeovers) verify(ctx context.Context, conn *pgconn.PgConn, schema bool, log *zap.Logger) error {
	jobs, dropped, ignored := t.take()
	if ignored > 0 {
		log.Debug("ignoring takeover notifications that name no job", zap.Int("count", ignored))
	}
	if len(jobs) == 0 && !dropped {
		return nil
	}
	notified := dropped
	// A key the server cannot convert would fail the whole read: in a
	// database whose encoding is neither UTF8 nor SQL_ASCII (both take any
	// UTF-8 without NUL), a key that is not ASCII is covered by position
	// instead, as a dropped one, and its readers use the fence-row check.
	enc := conn.ParameterStatus("server_encoding")
	asciiOnly := enc != "UTF8" && enc != "SQL_ASCII"
	keys := make([]string, 0, len(jobs))
	for k, n := range jobs {
		notified = notified || n
		if asciiOnly && !isASCII(k) {
			dropped = dropped || n
			continue
		}
		keys = append(keys, k)
	}
	fallback := func() error {
		if !notified {
			return nil
		}
		lsn, err := insertLSN(ctx, conn)
		if err != nil {
			return err
		}
		t.raise(lsn)
		t.verified.Add(1)
		return nil
	}
	if !schema {
		return fallback()
	}
	rr := conn.ExecParams(ctx, verifyQuery, [][]byte{textArray(keys)}, nil, nil, nil)
	type row struct {
		job string
		tk  takeover
	}
	var rows []row
	var lsnText string
	var bad error
	for rr.NextRow() {
		v := rr.Values()
		lsnText = string(v[0])
		if v[1] == nil {
			continue
		}
		epoch, err1 := strconv.ParseInt(string(v[2]), 10, 64)
		token, err2 := strconv.ParseInt(string(v[3]), 10, 64)
		if err := errors.Join(err1, err2); err != nil {
			bad = err
			continue
		}
		rows = append(rows, row{string(v[1]), takeover{epoch: epoch, token: token, retired: string(v[4]) == "true"}})
	}
	if _, err := rr.Close(); err != nil {
		var pg *pgconn.PgError
		if errors.As(err, &pg) {
			if !t.warned.Swap(true) {
				log.Warn("cannot read fence.fences to verify takeovers; readers with fence metadata fall back to the replica's fence row", zap.Error(err))
			}
			return fallback()
		}
		return err
	}
	lsn, err := parseLSN(lsnText)
	if err == nil {
		err = bad
	}
	if err != nil {
		return fmt.Errorf("verify takeovers: %w", err)
	}
	for _, r := range rows {
		r.tk.lsn = lsn
		tk, changed := t.update(r.job, r.tk)
		if !jobs[r.job] {
			continue
		}
		if changed {
			t.raise(lsn)
		} else {
			t.raise(tk.lsn)
		}
		log.Debug("takeover seen", zap.String("job_key", r.job), zap.Int64("epoch", tk.epoch), zap.Stringer("lsn", tk.lsn))
	}
	if dropped {
		t.raise(lsn)
	}
	t.warned.Store(false)
	t.verified.Add(1)
	return nil
}

// textArray is keys as a PostgreSQL text array literal.
func textArray(keys []string) []byte {
	b := []byte{'{'}
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, '"')
		for j := 0; j < len(k); j++ {
			if k[j] == '"' || k[j] == '\\' {
				b = append(b, '\\')
			}
			b = append(b, k[j])
		}
		b = append(b, '"')
	}
	return append(b, '}')
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

	// The primary eras the replica has shown (era.go): erasOK by
	// database, each with the poller connection (gen) it was shown on;
	// eraWant the eras asked for and not shown yet. gen changes with
	// every poller connection: a replica restarted or replaced shows its
	// eras again.
	gen     atomic.Uint64
	erasOK  atomic.Pointer[map[eraKey]uint64]
	eraMu   sync.Mutex
	eraWant map[eraKey]eraAsk
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
	eras    func() []eraKey                       // the primary eras known (era.go); nil: none
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

func newReplicas(primary *pgconn.Config, cfgs []*pgconn.Config, poll, maxLag time.Duration, db func(prev string, failed bool) string, eras func() []eraKey, log *zap.Logger) *replicas {
	ctx, cancel := context.WithCancel(context.Background())
	rs := &replicas{primary: primary, poll: poll, maxLag: maxLag, db: db, eras: eras, log: log, ctx: ctx, cancel: cancel}
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

// pick returns a healthy replica for a new connection, round robin, for
// which ok holds, or nil.
func (rs *replicas) pick(ok func(*replica) bool) *replica {
	n := len(rs.list)
	start := int(rs.next.Add(1))
	for i := range n {
		if r := rs.list[(start+i)%n]; r.healthy.Load() && ok(r) {
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
	var last *pgconn.PgConn // the connection the replica's eras were shown on (gen)
	for {
		var conn *pgconn.PgConn
		if pc.conn != nil || failures%max(1, int(time.Second/rs.poll)) == 0 {
			var err error
			if conn, err = pc.use(rs); err != nil {
				setDown("cannot connect: " + err.Error())
			}
		}
		if conn != last {
			last = conn
			r.gen.Add(1)
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
				// What the replica reports now, never a maximum kept
				// from before: a standby that crash-restarts, or is
				// rebuilt, may come back behind where it was, and reads
				// that need the older position must not go to it. Within
				// one postmaster's life (one poll connection) the
				// position only moves forward anyway.
				r.replay.Store(uint64(lsn))
				rs.confirmEras(r, pc, lsn, log)
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
	var eras func() []eraKey
	if es, ok := s.cfg.Interceptor.(eraSource); ok {
		eras = es.primaryEras
	}
	s.rs = newReplicas(s.primary, s.replicas, s.cfg.ReplicaPoll, s.cfg.ReplicaMaxLag, rr.RouteReads(), eras, s.log.Named("replicas"))
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
