package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/audit"
	"github.com/pgfence/pgfence/fence"
)

// ReadStats counts the readers' reads.
type ReadStats struct {
	Recorded int // reads that returned a row, checked by the audit (check 4)
	Replica  int // of those, answered by the replica
	Primary  int // of those, answered by the primary
	Pending  int // FN007: the replica had not replayed the generation
	Errors   int
	// AcrossFailover are reads whose generation was learnt before an
	// asynchronous failover and answered after it (or during it): not
	// recorded, since the generation may be one the failover lost.
	AcrossFailover int
}

// readers read results through the proxies' replica route while carrying
// a generation. A reader learns the generation the way a downstream
// service would: the job's latest committed result on the primary, with
// the primary's WAL position right after it. It then reads through a
// proxy with fence.job_key/fence.token set to that generation and
// fence.min_lsn to that position, and must never see a result of a smaller
// token (check 4). Reader i uses read policy primary, wait or pending.
type readers struct {
	h *harness

	mu   sync.Mutex
	recs []audit.ReadRecord
	stat ReadStats
}

var readPolicies = []string{"primary", "wait", "pending"}

func (rd *readers) run(ctx context.Context, i int, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, uint64(i)))
	policy := readPolicies[i%len(readPolicies)]
	primary := newDB(rd.h.primaryDSN)
	defer primary.close()
	var c *pgconn.PgConn
	defer func() {
		if c != nil {
			c.Close(context.Background())
		}
	}()
	for ctx.Err() == nil {
		sleepCtx(ctx, time.Duration(20+rng.IntN(80))*time.Millisecond)
		if c == nil || c.IsClosed() {
			p := rd.h.proxies[rng.IntN(len(rd.h.proxies))]
			cfg, err := pgconn.ParseConfig(p.dsn("chaos-reader") + "&connect_timeout=3")
			if err != nil {
				return
			}
			cfg.RuntimeParams["options"] = "-c fence.read_policy=" + policy + " -c fence.read_wait=500ms"
			if c, err = pgconn.ConnectConfig(ctx, cfg); err != nil {
				c = nil
				continue
			}
		}
		job := rd.h.jobs[rng.IntN(len(rd.h.jobs))]
		gen := rd.h.failoverGen.Load()
		var token int64
		var lsn string
		err := primary.do(ctx, func(c *pgx.Conn) error {
			return c.QueryRow(ctx, "SELECT token, pg_current_wal_lsn()::text FROM results WHERE job_key = $1", job).Scan(&token, &lsn)
		})
		if errors.Is(err, pgx.ErrNoRows) {
			continue
		}
		if err != nil {
			continue
		}
		set := fmt.Sprintf("SET fence.job_key = '%s'; SET fence.token = %d; SET fence.min_lsn = '%s'", job, token, lsn)
		if _, err := c.Exec(ctx, set).ReadAll(); err != nil {
			rd.add(func(s *ReadStats) { s.Errors++ })
			c.Close(ctx)
			continue
		}
		rs, err := c.Exec(ctx, "SELECT token, pg_is_in_recovery() FROM results WHERE job_key = '"+job+"'").ReadAll()
		if err != nil {
			if fence.Code(err) == fence.CodePending {
				rd.add(func(s *ReadStats) { s.Pending++ })
				continue
			}
			if ctx.Err() == nil {
				rd.add(func(s *ReadStats) { s.Errors++ })
			}
			c.Close(ctx)
			continue
		}
		if gen%2 == 1 || rd.h.failoverGen.Load() != gen {
			if rd.h.cfg.Failover == FailoverAsync {
				// The generation carried may be one the failover lost:
				// the new primary's older result is then the truth.
				rd.add(func(s *ReadStats) { s.AcrossFailover++ })
				continue
			}
		}
		if len(rs) != 1 || len(rs[0].Rows) != 1 {
			// The row was there on the primary: a read that finds none
			// saw an older state than the generation it carries.
			rd.record(audit.ReadRecord{Job: job, GenerationToken: token, SawToken: 0}, false)
			rd.h.count(func(s *Summary) {
				s.Anomalies = append(s.Anomalies, fmt.Sprintf("reader carrying job %s token %d found no result row", job, token))
			})
			continue
		}
		row := rs[0].Rows[0]
		saw, _ := strconv.ParseInt(string(row[0]), 10, 64)
		rd.record(audit.ReadRecord{Job: job, GenerationToken: token, SawToken: saw}, string(row[1]) == "t")
	}
}

func (rd *readers) add(f func(s *ReadStats)) {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	f(&rd.stat)
}

func (rd *readers) record(r audit.ReadRecord, replica bool) {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	rd.recs = append(rd.recs, r)
	rd.stat.Recorded++
	if replica {
		rd.stat.Replica++
	} else {
		rd.stat.Primary++
	}
}

func (rd *readers) stats() ReadStats {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	return rd.stat
}

func (rd *readers) records() []audit.ReadRecord {
	rd.mu.Lock()
	defer rd.mu.Unlock()
	return append([]audit.ReadRecord{}, rd.recs...)
}

// ConsumerStats counts the consumer's decisions.
type ConsumerStats struct {
	Accepted, Rejected int
}

// consumerName is the consumer's name in fence.accept_event.
const consumerName = "chaos-consumer"

// consumer applies outbox events with fence.accept_event, each in its own
// transaction on the primary, taking the events of each batch in a random
// order (a queue that reorders), so that events of older generations
// arrive after newer ones and must be rejected (check 5).
type consumer struct {
	h  *harness
	db *db

	mu   sync.Mutex
	stat ConsumerStats
}

type event struct {
	id           int64
	job          string
	epoch, token int64
	payload      string
}

func (cs *consumer) run(ctx context.Context, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 7))
	for ctx.Err() == nil {
		// Let events pile up so that a batch mixes generations.
		sleepCtx(ctx, time.Duration(500+rng.IntN(2000))*time.Millisecond)
		cs.batch(ctx, rng)
	}
}

// drain applies every event left.
func (cs *consumer) drain(ctx context.Context) error {
	rng := rand.New(rand.NewPCG(1, 7))
	var last error
	for ctx.Err() == nil {
		n, err := cs.batch(ctx, rng)
		if err == nil && n == 0 {
			return nil
		}
		if err != nil {
			last = err
			sleepCtx(ctx, 100*time.Millisecond)
		}
	}
	return fmt.Errorf("consumer drain: %w (last error: %v)", ctx.Err(), last)
}

func (cs *consumer) batch(ctx context.Context, rng *rand.Rand) (int, error) {
	var evs []event
	err := cs.db.do(ctx, func(c *pgx.Conn) error {
		rows, err := c.Query(ctx, `SELECT o.id, o.job_key, o.epoch, o.token, o.payload FROM outbox o
			WHERE NOT EXISTS (SELECT 1 FROM consumed c WHERE c.id = o.id) ORDER BY o.id LIMIT 50`)
		if err != nil {
			return err
		}
		evs, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (event, error) {
			var e event
			err := r.Scan(&e.id, &e.job, &e.epoch, &e.token, &e.payload)
			return e, err
		})
		return err
	})
	if err != nil {
		return 0, err
	}
	rng.Shuffle(len(evs), func(i, j int) { evs[i], evs[j] = evs[j], evs[i] })
	for _, e := range evs {
		if err := cs.apply(ctx, e); err != nil {
			return 0, err
		}
	}
	return len(evs), nil
}

func (cs *consumer) apply(ctx context.Context, e event) error {
	var ok bool
	err := cs.db.do(ctx, func(c *pgx.Conn) error {
		return pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
			if err := tx.QueryRow(ctx, "SELECT fence.accept_event($1, $2, $3, $4)", consumerName, e.job, e.epoch, e.token).Scan(&ok); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, "INSERT INTO consumed (id, accepted) VALUES ($1, $2)", e.id, ok); err != nil {
				return err
			}
			if !ok {
				return nil
			}
			_, err := tx.Exec(ctx, `INSERT INTO applied (job_key, epoch, token, payload) VALUES ($1, $2, $3, $4)
			ON CONFLICT (job_key) DO UPDATE SET epoch = excluded.epoch, token = excluded.token, payload = excluded.payload`,
				e.job, e.epoch, e.token, e.payload)
			return err
		})
	})
	if err != nil {
		return err
	}
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if ok {
		cs.stat.Accepted++
	} else {
		cs.stat.Rejected++
	}
	return nil
}

func (cs *consumer) stats() ConsumerStats {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	return cs.stat
}
