package proxy

import (
	"container/list"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Connections still in startup or authentication (issue 30, B-M4) are
// bounded apart from authenticated sessions: Config.MaxStartupClients of
// them at a time, counted from accept until the client has authenticated
// (or been refused). max_clients counts authenticated sessions only, and
// the admin console is not counted against it, so clients that never
// authenticate cannot take the slots of those that do, nor the
// console's. When the startup bound is reached, the connection that has
// waited longest is ended (53300, "too many connections still
// authenticating") to make room for the new one, rather than the new one
// refused: an honest client authenticates in a round trip or two, so an
// attacker who wants to keep it out must open MaxStartupClients
// connections within that time, again and again, instead of parking them
// for startup_timeout.

// startupSlots are the connections in startup, oldest first.
type startupSlots struct {
	mu      sync.Mutex
	pending list.List // of *startupSlot
}

// startupSlot is one connection's place among those in startup.
type startupSlot struct {
	c       net.Conn
	elem    *list.Element
	evicted atomic.Bool
}

// startupBegin counts c as in startup, ending the oldest connection in
// startup when that makes more than MaxStartupClients.
func (s *Server) startupBegin(c net.Conn) *startupSlot {
	p := &startupSlot{c: c}
	ss := &s.startups
	ss.mu.Lock()
	p.elem = ss.pending.PushBack(p)
	var old *startupSlot
	if limit := s.cfg.MaxStartupClients; limit > 0 && ss.pending.Len() > limit {
		old = ss.pending.Remove(ss.pending.Front()).(*startupSlot)
		old.elem = nil
	}
	ss.mu.Unlock()
	if old != nil {
		s.ops.stats.StartupEvictions.Add(1)
		old.evicted.Store(true)
		// Its goroutine wakes from its read or write, sees evicted and
		// tells its client why (startupError).
		old.c.SetDeadline(time.Now())
	}
	return p
}

// startupEnd ends p's count (authenticated, refused or gone); it may be
// called more than once.
func (s *Server) startupEnd(p *startupSlot) {
	ss := &s.startups
	ss.mu.Lock()
	if p.elem != nil {
		ss.pending.Remove(p.elem)
		p.elem = nil
	}
	ss.mu.Unlock()
}

// startupCount is how many connections are in startup.
func (s *Server) startupCount() int {
	s.startups.mu.Lock()
	defer s.startups.mu.Unlock()
	return s.startups.pending.Len()
}

// startupError is the error to tell p's client: err, or why it was
// ended to make room.
func (s *Server) startupError(p *startupSlot, err error) error {
	if !p.evicted.Load() {
		return err
	}
	p.c.SetWriteDeadline(time.Now().Add(time.Second))
	return &ProtocolError{Code: "53300", Msg: "pgfence: too many connections still authenticating (max_startup_clients); this one had waited longest and was closed to make room",
		Hint: "Authenticate promptly; raise max_startup_clients if many honest clients connect at once."}
}
