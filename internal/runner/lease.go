package runner

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Lease is the lease a run holds while its command runs.
type Lease struct {
	JobKey    string
	Holder    string
	Epoch     int64
	Token     int64
	ExpiresAt time.Time // as of acquisition

	// localDeadline is when the lease expires at the latest by our clock.
	localDeadline time.Time
}

// leases talks to the fence functions on the primary over one
// connection, opened on first use and reopened after it broke. It is used
// by one goroutine at a time.
type leases struct {
	cfg  *pgx.ConnConfig
	conn *pgx.Conn
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
	if s.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		s.conn.Close(ctx)
		cancel()
		s.conn = nil
	}
}

func (s *leases) acquire(ctx context.Context, jobKey, holder string, ttl time.Duration) (Lease, error) {
	l := Lease{JobKey: jobKey, Holder: holder}
	db, err := s.db(ctx)
	if err != nil {
		return l, err
	}
	err = db.QueryRow(ctx,
		`SELECT epoch, token, expires_at FROM fence.acquire($1, $2, $3::bigint * interval '1 microsecond')`,
		jobKey, holder, ttl.Microseconds()).Scan(&l.Epoch, &l.Token, &l.ExpiresAt)
	return l, err
}

func (s *leases) renew(ctx context.Context, jobKey string, token int64, ttl time.Duration) (time.Time, error) {
	var exp time.Time
	db, err := s.db(ctx)
	if err != nil {
		return exp, err
	}
	err = db.QueryRow(ctx,
		`SELECT fence.renew($1, $2, $3::bigint * interval '1 microsecond')`,
		jobKey, token, ttl.Microseconds()).Scan(&exp)
	return exp, err
}

func (s *leases) release(ctx context.Context, jobKey string, token int64) error {
	db, err := s.db(ctx)
	if err != nil {
		return err
	}
	_, err = db.Exec(ctx, `SELECT fence.release($1, $2)`, jobKey, token)
	return err
}

func sqlState(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// isLeaseHeld reports a live lease of another holder (FN002).
func isLeaseHeld(err error) bool { return sqlState(err) == "FN002" }

// isStale reports that our token is no longer current (FN001).
func isStale(err error) bool { return sqlState(err) == "FN001" }

// isGone reports that the database says the lease is not ours any more:
// taken over or released (FN001), the job retired (FN004) or unknown
// (FN005).
func isGone(err error) bool {
	switch sqlState(err) {
	case "FN001", "FN004", "FN005":
		return true
	}
	return false
}
