package proxy

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/internal/wire"
	"github.com/pgfence/pgfence/pool"
)

// serverSlot waits, if a server connection limit says so, until the
// client c of user and db may have a server connection (package pool:
// default_pool_size, reserve_pool_size, max_db_connections,
// max_user_connections). A client that waits query_wait_timeout, or
// through a shutdown, is refused: 53300, naming the limit that kept it
// out, or 57P01. The caller releases the slot when the session ends.
//
// With server_reuse, the slot comes with a backend parked by a client
// that left it (Server.park) when one was parked with exactly the
// client's startup parameters (sig, startupSignature): Server.open uses
// it instead of opening one.
func (s *Server) serverSlot(c net.Conn, user, db, sig string, log *zap.Logger) (*pool.Slot, error) {
	// The startup deadline does not run while the client waits its turn.
	c.SetDeadline(time.Time{})
	if !s.live().serverReuse {
		sig = "" // takes nothing parked
	}
	slot, err := s.pools.Acquire(s.shutCtx, pool.Key{Database: db, User: user}, sig)
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

// startupSignature is what a parked backend must have been opened with to
// serve a client with startup parameters params (user and database
// included): all of them, exactly. A backend's session defaults are its
// startup parameters (DISCARD ALL returns to them), so a client is only
// given one whose defaults are its own.
func startupSignature(params map[string]string) string {
	keys := make([]string, 0, len(params))
	for k := range params {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		// Length-prefixed: no two different sets give the same string.
		b.WriteString(strconv.Itoa(len(k)))
		b.WriteByte(':')
		b.WriteString(k)
		b.WriteString(strconv.Itoa(len(params[k])))
		b.WriteByte(':')
		b.WriteString(params[k])
	}
	return b.String()
}

// parkedBackend is a backend a client left, reset, waiting in its pool
// for the next client (pool.Conn).
type parkedBackend struct {
	conn   net.Conn
	pid    uint32
	key    []byte            // the backend's real cancel key
	params map[string]string // what it reported, as of its reset
}

// Close tells the backend to end and closes its socket.
func (pb *parkedBackend) Close() error {
	pb.conn.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	pb.conn.Write(wire.Terminate)
	return pb.conn.Close()
}

// quiet reports whether nothing has come from the backend since it was
// parked, without blocking or reading: the end of the stream (it exited:
// a restart, pg_terminate_backend, a failover) or a message (a FATAL
// before it exited) each mean it cannot serve.
func (pb *parkedBackend) quiet() bool {
	sc, ok := pb.conn.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	var buf [1]byte
	var n int
	var perr error
	if err := rc.Read(func(fd uintptr) bool {
		n, _, perr = syscall.Recvfrom(int(fd), buf[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return true
	}); err != nil {
		return false
	}
	return n < 0 || (n == 0 && errors.Is(perr, syscall.EAGAIN))
}

// hijacked is pb as the connection Server.open would have dialed.
func (pb *parkedBackend) hijacked() *pgconn.HijackedConn {
	return &pgconn.HijackedConn{Conn: pb.conn, PID: pb.pid, SecretKey: pb.key, ParameterStatuses: pb.params, TxStatus: 'I'}
}

// resetTimeout bounds a backend's reset before it is parked.
const resetTimeout = 5 * time.Second

// reset runs DISCARD ALL on pb, whose session left it with nothing in
// flight (relay.quietServer), and checks that its answer is exactly that
// of a backend idle outside a transaction: ParameterStatus (what the
// reset put back, kept in pb.params) and notices around CommandComplete
// "DISCARD ALL", then ReadyForQuery 'I'. Anything else, and the backend
// is not parked.
func (pb *parkedBackend) reset() error {
	return pb.exchange("DISCARD ALL", "DISCARD ALL", nil)
}

// exchange sends sql, a simple Query, to pb and reads its answer one
// message at a time, never past ReadyForQuery (frameReader): nil when it
// is exactly CommandComplete tag (rows, if any, to row first), then
// ReadyForQuery 'I', with ParameterStatus (kept in pb.params) and notices
// anywhere. Anything else is an error, and pb is not to be used.
func (pb *parkedBackend) exchange(sql, tag string, row func(*pgproto3.DataRow)) error {
	pb.conn.SetDeadline(time.Now().Add(resetTimeout))
	defer pb.conn.SetDeadline(time.Time{})
	msg, err := (&pgproto3.Query{String: sql}).Encode(nil)
	if err != nil {
		return err
	}
	if _, err := pb.conn.Write(msg); err != nil {
		return err
	}
	fe := pgproto3.NewFrontend(&frameReader{r: pb.conn}, io.Discard)
	done := false
	for {
		m, err := fe.Receive()
		if err != nil {
			return err
		}
		switch m := m.(type) {
		case *pgproto3.ParameterStatus:
			pb.params[m.Name] = m.Value
		case *pgproto3.NoticeResponse:
		case *pgproto3.RowDescription:
			if row == nil || done {
				return fmt.Errorf("%s: unexpected RowDescription", tag)
			}
		case *pgproto3.DataRow:
			if row == nil || done {
				return fmt.Errorf("%s: unexpected DataRow", tag)
			}
			row(m)
		case *pgproto3.CommandComplete:
			if done || !strings.HasPrefix(string(m.CommandTag), tag) {
				return fmt.Errorf("%s: unexpected CommandComplete %q", tag, m.CommandTag)
			}
			done = true
		case *pgproto3.ReadyForQuery:
			if !done || m.TxStatus != 'I' {
				return fmt.Errorf("%s: ReadyForQuery %q before it completed", tag, m.TxStatus)
			}
			return nil
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("%s: %s (SQLSTATE %s)", tag, m.Message, m.Code)
		default:
			return fmt.Errorf("%s: unexpected %T", tag, m)
		}
	}
}

// takeParked returns the backend that came with slot (pool.Slot.Conn)
// when it can still serve, as the connection open would have dialed, and
// when it was opened; nil when there was none or it has ended (it is
// closed: the slot stays, for the backend open dials instead).
func (s *Server) takeParked(slot *pool.Slot, user string, log *zap.Logger) (*pgconn.HijackedConn, time.Time) {
	pb, ok := slot.Conn.(*parkedBackend)
	if !ok {
		return nil, time.Time{}
	}
	slot.Conn = nil
	if !pb.quiet() {
		log.Info("parked server connection ended while parked; opening another", zap.Uint32("backend_pid", pb.pid))
		s.ops.stats.ServerParkedLost.Add(1)
		pb.Close()
		return nil, time.Time{}
	}
	if err := pb.admits(user); err != nil {
		// Opened anew, the connection gets PostgreSQL's own answer.
		log.Info("parked server connection not reused: its role or database no longer admits a new session", zap.Error(err))
		pb.Close()
		return nil, time.Time{}
	}
	return pb.hijacked(), slot.Born
}

// admitsQuery asks a parked backend whether what PostgreSQL checks when a
// session starts (the role may log in and has not expired, the database
// allows connections and the role has CONNECT on it) still holds: a
// client handed a backend parked before a REVOKE CONNECT, ALTER ROLE …
// NOLOGIN or ALTER DATABASE … ALLOW_CONNECTIONS false would otherwise
// get a session PostgreSQL now refuses (round 28, BK-H1). Every name and
// operator is pg_catalog's: the role's own search_path, in force after
// DISCARD ALL, steers none of it. pg_hba.conf is not SQL's to read: its
// changes reach parked backends with server_idle_timeout,
// server_lifetime or RECONNECT, as with PgBouncer.
//
// And that it is the client's role: the backend's session user by OID
// has the name the client logged in with (round 28, BK-H3: a role
// renamed, and a new one made with its name, was handed the old one's
// backend), is not a superuser, and the backend does not remember
// having been one's (BK-H2); and neither the role's nor the database's
// connection limit is 0.
const admitsQuery = `SELECT coalesce((SELECT r.rolcanlogin AND NOT r.rolsuper AND r.rolconnlimit OPERATOR(pg_catalog.<>) 0
   AND (r.rolvaliduntil IS NULL OR r.rolvaliduntil OPERATOR(pg_catalog.>) pg_catalog.now())
   AND r.rolname OPERATOR(pg_catalog.=) %s
 FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) pg_catalog."session_user"()), false)
 AND coalesce((SELECT d.datallowconn AND d.datconnlimit OPERATOR(pg_catalog.<>) 0 FROM pg_catalog.pg_database d
   WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()), false)
 AND pg_catalog.has_database_privilege(pg_catalog.current_database(), 'CONNECT')
 AND pg_catalog.current_setting('is_superuser') OPERATOR(pg_catalog.=) 'off'`

// escapeLiteral quotes s as an escape string literal (E'...'), which
// reads the same whatever standard_conforming_strings says.
func escapeLiteral(s string) string {
	return "E'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s) + "'"
}

// admits runs admitsQuery for the client's user on pb: nil when the
// answer is exactly one row 't'.
func (pb *parkedBackend) admits(user string) error {
	admitted := false
	err := pb.exchange(fmt.Sprintf(admitsQuery, escapeLiteral(user)), "SELECT", func(r *pgproto3.DataRow) {
		admitted = len(r.Values) == 1 && string(r.Values[0]) == "t"
	})
	if err == nil && !admitted {
		err = errors.New("the role may no longer log in, or the database no longer admits it")
	}
	return err
}

// park leaves sess's backend, which its session kept for it
// (Session.kept), reset, in its pool for the next client of the same
// startup parameters; or closes it when the reset fails or the server
// is shutting down. slot is the session's.
func (s *Server) park(sess *Session, slot *pool.Slot) {
	// A client of its signature that comes meanwhile waits for it (the
	// reset is a round trip; a new backend a fork and a login).
	slot.Parking(sess.sig)
	fd := sess.keptFD
	conn, err := fileConn(fd) // evloop_bridge.go: takes fd over
	if err != nil {
		syscall.Close(fd)
		sess.log.Warn("cannot park the server connection", zap.Error(err))
		return
	}
	params := make(map[string]string, len(sess.ServerParams))
	for k, v := range sess.ServerParams {
		params[k] = v
	}
	pb := &parkedBackend{conn: conn, pid: sess.BackendPID, key: sess.upKey, params: params}
	if !s.live().serverReuse || s.draining.Load() {
		pb.Close()
		return
	}
	if err := pb.reset(); err != nil {
		sess.log.Info("server connection not parked: its reset failed", zap.Error(err))
		pb.Close()
		return
	}
	s.parkOnce.Do(func() { go s.expireParked() })
	if slot.Park(pb, sess.sig, sess.born) {
		sess.log.Debug("server connection parked")
	}
}

// expireParked closes the parked backends past server_idle_timeout or
// server_lifetime, every second, until the server shuts down (Shutdown
// closes the rest).
func (s *Server) expireParked() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			s.pools.Expire()
		case <-s.shut:
			return
		}
	}
}

// closeParked closes every parked backend (RECONNECT, the shutdown).
func (s *Server) closeParked() { s.pools.CloseIdle() }

// mayKeepServer reports whether the session, ending with err, may leave
// its backend open for the next client (server_reuse): an intercepted
// session on the loop whose client left with Terminate, that nobody
// ended (the console's KILL, a shutdown, a replica's failure) and whose
// upstream is not TLS (its state is the loop's tls.Conn). Whether the
// backend is idle is known only once the relay has let go of it
// (relay.quietServer).
func (s *Session) mayKeepServer(err error) bool {
	if !errors.Is(err, errClientTerminate) || s.h == nil || !s.srv.live().serverReuse ||
		s.killedReason() != nil || s.st.Closed() || s.rt.fatal.Load() != nil || s.srv.draining.Load() ||
		s.info.closeNeeded.Load() || s.ServerParams["is_superuser"] != "off" {
		// RECONNECT marked it (round 28, BK-M1); a superuser's backend
		// keeps, past DISCARD ALL, that its user was one when it
		// started (SET SESSION AUTHORIZATION): never handed on (BK-H2).
		return false
	}
	s.connMu.Lock()
	defer s.connMu.Unlock()
	r := s.loopRelay
	return r != nil && r.intercept != nil && !s.serverStopped && r.server.tls == nil
}
