// Package lru is a least-recently-used cache bounded by what its entries
// cost in bytes, not by how many there are, for caches whose entries a
// client makes as large as it likes: the write gate's statement
// classifications and plans (rewrite, rewrite/plan). Caches of different
// types share one Pool, which holds the byte bound, one LRU order across
// them, and optionally an outer Budget the bytes are also taken from (the
// proxy's memory_budget, which gives way to client messages by Shrink).
//
// It is not a general-purpose cache: costs are the caller's estimates,
// and every operation takes the pool's one lock.
package lru

import (
	"sync"
	"sync/atomic"
)

// EntryOverhead is what every entry costs besides the caller's estimate:
// its list node, its map slot and its boxed key.
const EntryOverhead = 160

// Budget is an outer bound the pool's bytes are taken from as well.
type Budget interface {
	// Take reserves n bytes, or reports false when they do not fit.
	Take(n int64) bool
	// Give returns n bytes taken.
	Give(n int64)
}

// Pool is a byte bound shared by caches, with one LRU order across them.
// Safe for concurrent use.
type Pool struct {
	mu     sync.Mutex
	max    int64
	used   int64
	root   link // root.next is the most recently used, root.prev the least
	budget Budget

	bytes     atomic.Int64 // used, for reading without the lock
	entries   atomic.Int64
	evictions atomic.Int64
	uncached  atomic.Int64
}

// link is an entry's place in the pool's order.
type link struct {
	prev, next *link
	cost       int64
	owner      remover
	key        any
}

// remover is a cache, which forgets an entry the pool evicts.
type remover interface{ remove(key any) }

// NewPool returns a pool of max bytes.
func NewPool(max int64) *Pool {
	p := &Pool{max: max}
	p.root.next, p.root.prev = &p.root, &p.root
	return p
}

// SetMax changes the bound, evicting what no longer fits.
func (p *Pool) SetMax(max int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.max = max
	for p.used > p.max {
		p.evictOldest()
	}
}

// SetBudget makes the pool take its bytes from b as well (nil: none). The
// entries it holds are evicted first: their bytes were the old budget's.
func (p *Pool) SetBudget(b Budget) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.root.prev != &p.root {
		p.evictOldest()
	}
	p.budget = b
}

// Max returns the bound.
func (p *Pool) Max() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.max
}

// Bytes returns what the entries cost together.
func (p *Pool) Bytes() int64 { return p.bytes.Load() }

// Entries returns how many entries the pool holds.
func (p *Pool) Entries() int64 { return p.entries.Load() }

// Evictions returns how many entries were evicted to make room (for
// another entry, a smaller bound, or the budget: Shrink).
func (p *Pool) Evictions() int64 { return p.evictions.Load() }

// Uncached returns how many entries were not cached: larger than the
// bound, or with no room in the budget even with the pool empty.
func (p *Pool) Uncached() int64 { return p.uncached.Load() }

// Shrink evicts the least recently used entries until they freed at
// least n bytes, or the pool is empty, and returns what they freed.
func (p *Pool) Shrink(n int64) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var freed int64
	for freed < n && p.root.prev != &p.root {
		freed += p.evictOldest()
	}
	return freed
}

// evictOldest evicts the least recently used entry and returns its cost.
// p.mu held; the pool is not empty.
func (p *Pool) evictOldest() int64 {
	l := p.root.prev
	p.drop(l)
	l.owner.remove(l.key)
	p.evictions.Add(1)
	return l.cost
}

// drop unlinks l and gives its bytes back. p.mu held.
func (p *Pool) drop(l *link) {
	l.prev.next, l.next.prev = l.next, l.prev
	l.prev, l.next = nil, nil
	p.used -= l.cost
	p.bytes.Store(p.used)
	p.entries.Add(-1)
	if p.budget != nil {
		p.budget.Give(l.cost)
	}
}

// front makes l the most recently used. p.mu held.
func (p *Pool) front(l *link) {
	if p.root.next == l {
		return
	}
	if l.prev != nil {
		l.prev.next, l.next.prev = l.next, l.prev
	}
	l.prev, l.next = &p.root, p.root.next
	p.root.next.prev = l
	p.root.next = l
}

// Cache is one cache of a Pool. Safe for concurrent use.
type Cache[K comparable, V any] struct {
	p *Pool
	m map[K]*node[V] // under p.mu
}

type node[V any] struct {
	link
	val V
}

// New returns a cache in p.
func New[K comparable, V any](p *Pool) *Cache[K, V] {
	return &Cache[K, V]{p: p, m: make(map[K]*node[V])}
}

// Get returns the value cached under k, and makes it the most recently
// used. It allocates nothing.
func (c *Cache[K, V]) Get(k K) (V, bool) {
	c.p.mu.Lock()
	defer c.p.mu.Unlock()
	n, ok := c.m[k]
	if !ok {
		var zero V
		return zero, false
	}
	c.p.front(&n.link)
	return n.val, true
}

// Add caches v under k, with cost, its estimated size in bytes (plus
// EntryOverhead), evicting the least recently used entries of the pool
// until it fits. It reports false, caching nothing (and forgetting what k
// had), when v costs more than the pool's bound, or the budget has no room
// for it even with every entry of the pool evicted.
func (c *Cache[K, V]) Add(k K, v V, cost int64) bool {
	cost += EntryOverhead
	p := c.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if old, ok := c.m[k]; ok {
		p.drop(&old.link)
		delete(c.m, k)
	}
	if cost > p.max {
		p.uncached.Add(1)
		return false
	}
	for p.used+cost > p.max {
		p.evictOldest()
	}
	for p.budget != nil && !p.budget.Take(cost) {
		if p.root.prev == &p.root {
			p.uncached.Add(1)
			return false
		}
		p.evictOldest()
	}
	n := &node[V]{link: link{cost: cost, owner: c, key: k}, val: v}
	c.m[k] = n
	p.front(&n.link)
	p.used += cost
	p.bytes.Store(p.used)
	p.entries.Add(1)
	return true
}

// remove forgets k's entry, which the pool evicted. p.mu held.
func (c *Cache[K, V]) remove(key any) { delete(c.m, key.(K)) }

// Len returns how many entries the cache holds.
func (c *Cache[K, V]) Len() int {
	c.p.mu.Lock()
	defer c.p.mu.Unlock()
	return len(c.m)
}
