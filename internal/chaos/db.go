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
// dropped, and the next call opens a new one. When a connection kept from
// an earlier call turns out to be dead (the primary restarted since), f
// runs once more on a new one: callers pass only queries that may run
// twice.
func (d *db) do(ctx context.Context, f func(c *pgx.Conn) error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for try := 0; ; try++ {
		reused := d.conn != nil && !d.conn.IsClosed()
		if !reused {
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
			if reused && try == 0 && ctx.Err() == nil {
				continue
			}
		}
		return err
	}
}

func (d *db) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.conn != nil {
		d.conn.Close(context.Background())
		d.conn = nil
	}
}
