package proxy

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/lru"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
)

// Fence is the write gate: an Interceptor that wraps every transaction
// writing a protected table with the fence check (fence.gate) and the
// commit receipt (fence.commit), as DESIGN §3–§5 describe. Create it with
// NewFence and set it as Config.Interceptor.
type Fence struct {
	cache      *lru.Pool // the classifier's and the plans' (CacheMemory)
	cacheSized bool      // CacheMemory was given
	classifier *rewrite.Classifier
	plans      *plan.Cache // simple queries' plans, by what the planner reads
	cats       *catalogs
	log        *zap.Logger
	idle       *watchdog   // fence_idle.go
	refusals   *zap.Logger // sampled (fence_log.go)
	warned     sync.Map    // warnOnce's keys

	// Stats counts gate outcomes; read with Snapshot.
	Stats FenceStats
}

// FenceStats are the gate's counters since start.
type FenceStats struct {
	Gated      atomic.Int64 // transactions that passed the fence check
	Committed  atomic.Int64 // gated transactions committed with a new receipt
	Replayed   atomic.Int64 // commits answered as idempotent replays
	Refused    atomic.Int64 // gate or commit refusals (FN001, FN003-FN006, FN008, FN009)
	Unfenced   atomic.Int64 // protected writes without fence metadata (FN008)
	Classified atomic.Int64 // statements classified

	RefusalsNotLogged atomic.Int64 // refusal lines the log's sampler left out (fence_log.go)

	// For SHOW STATS and the metrics (metrics.go).
	Codes         CodeCounts // FN errors the clients got, by SQLSTATE
	GateLatency   Latency    // gate step: sent upstream → its response
	CommitLatency Latency    // receipt step: sent upstream → its response

	// Cache holds the classifier's and the plans' cached entries: its
	// bytes, entries, evictions and the statements it did not cache.
	Cache *lru.Pool
}

// FenceConfig configures NewFence.
type FenceConfig struct {
	// Primary is the DSN the gate's control connections use to read
	// fence.protected_tables of each database (and LISTEN for changes).
	// Its database is replaced by each client's.
	Primary string
	// CacheMemory bounds what the caches of statement classifications
	// and of rewritten queries' plans hold together, in bytes of heap as
	// estimated (rewrite/cachecost.go), least recently used first out. A
	// statement that would cost more is classified and not cached. Under a
	// Server the caches also count against its MemoryBudget and give way
	// to client messages (limits.go). Zero means an eighth of the
	// Server's MemoryBudget (64 MiB by default; rewrite.DefaultCacheMemory
	// without a Server).
	CacheMemory int64
	// GateIdleTimeout bounds how long a client may stay silent while its
	// transaction holds (or may hold) a fence row: past it the session is
	// ended, its transaction rolled back, and the client told FN012 (see
	// fence_idle.go). Keep it under the shortest lease TTL. Zero means
	// DefaultGateIdleTimeout (10s); negative means no bound.
	GateIdleTimeout time.Duration
	// CatalogRefresh is how often each watched
	// database's catalog is re-read when nothing notified a change (see
	// docs/reads.md). Zero means DefaultCatalogRefresh (5s).
	CatalogRefresh time.Duration
}

// NewFence returns a write gate.
func NewFence(cfg FenceConfig, log *zap.Logger) (*Fence, error) {
	pc, err := pgconn.ParseConfig(cfg.Primary)
	if err != nil {
		return nil, fmt.Errorf("fence: parse primary dsn: %w", err)
	}
	if cfg.GateIdleTimeout == 0 {
		cfg.GateIdleTimeout = DefaultGateIdleTimeout
	}
	cache := lru.NewPool(rewrite.DefaultCacheMemory)
	if cfg.CacheMemory > 0 {
		cache = lru.NewPool(cfg.CacheMemory)
	}
	f := &Fence{
		cache:      cache,
		cacheSized: cfg.CacheMemory > 0,
		classifier: rewrite.NewClassifier(cache),
		plans:      plan.NewCache(cache),
		cats:       newCatalogs(pc, cfg.CatalogRefresh, log.Named("catalog")),
		log:        log,
		idle:       newWatchdog(cfg.GateIdleTimeout, pc, log.Named("gate")),
	}
	f.refusals = refusalLogger(log, &f.Stats.RefusalsNotLogged)
	f.Stats.Cache = cache
	return f, nil
}

// Close stops the gate's control connections and its watchdog.
func (f *Fence) Close() {
	f.idle.close()
	f.cats.close()
}

// Open implements Interceptor.
func (f *Fence) Open(s *Session) (Handler, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cat, err := f.cats.get(ctx, s.Database)
	if err != nil {
		s.Logger().Warn("cannot load protected tables; refusing the session", zap.Error(err))
		if pe := resourceRefusal(err, "its control connection to PostgreSQL"); pe != nil { // accept.go
			return nil, pe
		}
		return nil, &ProtocolError{Code: "58000", Msg: fmt.Sprintf("pgfence: cannot read the protected tables of database %q; try again shortly", s.Database), Err: err}
	}
	if !cat.schema.Load() {
		// Said once per database, at its first session: its unfenced work
		// passes, its fenced work is refused with FN014 (setupError).
		f.warnOnce("schema:"+s.Database, "database has no usable fence schema; nothing in it is protected and fenced clients are refused until `pgfence migrate` runs",
			zap.String("database", s.Database))
	}
	be := newGateBackend(s.ServerParams, s.Logger())
	st, err := session.New(s.Params, be.stmts)
	if err != nil {
		f.cats.release(cat)
		if se, ok := err.(*fence.Error); ok {
			return nil, &ProtocolError{Code: se.Code, Msg: se.Message, Err: err}
		}
		return nil, &ProtocolError{Code: "22023", Msg: err.Error(), Err: err}
	}
	h := &fenceSession{
		f:           f,
		cat:         cat,
		st:          st,
		be:          be,
		user:        s.User,
		db:          s.Database,
		batchStmts:  map[string]*clientStmt{},
		copyStarted: make(chan struct{}, 1),
		portals:     map[string]*clientPortal{},
	}
	f.idle.add(h, s)
	return h, nil
}
