package proxy

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/internal/ownsql"
)

// Replicas across a failover (issue 31; docs/reads.md, "Replicas across a
// failover"). WAL positions of two timelines are not comparable: after a
// promotion a replica that replayed the old primary's WAL past the point
// where the new primary's history forked off is diverged (it holds
// transactions the new primary never had and cannot follow it without
// pg_rewind), yet its replay position may be at or past every position
// the new primary reports. So a position the proxy read on the primary
// means something only on a replica known to be on that primary's history.
//
// The primary's era (fence.eras, migration 019) tells. Each database's
// catalog watcher, whenever it connects to a primary, reads that server's
// era (fence.current_era, which makes the era's row first on a server
// just promoted) before any position it reads there: the era's number,
// timeline and start time. A replica serves a read of that database that
// needs a position only once it has shown that it has the era's row
// (fence.has_era, migration 021): a replica that follows the new primary
// replays the row, a diverged one never has it. The replica's poller asks,
// once per era, database and poller connection (a replica that is
// restarted or replaced is asked again), off the read path, at its next
// poll after the watcher read the era (eraSource) or a read asked
// (wantEra); a read whose replica has not shown the era meanwhile goes
// to another replica or the primary. Cost per read: one map lookup; per
// replica and era: a connection into the database (unless the poller's
// is there already) and two queries.
//
// Without the fence schema, or with one that predates fence.has_era, a
// database has no era the proxy can confirm (catalog.era is nil) and
// positions are compared as before; an era the watcher could not read
// (fence.current_era failed) is unknown, and no replica serves such reads
// (fail closed).

// primaryEra is a primary's era as a catalog watcher read it. known false:
// the database has eras but the watcher could not read the current one.
type primaryEra struct {
	era, timeline int32
	began         string // began_at, UTC, "YYYY-MM-DD HH24:MI:SS.US"
	known         bool
}

func (e primaryEra) String() string {
	if !e.known {
		return "unknown era"
	}
	return fmt.Sprintf("era %d (timeline %d, began %s UTC)", e.era, e.timeline, e.began)
}

// eraKey is an era of one database.
type eraKey struct {
	db string
	e  primaryEra
}

// eraAsk is an era a replica is asked to show: where it was last asked
// (0: not yet), and on which poller connection.
type eraAsk struct {
	replay LSN
	gen    uint64
	asked  bool
}

// eraProbeQuery: the database's fence schema has fence.has_era, a
// superuser's (the schema itself was judged by ownsql.Check first).
var eraProbeQuery = own("watcher: era probe", onControl, `SELECT EXISTS (SELECT FROM pg_catalog.pg_proc AS p JOIN pg_catalog.pg_roles AS o ON o.oid OPERATOR(pg_catalog.=) p.proowner
    WHERE p.oid OPERATOR(pg_catalog.=) pg_catalog.to_regprocedure('fence.has_era(pg_catalog.int4,pg_catalog.int4,pg_catalog.timestamptz)')::pg_catalog.oid
      AND o.rolsuper)::pg_catalog.text`)

// eraQuery reads the primary's era. fence.current_era makes the era's row
// on a server just promoted: a write, so this one transaction (the
// query's implicit one, which an error ends) is made read-write on the
// otherwise read-only control connection. began_at is spelled in UTC in
// ISO form, which every DateStyle reads back.
var eraQuery = own("watcher: primary's era", onControl, `SET TRANSACTION READ WRITE; SELECT e.era::pg_catalog.text, e.timeline::pg_catalog.text,
  pg_catalog.to_char(pg_catalog.timezone('UTC'::pg_catalog.text, e.began_at), 'YYYY-MM-DD HH24:MI:SS.US'::pg_catalog.text)
FROM fence.current_era() AS e`)

// hasEraQuery asks a replica whether it has the era's row.
var hasEraQuery = own("poller: replica's era", onControl,
	`SELECT fence.has_era($1::pg_catalog.int4, $2::pg_catalog.int4, pg_catalog.timezone('UTC'::pg_catalog.text, $3::pg_catalog.timestamp))::pg_catalog.text`)

// readEra records the era of the primary conn is connected to (c.era),
// before the watcher reads any position there; only with read routing. A
// database without a
// trusted fence schema, or whose schema has no fence.has_era, has none
// (nil). An era that cannot be read is unknown: no replica serves the
// database's reads that need a position until a later read succeeds.
func (cs *catalogs) readEra(c *catalog, conn *pgconn.PgConn, log *zap.Logger) error {
	if !c.schema.Load() || !cs.reads.Load() {
		c.era.Store(nil)
		return nil
	}
	res, err := conn.Exec(c.ctx, eraProbeQuery).ReadAll()
	if err != nil {
		return err
	}
	if len(res) != 1 || len(res[0].Rows) != 1 || string(res[0].Rows[0][0]) != "true" {
		if c.era.Load() != nil || !c.eraWarned.Swap(true) {
			log.Warn("the fence schema has no fence.has_era (migration 021): replicas are not checked to be on the primary's history after a failover; run pgfence migrate")
		}
		c.era.Store(nil)
		return nil
	}
	res, err = conn.Exec(c.ctx, eraQuery).ReadAll()
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		if !c.eraWarned.Swap(true) {
			log.Warn("cannot read the primary's era (fence.current_era): no replica serves this database's reads that need a WAL position until it can be read", zap.Error(err))
		}
		c.era.Store(&primaryEra{})
		return nil
	}
	if err != nil {
		return err
	}
	e := primaryEra{}
	if len(res) == 2 && len(res[1].Rows) == 1 && res[1].Rows[0][0] != nil {
		row := res[1].Rows[0]
		era, err1 := strconv.ParseInt(string(row[0]), 10, 32)
		tl, err2 := strconv.ParseInt(string(row[1]), 10, 32)
		if err1 == nil && err2 == nil && row[2] != nil {
			e = primaryEra{era: int32(era), timeline: int32(tl), began: string(row[2]), known: true}
		}
	}
	if !e.known && !c.eraWarned.Swap(true) {
		log.Warn("fence.current_era returned no era: no replica serves this database's reads that need a WAL position until it does")
	}
	if e.known {
		c.eraWarned.Store(false)
		if old := c.era.Load(); old == nil || *old != e {
			log.Info("primary's era", zap.Stringer("era", e))
		}
	}
	c.era.Store(&e)
	return nil
}

// eraSource is implemented by an interceptor whose catalogs know primary
// eras (*Fence): the replica pollers then check them before any read
// asks (confirmEras), so that the first reads after a start or a failover
// need not go to the primary.
type eraSource interface {
	primaryEras() []eraKey
}

// primaryEras lists the known era of every database watched.
func (f *Fence) primaryEras() []eraKey {
	f.cats.mu.Lock()
	defer f.cats.mu.Unlock()
	var out []eraKey
	for db, c := range f.cats.dbs {
		if e := c.era.Load(); e != nil && e.known && !c.gone.Load() {
			out = append(out, eraKey{db, *e})
		}
	}
	return out
}

// eraOK reports whether r may serve this session's reads that need a WAL
// position: the database has no era, or r has shown the primary's. When it
// has not, r's poller is asked to check (once per era).
func (h *fenceSession) eraOK(r *replica) bool {
	e := h.cat.era.Load()
	if e == nil {
		return true
	}
	if !e.known {
		return false
	}
	k := eraKey{h.cat.db, *e}
	if r.hasEra(k) {
		return true
	}
	r.wantEra(k)
	return false
}

// hasEra reports whether r has shown era k on its current poller
// connection. Any goroutine; no lock.
func (r *replica) hasEra(k eraKey) bool {
	m := r.erasOK.Load()
	if m == nil {
		return false
	}
	gen, ok := (*m)[k]
	return ok && gen == r.gen.Load()
}

// wantEra asks r's poller to check era k (one era per database: an
// earlier era's request is dropped); a new request wakes the poller.
func (r *replica) wantEra(k eraKey) {
	r.eraMu.Lock()
	if _, ok := r.eraWant[k]; ok {
		r.eraMu.Unlock()
		return
	}
	if r.eraWant == nil {
		r.eraWant = map[eraKey]eraAsk{}
	}
	for o := range r.eraWant {
		if o.db == k.db {
			delete(r.eraWant, o)
		}
	}
	r.eraWant[k] = eraAsk{}
	r.eraMu.Unlock()
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// confirmEras checks, on r's poller goroutine after a successful poll,
// the eras r was asked to show: each once per poller connection (gen),
// and again only when r has replayed more since it last said no (a
// follower not yet at the era's row). pc is the poller's connection; a
// database other than its own is asked on a connection opened for it.
func (rs *replicas) confirmEras(r *replica, pc *pollConn, replay LSN, log *zap.Logger) {
	if rs.eras != nil {
		for _, k := range rs.eras() {
			if !r.hasEra(k) {
				r.wantEra(k)
			}
		}
	}
	gen := r.gen.Load()
	r.eraMu.Lock()
	var todo []eraKey
	for k, a := range r.eraWant {
		if !a.asked || a.gen != gen || replay > a.replay {
			todo = append(todo, k)
		}
	}
	r.eraMu.Unlock()
	for _, k := range todo {
		ok, err := rs.askEra(r, pc, k)
		if err != nil {
			log.Debug("cannot check the replica's era", zap.String("database", k.db), zap.Stringer("era", k.e), zap.Error(err))
		}
		r.eraMu.Lock()
		if _, still := r.eraWant[k]; still && gen == r.gen.Load() {
			if ok {
				delete(r.eraWant, k)
				m := map[eraKey]uint64{}
				if old := r.erasOK.Load(); old != nil {
					m = maps.Clone(*old)
				}
				for o := range m {
					if o.db == k.db || m[o] != gen {
						delete(m, o)
					}
				}
				m[k] = gen
				r.erasOK.Store(&m)
				log.Info("replica is on the primary's history", zap.String("database", k.db), zap.Stringer("era", k.e))
			} else {
				if err == nil && !r.eraWant[k].asked {
					log.Warn("replica has not shown the primary's era: it serves no reads of the database that need a WAL position (diverged after a failover, or behind)",
						zap.String("database", k.db), zap.Stringer("era", k.e), zap.Stringer("replay_lsn", replay))
				}
				r.eraWant[k] = eraAsk{replay: replay, gen: gen, asked: true}
			}
		}
		r.eraMu.Unlock()
	}
}

// askEra asks r whether it has era k's row, in k's database, on a trusted
// fence schema.
func (rs *replicas) askEra(r *replica, pc *pollConn, k eraKey) (bool, error) {
	ctx, cancel := context.WithTimeout(rs.ctx, 5*time.Second)
	defer cancel()
	conn := pc.conn
	if pc.db != k.db || conn == nil {
		var err error
		if conn, err = dialControl(ctx, r.cfg, k.db, pollerAppName, rs.log, nil); err != nil {
			return false, err
		}
		defer conn.Close(context.Background())
	}
	trust, err := ownsql.Check(ctx, conn, []ownsql.Rel{ownsql.ProtectedTables})
	if err != nil {
		return false, err
	}
	if !trust.Trusted() {
		return false, fmt.Errorf("the replica's fence schema is not trusted: %s", trust.Problem)
	}
	res := conn.ExecParams(ctx, hasEraQuery, [][]byte{
		[]byte(strconv.Itoa(int(k.e.era))), []byte(strconv.Itoa(int(k.e.timeline))), []byte(k.e.began)}, nil, nil, nil).Read()
	if res.Err != nil {
		return false, res.Err
	}
	return len(res.Rows) == 1 && string(res.Rows[0][0]) == "true", nil
}
