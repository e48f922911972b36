package lru

import (
	"fmt"
	"sync"
	"testing"
)

// costOf is a cost that makes an entry take n bytes of the pool.
func costOf(n int64) int64 { return n - EntryOverhead }

func TestEvictsByBytesInLRUOrder(t *testing.T) {
	p := NewPool(1000)
	a, b := New[string, int](p), New[int, string](p) // two types, one order
	a.Add("x", 1, costOf(400))
	b.Add(1, "y", costOf(400))
	if _, ok := a.Get("x"); !ok { // x is now the most recently used
		t.Fatal("x not cached")
	}
	a.Add("z", 3, costOf(400)) // 1200 > 1000: the least recently used goes, y of the other cache
	if _, ok := b.Get(1); ok {
		t.Error("y cached, want it evicted (least recently used)")
	}
	if _, ok := a.Get("x"); !ok {
		t.Error("x evicted, want it kept (used after y)")
	}
	if got, want := p.Bytes(), int64(800); got != want {
		t.Errorf("Bytes: got %d, want %d", got, want)
	}
	if got := p.Evictions(); got != 1 {
		t.Errorf("Evictions: got %d, want 1", got)
	}
	if got := p.Entries(); got != 2 || a.Len() != 2 || b.Len() != 0 {
		t.Errorf("Entries %d, Len %d and %d, want 2, 2 and 0", got, a.Len(), b.Len())
	}
}

func TestLargerThanThePoolIsNotCached(t *testing.T) {
	p := NewPool(1000)
	c := New[string, int](p)
	c.Add("small", 1, costOf(100))
	if c.Add("big", 2, costOf(1001)) {
		t.Fatal("Add of an entry larger than the pool: true, want false")
	}
	if _, ok := c.Get("big"); ok {
		t.Error("the entry larger than the pool is cached")
	}
	if _, ok := c.Get("small"); !ok {
		t.Error("an entry larger than the pool evicted the others, want them kept")
	}
	if p.Uncached() != 1 || p.Evictions() != 0 {
		t.Errorf("Uncached %d, Evictions %d, want 1 and 0", p.Uncached(), p.Evictions())
	}
	// Replacing an entry with one too large forgets the old value.
	c.Add("small", 3, costOf(2000))
	if _, ok := c.Get("small"); ok || p.Bytes() != 0 {
		t.Errorf("after a too-large replacement: cached %v, Bytes %d, want gone and 0", ok, p.Bytes())
	}
}

// budget is a Budget of max bytes.
type budget struct {
	mu        sync.Mutex
	max, used int64
}

func (b *budget) Take(n int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.used+n > b.max {
		return false
	}
	b.used += n
	return true
}

func (b *budget) Give(n int64) {
	b.mu.Lock()
	b.used -= n
	b.mu.Unlock()
}

func TestBudgetAndShrink(t *testing.T) {
	bg := &budget{max: 1000}
	p := NewPool(800)
	p.SetBudget(bg)
	c := New[int, int](p)
	for i := range 4 {
		c.Add(i, i, costOf(200))
	}
	if bg.used != 800 {
		t.Fatalf("budget used %d, want 800", bg.used)
	}
	// Someone else takes 500 of the budget: the pool must give way.
	if bg.Take(500) {
		t.Fatal("budget took 500 over the pool's 800 of 1000")
	}
	if freed := p.Shrink(300); freed != 400 {
		t.Errorf("Shrink(300) freed %d, want 400 (two entries of 200)", freed)
	}
	if !bg.Take(500) {
		t.Fatal("budget cannot take 500 after Shrink")
	}
	// With 900 of 1000 taken (400 by the pool), an entry of 200 evicts
	// the pool's oldest until the budget has room.
	if !c.Add(9, 9, costOf(200)) {
		t.Fatal("Add with the budget short: false, want older entries evicted for it")
	}
	if c.Len() != 2 || bg.used != 900 {
		t.Errorf("Len %d, budget used %d, want 2 and 900", c.Len(), bg.used)
	}
	// With 600 of the budget others', an entry of 500 cannot be had even
	// with the pool empty.
	bg.Take(100)
	if c.Add(10, 10, costOf(500)) || c.Len() != 0 || bg.used != 600 || p.Uncached() != 1 {
		t.Errorf("Add with no room even with the pool empty: cached %d, budget used %d, uncached %d, want none, 600 and 1", c.Len(), bg.used, p.Uncached())
	}
	p.SetMax(0)
	if p.Bytes() != 0 {
		t.Errorf("Bytes after SetMax(0): %d", p.Bytes())
	}
}

func TestGetAllocatesNothing(t *testing.T) {
	c := New[string, int](NewPool(1 << 20))
	for i := range 10 {
		c.Add(fmt.Sprint(i), i, 100)
	}
	if n := testing.AllocsPerRun(100, func() { c.Get("5"); c.Get("nope") }); n != 0 {
		t.Errorf("Get: %v allocations, want 0", n)
	}
}

func TestConcurrent(t *testing.T) {
	p := NewPool(50 * 1000)
	c := New[int, int](p)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 5000 {
				k := (g*7919 + i) % 300
				if _, ok := c.Get(k); !ok {
					c.Add(k, k, costOf(1000))
				}
				if i%500 == 0 {
					p.Shrink(3000)
				}
			}
		}()
	}
	wg.Wait()
	if p.Bytes() > 50*1000 || p.Bytes() != int64(c.Len())*1000 || p.Entries() != int64(c.Len()) {
		t.Errorf("Bytes %d, Entries %d, Len %d: want at most 50000, 1000 per entry", p.Bytes(), p.Entries(), c.Len())
	}
}
