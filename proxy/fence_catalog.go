package proxy

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/rewrite"
)

// catalogs keeps, per database, the set of protected tables, loaded from
// fence.protected_tables and reloaded when fence.protect/unprotect notify
// pgfence_protected. A dedicated connection per database LISTENs; it
// reconnects on failure, reloading after every reconnect so no change is
// missed.
type catalogs struct {
	base *pgconn.Config // control connection settings (the primary DSN)
	log  *zap.Logger

	mu  sync.Mutex
	dbs map[string]*catalog

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

type catalog struct {
	db    string
	prot  atomic.Pointer[rewrite.Protected]
	ready chan struct{} // closed after the first load (successful or not)
	err   atomic.Pointer[error]

	tk takeovers // takeovers seen on pgfence_takeover (lsn.go)
}

func newCatalogs(base *pgconn.Config, log *zap.Logger) *catalogs {
	ctx, cancel := context.WithCancel(context.Background())
	return &catalogs{base: base, log: log, dbs: map[string]*catalog{}, ctx: ctx, cancel: cancel}
}

// get returns the catalog of db, loading it on first use. It fails (and
// the session must fail closed) when the catalog could not be loaded.
func (cs *catalogs) get(ctx context.Context, db string) (*catalog, error) {
	cs.mu.Lock()
	c, ok := cs.dbs[db]
	if !ok {
		c = &catalog{db: db, ready: make(chan struct{})}
		cs.dbs[db] = c
		cs.wg.Add(1)
		go func() { defer cs.wg.Done(); cs.watch(c) }()
	}
	cs.mu.Unlock()
	select {
	case <-c.ready:
	case <-ctx.Done():
		return nil, fmt.Errorf("load protected tables of %q: %w", db, ctx.Err())
	}
	if p := c.prot.Load(); p != nil {
		return c, nil
	}
	if e := c.err.Load(); e != nil {
		return nil, *e
	}
	return nil, fmt.Errorf("load protected tables of %q: not loaded", db)
}

func (cs *catalogs) close() {
	cs.cancel()
	cs.wg.Wait()
}

// watch keeps c current until the catalogs close.
func (cs *catalogs) watch(c *catalog) {
	log := cs.log.With(zap.String("database", c.db))
	first := true
	backoff := 100 * time.Millisecond
	for cs.ctx.Err() == nil {
		err := cs.listen(c, func() {
			if first {
				first = false
				close(c.ready)
			}
			backoff = 100 * time.Millisecond
		})
		if cs.ctx.Err() != nil {
			break
		}
		log.Warn("protected-table watcher lost its connection; reconnecting", zap.Error(err))
		if first {
			e := fmt.Errorf("load protected tables of %q: %w", c.db, err)
			c.err.Store(&e)
			// Let waiting sessions fail now rather than hang; later
			// sessions retry through the watcher's next attempt.
			first = false
			close(c.ready)
		}
		select {
		case <-cs.ctx.Done():
		case <-time.After(backoff):
		}
		if backoff < 5*time.Second {
			backoff *= 2
		}
	}
	if first {
		close(c.ready)
	}
}

// listen connects, LISTENs, loads, then reloads on every notification.
func (cs *catalogs) listen(c *catalog, loaded func()) error {
	cfg := cs.base.Copy()
	cfg.Database = c.db
	var reload atomic.Bool
	var notesMu sync.Mutex
	var notes []string // pgfence_takeover payloads not yet stamped with a position
	cfg.OnNotification = func(_ *pgconn.PgConn, n *pgconn.Notification) {
		if n.Channel == takeoverChannel {
			notesMu.Lock()
			notes = append(notes, n.Payload)
			notesMu.Unlock()
			return
		}
		reload.Store(true)
	}
	takeNotes := func() []string {
		notesMu.Lock()
		defer notesMu.Unlock()
		n := notes
		notes = nil
		return n
	}
	ctx, cancel := context.WithTimeout(cs.ctx, 10*time.Second)
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	cancel()
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(cs.ctx, "LISTEN pgfence_protected; LISTEN "+takeoverChannel).ReadAll(); err != nil {
		return err
	}
	if err := cs.load(c, conn); err != nil {
		return err
	}
	// Every takeover before this position is covered by it; every one
	// after is notified (read routing, lsn.go).
	floor, err := currentLSN(cs.ctx, conn)
	if err != nil {
		return err
	}
	if floor > LSN(c.tk.floor.Load()) {
		c.tk.floor.Store(uint64(floor))
	}
	c.err.Store(nil)
	loaded()
	for {
		// Notifications may arrive while a query runs: handle them
		// before waiting for more.
		if n := takeNotes(); len(n) > 0 {
			if err := c.tk.recordNotes(cs.ctx, conn, n, cs.log.With(zap.String("database", c.db))); err != nil {
				return err
			}
			continue
		}
		// Coalesce a burst of notifications into one reload.
		if reload.Swap(false) {
			if err := cs.load(c, conn); err != nil {
				return err
			}
			continue
		}
		if err := conn.WaitForNotification(cs.ctx); err != nil {
			return err
		}
	}
}

const protectedQuery = `SELECT n.nspname, c.relname
FROM fence.protected_tables p
JOIN pg_catalog.pg_class c ON c.oid = p.relid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace`

func (cs *catalogs) load(c *catalog, conn *pgconn.PgConn) error {
	var has string
	rr := conn.ExecParams(cs.ctx, "SELECT coalesce(to_regclass('fence.protected_tables')::text, '')", nil, nil, nil, nil)
	for rr.NextRow() {
		has = string(rr.Values()[0])
	}
	if _, err := rr.Close(); err != nil {
		return err
	}
	var rels []rewrite.RelName
	if has != "" {
		rr := conn.ExecParams(cs.ctx, protectedQuery, nil, nil, nil, nil)
		for rr.NextRow() {
			v := rr.Values()
			rels = append(rels, rewrite.RelName{Schema: string(v[0]), Name: string(v[1])})
		}
		if _, err := rr.Close(); err != nil {
			return err
		}
	}
	c.prot.Store(rewrite.NewProtected(rels))
	return nil
}
