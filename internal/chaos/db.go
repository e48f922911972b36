package chaos

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/ctlconn"
)

// db is one connection to the primary for the harness's own queries,
// opened lazily and opened again after the nemesis broke it (a restart of
// the primary ends every session). Calls are serialised.
type db struct {
	dsn  string
	conn ctlconn.Conn[*pgx.Conn]
}

func newDB(dsn string) *db { return &db{dsn: dsn} }

// do runs f on the connection (ctlconn.Conn.Do): a connection that f
// leaves broken is dropped, and the next call opens a new one. When a
// connection kept from an earlier call turns out to be dead (the primary
// restarted since), f runs once more on a new one: callers pass only
// queries that may run twice.
func (d *db) do(ctx context.Context, f func(c *pgx.Conn) error) error {
	return d.conn.Do(ctx, d.connect, f)
}

// connect opens the connection, giving up after five seconds (the
// primary may be down).
func (d *db) connect(ctx context.Context) (*pgx.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return pgx.Connect(ctx, d.dsn)
}

func (d *db) close() { d.conn.Close() }
