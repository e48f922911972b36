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
	s, err := p.Acquire(context.Background(), key, "")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// acquireAsync starts an Acquire and returns where its result arrives.
func acquireAsync(ctx context.Context, p *Pools, key Key) chan *Slot {
	ch := make(chan *Slot, 1)
	go func() {
		s, err := p.Acquire(ctx, key, "")
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
	_, err := p.Acquire(context.Background(), a, "")
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
	go func() { _, err := p.Acquire(ctx, a, ""); done <- err }()
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
	s2, err := p.Acquire(ctx, a, "") // waits 20 ms, then takes the reserve
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

// A reload that raises a limit lets in the clients already waiting, with
// no slot released (round 25, BC-L1).
func TestRegrant(t *testing.T) {
	var size atomic.Int64
	size.Store(1)
	p := New(func(Key) Limits { return Limits{PoolSize: int(size.Load())} })
	s1 := acq(t, p, a)
	ch := acquireAsync(context.Background(), p, a)
	waiting(t, p, a, 1)
	size.Store(2)
	p.Regrant()
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
				s, err := p.Acquire(context.Background(), key, "")
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

// fakeConn is a server connection whose Close is counted.
type fakeConn struct {
	name   string
	open   *atomic.Int64 // connections open, if counted
	closed atomic.Bool
}

func newConn(name string, open *atomic.Int64) *fakeConn {
	if open != nil {
		open.Add(1)
	}
	return &fakeConn{name: name, open: open}
}

func (c *fakeConn) Close() error {
	if c.closed.Swap(true) {
		panic("closed twice: " + c.name)
	}
	if c.open != nil {
		c.open.Add(-1)
	}
	return nil
}

func statOf(p *Pools, key Key) Stat {
	for _, s := range p.Stats() {
		if s.Key == key {
			return s
		}
	}
	return Stat{Key: key}
}

func TestParkedConnectionGoesToItsSignature(t *testing.T) {
	p := New(fixed(Limits{PoolSize: 2}))
	ctx := context.Background()
	s1, _ := p.Acquire(ctx, a, "x")
	if s1.Conn != nil {
		t.Fatal("a connection handed from an empty pool")
	}
	c1 := newConn("c1", nil)
	born := time.Now().Add(-time.Minute)
	if !s1.Park(c1, "x", born) {
		t.Fatal("not parked")
	}
	if st := statOf(p, a); st.Held != 1 || st.Idle != 1 {
		t.Fatalf("after Park: %+v, want held 1 idle 1", st)
	}
	// Another signature, with room in the pool: a slot of its own; the
	// parked connection stays.
	s2, _ := p.Acquire(ctx, a, "y")
	if s2.Conn != nil || c1.closed.Load() {
		t.Fatalf("signature y got %v; c1 closed %v", s2.Conn, c1.closed.Load())
	}
	s3, _ := p.Acquire(ctx, a, "x")
	if s3.Conn != Conn(c1) || !s3.Born.Equal(born) {
		t.Fatalf("signature x got %v born %v, want c1 born %v", s3.Conn, s3.Born, born)
	}
	if st := statOf(p, a); st.Held != 2 || st.Idle != 0 {
		t.Fatalf("after reuse: %+v, want held 2 idle 0", st)
	}
	if tt := p.Totals(); tt.Reused != 1 || tt.Parked != 1 || tt.Closed != 0 {
		t.Fatalf("totals %+v", tt)
	}
	s3.Release()
	s2.Release()
	s1.Release() // after Park: harmless
	if len(p.Stats()) != 0 {
		t.Fatalf("pools left: %+v", p.Stats())
	}
}

func TestEmptySignatureTakesNothingParked(t *testing.T) {
	p := New(fixed(Limits{}))
	s, _ := p.Acquire(context.Background(), a, "")
	c := newConn("c", nil)
	if !s.Park(c, "", time.Now()) {
		t.Fatal("not parked")
	}
	s2, _ := p.Acquire(context.Background(), a, "")
	if s2.Conn != nil {
		t.Fatal("the empty signature matched")
	}
	s2.Release()
	p.CloseIdle()
	if !c.closed.Load() || len(p.Stats()) != 0 {
		t.Fatalf("CloseIdle left %v %+v", c.closed.Load(), p.Stats())
	}
}

func TestParkedConnectionEvictedForAnotherSignature(t *testing.T) {
	for _, tc := range []struct {
		name   string
		lim    Limits
		parkAt Key
	}{
		{"default_pool_size", Limits{PoolSize: 1}, a},
		{"max_db_connections", Limits{MaxDB: 1}, b},     // b's parked connection makes room for a
		{"max_user_connections", Limits{MaxUser: 1}, c}, // c is alice's too
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := New(fixed(tc.lim))
			ctx := context.Background()
			s, _ := p.Acquire(ctx, tc.parkAt, "x")
			conn := newConn("parked", nil)
			s.Park(conn, "x", time.Now())
			got, err := p.Acquire(ctx, a, "y") // would wait for ever without the eviction
			if err != nil {
				t.Fatal(err)
			}
			if got.Conn != nil || !conn.closed.Load() {
				t.Fatalf("got %v, parked closed %v", got.Conn, conn.closed.Load())
			}
			if tt := p.Totals(); tt.Evicted != 1 || tt.Waited != 0 {
				t.Fatalf("totals %+v", tt)
			}
			got.Release()
			if len(p.Stats()) != 0 {
				t.Fatalf("pools left: %+v", p.Stats())
			}
		})
	}
}

func TestParkHandsToAWaiterOfItsSignature(t *testing.T) {
	p := New(fixed(Limits{PoolSize: 1}))
	ctx := context.Background()
	s1 := acq(t, p, a)
	ch := make(chan *Slot, 1)
	go func() {
		s, err := p.Acquire(ctx, a, "x")
		if err != nil {
			t.Error(err)
		}
		ch <- s
	}()
	waiting(t, p, a, 1)
	conn := newConn("c", nil)
	if parked := s1.Park(conn, "x", time.Now()); !parked {
		t.Fatal("Park reported the connection closed")
	}
	s := <-ch
	if s.Conn != Conn(conn) || conn.closed.Load() {
		t.Fatalf("the waiter got %v (closed %v), want the parked connection", s.Conn, conn.closed.Load())
	}
	s.Release()
}

func TestParkClosesWhenAWaiterOfAnotherSignatureNeedsThePlace(t *testing.T) {
	p := New(fixed(Limits{PoolSize: 1}))
	s1 := acq(t, p, a)
	ch := acquireAsync(context.Background(), p, a) // signature ""
	waiting(t, p, a, 1)
	conn := newConn("c", nil)
	if s1.Park(conn, "x", time.Now()) {
		t.Fatal("parked, though a client of another signature waited for its place")
	}
	s := <-ch
	if s == nil || s.Conn != nil {
		t.Fatalf("waiter got %+v", s)
	}
	if !conn.closed.Load() { // by the waiter, before its Acquire returned
		t.Fatal("not closed")
	}
	s.Release()
}

func TestParkedConnectionsExpire(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	p := New(fixed(Limits{IdleTimeout: time.Minute, Lifetime: time.Hour}))
	p.now = func() time.Time { return now }
	ctx := context.Background()
	old := newConn("old", nil)
	s, _ := p.Acquire(ctx, a, "x")
	if s.Park(old, "x", now.Add(-time.Hour)) || !old.closed.Load() {
		t.Fatal("a connection past server_lifetime was parked")
	}
	young := newConn("young", nil)
	s, _ = p.Acquire(ctx, a, "x")
	if !s.Park(young, "x", now.Add(-50*time.Minute)) { // under 0.9 h: whatever the jitter
		t.Fatal("not parked")
	}
	now = now.Add(59 * time.Second)
	p.Expire()
	if young.closed.Load() {
		t.Fatal("closed before server_idle_timeout")
	}
	now = now.Add(time.Second)
	p.Expire()
	if !young.closed.Load() || len(p.Stats()) != 0 {
		t.Fatalf("not closed at server_idle_timeout: %+v", p.Stats())
	}
	if tt := p.Totals(); tt.Expired != 2 || tt.Closed != 2 {
		t.Fatalf("totals %+v", tt)
	}
}

// Connections open (in use and parked) never exceed the limits, whatever
// the signatures.
func TestConcurrentParkingNeverOverLimit(t *testing.T) {
	const size = 3
	p := New(fixed(Limits{PoolSize: size, MaxDB: size + 1}))
	var open, peak atomic.Int64
	var wg sync.WaitGroup
	sigs := []string{"x", "y", ""}
	for i := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := a
			if i%4 == 0 {
				key = b
			}
			for j := range 50 {
				s, err := p.Acquire(context.Background(), key, sigs[(i+j)%3])
				if err != nil {
					t.Error(err)
					return
				}
				conn := s.Conn
				if conn == nil {
					conn = newConn("c", &open)
				}
				for {
					n, m := open.Load(), peak.Load()
					if n <= m || peak.CompareAndSwap(m, n) {
						break
					}
				}
				if j%5 == 4 {
					conn.Close()
					s.Release()
				} else {
					s.Park(conn, sigs[(i+j+1)%3], time.Now())
				}
			}
		}()
	}
	wg.Wait()
	if peak.Load() > size+1 {
		t.Fatalf("%d connections open at once, over max_db_connections %d", peak.Load(), size+1)
	}
	p.CloseIdle()
	if open.Load() != 0 || len(p.Stats()) != 0 {
		t.Fatalf("%d open, pools %+v", open.Load(), p.Stats())
	}
}

// A client whose signature's connection is being reset waits for it
// (Slot.Parking) rather than opening one, and gets it parked; if the
// reset fails (Release), it gets a slot of its own.
func TestWaitForAConnectionBeingReset(t *testing.T) {
	p := New(fixed(Limits{}))
	ctx := context.Background()
	for _, parks := range []bool{true, false} {
		s := acq(t, p, a)
		s.Parking("x")
		ch := make(chan *Slot, 1)
		go func() {
			got, err := p.Acquire(ctx, a, "x")
			if err != nil {
				t.Error(err)
			}
			ch <- got
		}()
		waiting(t, p, a, 1)
		conn := newConn("c", nil)
		if parks {
			s.Park(conn, "x", time.Now())
		} else {
			s.Release()
		}
		got := <-ch
		if parks && got.Conn != Conn(conn) || !parks && got.Conn != nil {
			t.Fatalf("parks %v: the waiting client got %v", parks, got.Conn)
		}
		got.Release()
	}
	// Another signature does not wait for it.
	s := acq(t, p, a)
	s.Parking("x")
	other, err := p.Acquire(ctx, a, "y")
	if err != nil || other.Conn != nil {
		t.Fatalf("another signature: %v %v", other, err)
	}
	other.Release()
	s.Release()
	if len(p.Stats()) != 0 {
		t.Fatalf("pools left: %+v", p.Stats())
	}
}

// A parked connection is evicted only when that lets the client in:
// still kept out by another bound, which no parked connection counts
// against, the client waits and the parked connection stays (taken out
// and never closed, it stayed open off the limits' count).
func TestEvictOnlyWhenItLetsIn(t *testing.T) {
	p := New(fixed(Limits{MaxDB: 1, MaxUser: 1, WaitTimeout: 50 * time.Millisecond}))
	ctx := context.Background()
	sb, _ := p.Acquire(ctx, b, "x") // bob, in db: parked
	bobs := newConn("bob", nil)
	sb.Park(bobs, "x", time.Now())
	active, _ := p.Acquire(ctx, c, "") // alice, in another database: in use
	// alice in db: max_db_connections (bob's parked one) could be made
	// room for, max_user_connections (her own, in use) cannot.
	_, err := p.Acquire(ctx, a, "y")
	if !errors.Is(err, ErrWaitTimeout) {
		t.Fatalf("got %v, want a wait timeout", err)
	}
	if bobs.closed.Load() {
		t.Fatal("bob's parked connection was closed, though that could not let alice in")
	}
	if st := statOf(p, b); st.Idle != 1 || st.Held != 1 {
		t.Fatalf("bob's pool after: %+v", st)
	}
	if tt := p.Totals(); tt.Evicted != 0 {
		t.Fatalf("totals %+v", tt)
	}
	active.Release()
	// Now making room works: alice gets in, bob's parked one closed.
	got, err := p.Acquire(ctx, a, "y")
	if err != nil || !bobs.closed.Load() {
		t.Fatalf("after alice's other connection ended: %v, bob's closed %v", err, bobs.closed.Load())
	}
	got.Release()
}
