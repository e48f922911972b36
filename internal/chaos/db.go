package chaos

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// db is one connection to the primary for the harness's own queries,
// opened lazily and opened again after the nemesis broke it (a restart of
// the primary ends every session). Calls are serialised.
type db struct {
	dsn string

	mu   sync.Mutex
	conn *pgx.Conn
}

func newDB(dsn string) *db { return &db{dsn: dsn} }

// do runs f on the connection; a connection that f leaves broken is
// dropped, and the next call opens a new one.
func (d *db) do(ctx context.Context, f func(c *pgx.Conn) error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.conn == nil || d.conn.IsClosed() {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		c, err := pgx.Connect(cctx, d.dsn)
		cancel()
		if err != nil {
			return err
		}
		d.conn = c
	}
	err := f(d.conn)
	var pe *pgconn.PgError
	broken := err != nil && !errors.Is(err, pgx.ErrNoRows) && !errors.As(err, &pe)
	if broken || d.conn.IsClosed() {
		d.conn.Close(context.Background())
		d.conn = nil
	}
	return err
}

func (d *db) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.conn != nil {
		d.conn.Close(context.Background())
		d.conn = nil
	}
}
