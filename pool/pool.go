// Package pool bounds the server connections a proxy's clients hold, as
// PgBouncer's pool settings do: per pool (a database and a user:
// default_pool_size, with reserve_pool_size more for a client that has
// waited reserve_pool_timeout), per database (max_db_connections) and per
// user (max_user_connections). A client over a limit waits its turn: in
// the order clients of its pool came, for at most query_wait_timeout.
//
// It hands out slots, not connections: what a slot stands for (today a
// client's own backend, for the client's whole session) is the caller's.
// Its seam with the proxy is three calls: Acquire before a server
// connection is opened, Slot.Release when it is closed, Stats for the
// console and the metrics. The limits are read at every decision, so a
// reload applies to the next one.
package pool

import (
	"context"
	"errors"
	"fmt"
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
}

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
}

// state is one pool's.
type state struct {
	held    int // slots held, reserve ones included
	reserve int // of which reserve slots
	waiting int
}

type waiter struct {
	key   Key
	since time.Time
	ready chan struct{} // closed when granted
	// granted, reserve: set under Pools.mu when the slot is given.
	granted, reserve bool
}

// New returns pools whose bounds limits gives for each key.
func New(limits func(Key) Limits) *Pools {
	return &Pools{limits: limits, now: time.Now, pools: map[Key]*state{}, byDB: map[string]int{}, byUser: map[string]int{}}
}

// Slot is a client's right to one server connection of its pool, until
// Release.
type Slot struct {
	p       *Pools
	key     Key
	reserve bool
	once    sync.Once
	// Waited is how long the client waited for it.
	Waited time.Duration
}

// Reserve reports whether the slot is one of the pool's reserve.
func (s *Slot) Reserve() bool { return s.reserve }

// Release gives the slot back; the first client waiting for one that now
// fits gets it. Releasing twice is harmless.
func (s *Slot) Release() {
	s.once.Do(func() {
		p := s.p
		p.mu.Lock()
		defer p.mu.Unlock()
		st := p.pools[s.key]
		st.held--
		if s.reserve {
			st.reserve--
		}
		p.byDB[s.key.Database]--
		p.byUser[s.key.User]--
		p.grantLocked()
		p.forgetLocked(s.key)
	})
}

// Acquire returns a slot of key's pool: at once when the limits allow,
// else after waiting behind the clients of the pool that came before.
// It gives up when ctx ends or Limits.WaitTimeout passes (*WaitError).
func (p *Pools) Acquire(ctx context.Context, key Key) (*Slot, error) {
	p.mu.Lock()
	st := p.stateLocked(key)
	start := p.now()
	w := &waiter{key: key, since: start, ready: make(chan struct{})}
	p.waiters = append(p.waiters, w)
	st.waiting++
	p.grantLocked()
	if w.granted {
		p.mu.Unlock()
		return &Slot{p: p, key: key, reserve: w.reserve}, nil
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
			return &Slot{p: p, key: key, reserve: w.reserve, Waited: p.now().Sub(start)}, nil
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
			return &Slot{p: p, key: key, reserve: w.reserve, Waited: p.now().Sub(start)}, nil
		}
		p.dropWaiterLocked(w)
		if cause == ErrWaitTimeout {
			p.totals.Timeouts++
		}
		full := p.fullLocked(key, p.limits(key), false)
		p.forgetLocked(key)
		p.mu.Unlock()
		return nil, &WaitError{Key: key, Waited: p.now().Sub(start), Limits: lim, Full: full, Err: cause}
	}
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
// pools with clients.
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
// waiting waits behind it.
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
		lim := p.limits(w.key)
		mayReserve := lim.ReserveSize > 0 && now.Sub(w.since) >= lim.ReserveTimeout
		if p.fullLocked(w.key, lim, false) == "" {
			p.giveLocked(w, false, now)
			continue
		}
		if mayReserve && p.fullLocked(w.key, lim, true) == "" {
			p.giveLocked(w, true, now)
			continue
		}
		blocked[w.key] = true
		kept = append(kept, w)
	}
	clear(p.waiters[len(kept):])
	p.waiters = kept
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
	// Held is the slots the pool's clients hold (server connections),
	// Reserve how many of them are the reserve's; Waiting the clients
	// waiting for one, the longest since OldestWait (zero: none).
	Held, Reserve, Waiting int
	OldestWait             time.Time
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
		s := Stat{Key: k, Held: st.held, Reserve: st.reserve, Waiting: st.waiting}
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
