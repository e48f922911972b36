package proxy

import (
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/lru"
)

// What the proxy asks of an Interceptor or Handler beyond the Interceptor
// interface, each optional: the console, the metrics and read routing
// test for these, never for a concrete type, so any Interceptor that
// implements them is served alike (the write gate, Fence, implements all
// three).

// GateStatsReporter is implemented by an Interceptor that counts what its
// gate did: SHOW STATS, SHOW CONFIG's gate row and the metrics endpoint
// read the counters it returns (the same value every call).
type GateStatsReporter interface {
	GateStats() *FenceStats
}

// GateReporter is implemented by a Handler that knows its session's fence
// state, which SHOW SESSIONS and SHOW CLIENTS show. Any goroutine.
type GateReporter interface {
	GateState() GateState
}

// GateState is a session's fence state.
type GateState struct {
	// Gen is the generation the transaction is gated with, else the one
	// the session presents (its fence.* settings); HasGen says whether
	// there is one.
	Gen    fence.Generation
	HasGen bool
	// Gated: the open transaction passed the gate; Replay: as a replay of
	// a step already committed.
	Gated, Replay bool
}

// ReadRouter is implemented by an Interceptor whose Handlers route reads
// to replicas (the Handler classifies each query; the Session's replica
// connection carries it: route.go, replica.go). With replicas configured
// and replica reads allowed, the Server calls RouteReads once, before it
// serves. The function returned tells the replica pollers which database
// to connect to (they keep no connection in a database nobody uses): one
// with client sessions, prev while it still has them (unless failed),
// else another, else "".
type ReadRouter interface {
	RouteReads() (sessionDB func(prev string, failed bool) string)
}

// CacheMemoryUser is implemented by an Interceptor whose caches count
// against the Server's memory budget (Config.MemoryBudget, limits.go). New
// calls UseMemory once, before it serves, with the budget and what the
// caches take their bytes from; the function returned makes the caches
// give at least n bytes back (evicting their least recently used
// entries), which the Server calls when a client message does not fit.
type CacheMemoryUser interface {
	UseMemory(budget int64, b lru.Budget) (shrink func(n int64) int64)
}

// UseMemory implements CacheMemoryUser: the caches get an eighth of the
// budget unless FenceConfig.CacheMemory says how much.
func (f *Fence) UseMemory(budget int64, b lru.Budget) func(n int64) int64 {
	if !f.cacheSized {
		f.cache.SetMax(budget / 8)
	}
	f.cache.SetBudget(b)
	return f.cache.Shrink
}

// GateStats implements GateStatsReporter.
func (f *Fence) GateStats() *FenceStats { return &f.Stats }

// RouteReads implements ReadRouter: the catalogs load read sets from now
// on (fence_catalog.go).
func (f *Fence) RouteReads() func(prev string, failed bool) string {
	f.cats.reads.Store(true)
	return f.cats.sessionDB
}

// gateStats returns the interceptor's gate counters, nil without a gate.
func (s *Server) gateStats() *FenceStats {
	if r, ok := s.cfg.Interceptor.(GateStatsReporter); ok {
		return r.GateStats()
	}
	return nil
}

var (
	_ GateStatsReporter = (*Fence)(nil)
	_ ReadRouter        = (*Fence)(nil)
	_ CacheMemoryUser   = (*Fence)(nil)
	_ GateReporter      = (*fenceSession)(nil)
)
