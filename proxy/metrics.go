package proxy

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
)

// This file holds the counters the admin console (SHOW STATS) and the
// Prometheus endpoint both read, the endpoint itself, and the health check
// behind /readyz and SHOW UPSTREAMS. The counters are plain atomics
// updated on the gate's path; Prometheus reads them at scrape time through
// a collector, so the wire loop never calls into the client library.

// gateCodes are the SQLSTATEs of the gate counted one by one; anything
// else in class FN is counted as "FN other".
var gateCodes = [...]string{"FN001", "FN002", "FN003", "FN004", "FN005", "FN006", "FN007", "FN008", "FN009", "FN015", "FN016", "FN017"}

// CodeCounts counts errors by SQLSTATE of class FN. The zero value is
// ready; safe for concurrent use.
type CodeCounts struct {
	n [len(gateCodes) + 1]atomic.Int64
}

// Add counts one error with code.
func (c *CodeCounts) Add(code string) {
	for i, k := range gateCodes {
		if k == code {
			c.n[i].Add(1)
			return
		}
	}
	c.n[len(gateCodes)].Add(1)
}

// Get returns the count for code ("FN other" for the rest).
func (c *CodeCounts) Get(code string) int64 {
	for i, k := range gateCodes {
		if k == code {
			return c.n[i].Load()
		}
	}
	return c.n[len(gateCodes)].Load()
}

// each calls f for every code, in order, with its count.
func (c *CodeCounts) each(f func(code string, n int64)) {
	for i, k := range gateCodes {
		f(k, c.n[i].Load())
	}
	f("FN other", c.n[len(gateCodes)].Load())
}

// latencyBuckets are the upper bounds, in seconds, of Latency's buckets:
// a gate or commit step is a round trip plus a row lock, normally well
// under a millisecond on a LAN, seconds when it waits for a takeover.
var latencyBuckets = [...]float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}

// Latency is a fixed-bucket histogram updated with atomics (no lock, no
// allocation). The zero value is ready.
type Latency struct {
	buckets [len(latencyBuckets) + 1]atomic.Uint64 // last: above every bound
	count   atomic.Uint64
	nanos   atomic.Int64
}

// Observe records one duration.
func (l *Latency) Observe(d time.Duration) {
	s := d.Seconds()
	i := 0
	for i < len(latencyBuckets) && s > latencyBuckets[i] {
		i++
	}
	l.buckets[i].Add(1)
	l.nanos.Add(int64(d))
	l.count.Add(1)
}

// Count returns how many durations were observed.
func (l *Latency) Count() uint64 { return l.count.Load() }

// Mean returns the mean duration (0 when nothing was observed).
func (l *Latency) Mean() time.Duration {
	n := l.count.Load()
	if n == 0 {
		return 0
	}
	return time.Duration(l.nanos.Load() / int64(n))
}

// snapshot returns the count, the sum in seconds and the cumulative bucket
// counts as Prometheus wants them.
func (l *Latency) snapshot() (uint64, float64, map[float64]uint64) {
	cum := make(map[float64]uint64, len(latencyBuckets))
	var run uint64
	for i, ub := range latencyBuckets {
		run += l.buckets[i].Load()
		cum[ub] = run
	}
	n := run + l.buckets[len(latencyBuckets)].Load()
	return n, float64(l.nanos.Load()) / 1e9, cum
}

// ServerStats are the server's counters since start. Read routing keeps
// its own (RouteStats).
type ServerStats struct {
	SessionsTotal atomic.Int64 // proxied sessions opened
	SessionsLoop  atomic.Int64 // of those, relayed by the event loop thread
	// ClientParks counts the times the event loop parked the client side
	// of an intercepted session because the Handler had to wait for an
	// earlier answer (a pipelined write behind a state change, a wrapped
	// COPY FROM, a settings read-back).
	ClientParks   atomic.Int64
	AdminSessions atomic.Int64 // admin console sessions opened
	// ConsoleRefusals counts console sessions refused (53300) because
	// their user had max_console_clients open (admin.go).
	ConsoleRefusals atomic.Int64
	// MessageTimeouts counts sessions ended because a message held whole
	// did not all arrive within message_timeout (evloop_client.go);
	// StartupEvictions connections in startup closed to make room under
	// max_startup_clients (startup_slots.go).
	MessageTimeouts  atomic.Int64
	StartupEvictions atomic.Int64
	UpstreamErrors   atomic.Int64 // upstream connections that failed (not refusals by PostgreSQL)
	// ServerParkedLost counts parked backends found ended when a client
	// came for one (pools.go): another was opened instead.
	ServerParkedLost atomic.Int64
	// AcceptErrors counts the accepts that failed and were retried after
	// a back-off: out of descriptors (EMFILE, ENFILE) or kernel memory,
	// or a connection that failed before it was taken (accept.go).
	AcceptErrors atomic.Int64

	mu      sync.Mutex
	refused map[string]int64 // clients refused, by SQLSTATE
}

// refusedClient counts a client refused with SQLSTATE code.
func (st *ServerStats) refusedClient(code string) {
	st.mu.Lock()
	if st.refused == nil {
		st.refused = make(map[string]int64)
	}
	st.refused[code]++
	st.mu.Unlock()
}

// Refused returns the clients refused so far, by SQLSTATE.
func (st *ServerStats) Refused() map[string]int64 {
	st.mu.Lock()
	defer st.mu.Unlock()
	out := make(map[string]int64, len(st.refused))
	for k, v := range st.refused {
		out[k] = v
	}
	return out
}

// UpstreamStatus is one upstream as SHOW UPSTREAMS and the metrics report
// it.
type UpstreamStatus struct {
	Role    string // "primary" or "replica"
	Addr    string // host:port
	Healthy bool
	// Error says why the upstream is unhealthy.
	Error string
	// ReplayLag is how far a replica's replay is behind the primary, when
	// known (LagKnown).
	ReplayLag time.Duration
	// LagBytes is the replay lag in WAL bytes, when known (LagKnown).
	LagBytes int64
	LagKnown bool
	// Checked is when the status was last measured.
	Checked time.Time
}

// health follows the primary's reachability with a cheap periodic
// connection, for /readyz.
type health struct {
	once    sync.Once
	mu      sync.Mutex
	primary UpstreamStatus
}

// DefaultHealthInterval is how often the primary is pinged for /readyz
// once the metrics endpoint is in use.
const DefaultHealthInterval = 5 * time.Second

// ping connects to the upstream pc describes (with its own user and
// database) and closes the connection.
func (s *Server) ping(ctx context.Context, role string, pc *pgconn.Config) UpstreamStatus {
	st := UpstreamStatus{Role: role, Addr: fmt.Sprintf("%s:%d", pc.Host, pc.Port), Checked: time.Now()}
	c := controlConfig(pc, "", "pgfence health check") // it runs no SQL, but starts a session
	if c.ConnectTimeout == 0 || c.ConnectTimeout > s.cfg.ConnectTimeout {
		c.ConnectTimeout = s.cfg.ConnectTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, c.ConnectTimeout)
	defer cancel()
	conn, err := pgconn.ConnectConfig(ctx, c)
	if err != nil {
		st.Error = err.Error()
		return st
	}
	// With a multi-host DSN (a cluster's nodes, target_session_attrs)
	// the address is the node that answered: after a failover, the new
	// primary's.
	if a := conn.Conn().RemoteAddr(); a != nil {
		st.Addr = a.String()
	}
	conn.Close(ctx)
	st.Healthy = true
	return st
}

// checkPrimary pings the primary and records the outcome.
func (s *Server) checkPrimary(ctx context.Context) UpstreamStatus {
	st := s.ping(ctx, "primary", s.primary)
	s.ops.health.mu.Lock()
	was := s.ops.health.primary
	s.ops.health.primary = st
	s.ops.health.mu.Unlock()
	if was.Healthy != st.Healthy && !was.Checked.IsZero() {
		if st.Healthy {
			s.log.Info("primary reachable again", zap.String("addr", st.Addr))
		} else {
			s.log.Warn("primary unreachable", zap.String("addr", st.Addr), zap.String("error", st.Error))
		}
	}
	return st
}

// startHealth starts the periodic primary check once; it ends when the
// server shuts down.
func (s *Server) startHealth() {
	s.ops.health.once.Do(func() {
		interval := s.cfg.HealthInterval
		go func() {
			t := time.NewTicker(interval)
			defer t.Stop()
			for !s.draining.Load() {
				s.checkPrimary(context.Background())
				<-t.C
			}
		}()
	})
}

// Ready reports whether the server is serving (a listener is open, not
// shutting down) and its last check found the primary reachable, with a
// reason when it is not.
func (s *Server) Ready() (bool, string) {
	if s.draining.Load() {
		return false, "shutting down"
	}
	s.mu.Lock()
	serving := len(s.listeners) > 0
	s.mu.Unlock()
	if !serving {
		return false, "not serving yet"
	}
	s.ops.health.mu.Lock()
	p := s.ops.health.primary
	s.ops.health.mu.Unlock()
	switch {
	case p.Checked.IsZero():
		return false, "primary not checked yet"
	case !p.Healthy:
		return false, "primary unreachable: " + p.Error
	}
	return true, "ready"
}

// MetricsHandler returns the HTTP handler for /metrics (Prometheus, from
// the server's own registry), /healthz (200 while the process runs) and
// /readyz (200 while serving with the primary reachable, else 503). It
// starts the primary's periodic health check.
func (s *Server) MetricsHandler() http.Handler {
	s.startHealth()
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		&collector{s: s},
	)
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: zap.NewStdLog(s.log), Registry: reg}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		ok, why := s.Ready()
		if !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		fmt.Fprintln(w, why)
	})
	return mux
}

// collector exports the server's and the gate's counters at scrape time.
type collector struct{ s *Server }

var (
	descSessions     = prometheus.NewDesc("pgfence_sessions", "Open proxied client sessions.", nil, nil)
	descSessionsTot  = prometheus.NewDesc("pgfence_sessions_opened_total", "Proxied client sessions opened.", nil, nil)
	descSessionsLoop = prometheus.NewDesc("pgfence_sessions_event_loop_total", "Proxied client sessions relayed by the event loop thread.", nil, nil)
	descMsgTimeouts  = prometheus.NewDesc("pgfence_message_timeouts_total", "Sessions ended because a client message held whole did not all arrive within message_timeout.", nil, nil)
	descEvictions    = prometheus.NewDesc("pgfence_startup_evictions_total", "Connections still in startup or authentication closed to make room under max_startup_clients.", nil, nil)
	descParks        = prometheus.NewDesc("pgfence_client_parks_total", "Times the event loop parked a session's client side because the write gate had to wait for an earlier answer (pipelined writes, wrapped COPY FROM, settings read-backs).", nil, nil)
	descAdminTot     = prometheus.NewDesc("pgfence_admin_sessions_opened_total", "Admin console sessions opened.", nil, nil)
	descAdminRefused = prometheus.NewDesc("pgfence_admin_sessions_refused_total", "Admin console sessions refused because their user had max_console_clients open.", nil, nil)
	descRefused      = prometheus.NewDesc("pgfence_clients_refused_total", "Clients refused before their session started, by SQLSTATE.", []string{"code"}, nil)
	descAcceptErrors = prometheus.NewDesc("pgfence_accept_errors_total", "Accepts of client connections that failed and were retried after a back-off (out of file descriptors, EMFILE/ENFILE, or kernel memory; a connection that failed before it was taken).", nil, nil)
	descPoolWaiting  = prometheus.NewDesc("pgfence_pool_waiting_clients", "Clients waiting for a server connection under default_pool_size, max_db_connections or max_user_connections (SHOW POOLS has them by database and user).", nil, nil)
	descPoolWaits    = prometheus.NewDesc("pgfence_pool_waits_total", "Clients that had to wait for a server connection.", nil, nil)
	descPoolWaitSecs = prometheus.NewDesc("pgfence_pool_wait_seconds_total", "Time clients waited for a server connection, summed over the waits that ended with one.", nil, nil)
	descPoolTimeouts = prometheus.NewDesc("pgfence_pool_wait_timeouts_total", "Clients refused (53300) after waiting query_wait_timeout for a server connection.", nil, nil)
	descPoolIdle     = prometheus.NewDesc("pgfence_pool_server_idle", "Server connections parked for the next client (server_reuse; SHOW POOLS sv_idle).", nil, nil)
	descPoolReused   = prometheus.NewDesc("pgfence_pool_server_reused_total", "Clients given a parked server connection instead of a new one (server_reuse).", nil, nil)
	descPoolParked   = prometheus.NewDesc("pgfence_pool_server_parked_total", "Server connections reset and parked when their client left (server_reuse).", nil, nil)
	descPoolClosed   = prometheus.NewDesc("pgfence_pool_server_closed_total", "Parked server connections closed, by why: evicted (a client of other startup parameters needed the place), expired (server_idle_timeout or server_lifetime), ended (found ended when a client came for it), other (RECONNECT, shutdown).", []string{"reason"}, nil)
	descUpErrors     = prometheus.NewDesc("pgfence_upstream_connection_errors_total", "Upstream connections that could not be opened (network, TLS, timeouts; not refusals by PostgreSQL).", nil, nil)
	descReads        = prometheus.NewDesc("pgfence_read_routes_total", "Reads a replica could serve, by where they went: replica, primary (behind, unhealthy, pinned, or code that must run in the client's session), pending (refused with FN007).", []string{"route"}, nil)
	descReadWaits    = prometheus.NewDesc("pgfence_read_waits_total", "Reads that waited for a replica to replay (fence.read_policy wait).", nil, nil)
	descReadRetries  = prometheus.NewDesc("pgfence_read_retries_total", "Routed reads answered by the primary after their replica failed.", nil, nil)
	descReadStale    = prometheus.NewDesc("pgfence_reads_stale_total", "Protected reads no replica served because the takeover watcher's notifications were held up (its freshness marker had not come back).", nil, nil)
	descGate         = prometheus.NewDesc("pgfence_gate_transactions_total", "Gated transactions by outcome: gated (passed the fence check), committed (new receipt), replayed (idempotent replay).", []string{"outcome"}, nil)
	descGateErr      = prometheus.NewDesc("pgfence_gate_errors_total", "Errors of class FN the clients got, by SQLSTATE (FN001 stale, FN003 conflict, FN004 retired, FN005 unknown job, FN006 receipt pruned, FN008 fencing required, FN009 unsupported, FN015 generation from before a failover, FN016 a commit the synchronous standby did not confirm, FN017 a first write before the synchronous standby confirmed its takeover).", []string{"code"}, nil)
	descClassified   = prometheus.NewDesc("pgfence_statements_classified_total", "Statements classified by the gate.", nil, nil)
	descCacheBytes   = prometheus.NewDesc("pgfence_cache_bytes", "Bytes the write gate's classifier and plan caches hold, as estimated (bounded by cache_memory, within memory_budget).", nil, nil)
	descCacheEntries = prometheus.NewDesc("pgfence_cache_entries", "Entries in the write gate's classifier and plan caches.", nil, nil)
	descCacheEvict   = prometheus.NewDesc("pgfence_cache_evictions_total", "Entries evicted from the write gate's caches to make room (least recently used first).", nil, nil)
	descCacheUncache = prometheus.NewDesc("pgfence_cache_uncached_total", "Statements classified and not cached: larger than cache_memory, or no room in memory_budget.", nil, nil)
	descLatency      = prometheus.NewDesc("pgfence_gate_step_duration_seconds", "Time from sending a gate step upstream to its response, by step (gate: fence check; commit: receipt).", []string{"step"}, nil)
	descUp           = prometheus.NewDesc("pgfence_upstream_up", "1 when the upstream was reachable at its last check.", []string{"role", "addr"}, nil)
	descLag          = prometheus.NewDesc("pgfence_replica_lag_seconds", "Replay lag of each replica, when known.", []string{"addr"}, nil)
	descLagBytes     = prometheus.NewDesc("pgfence_replica_lag_bytes", "Replay lag of each replica in WAL bytes, when known.", []string{"addr"}, nil)
)

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descSessions, descSessionsTot, descSessionsLoop, descParks, descMsgTimeouts, descEvictions, descAdminTot, descAdminRefused, descRefused, descAcceptErrors, descPoolWaiting, descPoolWaits, descPoolWaitSecs, descPoolTimeouts, descPoolIdle, descPoolReused, descPoolParked, descPoolClosed, descUpErrors, descReads, descReadWaits, descReadRetries, descReadStale,
		descGate, descGateErr, descClassified, descCacheBytes, descCacheEntries, descCacheEvict, descCacheUncache, descLatency, descUp, descLag, descLagBytes} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	s := c.s
	st := &s.ops.stats
	counter := func(d *prometheus.Desc, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	ch <- prometheus.MustNewConstMetric(descSessions, prometheus.GaugeValue, float64(len(s.sessions())))
	counter(descSessionsTot, st.SessionsTotal.Load())
	counter(descSessionsLoop, st.SessionsLoop.Load())
	counter(descParks, st.ClientParks.Load())
	counter(descMsgTimeouts, st.MessageTimeouts.Load())
	counter(descEvictions, st.StartupEvictions.Load())
	counter(descAdminTot, st.AdminSessions.Load())
	counter(descAdminRefused, st.ConsoleRefusals.Load())
	for code, n := range st.Refused() {
		counter(descRefused, n, code)
	}
	counter(descAcceptErrors, st.AcceptErrors.Load())
	counter(descUpErrors, st.UpstreamErrors.Load())
	waiting, idle := 0, 0
	for _, p := range s.pools.Stats() {
		waiting += p.Waiting
		idle += p.Idle
	}
	ch <- prometheus.MustNewConstMetric(descPoolWaiting, prometheus.GaugeValue, float64(waiting))
	ch <- prometheus.MustNewConstMetric(descPoolIdle, prometheus.GaugeValue, float64(idle))
	pt := s.pools.Totals()
	counter(descPoolReused, int64(pt.Reused))
	counter(descPoolParked, int64(pt.Parked))
	counter(descPoolClosed, int64(pt.Evicted), "evicted")
	counter(descPoolClosed, int64(pt.Expired), "expired")
	counter(descPoolClosed, st.ServerParkedLost.Load(), "ended")
	counter(descPoolClosed, int64(pt.Closed-pt.Evicted-pt.Expired), "other")
	counter(descPoolWaits, int64(pt.Waited))
	ch <- prometheus.MustNewConstMetric(descPoolWaitSecs, prometheus.CounterValue, pt.WaitTime.Seconds())
	counter(descPoolTimeouts, int64(pt.Timeouts))
	rs := s.RouteStats()
	if rs == nil {
		rs = &RouteStats{} // no replicas: nothing is routed
	}
	counter(descReads, rs.Primary.Load(), "primary")
	counter(descReads, rs.Replica.Load(), "replica")
	counter(descReads, rs.Pending.Load(), "pending")
	counter(descReadWaits, rs.Waits.Load())
	counter(descReadRetries, rs.Retries.Load())
	counter(descReadStale, rs.Stale.Load())
	if fs := s.gateStats(); fs != nil {
		counter(descGate, fs.Gated.Load(), "gated")
		counter(descGate, fs.Committed.Load(), "committed")
		counter(descGate, fs.Replayed.Load(), "replayed")
		fs.Codes.each(func(code string, n int64) { counter(descGateErr, n, code) })
		counter(descClassified, fs.Classified.Load())
		if fs.Cache != nil {
			ch <- prometheus.MustNewConstMetric(descCacheBytes, prometheus.GaugeValue, float64(fs.Cache.Bytes()))
			ch <- prometheus.MustNewConstMetric(descCacheEntries, prometheus.GaugeValue, float64(fs.Cache.Entries()))
			counter(descCacheEvict, fs.Cache.Evictions())
			counter(descCacheUncache, fs.Cache.Uncached())
		}
		for _, l := range []struct {
			step string
			h    *Latency
		}{{"gate", &fs.GateLatency}, {"commit", &fs.CommitLatency}} {
			n, sum, b := l.h.snapshot()
			ch <- prometheus.MustNewConstHistogram(descLatency, n, sum, b, l.step)
		}
	}
	s.ops.health.mu.Lock()
	p := s.ops.health.primary
	s.ops.health.mu.Unlock()
	if !p.Checked.IsZero() {
		ch <- prometheus.MustNewConstMetric(descUp, prometheus.GaugeValue, b2f(p.Healthy), "primary", p.Addr)
	}
	if f := s.replicaStatusFunc(); f != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		for _, r := range f(ctx) {
			ch <- prometheus.MustNewConstMetric(descUp, prometheus.GaugeValue, b2f(r.Healthy), "replica", r.Addr)
			if r.LagKnown {
				ch <- prometheus.MustNewConstMetric(descLag, prometheus.GaugeValue, r.ReplayLag.Seconds(), r.Addr)
				ch <- prometheus.MustNewConstMetric(descLagBytes, prometheus.GaugeValue, float64(r.LagBytes), r.Addr)
			}
		}
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// timeStep records the latency of a gate or commit step that just got its
// response, and moves a query's clock on to the next statement. Server
// goroutine.
func (h *fenceSession) timeStep(t *tag, st step) {
	if t.sent.IsZero() {
		return
	}
	now := time.Now()
	switch st {
	case stepGate:
		h.f.Stats.GateLatency.Observe(now.Sub(t.sent))
	case stepReceipt:
		h.f.Stats.CommitLatency.Observe(now.Sub(t.sent))
	}
	t.sent = now
}
