// Package pool bounds the server connections a proxy's clients hold, as
// PgBouncer's pool settings do: per pool (a database and a user:
// default_pool_size, with reserve_pool_size more for a client that has
// waited reserve_pool_timeout), per database (max_db_connections) and per
// user (max_user_connections). A client over a limit waits its turn: in
// the order clients of its pool came, for at most query_wait_timeout.
//
// It hands out slots, and keeps the server connections parked between
// clients: what a connection is, and whether it may serve another client,
// is the caller's. Its seam with the proxy is a few calls: Acquire before
// a server connection is opened (it hands back a parked one of the same
// signature when there is one: Slot.Conn), Slot.Release when the
// connection is closed, Slot.Park when it is left, reset, for the next
// client (server_idle_timeout and server_lifetime bound how long it
// stays: Expire), Stats and Totals for the console and the metrics. A
// parked connection counts against every limit, as an open one does, and
// is closed when a client of another signature needs its place. The
// limits are read at every decision, so a reload applies to the next one.
package pool

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"time"
)

// Key names a pool.
type Key struct {
	Database string
	User     string
}

// Limits are the bounds that apply to a pool. Zero means no bound.
type Limits struct {
	// PoolSize bounds the slots of the pool (default_pool_size).
	PoolSize int
	// ReserveSize slots more may be given to a client that has waited
	// ReserveTimeout (reserve_pool_size, reserve_pool_timeout; a zero
	// timeout gives them to a client that would wait at all).
	ReserveSize    int
	ReserveTimeout time.Duration
	// MaxDB and MaxUser bound the slots of every pool of the database,
	// and of the user (max_db_connections, max_user_connections).
	MaxDB   int
	MaxUser int
	// WaitTimeout bounds a client's wait (query_wait_timeout).
	WaitTimeout time.Duration
	// IdleTimeout closes a connection parked longer (server_idle_timeout);
	// Lifetime one opened longer ago, less up to a tenth at random so that
	// connections opened together are not closed together
	// (server_lifetime). Zero: no bound.
	IdleTimeout time.Duration
	Lifetime    time.Duration
}

// Conn is a server connection the pools keep parked between clients.
type Conn interface{ Close() error }

// ErrWaitTimeout is the cause of a wait that lasted WaitTimeout.
var ErrWaitTimeout = errors.New("query_wait_timeout")

// WaitError is a wait that ended without a slot: WaitTimeout passed
// (Err is ErrWaitTimeout), or the context ended.
type WaitError struct {
	Key    Key
	Waited time.Duration
	Limits Limits
	// Full says which bound kept the client waiting when it gave up:
	// "default_pool_size", "max_db_connections" or "max_user_connections".
	Full string
	Err  error
}

func (e *WaitError) Error() string {
	return fmt.Sprintf("no server connection for database %q user %q after %s: %s reached: %v",
		e.Key.Database, e.Key.User, e.Waited.Round(time.Millisecond), e.Full, e.Err)
}

func (e *WaitError) Unwrap() error { return e.Err }

// Pools hands out slots under the limits. Safe for concurrent use.
type Pools struct {
	limits func(Key) Limits
	now    func() time.Time

	mu      sync.Mutex
	pools   map[Key]*state
	byDB    map[string]int
	byUser  map[string]int
	waiters []*waiter // every waiting client, in the order they came
	totals  Totals
}

// Totals are counters since the pools were made.
type Totals struct {
	// Waited counts the clients that had to wait for a slot, WaitTime
	// their waits' sum (those that got one); Timeouts the waits that
	// ended with ErrWaitTimeout.
	Waited   uint64
	WaitTime time.Duration
	Timeouts uint64
	// Reused counts the clients given a parked connection; Parked the
	// connections parked; Closed the parked connections closed: Evicted
	// for a client of another signature, Expired by IdleTimeout or
	// Lifetime (Expire, Park), the rest by CloseIdle.
	Reused, Parked, Closed, Evicted, Expired uint64
}

// state is one pool's.
type state struct {
	held    int // slots held, reserve ones included, parked ones too
	reserve int // of which reserve slots
	waiting int
	idle    []*parked // parked connections, the longest parked first
	// resetting: the signatures of connections being reset to be parked
	// (Slot.Parking), one entry each; a client of one waits for it
	// rather than opening a connection.
	resetting map[*Slot]string
}

// parked is a connection parked in a pool, with the slot it holds.
type parked struct {
	conn   Conn
	sig    string
	born   time.Time // when the connection was opened
	since  time.Time // when it was parked
	jitter float64   // of Lifetime taken off, [0, 0.1)
	slot   *Slot
	// evicted: closed for a client of another signature (by that
	// client, before its Acquire returns).
	evicted bool
}

type waiter struct {
	key   Key
	sig   string
	since time.Time
	ready chan struct{} // closed when granted
	// granted, reserve, conn, evicted: set under Pools.mu when the
	// slot is given; conn is a parked connection handed with it,
	// evicted the parked connections closed to make room for it, which
	// Acquire closes before it returns: the connection the client opens
	// next is never one over a limit.
	granted, reserve bool
	conn             *parked
	evicted          []Conn
}

// New returns pools whose bounds limits gives for each key.
func New(limits func(Key) Limits) *Pools {
	return &Pools{limits: limits, now: time.Now, pools: map[Key]*state{}, byDB: map[string]int{}, byUser: map[string]int{}}
}

// Slot is a client's right to one server connection of its pool, until
// Release (the connection is closed) or Park (it is left for the next
// client).
type Slot struct {
	p       *Pools
	key     Key
	reserve bool
	mu      sync.Mutex // Release and Park: the first one counts
	done    bool
	// Waited is how long the client waited for it.
	Waited time.Duration
	// Conn is the parked connection handed with the slot (nil: the
	// caller opens one), opened at Born.
	Conn Conn
	Born time.Time
}

// Reserve reports whether the slot is one of the pool's reserve.
func (s *Slot) Reserve() bool { return s.reserve }

// finish marks s released or parked; false if it already was.
func (s *Slot) finish() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return false
	}
	s.done = true
	return true
}

// Parking says that s's connection is being reset to be parked with
// signature sig (Park or Release comes next): a client of the pool with
// that signature waits for it rather than opening another, the reset
// costing less than a new connection.
func (s *Slot) Parking(sig string) {
	if sig == "" {
		return
	}
	p := s.p
	p.mu.Lock()
	defer p.mu.Unlock()
	st := p.pools[s.key]
	if st.resetting == nil {
		st.resetting = map[*Slot]string{}
	}
	st.resetting[s] = sig
}

// resetDoneLocked forgets that s's connection is being reset.
func (p *Pools) resetDoneLocked(s *Slot) {
	if st := p.pools[s.key]; st != nil {
		delete(st.resetting, s)
	}
}

// Release gives the slot back (its connection is closed, or was never
// opened); the first client waiting for one that now fits gets it.
// Releasing twice, or after Park, is harmless.
func (s *Slot) Release() {
	if !s.finish() {
		return
	}
	p := s.p
	p.mu.Lock()
	defer p.mu.Unlock()
	p.resetDoneLocked(s)
	p.dropLocked(s.key, s.reserve)
	p.grantLocked()
	p.forgetLocked(s.key)
}

// addLocked puts a slot of key back on the counts (dropLocked undone).
func (p *Pools) addLocked(key Key, reserve bool) {
	st := p.pools[key]
	st.held++
	if reserve {
		st.reserve++
	}
	p.byDB[key.Database]++
	p.byUser[key.User]++
}

// dropLocked takes a slot of key off the counts.
func (p *Pools) dropLocked(key Key, reserve bool) {
	st := p.pools[key]
	st.held--
	if reserve {
		st.reserve--
	}
	p.byDB[key.Database]--
	p.byUser[key.User]--
}

// Park leaves conn, reset by the caller and opened at born, to the next
// client of the pool whose Acquire names sig. The slot stays held by it.
// A connection past Lifetime is closed at once (the slot is released),
// one whose place a client of another signature waits for is closed by
// that client. Park after Release, or twice, closes conn. It reports
// whether conn was parked (or handed to a waiting client).
func (s *Slot) Park(conn Conn, sig string, born time.Time) bool {
	if !s.finish() {
		conn.Close()
		return false
	}
	p := s.p
	p.mu.Lock()
	p.resetDoneLocked(s)
	now := p.now()
	pk := &parked{conn: conn, sig: sig, born: born, since: now, jitter: rand.Float64() / 10, slot: &Slot{p: p, key: s.key, reserve: s.reserve}}
	if pk.expired(p.limits(s.key), now) {
		p.dropLocked(s.key, s.reserve)
		p.totals.Expired++
		p.totals.Closed++
		p.grantLocked()
		p.forgetLocked(s.key)
		p.mu.Unlock()
		conn.Close()
		return false
	}
	st := p.pools[s.key]
	st.idle = append(st.idle, pk)
	p.totals.Parked++
	p.grantLocked()
	parkedOK := !pk.evicted
	p.mu.Unlock()
	return parkedOK
}

// expired reports whether pk is past lim's IdleTimeout or Lifetime at now.
func (pk *parked) expired(lim Limits, now time.Time) bool {
	if lim.Lifetime > 0 && now.Sub(pk.born) >= time.Duration(float64(lim.Lifetime)*(1-pk.jitter)) {
		return true
	}
	return lim.IdleTimeout > 0 && now.Sub(pk.since) >= lim.IdleTimeout
}

func closeAll(cs []Conn) {
	for _, c := range cs {
		c.Close()
	}
}

// Expire closes the parked connections past IdleTimeout or Lifetime; the
// caller runs it now and then (every second is enough).
func (p *Pools) Expire() {
	p.mu.Lock()
	now := p.now()
	var closed []Conn
	for key, st := range p.pools {
		lim := p.limits(key)
		kept := st.idle[:0]
		for _, pk := range st.idle {
			if !pk.expired(lim, now) {
				kept = append(kept, pk)
				continue
			}
			closed = append(closed, pk.conn)
			p.dropLocked(key, pk.slot.reserve)
			p.totals.Expired++
			p.totals.Closed++
		}
		clear(st.idle[len(kept):])
		st.idle = kept
	}
	if len(closed) > 0 {
		p.grantLocked()
		for key := range p.pools {
			p.forgetLocked(key)
		}
	}
	p.mu.Unlock()
	closeAll(closed)
}

// Regrant gives slots to the waiting clients the limits now allow (the
// caller changed what its limits function returns: a reload).
func (p *Pools) Regrant() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.grantLocked()
}

// CloseIdleOf closes the parked connections of database db (every
// database's when db is empty: RECONNECT).
func (p *Pools) CloseIdleOf(db string) {
	p.mu.Lock()
	var closed []Conn
	for key, st := range p.pools {
		if db != "" && key.Database != db {
			continue
		}
		for _, pk := range st.idle {
			closed = append(closed, pk.conn)
			p.dropLocked(key, pk.slot.reserve)
			p.totals.Closed++
		}
		st.idle = nil
	}
	p.grantLocked()
	for key := range p.pools {
		p.forgetLocked(key)
	}
	p.mu.Unlock()
	closeAll(closed)
}

// CloseIdle closes every parked connection (a shutdown, or the primary
// changed under them).
func (p *Pools) CloseIdle() { p.CloseIdleOf("") }

// Acquire returns a slot of key's pool: at once when the limits allow,
// else after waiting behind the clients of the pool that came before.
// A connection parked in the pool with signature sig comes with it
// (Slot.Conn; the one parked last, whose caches are the warmest); an
// empty sig takes none. It gives up when ctx ends or Limits.WaitTimeout
// passes (*WaitError).
func (p *Pools) Acquire(ctx context.Context, key Key, sig string) (*Slot, error) {
	p.mu.Lock()
	st := p.stateLocked(key)
	start := p.now()
	w := &waiter{key: key, sig: sig, since: start, ready: make(chan struct{})}
	p.waiters = append(p.waiters, w)
	st.waiting++
	p.grantLocked()
	if w.granted {
		p.mu.Unlock()
		return w.slot(p, 0), nil
	}
	lim := p.limits(key)
	p.totals.Waited++
	p.mu.Unlock()

	var timeout, reserve <-chan time.Time
	if lim.WaitTimeout > 0 {
		t := time.NewTimer(lim.WaitTimeout)
		defer t.Stop()
		timeout = t.C
	}
	if lim.ReserveSize > 0 && lim.ReserveTimeout > 0 {
		t := time.NewTimer(lim.ReserveTimeout)
		defer t.Stop()
		reserve = t.C
	}
	for {
		var cause error
		select {
		case <-w.ready:
			return w.slot(p, p.now().Sub(start)), nil
		case <-reserve:
			// Now the reserve is open to it: look again.
			reserve = nil
			p.mu.Lock()
			p.grantLocked()
			p.mu.Unlock()
			continue
		case <-timeout:
			cause = ErrWaitTimeout
		case <-ctx.Done():
			cause = ctx.Err()
		}
		p.mu.Lock()
		if w.granted { // given in the meantime: keep it
			p.mu.Unlock()
			return w.slot(p, p.now().Sub(start)), nil
		}
		p.dropWaiterLocked(w)
		if cause == ErrWaitTimeout {
			p.totals.Timeouts++
		}
		full := p.fullLocked(key, p.limits(key), false)
		if full == "" {
			full = "a limit since raised" // given up before a decision looked again
		}
		p.forgetLocked(key)
		p.mu.Unlock()
		return nil, &WaitError{Key: key, Waited: p.now().Sub(start), Limits: lim, Full: full, Err: cause}
	}
}

// slot is the slot granted to w, which waited waited, once the
// connections evicted for it are closed.
func (w *waiter) slot(p *Pools, waited time.Duration) *Slot {
	closeAll(w.evicted)
	w.evicted = nil
	if w.conn != nil {
		s := w.conn.slot
		s.Waited, s.Conn, s.Born = waited, w.conn.conn, w.conn.born
		return s
	}
	return &Slot{p: p, key: w.key, reserve: w.reserve, Waited: waited}
}

func (p *Pools) stateLocked(key Key) *state {
	st := p.pools[key]
	if st == nil {
		st = &state{}
		p.pools[key] = st
	}
	return st
}

// forgetLocked drops an empty pool's state once nothing refers to it,
// keeping its counters only while it is in use: the console shows the
// pools with clients or parked connections.
func (p *Pools) forgetLocked(key Key) {
	if st := p.pools[key]; st != nil && st.held == 0 && st.waiting == 0 {
		delete(p.pools, key)
	}
	if p.byDB[key.Database] == 0 {
		delete(p.byDB, key.Database)
	}
	if p.byUser[key.User] == 0 {
		delete(p.byUser, key.User)
	}
}

// fullLocked names the bound that keeps a client of key from a slot, ""
// when none does; reserve: the client may use the reserve.
func (p *Pools) fullLocked(key Key, lim Limits, reserve bool) string {
	st := p.pools[key]
	size := lim.PoolSize
	if size > 0 && reserve {
		size += lim.ReserveSize
	}
	switch {
	case size > 0 && st.held >= size:
		return "default_pool_size"
	case lim.MaxDB > 0 && p.byDB[key.Database] >= lim.MaxDB:
		return "max_db_connections"
	case lim.MaxUser > 0 && p.byUser[key.User] >= lim.MaxUser:
		return "max_user_connections"
	}
	return ""
}

// grantLocked gives slots to the waiting clients that now fit, in the
// order they came; a client whose pool has an earlier client still
// waiting waits behind it. A client whose pool has a connection parked
// with its signature gets it; one kept out by a limit that parked
// connections count against gets the place of the longest parked of
// them, which it closes (waiter.evicted).
func (p *Pools) grantLocked() {
	if len(p.waiters) == 0 {
		return
	}
	now := p.now()
	blocked := map[Key]bool{}
	kept := p.waiters[:0]
	for _, w := range p.waiters {
		if blocked[w.key] {
			kept = append(kept, w)
			continue
		}
		if pk := p.takeParkedLocked(w.key, w.sig); pk != nil {
			p.giveParkedLocked(w, pk, now)
			continue
		}
		if p.resettingLocked(w.key, w.sig) {
			// One of its signature is being reset: it waits for it.
			blocked[w.key] = true
			kept = append(kept, w)
			continue
		}
		lim := p.limits(w.key)
		mayReserve := lim.ReserveSize > 0 && now.Sub(w.since) >= lim.ReserveTimeout
		full := p.fullLocked(w.key, lim, false)
		var evicted []*parked
		for full != "" {
			if mayReserve && p.fullLocked(w.key, lim, true) == "" {
				break
			}
			pk := p.evictableLocked(w.key, full)
			if pk == nil {
				break
			}
			evicted = append(evicted, pk)
			p.dropLocked(pk.slot.key, pk.slot.reserve)
			full = p.fullLocked(w.key, lim, false)
		}
		reserve := full != "" && mayReserve && p.fullLocked(w.key, lim, true) == ""
		if full == "" || reserve {
			for _, pk := range evicted {
				pk.evicted = true
				w.evicted = append(w.evicted, pk.conn)
				p.forgetLocked(pk.slot.key)
				p.totals.Evicted++
				p.totals.Closed++
			}
			p.giveLocked(w, reserve, now)
			continue
		}
		// Still kept out (another bound none of the parked connections
		// counts against): the ones taken out go back, for nothing.
		for i := len(evicted) - 1; i >= 0; i-- {
			pk := evicted[i]
			p.addLocked(pk.slot.key, pk.slot.reserve)
			st := p.pools[pk.slot.key]
			st.idle = append([]*parked{pk}, st.idle...)
		}
		blocked[w.key] = true
		kept = append(kept, w)
	}
	clear(p.waiters[len(kept):])
	p.waiters = kept
}

// takeParkedLocked takes from key's pool the connection parked last with
// signature sig, nil if none ("" matches none).
func (p *Pools) takeParkedLocked(key Key, sig string) *parked {
	st := p.pools[key]
	if sig == "" || st == nil {
		return nil
	}
	for i := len(st.idle) - 1; i >= 0; i-- {
		if pk := st.idle[i]; pk.sig == sig {
			st.idle = append(st.idle[:i], st.idle[i+1:]...)
			return pk
		}
	}
	return nil
}

// resettingLocked reports whether a connection of key's pool with
// signature sig is being reset to be parked ("" matches none).
func (p *Pools) resettingLocked(key Key, sig string) bool {
	st := p.pools[key]
	if sig == "" || st == nil {
		return false
	}
	for _, rs := range st.resetting {
		if rs == sig {
			return true
		}
	}
	return false
}

// evictableLocked takes the longest parked connection that counts
// against the limit full keeps key's client out by, nil if none.
func (p *Pools) evictableLocked(key Key, full string) *parked {
	var best *parked
	var bestKey Key
	for k, st := range p.pools {
		switch {
		case full == "default_pool_size" && k != key,
			full == "max_db_connections" && k.Database != key.Database,
			full == "max_user_connections" && k.User != key.User:
			continue
		}
		if len(st.idle) > 0 && (best == nil || st.idle[0].since.Before(best.since)) {
			best, bestKey = st.idle[0], k
		}
	}
	if best != nil {
		st := p.pools[bestKey]
		st.idle = st.idle[1:]
	}
	return best
}

func (p *Pools) giveLocked(w *waiter, reserve bool, now time.Time) {
	st := p.pools[w.key]
	st.held++
	st.waiting--
	if reserve {
		st.reserve++
	}
	if d := now.Sub(w.since); d > 0 {
		p.totals.WaitTime += d
	}
	p.byDB[w.key.Database]++
	p.byUser[w.key.User]++
	w.granted, w.reserve = true, reserve
	close(w.ready)
}

// giveParkedLocked gives w the parked connection pk, whose slot it takes
// over (the counts do not change).
func (p *Pools) giveParkedLocked(w *waiter, pk *parked, now time.Time) {
	p.pools[w.key].waiting--
	if d := now.Sub(w.since); d > 0 {
		p.totals.WaitTime += d
	}
	p.totals.Reused++
	w.granted, w.reserve, w.conn = true, pk.slot.reserve, pk
	close(w.ready)
}

func (p *Pools) dropWaiterLocked(w *waiter) {
	for i, x := range p.waiters {
		if x == w {
			p.waiters = append(p.waiters[:i], p.waiters[i+1:]...)
			break
		}
	}
	p.pools[w.key].waiting--
	// A client that gave up may have held back others of its pool.
	p.grantLocked()
}

// Stat is one pool as the console shows it.
type Stat struct {
	Key
	// Held is the pool's server connections, Idle how many of them are
	// parked (the rest are its clients'), Reserve how many are the
	// reserve's; Waiting the clients waiting for one, the longest since
	// OldestWait (zero: none).
	Held, Idle, Reserve, Waiting int
	OldestWait                   time.Time
}

// Totals returns the counters.
func (p *Pools) Totals() Totals {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.totals
}

// Stats returns the pools with clients, by database and user.
func (p *Pools) Stats() []Stat {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]Stat, 0, len(p.pools))
	for k, st := range p.pools {
		s := Stat{Key: k, Held: st.held, Idle: len(st.idle), Reserve: st.reserve, Waiting: st.waiting}
		for _, w := range p.waiters {
			if w.key == k {
				s.OldestWait = w.since
				break
			}
		}
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Database != out[j].Database {
			return out[i].Database < out[j].Database
		}
		return out[i].User < out[j].User
	})
	return out
}
