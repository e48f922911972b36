//go:build unix

package proxy

import (
	"net"
	"syscall"
	"testing"
	"time"
)

// The pollers' own tests: each runs on every poller of the platform
// (epoll is the reference the poll poller must match).

func pollerKinds() []string {
	if defaultPoller == "epoll" {
		return []string{"epoll", "poll"}
	}
	return []string{"poll"}
}

func eachPoller(t *testing.T, f func(t *testing.T, p poller)) {
	for _, kind := range pollerKinds() {
		t.Run(kind, func(t *testing.T) {
			p, err := newPoller(kind)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.close() })
			if p.name() != kind {
				t.Fatalf("poller %q is named %q", kind, p.name())
			}
			f(t, p)
		})
	}
}

// fdPair is a connected TCP pair: fd, a non-blocking descriptor of one
// end out of Go's netpoller (as the loop has a session's socket), and the
// other end.
func fdPair(t *testing.T) (int, *net.TCPConn) {
	t.Helper()
	peer, c := tcpPair(t)
	fd, err := dupConn(c.(*net.TCPConn))
	c.Close() // out of Go's netpoller, as takeSock does
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	return fd, peer.(*net.TCPConn)
}

// tcpPair is a connected pair of TCP connections, closed at the end of t.
func tcpPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	a, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// waitFor waits (up to 10 s) until p reports an event for fd, and returns
// its bits.
func waitFor(t *testing.T, p poller, fd int) uint32 {
	t.Helper()
	events := make([]pollEvent, 8)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		n, errno := p.wait(events, 100)
		if errno != 0 && errno != syscall.EINTR {
			t.Fatalf("wait: %v", errno)
		}
		for _, ev := range events[:max(n, 0)] {
			if ev.Fd == int32(fd) {
				return ev.Events
			}
		}
	}
	t.Fatalf("no event for fd %d in 10 s", fd)
	return 0
}

// quiet checks that a wait of 50 ms reports nothing for fd (what it
// must not report: a negative, so the timeout orders nothing).
func quiet(t *testing.T, p poller, fd int) {
	t.Helper()
	events := make([]pollEvent, 8)
	n, errno := p.wait(events, 50)
	if errno != 0 && errno != syscall.EINTR {
		t.Fatalf("wait: %v", errno)
	}
	for _, ev := range events[:max(n, 0)] {
		if ev.Fd == int32(fd) {
			t.Fatalf("got event %#x for fd %d, want none", ev.Events, fd)
		}
	}
}

// TestPollerOneShot: a one-shot descriptor reports once, although it stays
// readable, until it is modified (re-armed); a level-triggered one
// reports on every wait.
func TestPollerOneShot(t *testing.T) {
	eachPoller(t, func(t *testing.T, p poller) {
		fd, peer := fdPair(t)
		if err := p.add(fd, evIn|evRDHup|evOneShot); err != nil {
			t.Fatal(err)
		}
		if _, err := peer.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		if ev := waitFor(t, p, fd); ev&evIn == 0 {
			t.Fatalf("got %#x, want evIn", ev)
		}
		quiet(t, p, fd) // still readable, but reported once
		if err := p.modify(fd, evIn|evRDHup|evOneShot); err != nil {
			t.Fatal(err)
		}
		if ev := waitFor(t, p, fd); ev&evIn == 0 {
			t.Fatalf("re-armed: got %#x, want evIn", ev)
		}
		if err := p.modify(fd, evIn); err != nil { // level-triggered
			t.Fatal(err)
		}
		waitFor(t, p, fd)
		waitFor(t, p, fd)
		if err := p.remove(fd); err != nil {
			t.Fatal(err)
		}
		quiet(t, p, fd)
		if err := p.remove(fd); err != syscall.ENOENT {
			t.Fatalf("second remove: got %v, want ENOENT", err)
		}
		if err := p.modify(fd, evIn); err != syscall.ENOENT {
			t.Fatalf("modify after remove: got %v, want ENOENT", err)
		}
	})
}

// waitingIn waits until a wait of p has begun in another goroutine, where
// the poller can tell (the poll poller); epoll sees a change made at any
// time.
func waitingIn(t *testing.T, p poller) {
	pp, ok := p.(*pollPoller)
	if !ok {
		return
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		pp.mu.Lock()
		w := pp.waiting
		pp.mu.Unlock()
		if w {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the wait did not begin in 10 s")
		}
		time.Sleep(time.Millisecond) // polling an observation, not ordering
	}
}

// TestPollerChangeWhileWaiting: a descriptor added (publish, on a session
// goroutine) or modified (a client goroutine re-arming its watch) while
// the loop waits, with no timeout, is seen by that wait or the next one
// without waiting for an unrelated event.
func TestPollerChangeWhileWaiting(t *testing.T) {
	for _, change := range []string{"add", "modify"} {
		t.Run(change, func(t *testing.T) {
			eachPoller(t, func(t *testing.T, p poller) {
				fd, peer := fdPair(t)
				if change == "modify" {
					if err := p.add(fd, evOneShot); err != nil {
						t.Fatal(err)
					}
				}
				if _, err := peer.Write([]byte("x")); err != nil {
					t.Fatal(err)
				}
				got := make(chan uint32, 1)
				go func() { // the loop thread
					events := make([]pollEvent, 8)
					for {
						n, errno := p.waitIdle(events)
						if errno != 0 && errno != syscall.EINTR {
							got <- 0
							return
						}
						for _, ev := range events[:max(n, 0)] {
							if ev.Fd == int32(fd) {
								got <- ev.Events
								return
							}
						}
					}
				}()
				waitingIn(t, p)
				var err error
				if change == "add" {
					err = p.add(fd, evIn|evRDHup)
				} else {
					err = p.modify(fd, evIn|evRDHup|evOneShot)
				}
				if err != nil {
					t.Fatal(err)
				}
				select {
				case ev := <-got:
					if ev&evIn == 0 {
						t.Fatalf("got %#x, want evIn", ev)
					}
				case <-time.After(10 * time.Second):
					t.Fatal("the wait did not see the change in 10 s")
				}
			})
		})
	}
}

// TestPollerHangupUnwatched: with no events asked (clientOff: a parked
// client), a half-close is not reported (epoll's evRDHup is not asked
// for, and the poll poller has none) but a reset is, once for a one-shot
// watch, on every wait otherwise.
func TestPollerHangupUnwatched(t *testing.T) {
	for _, oneshot := range []bool{true, false} {
		name := "level"
		if oneshot {
			name = "oneshot"
		}
		t.Run(name, func(t *testing.T) {
			eachPoller(t, func(t *testing.T, p poller) {
				fd, peer := fdPair(t)
				var off uint32
				if oneshot {
					off = evOneShot
				}
				if err := p.add(fd, off); err != nil {
					t.Fatal(err)
				}
				if _, err := peer.Write([]byte("x")); err != nil {
					t.Fatal(err)
				}
				if err := peer.CloseWrite(); err != nil {
					t.Fatal(err)
				}
				quiet(t, p, fd) // readable, half-closed: nothing asked
				if err := peer.SetLinger(0); err != nil {
					t.Fatal(err)
				}
				peer.Close() // a reset
				if ev := waitFor(t, p, fd); ev&(evHup|evErr) == 0 || ev&evIn != 0 {
					t.Fatalf("reset: got %#x, want evHup or evErr without evIn", ev)
				}
				if oneshot {
					quiet(t, p, fd)
				} else {
					waitFor(t, p, fd)
				}
			})
		})
	}
}

// TestPollerHalfCloseReadable: the peer's half-close is readable on both
// pollers, with evRDHup only on epoll; a read then returns 0, which is
// how the loop sees it with poll(2).
func TestPollerHalfCloseReadable(t *testing.T) {
	eachPoller(t, func(t *testing.T, p poller) {
		fd, peer := fdPair(t)
		if err := p.add(fd, evIn|evRDHup); err != nil {
			t.Fatal(err)
		}
		if err := peer.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		ev := waitFor(t, p, fd)
		if ev&evIn == 0 {
			t.Fatalf("got %#x, want evIn", ev)
		}
		if rd := ev&evRDHup != 0; rd != (p.name() == "epoll") {
			t.Fatalf("got %#x: evRDHup %v, want it only on epoll", ev, rd)
		}
		var b [8]byte
		if n, err := rawIO(syscall.SYS_READ, fd, b[:]); n != 0 || err != nil {
			t.Fatalf("read: got %d, %v, want 0 (the end)", n, err)
		}
	})
}

// TestNewRefusesPoller: an unknown poller, or one the platform does not
// have, is a configuration error.
func TestNewRefusesPoller(t *testing.T) {
	bad := []string{"kqueue", "EPOLL"}
	if defaultPoller != "epoll" {
		bad = append(bad, "epoll")
	}
	for _, kind := range bad {
		if _, err := New(Config{Primary: "postgres://127.0.0.1/x", Poller: kind}, nil); err == nil {
			t.Errorf("poller %q: New accepted it", kind)
		}
	}
	for _, kind := range append(pollerKinds(), "") {
		if _, err := New(Config{Primary: "postgres://127.0.0.1/x", Poller: kind}, nil); err != nil {
			t.Errorf("poller %q: %v", kind, err)
		}
	}
}
