package proxy

import (
	"errors"
	"fmt"
	"net"
	"time"

	"go.uber.org/zap"

	"github.com/pgfence/pgfence/pool"
)

// serverSlot waits, if a server connection limit says so, until the
// client c of user and db may have a server connection (package pool:
// default_pool_size, reserve_pool_size, max_db_connections,
// max_user_connections). A client that waits query_wait_timeout, or
// through a shutdown, is refused: 53300, naming the limit that kept it
// out, or 57P01. The caller releases the slot when the session ends.
func (s *Server) serverSlot(c net.Conn, user, db string, log *zap.Logger) (*pool.Slot, error) {
	// The startup deadline does not run while the client waits its turn.
	c.SetDeadline(time.Time{})
	slot, err := s.pools.Acquire(s.shutCtx, pool.Key{Database: db, User: user})
	if err == nil {
		if slot.Waited > 0 {
			log.Info("waited for a server connection", zap.Duration("waited", slot.Waited), zap.Bool("reserve", slot.Reserve()))
		}
		return slot, nil
	}
	var we *pool.WaitError
	if errors.As(err, &we) && errors.Is(err, pool.ErrWaitTimeout) {
		return nil, &ProtocolError{Code: "53300",
			Msg: fmt.Sprintf("pgfence: no server connection for database %q user %q within query_wait_timeout (%s): %s reached",
				db, user, we.Waited.Round(time.Millisecond), we.Full),
			Hint: "the proxy bounds the server connections of each database and user: raise default_pool_size, max_db_connections or max_user_connections, or query_wait_timeout, or open fewer sessions at once",
			Err:  err}
	}
	return nil, &ProtocolError{Code: "57P01", Msg: "terminating connection: pgfence is shutting down", Err: errShutdown}
}
