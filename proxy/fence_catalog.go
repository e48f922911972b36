package proxy

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/internal/ownsql"
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

	prot atomic.Pointer[rewrite.Protected]
	// code: which built-in names the database also defines outside
	// pg_catalog (fence_usercode.go); nil until the first load.
	code  atomic.Pointer[userCode]
	reads atomic.Pointer[readSet] // nil: not known (every read may reach protected data)
	// settled: the last read set loaded, kept while reads is nil (after a
	// DDL notification until the next load, or while the watcher
	// reconnects): what the custom-settings defence counts code by then
	// (settingRelCode, route.go).
	settled atomic.Pointer[readSet]
	last    *readSet      // the last set read (watcher goroutine), to skip unchanged ones
	ready   chan struct{} // closed after the first load (successful or not)
	err     atomic.Pointer[error]
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
	// untrusted says why a schema named fence was not read (ownsql.Check:
	// not a superuser's, or not made of plain tables): the database is
	// then treated as having no fence schema (schema is false), but this
	// tells the two apart. nil when there is no such schema or it is
	// trusted.
	untrusted atomic.Pointer[string]
	// ddlSeen counts pgfence_protected notifications: a load that one
	// arrived during read the catalog before that change.
	ddlSeen atomic.Uint64

	// era: the primary's era, read by the watcher each time it connects
	// and before any position it reads there (era.go): a replica serves
	// the database's reads that need a position only once it has shown
	// it. nil: the database has no era the proxy can confirm.
	era       atomic.Pointer[primaryEra]
	eraWarned atomic.Bool

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
		c.tk.kick = make(chan struct{}, 1)
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
		if c.era.Load() != nil {
			// The next connection may reach another server (a promoted
			// standby): until it has read that one's era, no replica
			// serves a read that needs a position.
			c.era.Store(&primaryEra{})
		}
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
	var reload atomic.Bool
	mk, err := newMarker(&c.tk)
	if err != nil {
		return err
	}
	onNote := func(_ *pgconn.PgConn, n *pgconn.Notification) {
		if n.Channel == mk.channel {
			mk.note(n)
			return
		}
		if n.Channel == takeoverChannel {
			// Only a hint: the job's fence row is read before anything is
			// recorded (lsn.go).
			c.tk.note(n.Payload)
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
	// The read-set query is planned above the JIT threshold; compiling
	// it costs more than running it: control connections run with jit
	// off (ownsql.PinReadOnly).
	ctx, cancel := context.WithTimeout(c.ctx, 10*time.Second)
	conn, err := dialControl(ctx, cs.base, c.db, watcherAppName, cs.log, func(cfg *pgconn.Config) { cfg.OnNotification = onNote })
	cancel()
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	mk.pid = conn.PID()
	c.tk.markSent.Store(0)
	if _, err := conn.Exec(c.ctx, listenSQL+"; LISTEN "+mk.channel).ReadAll(); err != nil {
		return err
	}
	// Every DDL committed before this time is in the catalog the load
	// reads, and every takeover before it below the floor read after it:
	// the tracker is fresh as of then (freshWithin).
	start := time.Now()
	if err := cs.load(c, conn); err != nil {
		return err
	}
	log := cs.log.With(zap.String("database", c.db))
	// The primary's era before any position read on this connection: the
	// positions mean something only on replicas that have shown it.
	if err := cs.readEra(c, conn, log); err != nil {
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
	c.tk.publish(start)
	c.live.Store(true)
	loaded()
	for {
		// A marker that came back: every notification before it has
		// been taken, so once the jobs pending now are read the tracker
		// is fresh as of its sending (lsn.go, freshWithin). Taken before
		// the read: one that comes back during it waits for the next.
		back := mk.back
		mk.back = time.Time{}
		// Notifications may arrive while a query runs: handle them
		// before waiting for more. The takeovers pending (notified or
		// hinted) are read in one query, then a reload if one is due, so
		// that a stream of notifications delays neither.
		if c.tk.hasPending() {
			if err := c.tk.verify(c.ctx, conn, c.schema.Load(), log); err != nil {
				return err
			}
		}
		if !back.IsZero() {
			c.tk.publish(back)
		}
		// Coalesce a burst of notifications into one reload.
		if reload.Swap(false) {
			if err := cs.load(c, conn); err != nil {
				return err
			}
			// An era not read yet (or a schema that has changed): again.
			if e := c.era.Load(); e != nil && !e.known || e == nil && c.schema.Load() && cs.reads.Load() {
				if err := cs.readEra(c, conn, log); err != nil {
					return err
				}
			}
			continue
		}
		// A reader asked for a marker: one at a time (asks while one is
		// in flight are answered by it; a reader it leaves stale asks
		// again).
		if c.tk.markAsk.Swap(false) && mk.nonce == "" {
			if err := mk.send(c.ctx, conn); err != nil {
				return err
			}
			continue
		}
		if c.tk.hasPending() || !mk.back.IsZero() {
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
	ctx, cancel := context.WithCancel(c.ctx)
	if periodic {
		ctx, cancel = context.WithTimeout(c.ctx, every)
	}
	defer cancel()
	// A reader's hint (takeovers.hint) ends the wait too.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		select {
		case <-c.tk.kick:
			cancel()
		case <-stop:
		}
	}()
	err = conn.WaitForNotification(ctx)
	if err != nil && c.ctx.Err() == nil && ctx.Err() != nil {
		return errors.Is(ctx.Err(), context.DeadlineExceeded), nil
	}
	return false, err
}

// listenSQL subscribes the watcher to both channels (and, appended per
// connection, to its marker's).
var listenSQL = own("watcher: listen", onControl, "LISTEN pgfence_protected; LISTEN "+takeoverChannel)

func init() {
	ownTemplate("watcher: listen to its marker's channel", onControl, "LISTEN pgfence_mark_00", "LISTEN pgfence_mark_")
}

// markSQL sends a marker: the channel and the nonce are parameters, so
// neither shows in pg_stat_activity.query. Committed with
// synchronous_commit local: the barrier rests on the order of the
// notification queue, not on a standby, and a marker must not wait for a
// synchronous one; but flushed, not off: an asynchronous commit's record
// waits for the WAL writer (up to three wal_writer_delay) before any
// replica can have it, and every insert position read after it (the
// positions of takeovers verified then) would wait as long on replicas.
var markSQL = own("watcher: freshness marker", onControl,
	"SELECT pg_catalog.set_config('synchronous_commit', 'local', true), pg_catalog.pg_notify($1, $2)")

// marker is the watcher's freshness barrier (lsn.go, freshWithin) on one
// connection: it NOTIFYs its own channel and waits for that notification
// to come back. Watcher goroutine only (pgconn calls note on it).
//
// Nobody else can make a marker come back early, which would make the
// tracker look fresh while takeovers are still queued behind a flood:
//   - a marker counts only if its notification was sent by the watcher's
//     own backend (Notification.PID, which PostgreSQL fills in from the
//     sending backend: no client can set it);
//   - and carries the nonce sent with it: 128 random bits, fresh per
//     marker, sent as a bind parameter (pg_stat_activity shows the
//     statement's text, with $2; only a server log with log_statement
//     = 'all' or a parameter-logging setting records it, and those are
//     the superuser's), accepted once. A forger could learn it only from
//     the notification itself (listening on the channel), which it
//     receives after the watcher's backend queued it: a copy it sends
//     then is queued behind the real one, which the watcher has taken
//     first, so the copy finds no nonce outstanding.
//   - The channel's name is random per connection too
//     (pgfence_mark_<32 hex>), so that nobody's notifications reach it by
//     chance; it is not relied on as a secret: the LISTEN's text shows in
//     pg_stat_activity (to the control role and pg_read_all_stats) until
//     the watcher's next statement. A flood on it, like one on
//     pgfence_takeover, only makes markers late: reads go to the primary.
type marker struct {
	t       *takeovers
	channel string
	pid     uint32    // the watcher's backend
	nonce   string    // of the marker in flight; "" none
	sent    time.Time // when the marker in flight was sent
	back    time.Time // the send time of a marker that came back, not yet published
}

func newMarker(t *takeovers) (*marker, error) {
	name, err := randomHex(16)
	if err != nil {
		return nil, err
	}
	return &marker{t: t, channel: "pgfence_mark_" + name}, nil
}

// randomHex is n random bytes in hex.
func randomHex(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("random marker: %w", err)
	}
	return hex.EncodeToString(b), nil
}

// send sends a marker. Its time is taken before the statement is sent:
// every transaction that committed before it queued its notifications
// before the marker's.
func (m *marker) send(ctx context.Context, conn *pgconn.PgConn) error {
	nonce, err := randomHex(16)
	if err != nil {
		return err
	}
	m.nonce, m.sent = nonce, time.Now()
	m.t.markSent.Store(m.sent.UnixNano())
	m.t.marks.Add(1)
	_, err = conn.ExecParams(ctx, markSQL, [][]byte{[]byte(m.channel), []byte(nonce)}, nil, nil, nil).Close()
	return err
}

// note takes a notification on the marker's channel: the marker in
// flight, come back, or anything else, ignored.
func (m *marker) note(n *pgconn.Notification) {
	if m.nonce == "" || n.PID != m.pid || subtle.ConstantTimeCompare([]byte(n.Payload), []byte(m.nonce)) != 1 {
		return
	}
	m.nonce, m.back = "", m.sent
	m.t.markSent.Store(0)
}

// protectedQuery lists the protected tables. It runs only after
// ownsql.Check has found fence.protected_tables a superuser's plain table.
var protectedQuery = own("watcher: protected tables", onControl, `SELECT n.nspname, c.relname
FROM fence.protected_tables AS p
JOIN pg_catalog.pg_class AS c ON c.oid OPERATOR(pg_catalog.=) p.relid::pg_catalog.oid
JOIN pg_catalog.pg_namespace AS n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace`)

// The watcher's load reads in one snapshot: the check of schema fence and
// everything read from fence and from the catalog after it.
var (
	loadBeginSQL  = own("watcher: load begins", onControl, "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
	loadCommitSQL = own("watcher: load ends", onControl, "COMMIT")
	checkSQL      = own("fence schema check", onControl, ownsql.CheckSQL)
)

// load reads, in one snapshot, whether the database has a fence schema
// pgfence trusts (ownsql.Check: a superuser's, of plain tables), the
// protected tables and, with read routing and a protected table, whether
// the catalog is tracked and, if it is, the read set. A schema named fence
// that is not trusted is not read: the database is treated as having
// none, and c.untrusted says why (logged at WARN when first found).
func (cs *catalogs) load(c *catalog, conn *pgconn.PgConn) (err error) {
	seen := c.ddlSeen.Load()
	if _, err := conn.Exec(c.ctx, loadBeginSQL).ReadAll(); err != nil {
		return err
	}
	defer func() {
		if err == nil {
			_, err = conn.Exec(c.ctx, loadCommitSQL).ReadAll()
		}
	}()
	trust, err := ownsql.Check(c.ctx, conn, []ownsql.Rel{ownsql.ProtectedTables})
	if err != nil {
		return err
	}
	cs.noteTrust(c, trust)
	var rels []rewrite.RelName
	if trust.Trusted() {
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
	code := &userCode{major: serverMajor(conn.ParameterStatus("server_version"))}
	if prot.Len() > 0 {
		var err error
		if code, err = loadUserCode(c.ctx, conn); err != nil {
			return err
		}
	}
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
	c.schema.Store(trust.Trusted())
	c.prot.Store(prot)
	if c.ddlSeen.Load() != seen {
		rd = nil // a change arrived while this load read: it may predate it
	}
	// code before reads: a read set is never used with an older code's
	// names. code is not dropped at a DDL notification: a read meanwhile
	// is protected anyway (no read set), and the gate's window until the
	// reload is the documented limit (security.md, built-ins by name).
	c.code.Store(code)
	c.reads.Store(rd)
	if rd != nil {
		c.settled.Store(rd)
	}
	c.loads.Add(1)
	return nil
}

// noteTrust records what ownsql.Check found of c's schema fence, and logs
// at WARN when it finds one it does not trust (again only once that
// changes).
func (cs *catalogs) noteTrust(c *catalog, trust ownsql.Trust) {
	if !trust.Untrusted() {
		c.untrusted.Store(nil)
		return
	}
	why := trust.Problem
	if old := c.untrusted.Swap(&why); old == nil || *old != why {
		cs.log.Warn("this database's schema fence is not pgfence's to trust, so it is not read: the database is treated as having no fence schema",
			zap.String("database", c.db), zap.String("why", why))
	}
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
// pg_stats, pg_stats_ext, pg_stats_ext_exprs over them; pg_largeobject;
// pg_class's row and page counts) expose protected data too: a lagging
// replica's statistics show the previous generation's values.
//
// A relation whose own objects depend on the database's code (pg_depend:
// its indexes' expressions and predicates, its extended statistics'
// expressions, its constraints, defaults, policies and rules; not its
// triggers, which no read fires) runs that code on every read: the
// planner folds an index expression or a child's CHECK calling an
// immutable function while planning any read of the table, as the
// reader, on the node that serves it (round 8, attacker P's H6). It
// exposes, whatever the code reads; so do its inheritance ancestors (a
// read of the parent plans the child) and the views over it. Such
// relations are also code (runsRelCode): code may FETCH from any cursor
// of the session (route_rotx.go).
type readSet struct {
	rels  map[rewrite.RelName]bool // schema-qualified name → exposes protected data
	names map[string]bool          // unqualified name → some relation of that name exposes
	// codeRels and codeNames: the relations whose reads run the database's
	// code (a view's function, a policy's, an index expression's, ...).
	codeRels  map[rewrite.RelName]bool
	codeNames map[string]bool
	// setsRels and setsNames: the relations whose reads may run code that
	// changes the session's state (a user's function, operator or domain
	// in a view, a policy or an object the planner folds, or a built-in
	// not known to be safe: set_config, nextval, an advisory lock;
	// safeBuiltin), a subset of the code ones. Custom settings made so
	// are in no view: such a read runs in the client's own session, the
	// primary's (runsSessionCode, route.go; round 12, attacker X's M1).
	// The code ones that only read the session (current_setting,
	// pg_stat_activity) are not here.
	setsRels  map[rewrite.RelName]bool
	setsNames map[string]bool
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
	lsn LSN
	// upto is the primary's position after the watcher's last load that
	// found the set unchanged (lsn when it was read): the set holds for
	// every takeover before it.
	upto LSN
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

// runsRelCode reports whether a read of rel may run the database's code
// (a view's or a policy's function, an index expression's): unknown names
// and a nil set (not loaded, or an untracked database) say yes.
func (r *readSet) runsRelCode(rel rewrite.RelName) bool {
	if r == nil || r.all {
		return true
	}
	if rel.Schema == "" {
		c, ok := r.codeNames[rel.Name]
		_, known := r.names[rel.Name]
		return !known || ok && c
	}
	c, ok := r.codeRels[rel]
	return !ok || c
}

// setsRelCode reports whether a read of rel may run code that changes
// the session's state (setsRels): unknown names and a nil set say yes, as
// runsRelCode. Unlike runsRelCode, a database whose operators, casts or
// domains run code (all) does not make every relation count: the set
// follows what a relation's own definitions use (a view's or policy's
// operator, cast or domain by pg_depend and its tree, an index's
// operator class whose support functions or operators are not C, and,
// where such code exists, a column of a type of the database's own, whose
// comparisons a plain ORDER BY or DISTINCT runs), and what a statement's
// own expressions may run counts by runsCode.
func (r *readSet) setsRelCode(rel rewrite.RelName) bool {
	if r == nil {
		return true
	}
	if rel.Schema == "" {
		c, ok := r.setsNames[rel.Name]
		_, known := r.names[rel.Name]
		return !known || ok && c
	}
	c, ok := r.setsRels[rel]
	return !ok || c
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

// vouched is the position up to which the set is known to hold: the
// watcher's last load that found it unchanged (or read it).
func (r *readSet) vouched() LSN {
	if r == nil {
		return 0
	}
	return r.upto
}

// readSetCTE computes rels(nspname, relname, exposed) for every relation a
// query can name (tables, partitioned tables, views, materialized views,
// foreign tables, sequences; not other sessions' temporary ones). Objects
// created by initdb (OID below FirstNormalObjectId, 16384) are trusted:
// system views read system catalogs and built-in functions only, except
// the statistics and large objects (statsRels). A rule or policy that
// reads a catalog initdb pinned has no pg_depend row for it: its tree is
// searched for the OIDs of the pinned ones, as for the built-ins that run
// SQL (runs_sql). A view or policy that calls a session-local built-in
// (current_setting, ...: rewrite.SessionLocalNames) or reads such a
// system view runs code too: the replica session would answer it
// otherwise (custom settings made by code are in no view: round 11,
// attacker V's M1), so its reads go to the primary (runsDBCode).
//
// sets(oid) are the code relations whose reads may change the session's
// state: a view (not a materialized one: reading it runs nothing of its
// query) or a policy that depends on a user's function, operator or
// domain, or calls a built-in function not on the allowlist
// (safeBuiltin: set_config, nextval, an advisory lock), a relation whose
// own objects the planner folds depend on a user's function (runs), and,
// transitively, the views over one and its inheritance parents; and a
// table with an index whose operator class (a user's) has support
// functions or operators not written in C (an index scan calls them),
// and, in a database whose operators, operator classes, casts or domains
// run code other than C (everything), a relation with a column of a type
// of its own (a plain ORDER BY, DISTINCT or GROUP BY compares it; a
// domain over a built-in type compares as its base type). Such a
// read goes to the primary (runsSessionCode, route.go; round 12,
// attacker X's M1). Every one of them is code too.
var readSetCTE = `WITH RECURSIVE
prot(oid) AS (SELECT p.relid::pg_catalog.oid FROM fence.protected_tables AS p),
down(oid) AS (SELECT prot.oid FROM prot
  UNION SELECT i.inhrelid FROM pg_catalog.pg_inherits AS i JOIN down AS d ON i.inhparent OPERATOR(pg_catalog.=) d.oid),
up(oid) AS (SELECT prot.oid FROM prot
  UNION SELECT i.inhparent FROM pg_catalog.pg_inherits AS i JOIN up AS u ON i.inhrelid OPERATOR(pg_catalog.=) u.oid),
runs_sql(oids) AS (SELECT pg_catalog.array_agg(p.oid) FROM pg_catalog.pg_proc AS p
  WHERE p.pronamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace::pg_catalog.oid
    AND p.proname OPERATOR(pg_catalog.=) ANY ('{query_to_xml,query_to_xmlschema,query_to_xml_and_xmlschema,table_to_xml,table_to_xmlschema,table_to_xml_and_xmlschema,cursor_to_xml,cursor_to_xmlschema,schema_to_xml,schema_to_xmlschema,schema_to_xml_and_xmlschema,database_to_xml,database_to_xmlschema,database_to_xml_and_xmlschema,ts_stat,ts_rewrite,currtid2}'::pg_catalog.name[])),
session_local(funcs, rels) AS (SELECT
  (SELECT coalesce(pg_catalog.array_agg(p.oid), '{}'::pg_catalog.oid[]) FROM pg_catalog.pg_proc AS p
    WHERE p.pronamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace::pg_catalog.oid
      AND p.proname OPERATOR(pg_catalog.=) ANY ('` + sessionLocalFuncs + `'::pg_catalog.name[])),
  (SELECT coalesce(pg_catalog.array_agg(c.oid), '{}'::pg_catalog.oid[]) FROM pg_catalog.pg_class AS c
    WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace::pg_catalog.oid
      AND c.relname OPERATOR(pg_catalog.=) ANY ('` + sessionLocalViews + `'::pg_catalog.name[]))),
exprs(rel, classid, objid, tree) AS (
  SELECT r.ev_class, 'pg_catalog.pg_rewrite'::pg_catalog.regclass::pg_catalog.oid, r.oid, r.ev_action::pg_catalog.text
    FROM pg_catalog.pg_rewrite AS r
    WHERE r.ev_type OPERATOR(pg_catalog.=) '1'::pg_catalog."char" AND r.ev_class OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid
  UNION ALL
  SELECT po.polrelid, 'pg_catalog.pg_policy'::pg_catalog.regclass::pg_catalog.oid, po.oid, coalesce(po.polqual::pg_catalog.text, '')
    FROM pg_catalog.pg_policy AS po WHERE po.polrelid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid),
opaque(oid) AS (
  SELECT e.rel FROM exprs AS e
  WHERE EXISTS (SELECT FROM pg_catalog.pg_depend AS d
      WHERE d.classid OPERATOR(pg_catalog.=) e.classid AND d.objid OPERATOR(pg_catalog.=) e.objid
        AND d.refobjid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid
        AND (d.refclassid OPERATOR(pg_catalog.=) ANY (ARRAY['pg_catalog.pg_proc'::pg_catalog.regclass::pg_catalog.oid,
                                                           'pg_catalog.pg_operator'::pg_catalog.regclass::pg_catalog.oid])
          OR d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_type'::pg_catalog.regclass::pg_catalog.oid
             AND EXISTS (SELECT FROM pg_catalog.pg_type AS t
                 WHERE t.oid OPERATOR(pg_catalog.=) d.refobjid AND t.typtype OPERATOR(pg_catalog.=) 'd'::pg_catalog."char")))
     OR EXISTS (SELECT FROM pg_catalog.regexp_matches(e.tree, ':(?:funcid|aggfnoid|winfnoid) ([0-9]+)', 'g') AS m, runs_sql AS r, session_local AS l
      WHERE m[1]::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (r.oids OPERATOR(pg_catalog.||) l.funcs))
     OR EXISTS (SELECT FROM pg_catalog.regexp_matches(e.tree, ':relid ([0-9]+)', 'g') AS m, session_local AS l
      WHERE m[1]::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (l.rels))
     OR EXISTS (SELECT FROM pg_catalog.regexp_matches(e.tree, ':relid ([0-9]+)', 'g') AS m
      WHERE m[1]::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (ARRAY['pg_catalog.pg_statistic'::pg_catalog.regclass::pg_catalog.oid,
        'pg_catalog.pg_statistic_ext_data'::pg_catalog.regclass::pg_catalog.oid, 'pg_catalog.pg_largeobject'::pg_catalog.regclass::pg_catalog.oid]))),
edges(rel, ref) AS (
  SELECT e.rel, d.refobjid FROM exprs AS e JOIN pg_catalog.pg_depend AS d
    ON d.classid OPERATOR(pg_catalog.=) e.classid AND d.objid OPERATOR(pg_catalog.=) e.objid
   AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass::pg_catalog.oid
   AND d.refobjid OPERATOR(pg_catalog.<>) e.rel),
owned(rel, classid, objid) AS (
  SELECT DISTINCT d.refobjid, d.classid, d.objid FROM pg_catalog.pg_depend AS d
  WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass::pg_catalog.oid
    AND d.refobjid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid
    AND d.deptype OPERATOR(pg_catalog.=) ANY ('{a,i}'::pg_catalog."char"[])
    AND d.classid OPERATOR(pg_catalog.<>) 'pg_catalog.pg_trigger'::pg_catalog.regclass::pg_catalog.oid),
owned_runs(oid) AS (
  SELECT o.rel FROM owned AS o
  WHERE EXISTS (SELECT FROM pg_catalog.pg_depend AS d
      WHERE d.classid OPERATOR(pg_catalog.=) o.classid AND d.objid OPERATOR(pg_catalog.=) o.objid
        AND d.refobjid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid
        AND (d.refclassid OPERATOR(pg_catalog.=) ANY (ARRAY['pg_catalog.pg_proc'::pg_catalog.regclass::pg_catalog.oid,
                                                           'pg_catalog.pg_operator'::pg_catalog.regclass::pg_catalog.oid])
          OR d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_type'::pg_catalog.regclass::pg_catalog.oid
             AND EXISTS (SELECT FROM pg_catalog.pg_type AS t
                 WHERE t.oid OPERATOR(pg_catalog.=) d.refobjid AND t.typtype OPERATOR(pg_catalog.=) 'd'::pg_catalog."char")))),
runs(oid) AS (SELECT opaque.oid FROM opaque UNION SELECT owned_runs.oid FROM owned_runs),
sets_direct(oid) AS (
  SELECT e.rel FROM exprs AS e JOIN pg_catalog.pg_class AS c ON c.oid OPERATOR(pg_catalog.=) e.rel
  WHERE c.relkind OPERATOR(pg_catalog.<>) 'm'::pg_catalog."char" AND (
     EXISTS (SELECT FROM pg_catalog.pg_depend AS d
      WHERE d.classid OPERATOR(pg_catalog.=) e.classid AND d.objid OPERATOR(pg_catalog.=) e.objid
        AND d.refobjid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid
        AND (d.refclassid OPERATOR(pg_catalog.=) ANY (ARRAY['pg_catalog.pg_proc'::pg_catalog.regclass::pg_catalog.oid,
                                                           'pg_catalog.pg_operator'::pg_catalog.regclass::pg_catalog.oid])
          OR d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_type'::pg_catalog.regclass::pg_catalog.oid
             AND EXISTS (SELECT FROM pg_catalog.pg_type AS t
                 WHERE t.oid OPERATOR(pg_catalog.=) d.refobjid AND t.typtype OPERATOR(pg_catalog.=) 'd'::pg_catalog."char")))
     OR EXISTS (SELECT FROM pg_catalog.regexp_matches(e.tree, ':(?:funcid|aggfnoid|winfnoid|opfuncid|hashfuncid|negfuncid) ([0-9]+)', 'g') AS m
         LEFT JOIN pg_catalog.pg_proc AS p ON p.oid OPERATOR(pg_catalog.=) m[1]::pg_catalog.oid, runs_sql AS r
       WHERE m[1]::pg_catalog.oid OPERATOR(pg_catalog.<>) '0'::pg_catalog.oid AND NOT coalesce(` + safeBuiltin + `, false)))
  UNION SELECT owned_runs.oid FROM owned_runs
  UNION SELECT o.rel FROM owned AS o JOIN pg_catalog.pg_depend AS d
      ON d.classid OPERATOR(pg_catalog.=) o.classid AND d.objid OPERATOR(pg_catalog.=) o.objid
     AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_opclass'::pg_catalog.regclass::pg_catalog.oid
     AND d.refobjid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid
    JOIN pg_catalog.pg_opclass AS oc ON oc.oid OPERATOR(pg_catalog.=) d.refobjid
  WHERE EXISTS (SELECT FROM pg_catalog.pg_amproc AS a JOIN pg_catalog.pg_proc AS p ON p.oid OPERATOR(pg_catalog.=) a.amproc::pg_catalog.oid, trusted
                WHERE a.amprocfamily OPERATOR(pg_catalog.=) oc.opcfamily AND p.prolang OPERATOR(pg_catalog.<>) ALL (trusted.langs))
     OR EXISTS (SELECT FROM pg_catalog.pg_amop AS a JOIN pg_catalog.pg_operator AS op ON op.oid OPERATOR(pg_catalog.=) a.amopopr
                  JOIN pg_catalog.pg_proc AS p ON p.oid OPERATOR(pg_catalog.=) op.oprcode::pg_catalog.oid, trusted
                WHERE a.amopfamily OPERATOR(pg_catalog.=) oc.opcfamily AND p.prolang OPERATOR(pg_catalog.<>) ALL (trusted.langs))
  UNION SELECT a.attrelid FROM pg_catalog.pg_attribute AS a JOIN pg_catalog.pg_type AS t ON t.oid OPERATOR(pg_catalog.=) a.atttypid, everything
  WHERE everything.all_exposed AND a.attrelid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid
    AND a.attnum OPERATOR(pg_catalog.>) '0'::pg_catalog.int2 AND NOT a.attisdropped
    AND (t.typtype OPERATOR(pg_catalog.<>) 'd'::pg_catalog."char"
          AND (t.oid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid OR t.typelem OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid)
      OR t.typbasetype OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid)),
code_edges(rel, ref) AS (
  SELECT g.rel, g.ref FROM edges AS g
  UNION SELECT i.inhparent, i.inhrelid FROM pg_catalog.pg_inherits AS i),
sets(oid) AS (
  SELECT sets_direct.oid FROM sets_direct
  UNION SELECT g.rel FROM code_edges AS g JOIN sets AS s ON s.oid OPERATOR(pg_catalog.=) g.ref
    JOIN pg_catalog.pg_class AS c ON c.oid OPERATOR(pg_catalog.=) g.rel
  WHERE c.relkind OPERATOR(pg_catalog.<>) 'm'::pg_catalog."char"),
code(oid) AS (
  SELECT runs.oid FROM runs
  UNION SELECT sets.oid FROM sets
  UNION SELECT g.rel FROM code_edges AS g JOIN code AS c ON c.oid OPERATOR(pg_catalog.=) g.ref),
exposed(oid) AS (
  SELECT down.oid FROM down UNION SELECT up.oid FROM up UNION SELECT code.oid FROM code
  UNION SELECT c.oid FROM pg_catalog.pg_class AS c
    WHERE c.relkind OPERATOR(pg_catalog.=) 'f'::pg_catalog."char"
       OR c.relnamespace OPERATOR(pg_catalog.=) 'fence'::pg_catalog.regnamespace::pg_catalog.oid
  UNION SELECT c.oid FROM pg_catalog.pg_class AS c
    WHERE c.relnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace::pg_catalog.oid
      AND c.relname OPERATOR(pg_catalog.=) ANY ('` + statsRels + `'::pg_catalog.name[])
  UNION SELECT g.rel FROM edges AS g JOIN exposed AS x ON x.oid OPERATOR(pg_catalog.=) g.ref),
rels(nspname, relname, exposed, code, sets) AS (
  SELECT n.nspname::pg_catalog.text, c.relname::pg_catalog.text, c.oid OPERATOR(pg_catalog.=) ANY (SELECT exposed.oid FROM exposed),
    c.oid OPERATOR(pg_catalog.=) ANY (SELECT code.oid FROM code), c.oid OPERATOR(pg_catalog.=) ANY (SELECT sets.oid FROM sets)
  FROM pg_catalog.pg_class AS c JOIN pg_catalog.pg_namespace AS n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
  WHERE c.relkind OPERATOR(pg_catalog.=) ANY ('{r,p,v,m,f,S}'::pg_catalog."char"[])
    AND c.relpersistence OPERATOR(pg_catalog.<>) 't'::pg_catalog."char"),
trusted(langs) AS (SELECT pg_catalog.array_agg(l.oid) FROM pg_catalog.pg_language AS l
  WHERE l.lanname OPERATOR(pg_catalog.=) ANY ('{c,internal}'::pg_catalog.name[])),
everything(all_exposed) AS (SELECT
     EXISTS (SELECT FROM pg_catalog.pg_operator AS o JOIN pg_catalog.pg_proc AS p ON p.oid OPERATOR(pg_catalog.=) o.oprcode::pg_catalog.oid, trusted
             WHERE o.oid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid AND p.prolang OPERATOR(pg_catalog.<>) ALL (trusted.langs))
  OR EXISTS (SELECT FROM pg_catalog.pg_amproc AS a JOIN pg_catalog.pg_proc AS p ON p.oid OPERATOR(pg_catalog.=) a.amproc::pg_catalog.oid, trusted
             WHERE a.oid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid AND p.prolang OPERATOR(pg_catalog.<>) ALL (trusted.langs))
  OR EXISTS (SELECT FROM pg_catalog.pg_cast AS k JOIN pg_catalog.pg_proc AS p ON p.oid OPERATOR(pg_catalog.=) k.castfunc, trusted
             WHERE k.oid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid AND p.prolang OPERATOR(pg_catalog.<>) ALL (trusted.langs))
  OR EXISTS (SELECT FROM pg_catalog.pg_constraint AS k JOIN pg_catalog.pg_depend AS d
               ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_constraint'::pg_catalog.regclass::pg_catalog.oid
              AND d.objid OPERATOR(pg_catalog.=) k.oid
              AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass::pg_catalog.oid
              AND d.refobjid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid
             WHERE k.contypid OPERATOR(pg_catalog.<>) '0'::pg_catalog.oid))
`

// readSetHashQuery fingerprints the set, so an unchanged catalog is not
// transferred again.
var readSetHashQuery = own("watcher: read set hash", onControl, readSetCTE+`SELECT pg_catalog.md5(coalesce(pg_catalog.string_agg(
    pg_catalog.format('%I.%I:%s:%s:%s', rels.nspname, rels.relname, rels.exposed, rels.code, rels.sets), ',' ORDER BY rels.nspname, rels.relname), ''))
  OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) (SELECT everything.all_exposed FROM everything)::pg_catalog.text
FROM rels`)

// ddlTrigger is the event trigger that makes a database's catalog
// tracked: on ddl_command_end, enabled ALWAYS (it fires whatever
// session_replication_role says), for every command tag, it notifies
// pgfence_protected. See docs/reads.md.
const ddlTrigger = "pgfence_catalog_changed"

// catalogModeQuery: is the catalog tracked (ddlTrigger), and does
// fence.replica_reached exist, a superuser's function (the replica
// fence-row check calls it on the client's session).
var catalogModeQuery = own("watcher: catalog mode", onControl, `SELECT EXISTS (SELECT FROM pg_catalog.pg_event_trigger AS e
    WHERE e.evtname OPERATOR(pg_catalog.=) '`+ddlTrigger+`'::pg_catalog.name
      AND e.evtevent OPERATOR(pg_catalog.=) 'ddl_command_end'::pg_catalog.name
      AND e.evtenabled OPERATOR(pg_catalog.=) 'A'::pg_catalog."char" AND e.evttags IS NULL)::pg_catalog.text,
  EXISTS (SELECT FROM pg_catalog.pg_proc AS p JOIN pg_catalog.pg_roles AS o ON o.oid OPERATOR(pg_catalog.=) p.proowner
    WHERE p.oid OPERATOR(pg_catalog.=) pg_catalog.to_regprocedure('fence.replica_reached(pg_catalog.text,pg_catalog.int8,pg_catalog.int8)')::pg_catalog.oid
      AND o.rolsuper)::pg_catalog.text`)

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

var readSetQuery = own("watcher: read set", onControl, readSetCTE+`SELECT rels.nspname, rels.relname, rels.exposed::pg_catalog.text, rels.code::pg_catalog.text,
  rels.sets::pg_catalog.text FROM rels`)

// sessionLocalFuncs and sessionLocalViews are rewrite.SessionLocalNames
// as SQL array literals.
var sessionLocalFuncs, sessionLocalViews = func() (string, string) {
	f, v := rewrite.SessionLocalNames()
	return "{" + strings.Join(f, ",") + "}", "{" + strings.Join(v, ",") + "}"
}()

// safeBuiltin is the allowlist of the built-ins that cannot change the
// session's state, as a condition on p (a pg_proc row; NULL: unknown,
// not safe) and r (runs_sql): a function initdb made (an OID below
// 16384) that does not run SQL (runs_sql: query_to_xml and the like run
// any text, set_config too), is not one the proxy sends to the primary
// (rewrite's primaryOnly: nextval, advisory locks, txid_current,
// pg_backend_pid, ...), and that PostgreSQL marks immutable or stable
// (which it keeps for its own: no side effects) or the proxy knows to be
// read-only though volatile (random, clock_timestamp, ...). Everything
// else, set_config and every other volatile built-in among them, may
// change the session: a view or policy that calls one is in the read
// set's sets (round 12, attacker X's M1).
var safeBuiltin = func() string {
	ro, po, pre := rewrite.SessionSafeNames()
	return `(p.oid OPERATOR(pg_catalog.<) '16384'::pg_catalog.oid AND p.oid OPERATOR(pg_catalog.<>) ALL (r.oids)
    AND p.proname OPERATOR(pg_catalog.<>) ALL ('{` + strings.Join(po, ",") + `}'::pg_catalog.name[])
    AND NOT (p.proname::pg_catalog.text OPERATOR(pg_catalog.^@) ANY ('{` + strings.Join(pre, ",") + `}'::pg_catalog.text[]))
    AND (p.provolatile OPERATOR(pg_catalog.<>) 'v'::pg_catalog."char"
      OR p.proname OPERATOR(pg_catalog.=) ANY ('{` + strings.Join(ro, ",") + `}'::pg_catalog.name[])))`
}()

// statsRels are the system relations that hold values of every table's
// columns: the planner's statistics, and the views over them; large
// objects; and pg_class, whose reltuples, relpages and relallvisible
// count a table's rows and pages as the last ANALYZE or VACUUM on the
// primary left them (round 16, attacker AE's M1: a lagging replica's
// showed the previous generation's count). A user's view over it is
// exposed with it; the system's views over pg_class show no counts
// (information_schema.tables, pg_tables) and stay routed.
const statsRels = "{pg_statistic,pg_statistic_ext_data,pg_stats,pg_stats_ext,pg_stats_ext_exprs,pg_largeobject,pg_class}"

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
// pg_depend row), or a built-in not on the allowlist (safeBuiltin:
// set_config, nextval, ... change the session's state where they run). A
// field can be any function callable with one argument (its others have
// defaults): a user's not written in C, a user's aggregate, one of those
// built-ins, or a built-in not on the allowlist ((4242::bigint).pg_advisory_lock
// takes a lock, ('s'::regclass).nextval moves a sequence).
var readCodeQuery = own("watcher: read set code", onControl, `WITH
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
      AND c.relname OPERATOR(pg_catalog.=) ANY ('`+statsRels+`'::pg_catalog.name[]))
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
                         WHERE m[1]::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (r.oids))
              OR EXISTS (SELECT FROM pg_catalog.regexp_matches(coalesce(k.conbin::pg_catalog.text, ''), ':(?:funcid|opfuncid) ([0-9]+)', 'g') AS m
                           LEFT JOIN pg_catalog.pg_proc AS p ON p.oid OPERATOR(pg_catalog.=) m[1]::pg_catalog.oid, runs_sql AS r
                         WHERE m[1]::pg_catalog.oid OPERATOR(pg_catalog.<>) '0'::pg_catalog.oid AND NOT coalesce(`+safeBuiltin+`, false))))
  )::pg_catalog.text
UNION ALL
SELECT DISTINCT 'field', p.proname::pg_catalog.text FROM pg_catalog.pg_proc AS p, trusted, runs_sql AS r
WHERE (p.oid OPERATOR(pg_catalog.>=) '16384'::pg_catalog.oid
       AND (p.prolang OPERATOR(pg_catalog.<>) ALL (trusted.langs) OR p.prokind OPERATOR(pg_catalog.=) ANY ('{a,w}'::pg_catalog."char"[]))
    OR p.oid OPERATOR(pg_catalog.=) ANY (r.oids)
    OR p.oid OPERATOR(pg_catalog.<) '16384'::pg_catalog.oid AND NOT `+safeBuiltin+`)
  AND p.prokind OPERATOR(pg_catalog.<>) 'p'::pg_catalog."char" AND p.pronargs OPERATOR(pg_catalog.>=) '1'::pg_catalog.int2
  AND p.pronargs OPERATOR(pg_catalog.-) p.pronargdefaults OPERATOR(pg_catalog.<=) '1'::pg_catalog.int2`)

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
		// Unchanged: the same set, valid from the same position, now
		// vouched for up to this one (route.go: a set vouched for only up
		// to before a takeover the reader carries cannot judge its read).
		lsn, err := insertLSN(ctx, conn)
		if err != nil {
			return nil, err
		}
		cp := *old
		cp.upto = lsn
		return &cp, nil
	}
	rd := &readSet{rels: map[rewrite.RelName]bool{}, names: map[string]bool{},
		codeRels: map[rewrite.RelName]bool{}, codeNames: map[string]bool{},
		setsRels: map[rewrite.RelName]bool{}, setsNames: map[string]bool{}, all: all || strings.HasSuffix(hash, " true"),
		colFuncs: fields, hash: hash, code: code}
	rr = conn.ExecParams(ctx, readSetQuery, nil, nil, nil, nil)
	for rr.NextRow() {
		v := rr.Values()
		name := rewrite.RelName{Schema: string(v[0]), Name: string(v[1])}
		exp := string(v[2]) == "true"
		rd.rels[name] = exp
		rd.names[name.Name] = rd.names[name.Name] || exp
		code := string(v[3]) == "true"
		rd.codeRels[name] = code
		rd.codeNames[name.Name] = rd.codeNames[name.Name] || code
		sets := string(v[4]) == "true"
		rd.setsRels[name] = sets
		rd.setsNames[name.Name] = rd.setsNames[name.Name] || sets
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
	rd.lsn, rd.upto = lsn, lsn
	return rd, nil
}
