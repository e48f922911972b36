package runner

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
)

// held is the lease a run holds while its command runs.
type held struct {
	fence.Lease
	// localDeadline is when the lease expires at the latest by our clock.
	localDeadline time.Time
}

// leases talks to the fence functions on the primary over one
// connection, opened on first use and reopened after it broke. It is used
// by one goroutine at a time.
type leases struct {
	cfg  *pgx.ConnConfig
	conn *pgx.Conn
	log  *zap.Logger
	// lockTimeout bounds an acquire's wait for the fence row (zero: no
	// limit); see watchedAcquire.
	lockTimeout time.Duration
}

// db returns the open connection, connecting when there is none.
func (s *leases) db(ctx context.Context) (*pgx.Conn, error) {
	if s.conn != nil && !s.conn.IsClosed() {
		return s.conn, nil
	}
	s.close()
	c, err := pgx.ConnectConfig(ctx, s.cfg)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	s.conn = c
	return c, nil
}

// close closes the connection, if any.
func (s *leases) close() {
	closeConn(s.conn)
	s.conn = nil
}

// closeConn closes c, if any, giving the server a second to hear the
// Terminate.
func closeConn(c *pgx.Conn) {
	if c == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	c.Close(ctx)
}

func (s *leases) acquire(ctx context.Context, jobKey, holder string, ttl time.Duration) (held, error) {
	db, err := s.db(ctx)
	if err != nil {
		return held{}, err
	}
	l, err := watchedAcquire(ctx, db, s.cfg, s.log, jobKey, holder, ttl, s.lockTimeout)
	return held{Lease: l}, err
}

func (s *leases) renew(ctx context.Context, jobKey string, token int64, ttl time.Duration) (time.Time, error) {
	db, err := s.db(ctx)
	if err != nil {
		return time.Time{}, err
	}
	return fence.Renew(ctx, db, jobKey, token, ttl)
}

func (s *leases) release(ctx context.Context, jobKey string, token int64) error {
	db, err := s.db(ctx)
	if err != nil {
		return err
	}
	return fence.Release(ctx, db, jobKey, token)
}

// isGone reports that the database says the lease is not ours any more:
// taken over or released (FN001), the job retired (FN004) or unknown
// (FN005), or the generation void after a failover (FN015).
func isGone(err error) bool {
	return fence.IsStale(err) || fence.IsRetired(err) || fence.IsUnknownJob(err) || fence.IsFailover(err)
}

// era is the era the server is in now (fence.current_era()), for the log
// when a generation turns out void after a failover.
type era struct {
	era, timeline int32
	lossless      bool
	reason        string
}

func (s *leases) currentEra(ctx context.Context) (era, error) {
	db, err := s.db(ctx)
	if err != nil {
		return era{}, err
	}
	var e era
	var reason *string
	err = db.QueryRow(ctx, "SELECT era, timeline, lossless, reason FROM fence.current_era()").Scan(&e.era, &e.timeline, &e.lossless, &reason)
	if reason != nil {
		e.reason = *reason
	}
	return e, err
}
