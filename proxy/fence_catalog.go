package proxy

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/rewrite"
)

// catalogs keeps, per database that has client sessions, what the gate and
// the read router need from that database's catalog: the protected tables
// (fence.protected_tables), the takeovers (pgfence_takeover, lsn.go) and,
// with read routing, which relations a read may reach protected data
// through (readSet). A watcher connection per database LISTENs for
// pgfence_protected and pgfence_takeover and reloads on every notification
// and after every reconnect, so no change is missed.
//
// A watcher lives exactly as long as its database has client sessions
// (Fence.Open takes a reference, the session's end gives it back): the
// proxy holds no connection in a database nobody uses through it, so DROP
// DATABASE, CREATE DATABASE ... TEMPLATE and ALTER DATABASE ... RENAME of
// that database work while the proxy serves others. A database that
// disappears under its watcher (DROP DATABASE ... WITH (FORCE)) is logged
// once and not reconnected to. A new watcher starts from a safe floor: its
// takeover floor is the primary's position when it connected (lsn.go), and
// its read set is the catalog as of then.
type catalogs struct {
	base *pgconn.Config // control connection settings (the primary DSN)
	log  *zap.Logger
	// refresh is how often a watcher reloads the catalog whatever was
	// notified: it notices within that time a DDL event trigger that was
	// disabled or dropped (which notifies nobody), and a database
	// restored whole under the proxy (a restore's triggers are created
	// after its data, so nothing notifies). Correctness never waits for
	// it: the backstop fences what the proxy does not know yet; the
	// refresh only ends the time in which the proxy's answers are the
	// backstop's (a retry's FN00R an error, not a notice).
	refresh time.Duration
	// reads: read routing is on: load read sets.
	reads atomic.Bool
	// deaf: watchers ignore pgfence_protected and do not refresh (tests:
	// the gate must be correct without either).
	deaf atomic.Bool

	mu  sync.Mutex
	dbs map[string]*catalog

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// DefaultCatalogRefresh is how often a database's
// catalog is re-read when nothing notified a change.
const DefaultCatalogRefresh = 5 * time.Second

type catalog struct {
	db   string
	refs int // sessions holding it (catalogs.mu)
	ctx  context.Context
	stop context.CancelFunc

	prot  atomic.Pointer[rewrite.Protected]
	reads atomic.Pointer[readSet] // nil: not known (every read may reach protected data)
	last  *readSet                // the last set read (watcher goroutine), to skip unchanged ones
	ready chan struct{}           // closed after the first load (successful or not)
	err   atomic.Pointer[error]
	// gone: the database no longer exists; the watcher has stopped.
	gone atomic.Bool
	// live: the watcher is connected and has loaded, so takeovers are
	// seen as they happen. While it is not, readers without fence
	// metadata cannot be told which takeovers they need (route.go).
	live atomic.Bool
	// reached: fence.replica_reached(job, epoch, token) exists (the
	// replica fence-row check uses it, route.go).
	reached atomic.Bool
	// tracked: the database notifies DDL (ddlTrigger), so a read set can
	// be kept current; without it reads is nil (every read protected).
	tracked atomic.Bool
	// schema: the database has the fence schema (fence.protected_tables),
	// so a fenced transaction the gate cannot see into ends with
	// commit_if_written even while prot is empty (fence_session.go).
	schema atomic.Bool
	// ddlSeen counts pgfence_protected notifications: a load that one
	// arrived during read the catalog before that change.
	ddlSeen atomic.Uint64

	tk takeovers // takeovers seen on pgfence_takeover (lsn.go)
	// loads counts completed loads (tests observe it).
	loads atomic.Int64
	done  chan struct{} // closed when the watcher has ended
}

// Control connections name themselves in pg_stat_activity.
const (
	watcherAppName = "pgfence catalog watcher"
	pollerAppName  = "pgfence replica poller"
)

func newCatalogs(base *pgconn.Config, refresh time.Duration, log *zap.Logger) *catalogs {
	if refresh <= 0 {
		refresh = DefaultCatalogRefresh
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &catalogs{base: base, log: log, refresh: refresh, dbs: map[string]*catalog{}, ctx: ctx, cancel: cancel}
}

// get returns the catalog of db for a session, loading it on first use,
// and takes a reference the session gives back with release. It fails
// (and the session must fail closed) when the catalog could not be loaded;
// no reference is held then.
func (cs *catalogs) get(ctx context.Context, db string) (*catalog, error) {
	cs.mu.Lock()
	c, ok := cs.dbs[db]
	if !ok || c.gone.Load() {
		c = &catalog{db: db, ready: make(chan struct{}), done: make(chan struct{})}
		c.ctx, c.stop = context.WithCancel(cs.ctx)
		cs.dbs[db] = c
		cs.wg.Add(1)
		go func() { defer cs.wg.Done(); cs.watch(c) }()
	}
	c.refs++
	cs.mu.Unlock()
	select {
	case <-c.ready:
	case <-ctx.Done():
		cs.release(c)
		return nil, fmt.Errorf("load protected tables of %q: %w", db, ctx.Err())
	}
	if p := c.prot.Load(); p != nil {
		return c, nil
	}
	cs.release(c)
	if e := c.err.Load(); e != nil {
		return nil, *e
	}
	return nil, fmt.Errorf("load protected tables of %q: not loaded", db)
}

// release gives back a reference taken by get. The last one stops the
// watcher, which closes its connection.
func (cs *catalogs) release(c *catalog) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if c.refs--; c.refs > 0 {
		return
	}
	c.stop()
	if cs.dbs[c.db] == c {
		delete(cs.dbs, c.db)
	}
}

// lookup returns the catalog of db if a watcher keeps one, without taking
// a reference.
func (cs *catalogs) lookup(db string) *catalog {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	return cs.dbs[db]
}

// sessionDB names a database that has client sessions, for the read
// router's pollers (lsn.go), which keep no connection in a database nobody
// uses: prev while it still has sessions (unless it failed), else any
// other, else "".
func (cs *catalogs) sessionDB(prev string, failed bool) string {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if c := cs.dbs[prev]; c != nil && !failed && !c.gone.Load() {
		return prev
	}
	alt := ""
	for db, c := range cs.dbs {
		if c.gone.Load() {
			continue
		}
		if db != prev {
			return db
		}
		alt = db
	}
	return alt
}

func (cs *catalogs) close() {
	cs.cancel()
	cs.wg.Wait()
}

// watch keeps c current until its last session ends or the catalogs close.
func (cs *catalogs) watch(c *catalog) {
	defer close(c.done)
	log := cs.log.With(zap.String("database", c.db))
	first := true
	backoff := 100 * time.Millisecond
	var lost error // why the connection was lost, until it is back
	failures := 0
	for c.ctx.Err() == nil {
		err := cs.listen(c, func() {
			if first {
				first = false
				close(c.ready)
			}
			if lost != nil {
				log.Info("catalog watcher reconnected", zap.NamedError("after", lost))
				lost = nil
			}
			backoff, failures = 100*time.Millisecond, 0
		})
		c.live.Store(false)
		c.reads.Store(nil)
		if c.ctx.Err() != nil {
			break
		}
		if databaseGone(err) {
			log.Info("database no longer exists (dropped or renamed); its catalog watcher stops", zap.Error(err))
			e := fmt.Errorf("database %q no longer exists: %w", c.db, err)
			c.err.Store(&e)
			c.gone.Store(true)
			break
		}
		if first {
			e := fmt.Errorf("load protected tables of %q: %w", c.db, err)
			c.err.Store(&e)
			// Let waiting sessions fail now rather than hang; later
			// sessions retry through the watcher's next attempt (if
			// sessions still hold the catalog) or a new one.
			first = false
			close(c.ready)
		}
		// One line per outage: the loss is logged with its outcome (a
		// reconnection, the database's end, or this warning once).
		if lost == nil {
			lost = err
			backoff = 0 // try again at once: it may be gone
		} else if failures++; failures == 1 {
			log.Warn("catalog watcher cannot reconnect; retrying", zap.Error(err), zap.NamedError("lost", lost))
		} else {
			log.Debug("catalog watcher still cannot reconnect", zap.Error(err))
		}
		select {
		case <-c.ctx.Done():
		case <-time.After(backoff):
		}
		backoff = min(max(2*backoff, 100*time.Millisecond), 5*time.Second)
	}
	if first {
		close(c.ready)
	}
}

// databaseGone reports whether err says the database does not exist (it
// was dropped or renamed).
func databaseGone(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == "3D000"
}

// listen connects, LISTENs, loads, then reloads on every notification
// and, with read routing, every cs.refresh.
func (cs *catalogs) listen(c *catalog, loaded func()) error {
	cfg := cs.base.Copy()
	cfg.Database = c.db
	// The read-set query is planned above the JIT threshold; compiling
	// it costs more than running it.
	cfg.RuntimeParams["jit"] = "off"
	cfg.RuntimeParams["application_name"] = watcherAppName
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
		if cs.deaf.Load() {
			return
		}
		// The protected set or the catalog changed: until it is read
		// again, every read is protected. pgconn calls this while it
		// receives, on the watcher's goroutine, in the order of the
		// notifications: a takeover notified after this change is
		// recorded after the set was dropped (route.go relies on it).
		c.ddlSeen.Add(1)
		c.reads.Store(nil)
		reload.Store(true)
	}
	takeNotes := func() []string {
		notesMu.Lock()
		defer notesMu.Unlock()
		n := notes
		notes = nil
		return n
	}
	ctx, cancel := context.WithTimeout(c.ctx, 10*time.Second)
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	cancel()
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(c.ctx, "LISTEN pgfence_protected; LISTEN "+takeoverChannel).ReadAll(); err != nil {
		return err
	}
	if err := cs.load(c, conn); err != nil {
		return err
	}
	// Every takeover before this position is covered by it; every one
	// after is notified (read routing, lsn.go).
	floor, err := insertLSN(c.ctx, conn)
	if err != nil {
		return err
	}
	if floor > LSN(c.tk.floor.Load()) {
		c.tk.floor.Store(uint64(floor))
	}
	c.err.Store(nil)
	c.live.Store(true)
	loaded()
	log := cs.log.With(zap.String("database", c.db))
	for {
		// Notifications may arrive while a query runs: handle them
		// before waiting for more.
		if n := takeNotes(); len(n) > 0 {
			if err := c.tk.recordNotes(c.ctx, conn, n, log); err != nil {
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
		timedOut, err := c.wait(conn, !cs.deaf.Load(), cs.refresh)
		if err != nil {
			return err
		}
		if timedOut {
			reload.Store(true)
		}
	}
}

// wait waits for a notification or (periodic) the refresh interval, which
// it reports. The connection stays usable when the interval ends the
// wait: pgconn's default context handling sets a deadline, and a timeout
// does not close it.
func (c *catalog) wait(conn *pgconn.PgConn, periodic bool, every time.Duration) (timedOut bool, err error) {
	ctx, cancel := c.ctx, context.CancelFunc(func() {})
	if periodic {
		ctx, cancel = context.WithTimeout(c.ctx, every)
	}
	defer cancel()
	err = conn.WaitForNotification(ctx)
	if err != nil && c.ctx.Err() == nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return true, nil
	}
	return false, err
}

const protectedQuery = `SELECT n.nspname, c.relname
FROM fence.protected_tables p
JOIN pg_catalog.pg_class c ON c.oid = p.relid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace`

// load reads the protected tables and, with read routing and a protected
// table, whether the catalog is tracked and, if it is, the read set.
func (cs *catalogs) load(c *catalog, conn *pgconn.PgConn) error {
	seen := c.ddlSeen.Load()
	var has string
	rr := conn.ExecParams(c.ctx, "SELECT coalesce(to_regclass('fence.protected_tables')::text, '')", nil, nil, nil, nil)
	for rr.NextRow() {
		has = string(rr.Values()[0])
	}
	if _, err := rr.Close(); err != nil {
		return err
	}
	var rels []rewrite.RelName
	if has != "" {
		rr := conn.ExecParams(c.ctx, protectedQuery, nil, nil, nil, nil)
		for rr.NextRow() {
			v := rr.Values()
			rels = append(rels, rewrite.RelName{Schema: string(v[0]), Name: string(v[1])})
		}
		if _, err := rr.Close(); err != nil {
			return err
		}
	}
	prot := rewrite.NewProtected(rels)
	var rd *readSet
	if cs.reads.Load() && prot.Len() > 0 {
		tracked, reached, err := catalogMode(c.ctx, conn)
		if err != nil {
			return err
		}
		c.tracked.Store(tracked)
		c.reached.Store(reached)
		if tracked {
			if rd, err = loadReadSet(c.ctx, conn, c.last); err != nil {
				return err
			}
			c.last = rd
		}
	}
	c.schema.Store(has != "")
	c.prot.Store(prot)
	if c.ddlSeen.Load() != seen {
		rd = nil // a change arrived while this load read: it may predate it
	}
	c.reads.Store(rd)
	c.loads.Add(1)
	return nil
}

// readSet says which relation names a read may reach protected data
// through, as the catalog was at one position. It is kept only for a
// database that notifies every DDL (ddlTrigger): views, policies and
// names change by plain DDL, which otherwise tells nobody, and a set the
// proxy cannot keep current would let a redefined view, or a new one that
// shadows a safe name on the search path, serve protected data from a
// lagging replica. Without the trigger there is no set, and in a database
// with protected tables every read is a protected read. A protected table, its
// inheritance (and partition) ancestors and descendants, a view or
// materialized view whose rule reads such a relation, calls a user-defined
// function or operator, casts to a user-defined domain or calls a
// built-in that runs SQL or reads relations by name (query_to_xml, ...),
// a table whose row-security policies do the same, transitively, any
// foreign table, and the fence schema's own tables all "expose" protected
// data: a read of one is a protected read. So is a read of a name the set
// does not know (a view or table created since, a temporary table, a
// typo): failing closed costs such reads the primary (or an LSN check),
// never a stale answer. An unqualified name is safe only when every known
// relation of that name, in any schema, is: the search_path need not be
// resolved and nothing on it can shadow a safe name unseen.
//
// The system relations that hold values of every table's columns (the
// planner's statistics: pg_statistic, pg_statistic_ext_data and the views
// pg_stats, pg_stats_ext, pg_stats_ext_exprs over them; pg_largeobject)
// expose protected data too: a lagging replica's statistics show the
// previous generation's values.
type readSet struct {
	rels  map[rewrite.RelName]bool // schema-qualified name → exposes protected data
	names map[string]bool          // unqualified name → some relation of that name exposes
	// all: the database has user-defined operators, casts, operator-class
	// support functions, range subtype differences, type I/O functions or
	// domain checks that run code other than C, or a built-in that runs
	// SQL (query_to_xml, ts_rewrite, ...: readCodeQuery): they run inside
	// any expression, not only where a statement names them
	// (rewrite.Stmt.CatalogExprs), so every such read may reach protected
	// data.
	all bool
	// colFuncs are the names of the functions a read may call by writing
	// them as a field (n.f, (expr).f: rewrite.Stmt.Fields): a user's
	// function or aggregate not written in C, or a built-in that runs SQL,
	// callable with one argument.
	colFuncs map[string]bool
	// lsn is the primary's position after the set was read: a replica
	// that has not replayed it may still have older definitions, so a
	// read the set calls safe needs it (route.go).
	lsn  LSN
	hash string
	code string // readCode's fingerprint
}

// exposes reports whether a read of rel may reach protected data. A nil
// set (not loaded) exposes everything.
func (r *readSet) exposes(rel rewrite.RelName) bool {
	if r == nil || r.all {
		return true
	}
	if rel.Schema == "" {
		exp, ok := r.names[rel.Name]
		return !ok || exp
	}
	exp, ok := r.rels[rel]
	return !ok || exp
}

// runsCode reports whether st's expressions may run code that reaches
// protected data where the statement names no relation or function for
// it: an operator, cast or domain check of the database's (all), or a
// function called as a field (colFuncs). A nil set (not loaded) says yes
// for anything resolved through the catalog.
func (r *readSet) runsCode(st *rewrite.Stmt) bool {
	if !st.CatalogExprs {
		return false
	}
	if r == nil || r.all {
		return true
	}
	for _, f := range st.Fields {
		if r.colFuncs[f] {
			return true
		}
	}
	return false
}

// position is the set's lsn (0 for a nil set).
func (r *readSet) position() LSN {
	if r == nil {
		return 0
	}
	return r.lsn
}

// readSetCTE computes rels(nspname, relname, exposed) for every relation a
// query can name (tables, partitioned tables, views, materialized views,
// foreign tables, sequences; not other sessions' temporary ones). Objects
// created by initdb (OID below FirstNormalObjectId, 16384) are trusted:
// system views read system catalogs and built-in functions only, except
// the statistics and large objects (statsRels). A rule or policy that
// reads a catalog initdb pinned has no pg_depend row for it: its tree is
// searched for the OIDs of the pinned ones, as for the built-ins that run
// SQL (runs_sql).
const readSetCTE = `WITH RECURSIVE
prot(oid) AS (SELECT relid FROM fence.protected_tables),
down(oid) AS (SELECT oid FROM prot
  UNION SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN down d ON i.inhparent = d.oid),
up(oid) AS (SELECT oid FROM prot
  UNION SELECT i.inhparent FROM pg_catalog.pg_inherits i JOIN up u ON i.inhrelid = u.oid),
runs_sql(oids) AS (SELECT array_agg(oid) FROM pg_catalog.pg_proc
  WHERE pronamespace = 'pg_catalog'::regnamespace AND proname IN ('query_to_xml', 'query_to_xmlschema',
    'query_to_xml_and_xmlschema', 'table_to_xml', 'table_to_xmlschema', 'table_to_xml_and_xmlschema',
    'cursor_to_xml', 'cursor_to_xmlschema', 'schema_to_xml', 'schema_to_xmlschema',
    'schema_to_xml_and_xmlschema', 'database_to_xml', 'database_to_xmlschema',
    'database_to_xml_and_xmlschema', 'ts_stat', 'ts_rewrite', 'currtid2')),
exprs(rel, classid, objid, tree) AS (
  SELECT ev_class, 'pg_catalog.pg_rewrite'::regclass, oid, ev_action::text
    FROM pg_catalog.pg_rewrite WHERE ev_type = '1' AND ev_class >= 16384
  UNION ALL
  SELECT polrelid, 'pg_catalog.pg_policy'::regclass, oid, coalesce(polqual::text, '')
    FROM pg_catalog.pg_policy WHERE polrelid >= 16384),
opaque(oid) AS (
  SELECT e.rel FROM exprs e
  WHERE EXISTS (SELECT FROM pg_catalog.pg_depend d
      WHERE d.classid = e.classid AND d.objid = e.objid AND d.refobjid >= 16384
        AND (d.refclassid IN ('pg_catalog.pg_proc'::regclass, 'pg_catalog.pg_operator'::regclass)
          OR d.refclassid = 'pg_catalog.pg_type'::regclass
             AND EXISTS (SELECT FROM pg_catalog.pg_type t WHERE t.oid = d.refobjid AND t.typtype = 'd')))
     OR EXISTS (SELECT FROM regexp_matches(e.tree, ':(?:funcid|aggfnoid|winfnoid) (\d+)', 'g') m, runs_sql r
      WHERE m[1]::oid = ANY (r.oids))
     OR EXISTS (SELECT FROM pg_catalog.regexp_matches(e.tree, ':relid ([0-9]+)', 'g') AS m
      WHERE m[1]::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (ARRAY['pg_catalog.pg_statistic'::pg_catalog.regclass::pg_catalog.oid,
        'pg_catalog.pg_statistic_ext_data'::pg_catalog.regclass::pg_catalog.oid, 'pg_catalog.pg_largeobject'::pg_catalog.regclass::pg_catalog.oid]))),
edges(rel, ref) AS (
  SELECT e.rel, d.refobjid FROM exprs e JOIN pg_catalog.pg_depend d
    ON d.classid = e.classid AND d.objid = e.objid
   AND d.refclassid = 'pg_catalog.pg_class'::regclass AND d.refobjid <> e.rel),
exposed(oid) AS (
  SELECT oid FROM down UNION SELECT oid FROM up UNION SELECT oid FROM opaque
  UNION SELECT oid FROM pg_catalog.pg_class WHERE relkind = 'f' OR relnamespace = 'fence'::regnamespace
  UNION SELECT c.oid FROM pg_catalog.pg_class AS c
    WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace::pg_catalog.oid
      AND c.relname OPERATOR(pg_catalog.=) ANY ('` + statsRels + `'::pg_catalog.name[])
  UNION SELECT g.rel FROM edges g JOIN exposed x ON x.oid = g.ref),
rels(nspname, relname, exposed) AS (
  SELECT n.nspname::text, c.relname::text, c.oid IN (SELECT oid FROM exposed)
  FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
  WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S') AND c.relpersistence <> 't'),
trusted(langs) AS (SELECT array_agg(oid) FROM pg_catalog.pg_language WHERE lanname IN ('c', 'internal')),
everything(all_exposed) AS (SELECT
     EXISTS (SELECT FROM pg_catalog.pg_operator o JOIN pg_catalog.pg_proc p ON p.oid = o.oprcode, trusted
             WHERE o.oid >= 16384 AND p.prolang <> ALL (trusted.langs))
  OR EXISTS (SELECT FROM pg_catalog.pg_amproc a JOIN pg_catalog.pg_proc p ON p.oid = a.amproc, trusted
             WHERE a.oid >= 16384 AND p.prolang <> ALL (trusted.langs))
  OR EXISTS (SELECT FROM pg_catalog.pg_cast k JOIN pg_catalog.pg_proc p ON p.oid = k.castfunc, trusted
             WHERE k.oid >= 16384 AND p.prolang <> ALL (trusted.langs))
  OR EXISTS (SELECT FROM pg_catalog.pg_constraint k JOIN pg_catalog.pg_depend d
               ON d.classid = 'pg_catalog.pg_constraint'::regclass AND d.objid = k.oid
              AND d.refclassid = 'pg_catalog.pg_proc'::regclass AND d.refobjid >= 16384
             WHERE k.contypid <> 0))
`

// readSetHashQuery fingerprints the set, so an unchanged catalog is not
// transferred again.
const readSetHashQuery = readSetCTE + `SELECT md5(coalesce(string_agg(format('%I.%I:%s', nspname, relname, exposed), ','
    ORDER BY nspname, relname), '')) || ' ' || (SELECT all_exposed FROM everything)::text
FROM rels`

// ddlTrigger is the event trigger that makes a database's catalog
// tracked: on ddl_command_end, enabled ALWAYS (it fires whatever
// session_replication_role says), for every command tag, it notifies
// pgfence_protected. See docs/reads.md.
const ddlTrigger = "pgfence_catalog_changed"

// catalogModeQuery: is the catalog tracked (ddlTrigger), and does
// fence.replica_reached exist.
const catalogModeQuery = `SELECT EXISTS (SELECT FROM pg_catalog.pg_event_trigger
    WHERE evtname = '` + ddlTrigger + `' AND evtevent = 'ddl_command_end' AND evtenabled = 'A' AND evttags IS NULL)::text,
  (to_regprocedure('fence.replica_reached(text,bigint,bigint)') IS NOT NULL)::text`

func catalogMode(ctx context.Context, conn *pgconn.PgConn) (tracked, reached bool, err error) {
	rr := conn.ExecParams(ctx, catalogModeQuery, nil, nil, nil, nil)
	for rr.NextRow() {
		v := rr.Values()
		tracked, reached = string(v[0]) == "true", string(v[1]) == "true"
	}
	if _, err := rr.Close(); err != nil {
		return false, false, fmt.Errorf("catalog mode: %w", err)
	}
	return tracked, reached, nil
}

const readSetQuery = readSetCTE + `SELECT nspname, relname, exposed::text FROM rels`

// statsRels are the system relations that hold values of every table's
// columns: the planner's statistics, and the views over them; large
// objects.
const statsRels = "{pg_statistic,pg_statistic_ext_data,pg_stats,pg_stats_ext,pg_stats_ext_exprs,pg_largeobject}"

// readCodeQuery reads, beside the read set, what code the database runs
// inside expressions (rows "all", "true" or "false") and which functions a
// read may call as a field (rows "field", name): readSet.all and
// readSet.colFuncs. The code: every function not written in C or internal
// whose OID is a user's, and the built-ins that run SQL or read relations
// by name (runs_sql, as in readSetCTE). It counts where it is an
// operator's, an operator class's support function, a cast's, a range's
// subtype difference, a type's I/O or analyze function, or where a domain's
// CHECK calls a user's function, or one of those built-ins, or reads a
// statistics catalog (its tree is searched: a pinned built-in has no
// pg_depend row). A field can be any function callable with one argument
// (its others have defaults): a user's not written in C, a user's
// aggregate, or one of those built-ins.
const readCodeQuery = `WITH
trusted(langs) AS (SELECT pg_catalog.array_agg(l.oid) FROM pg_catalog.pg_language AS l
  WHERE l.lanname OPERATOR(pg_catalog.=) ANY ('{c,internal}'::pg_catalog.name[])),
runs_sql(oids) AS (SELECT pg_catalog.array_agg(p.oid) FROM pg_catalog.pg_proc AS p
  WHERE p.pronamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace::pg_catalog.oid
    AND p.proname OPERATOR(pg_catalog.=) ANY ('{query_to_xml,query_to_xmlschema,query_to_xml_and_xmlschema,table_to_xml,table_to_xmlschema,table_to_xml_and_xmlschema,cursor_to_xml,cursor_to_xmlschema,schema_to_xml,schema_to_xmlschema,schema_to_xml_and_xmlschema,database_to_xml,database_to_xmlschema,database_to_xml_and_xmlschema,ts_stat,ts_rewrite,currtid2}'::pg_catalog.name[])),
code(oids) AS (SELECT coalesce(pg_catalog.array_agg(p.oid), '{}'::pg_catalog.oid[]) OPERATOR(pg_catalog.||) (SELECT r.oids FROM runs_sql AS r)
  FROM pg_catalog.pg_proc AS p, trusted
  WHERE p.oid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid AND p.prolang OPERATOR(pg_catalog.<>) ALL (trusted.langs)),
reaches(oids) AS (SELECT r.oids OPERATOR(pg_catalog.||) (SELECT pg_catalog.array_agg(c.oid) FROM pg_catalog.pg_class AS c
    WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace::pg_catalog.oid
      AND c.relname OPERATOR(pg_catalog.=) ANY ('` + statsRels + `'::pg_catalog.name[]))
  FROM runs_sql AS r)
SELECT 'all', (
     EXISTS (SELECT FROM pg_catalog.pg_operator AS o, code
             WHERE o.oid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid AND o.oprcode::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (code.oids))
  OR EXISTS (SELECT FROM pg_catalog.pg_amproc AS a, code
             WHERE a.oid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid AND a.amproc::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (code.oids))
  OR EXISTS (SELECT FROM pg_catalog.pg_cast AS k, code
             WHERE k.oid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid AND k.castfunc OPERATOR(pg_catalog.=) ANY (code.oids))
  OR EXISTS (SELECT FROM pg_catalog.pg_range AS g, code
             WHERE g.rngtypid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid AND g.rngsubdiff::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (code.oids))
  OR EXISTS (SELECT FROM pg_catalog.pg_type AS t, code
             WHERE t.oid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid
               AND ARRAY[t.typinput::pg_catalog.oid, t.typoutput::pg_catalog.oid, t.typreceive::pg_catalog.oid, t.typsend::pg_catalog.oid,
                         t.typmodin::pg_catalog.oid, t.typmodout::pg_catalog.oid, t.typanalyze::pg_catalog.oid, t.typsubscript::pg_catalog.oid]
                   OPERATOR(pg_catalog.&&) code.oids)
  OR EXISTS (SELECT FROM pg_catalog.pg_constraint AS k
             WHERE k.contypid OPERATOR(pg_catalog.<>) '0'::pg_catalog.oid AND (
                 EXISTS (SELECT FROM pg_catalog.pg_depend AS d
                         WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_constraint'::pg_catalog.regclass::pg_catalog.oid
                           AND d.objid OPERATOR(pg_catalog.=) k.oid
                           AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass::pg_catalog.oid
                           AND d.refobjid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid)
              OR EXISTS (SELECT FROM pg_catalog.regexp_matches(coalesce(k.conbin::pg_catalog.text, ''), ':(?:funcid|opfuncid|relid) ([0-9]+)', 'g') AS m, reaches AS r
                         WHERE m[1]::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (r.oids))))
  )::pg_catalog.text
UNION ALL
SELECT DISTINCT 'field', p.proname::pg_catalog.text FROM pg_catalog.pg_proc AS p, trusted, runs_sql AS r
WHERE (p.oid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid
       AND (p.prolang OPERATOR(pg_catalog.<>) ALL (trusted.langs) OR p.prokind OPERATOR(pg_catalog.=) ANY ('{a,w}'::pg_catalog."char"[]))
    OR p.oid OPERATOR(pg_catalog.=) ANY (r.oids))
  AND p.prokind OPERATOR(pg_catalog.<>) 'p'::pg_catalog."char" AND p.pronargs OPERATOR(pg_catalog.>=) '1'::pg_catalog.int2
  AND p.pronargs OPERATOR(pg_catalog.-) p.pronargdefaults OPERATOR(pg_catalog.<=) '1'::pg_catalog.int2`

// readCode runs readCodeQuery: whether the database runs code inside
// expressions, the functions callable as a field, and a fingerprint of
// both.
func readCode(ctx context.Context, conn *pgconn.PgConn) (all bool, fields map[string]bool, hash string, err error) {
	fields = map[string]bool{}
	var names []string
	rr := conn.ExecParams(ctx, readCodeQuery, nil, nil, nil, nil)
	for rr.NextRow() {
		v := rr.Values()
		switch string(v[0]) {
		case "all":
			all = string(v[1]) == "true"
		case "field":
			fields[string(v[1])] = true
			names = append(names, string(v[1]))
		}
	}
	if _, err := rr.Close(); err != nil {
		return false, nil, "", fmt.Errorf("read set code: %w", err)
	}
	slices.Sort(names)
	return all, fields, fmt.Sprintf("%v %q", all, names), nil
}

// loadReadSet reads the read set, or returns old when the catalog has not
// changed since old was read.
func loadReadSet(ctx context.Context, conn *pgconn.PgConn, old *readSet) (*readSet, error) {
	var hash string
	rr := conn.ExecParams(ctx, readSetHashQuery, nil, nil, nil, nil)
	for rr.NextRow() {
		hash = string(rr.Values()[0])
	}
	if _, err := rr.Close(); err != nil {
		return nil, fmt.Errorf("read set: %w", err)
	}
	all, fields, code, err := readCode(ctx, conn)
	if err != nil {
		return nil, err
	}
	if old != nil && old.hash == hash && old.code == code {
		return old, nil
	}
	rd := &readSet{rels: map[rewrite.RelName]bool{}, names: map[string]bool{}, all: all || strings.HasSuffix(hash, " true"),
		colFuncs: fields, hash: hash, code: code}
	rr = conn.ExecParams(ctx, readSetQuery, nil, nil, nil, nil)
	for rr.NextRow() {
		v := rr.Values()
		name := rewrite.RelName{Schema: string(v[0]), Name: string(v[1])}
		exp := string(v[2]) == "true"
		rd.rels[name] = exp
		rd.names[name.Name] = rd.names[name.Name] || exp
	}
	if _, err := rr.Close(); err != nil {
		return nil, fmt.Errorf("read set: %w", err)
	}
	// After the snapshot: every definition the set was read from is
	// before this position.
	lsn, err := insertLSN(ctx, conn)
	if err != nil {
		return nil, err
	}
	rd.lsn = lsn
	return rd, nil
}
