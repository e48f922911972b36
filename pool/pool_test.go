package pool

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func fixed(l Limits) func(Key) Limits { return func(Key) Limits { return l } }

var (
	a = Key{"db", "alice"}
	b = Key{"db", "bob"}
	c = Key{"other", "alice"}
)

// waiting waits until key's pool has n clients waiting (observation, not
// a sleep: the goroutines' order of arrival is what a case is about).
func waiting(t *testing.T, p *Pools, key Key, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		for _, s := range p.Stats() {
			if s.Key == key && s.Waiting == n {
				return
			}
		}
		if n == 0 && !hasPool(p, key) {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("pool %v never had %d waiting: %+v", key, n, p.Stats())
}

func hasPool(p *Pools, key Key) bool {
	for _, s := range p.Stats() {
		if s.Key == key {
			return true
		}
	}
	return false
}

func acq(t *testing.T, p *Pools, key Key) *Slot {
	t.Helper()
	s, err := p.Acquire(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// acquireAsync starts an Acquire and returns where its result arrives.
func acquireAsync(ctx context.Context, p *Pools, key Key) chan *Slot {
	ch := make(chan *Slot, 1)
	go func() {
		s, err := p.Acquire(ctx, key)
		if err != nil {
			close(ch)
			return
		}
		ch <- s
	}()
	return ch
}

func TestPoolSizeWaitsInOrder(t *testing.T) {
	p := New(fixed(Limits{PoolSize: 2}))
	ctx := context.Background()
	s1 := acq(t, p, a)
	s2 := acq(t, p, a)
	var order []int
	var mu sync.Mutex
	var wg sync.WaitGroup
	var got []*Slot
	for i := range 3 {
		wg.Add(1)
		ch := acquireAsync(ctx, p, a)
		waiting(t, p, a, i+1)
		go func() {
			defer wg.Done()
			s := <-ch
			mu.Lock()
			order = append(order, i)
			got = append(got, s)
			mu.Unlock()
			s.Release()
		}()
	}
	// Another pool is not held back by a's queue.
	acq(t, p, b).Release()
	if st := p.Stats(); st[0].Key != a || st[0].Held != 2 || st[0].Waiting != 3 {
		t.Fatalf("stats: %+v", st)
	}
	s1.Release()
	wg.Wait()
	s2.Release()
	if len(order) != 3 || order[0] != 0 || order[1] != 1 || order[2] != 2 {
		t.Fatalf("order of the waiting clients' slots: %v, want 0 1 2", order)
	}
	for _, s := range got {
		if s.Waited <= 0 {
			t.Fatalf("a waiting client's slot says it waited %v", s.Waited)
		}
	}
	if tot := p.Totals(); tot.Waited != 3 || tot.Timeouts != 0 {
		t.Fatalf("totals %+v, want 3 waited", tot)
	}
	if len(p.Stats()) != 0 {
		t.Fatalf("pools left after every slot was released: %+v", p.Stats())
	}
}

func TestMaxDBAndMaxUser(t *testing.T) {
	ctx := context.Background()
	t.Run("max_db_connections", func(t *testing.T) {
		p := New(fixed(Limits{MaxDB: 2}))
		sa := acq(t, p, a)
		sb := acq(t, p, b)
		acq(t, p, c).Release()        // another database
		ch := acquireAsync(ctx, p, b) // db is full
		waiting(t, p, b, 1)
		sa.Release() // alice's slot frees the database for bob
		s := <-ch
		if s == nil {
			t.Fatal("no slot")
		}
		s.Release()
		sb.Release()
	})
	t.Run("max_user_connections", func(t *testing.T) {
		p := New(fixed(Limits{MaxUser: 1}))
		sa := acq(t, p, a)
		acq(t, p, b).Release()        // another user
		ch := acquireAsync(ctx, p, c) // alice, another database
		waiting(t, p, c, 1)
		sa.Release()
		if s := <-ch; s == nil {
			t.Fatal("no slot")
		} else {
			s.Release()
		}
	})
}

func TestWaitTimeout(t *testing.T) {
	p := New(fixed(Limits{PoolSize: 1, WaitTimeout: 30 * time.Millisecond}))
	s := acq(t, p, a)
	defer s.Release()
	_, err := p.Acquire(context.Background(), a)
	var we *WaitError
	if !errors.As(err, &we) || !errors.Is(err, ErrWaitTimeout) || we.Full != "default_pool_size" || we.Waited < 30*time.Millisecond {
		t.Fatalf("got %v, want a WaitError of query_wait_timeout naming default_pool_size", err)
	}
	if tot := p.Totals(); tot.Timeouts != 1 {
		t.Fatalf("totals %+v, want 1 timeout", tot)
	}
	if st := p.Stats(); len(st) != 1 || st[0].Waiting != 0 || st[0].Held != 1 {
		t.Fatalf("after the timeout: %+v", st)
	}
}

func TestContextEndsWait(t *testing.T) {
	p := New(fixed(Limits{PoolSize: 1}))
	s := acq(t, p, a)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { _, err := p.Acquire(ctx, a); done <- err }()
	waiting(t, p, a, 1)
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	s.Release()
	if len(p.Stats()) != 0 {
		t.Fatalf("pools left: %+v", p.Stats())
	}
}

func TestReserve(t *testing.T) {
	p := New(fixed(Limits{PoolSize: 1, ReserveSize: 1, ReserveTimeout: 20 * time.Millisecond}))
	ctx := context.Background()
	s1 := acq(t, p, a)
	s2, err := p.Acquire(ctx, a) // waits 20 ms, then takes the reserve
	if err != nil || !s2.Reserve() || s2.Waited < 20*time.Millisecond {
		t.Fatalf("got %v (reserve %v after %v), want a reserve slot after the reserve timeout", err, s2 != nil && s2.Reserve(), s2.Waited)
	}
	if st := p.Stats(); st[0].Held != 2 || st[0].Reserve != 1 {
		t.Fatalf("stats %+v", st)
	}
	// The reserve is full too: a third waits until a slot is released.
	ch := acquireAsync(ctx, p, a)
	waiting(t, p, a, 1)
	s2.Release()
	s3 := <-ch
	if s3 == nil {
		t.Fatal("no slot")
	}
	s1.Release()
	s3.Release()
	s3.Release() // twice: harmless
	if len(p.Stats()) != 0 {
		t.Fatalf("pools left: %+v", p.Stats())
	}
}

// TestLimitsReadEachTime: a reload's larger pool lets waiting clients in
// at the next decision.
func TestLimitsReadEachTime(t *testing.T) {
	var size atomic.Int64
	size.Store(1)
	p := New(func(Key) Limits { return Limits{PoolSize: int(size.Load())} })
	ctx := context.Background()
	s1 := acq(t, p, a)
	s2 := acq(t, p, b)
	ch := acquireAsync(ctx, p, a)
	waiting(t, p, a, 1)
	size.Store(2)
	s2.Release() // any decision looks again
	s := <-ch
	if s == nil {
		t.Fatal("no slot")
	}
	s.Release()
	s1.Release()
}

func TestConcurrentNeverOverLimit(t *testing.T) {
	const size = 3
	p := New(fixed(Limits{PoolSize: size, MaxDB: size + 1}))
	var held, peak atomic.Int64
	var wg sync.WaitGroup
	for i := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := a
			if i%4 == 0 {
				key = b
			}
			for range 50 {
				s, err := p.Acquire(context.Background(), key)
				if err != nil {
					t.Error(err)
					return
				}
				n := held.Add(1)
				for {
					m := peak.Load()
					if n <= m || peak.CompareAndSwap(m, n) {
						break
					}
				}
				held.Add(-1)
				s.Release()
			}
		}()
	}
	wg.Wait()
	if peak.Load() > size+1 {
		t.Fatalf("%d slots held at once, over max_db_connections %d", peak.Load(), size+1)
	}
	for _, s := range p.Stats() {
		t.Fatalf("pool left after every slot was released: %+v", s)
	}
}
