// Package ctlconn is the one PostgreSQL connection a component keeps for
// its own queries, next to the traffic it serves or drives: the proxy's
// auth_query lookups (proxy.authLookup), the chaos harness's checks
// (internal/chaos). The connection is opened when first needed, used by
// one caller at a time, dropped when a query leaves it broken, and opened
// again when a kept one turns out to be dead, as after a restart of
// PostgreSQL, which ends every session.
//
// It is not a pool: callers wait for each other, which suits queries that
// are rare next to that traffic.
package ctlconn

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Session is the connection Conn keeps: a *pgx.Conn or a *pgconn.PgConn.
type Session interface {
	IsClosed() bool
	Close(ctx context.Context) error
}

// Conn keeps one connection. The zero value holds none; it is used
// through a pointer and must not be copied.
type Conn[S Session] struct {
	mu   sync.Mutex
	s    S
	open bool
}

// Do runs f on the connection, opening it with connect when there is none
// (an error from connect is returned wrapped, "connect: ..."). A
// connection that f leaves broken (f fails otherwise than with
// PostgreSQL's answer or pgx.ErrNoRows, or the connection is closed) is
// closed and dropped, and the next call opens a new one. When the
// connection was kept from an earlier call and turns out to be dead, f runs
// once more on a new one, unless ctx has ended: callers pass only work
// that may run twice. One that fails on a connection just opened is not
// run again.
func (c *Conn[S]) Do(ctx context.Context, connect func(context.Context) (S, error), f func(S) error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for try := 0; ; try++ {
		reused := c.open && !c.s.IsClosed()
		if !reused {
			s, err := connect(ctx)
			if err != nil {
				return fmt.Errorf("connect: %w", err)
			}
			c.s, c.open = s, true
		}
		err := f(c.s)
		if broken(err) || c.s.IsClosed() {
			c.drop()
			if reused && try == 0 && ctx.Err() == nil {
				continue
			}
		}
		return err
	}
}

// broken reports whether err says more than that a statement failed: a
// connection that returned it cannot be trusted with the next one.
func broken(err error) bool {
	var pe *pgconn.PgError
	return err != nil && !errors.Is(err, pgx.ErrNoRows) && !errors.As(err, &pe)
}

// Close closes the connection, if there is one. A later Do opens a new one.
func (c *Conn[S]) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.drop()
}

func (c *Conn[S]) drop() {
	if c.open {
		c.s.Close(context.Background())
		var none S
		c.s, c.open = none, false
	}
}
