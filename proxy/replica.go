package proxy

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/pgfence/pgfence/internal/wire"
	"go.uber.org/zap"
)

// A session's second upstream: a connection to a streaming replica, opened
// lazily the first time the write gate routes a read there (DESIGN §6,
// §8). The rules that keep one client conversation out of two backends
// coherent:
//
//   - Only one upstream has requests in flight at a time. The client
//     goroutine switches Session.sw (where requests go) only when nothing
//     is outstanding and the transaction status is idle; a transaction
//     begun on the replica (BEGIN READ ONLY) stays there until it ends.
//   - Each upstream connection has its own reader goroutine, or both are
//     read by the session's event loop (evloop_replica_linux.go); both
//     match responses against the session's one outstanding-request queue
//     and pass them through the Handler, and both write to the client
//     through the same writer, which then locks (clientWriter).
//   - A routed request is waited for before the client goroutine reads on
//     (routeWait). If the replica fails before any of its response reached
//     the client, the request is sent again to the primary; if part of it
//     did, or a read-only transaction was open there, the session ends
//     with 08006, as it would if its backend had crashed.

// clientWriter is the buffered writer to the client. With a replica
// possible (shared), the two upstream readers lock it per Write and Flush;
// a message is always written whole by one Write, except large primary
// messages, which the primary streams only while it is the upstream in use
// (the idle replica's messages are dropped).
type clientWriter struct {
	*bufio.Writer
	mu     sync.Mutex
	shared bool
}

func newClientWriter(c net.Conn, size int, shared bool) *clientWriter {
	return &clientWriter{Writer: bufio.NewWriterSize(c, size), shared: shared}
}

func (w *clientWriter) Write(b []byte) (int, error) {
	if !w.shared {
		return w.Writer.Write(b)
	}
	w.mu.Lock()
	n, err := w.Writer.Write(b)
	w.mu.Unlock()
	return n, err
}

func (w *clientWriter) Flush() error {
	if !w.shared {
		return w.Writer.Flush()
	}
	w.mu.Lock()
	err := w.Writer.Flush()
	w.mu.Unlock()
	return err
}

// replicaConn is a session's connection to a replica.
type replicaConn struct {
	r    *replica
	conn net.Conn
	sw   *bufio.Writer
	sf   wire.Framer
	pid  uint32
	key  []byte

	done chan struct{} // closed when the reader goroutine ends
	err  error         // why it ended (read after done)
	// forwarded: a message of the current routed request reached the
	// client (reset by the client goroutine before each routed request).
	forwarded atomic.Bool
	closeOnce sync.Once
	// loop is set when the session's event loop reads the connection
	// instead of a reader goroutine (evloop_replica_linux.go); conn is
	// closed then, its socket a duplicate the loop watches.
	loop *loopReplica
}

// close tells the replica backend to end and closes (on the loop: shuts
// down) the connection, which ends its reader.
func (rc *replicaConn) close() {
	rc.closeOnce.Do(func() {
		if rc.loop != nil {
			rc.loop.stop()
			return
		}
		rc.conn.Write(wire.Terminate)
		rc.conn.Close()
	})
}

// release closes the socket the event loop read rc through, once the loop
// has let go of it (nothing to do for a reader goroutine's connection).
// Its owner calls it: the client goroutine dropping rc, or the session's
// end.
func (rc *replicaConn) release() {
	if rc.loop != nil {
		rc.loop.release()
	}
}

// sessionRoute is a Session's routing state.
type sessionRoute struct {
	rep       *replicaConn // client goroutine writes; readers read under the session's use
	primarySW *bufio.Writer
	onRep     atomic.Bool // requests currently go to the replica
	waiting   atomic.Bool // the client goroutine waits for a routed request (retry possible)
	fatal     atomic.Pointer[ProtocolError]
	mu        sync.Mutex // guards rep for readers outside the client goroutine (cancel, close)
}

// errReplicaUnavailable: the replica could not be used; the caller goes to
// the primary.
var errReplicaUnavailable = errors.New("replica unavailable")

// OnReplica reports whether the session's requests currently go to its
// replica connection. Client goroutine.
func (s *Session) OnReplica() bool { return s.rt.onRep.Load() }

// useReplica makes the replica connection (opening it to r when needed)
// the upstream for the following requests. The caller guarantees nothing is
// outstanding and the transaction status is idle. Client goroutine only.
func (s *Session) useReplica(r *replica) error {
	rc := s.rt.rep
	if rc != nil {
		select {
		case <-rc.done:
			s.dropReplica()
			rc = nil
		default:
		}
	}
	if rc != nil && rc.r != r {
		s.dropReplica()
		rc = nil
	}
	if rc == nil {
		var err error
		if rc, err = s.openReplica(r); err != nil {
			s.log.Info("cannot open a replica connection; reading from the primary", zap.String("replica", r.addr), zap.Error(err))
			return fmt.Errorf("%w: %w", errReplicaUnavailable, err)
		}
	}
	if !s.rt.onRep.Load() {
		if err := s.sw.Flush(); err != nil {
			return err
		}
		s.rt.primarySW = s.sw
		s.rt.onRep.Store(true)
	}
	s.sw = rc.sw // a new connection's, if the one in use had ended
	return nil
}

// usePrimary makes the primary the upstream again. The caller guarantees
// nothing is outstanding on the replica and no transaction is open there.
// Client goroutine only.
func (s *Session) usePrimary() error {
	if !s.rt.onRep.Load() {
		return nil
	}
	err := s.sw.Flush()
	s.sw = s.rt.primarySW
	s.rt.onRep.Store(false)
	if err != nil {
		s.dropReplica()
	}
	return nil
}

// dropReplica closes the replica connection. Client goroutine, with the
// replica not in use.
func (s *Session) dropReplica() {
	s.rt.mu.Lock()
	rc := s.rt.rep
	s.rt.rep = nil
	s.rt.mu.Unlock()
	if rc != nil {
		rc.close()
		<-rc.done
		rc.release()
	}
}

// replicaConnNow is the session's replica connection (nil: none), from
// any goroutine.
func (s *Session) replicaConnNow() *replicaConn {
	s.rt.mu.Lock()
	defer s.rt.mu.Unlock()
	return s.rt.rep
}

// stopReplica tells the replica connection to end, at session end,
// without waiting for its reader.
func (s *Session) stopReplica() {
	if rc := s.replicaConnNow(); rc != nil {
		rc.close()
	}
}

// closeReplica ends the replica connection at session end, once nothing
// reads it but its own reader (a session on the event loop: once the loop
// has let go of the session, interceptEnd.endServer).
func (s *Session) closeReplica() {
	if rc := s.replicaConnNow(); rc != nil {
		rc.close()
		rc.release()
		<-rc.done
	}
}

// openReplica dials r as the client's user and database with the client's
// startup parameters, as Server.open dials the primary.
func (s *Session) openReplica(r *replica) (*replicaConn, error) {
	srv := s.srv
	hj, err := srv.connectAs(r.cfg, s.User, s.Database, s.Params, s.proof) // as the primary's (server.go)
	if err != nil {
		return nil, err
	}
	size := srv.cfg.BufferSize
	rc := &replicaConn{r: r, conn: hj.Conn, pid: hj.PID, key: hj.SecretKey, done: make(chan struct{}),
		sw: bufio.NewWriterSize(hj.Conn, size)}
	rc.sf = wire.Framer{R: bufio.NewReaderSize(hj.Conn, size), Flush: s.cw.Flush, From: "replica", Count: &s.info.stats.sent}
	// The event loop reads it when the session is on the loop
	// (evloop_replica_linux.go), else a reader goroutine.
	onLoop, err := s.replicaOnLoop(rc)
	if err != nil {
		rc.close()
		return nil, err
	}
	s.rt.mu.Lock()
	s.rt.rep = rc
	s.rt.mu.Unlock()
	s.log.Debug("replica connection open", zap.String("replica", r.addr), zap.Uint32("replica_pid", hj.PID), zap.Bool("event_loop", onLoop))
	if onLoop {
		return rc, nil
	}
	go func() {
		defer close(rc.done)
		rc.err = s.guard("replica", func() error { return s.replicaLoop(rc) })
	}()
	return rc, nil
}

// replicaLoop is serverLoop for the replica connection. Messages larger
// than the buffer are read whole (so each reaches the client in one
// locked Write). It never ends the session by returning: a failure while
// the replica serves a request that cannot be retried ends it through
// failReplica.
func (s *Session) replicaLoop(rc *replicaConn) error {
	size := rc.sf.R.Size()
	var big []byte
	for {
		typ, total, err := rc.sf.Next()
		if err != nil {
			s.cw.Flush()
			s.replicaFailed(fmt.Errorf("replica: %w", err))
			return err
		}
		var msg []byte
		if total > size {
			big, err = rc.sf.ReadInto(big[:0], total)
			msg = big
		} else {
			msg, err = rc.sf.Whole(total)
		}
		if err != nil {
			s.replicaFailed(fmt.Errorf("replica: %w", err))
			return err
		}
		if typ == 'E' && s.oversized.Load() {
			msg = s.srv.oversizedError(msg) // limits.go
		}
		if s.replicaDrop(rc, typ, msg) {
			if total <= size {
				rc.sf.Discard(total)
			}
			continue
		}
		fwd, err := s.interceptServer(msg)
		if err != nil {
			s.failReplica(err)
			return err
		}
		if fwd {
			rc.forwarded.Store(true)
			if _, err := s.cw.Write(msg); err != nil {
				return fmt.Errorf("client: %w", err)
			}
		}
		if total <= size {
			rc.sf.Discard(total)
		} else if cap(big) > 4*size {
			big = nil
		}
		if tx, ok := wire.ReadyStatus(msg); ok {
			if s.ready(tx) {
				s.cw.Flush()
				s.closeServer()
				return errShutdown
			}
		}
	}
}

// replicaAnswers reports whether the replica connection serves a request
// of the session now: its requests go there, and one is in flight or a
// transaction is open there.
func (s *Session) replicaAnswers() bool {
	return s.rt.onRep.Load() && (s.q.Front() != nil || s.TxStatus() != 'I')
}

// replicaDrop reports whether the replica's message msg is dropped rather
// than passed on: nothing of the session's is in flight there (a notice),
// or the replica ends the connection (a FATAL before shutdown), which is
// a failure, never an answer: the connection is closed, and the read is
// retried on the primary when it can be.
func (s *Session) replicaDrop(rc *replicaConn, typ byte, msg []byte) bool {
	if s.replicaAnswers() && (typ != 'E' || !fatalError(msg)) {
		return false
	}
	if typ == 'E' {
		s.log.Info("replica connection reported an error; closing it", zap.ByteString("error", msg))
		rc.close()
	}
	return true
}

// upstreamFailed returns err, the failure to read an upstream; when the
// upstream is the replica connection rc, the session learns of it first
// (replicaFailed).
func (s *Session) upstreamFailed(rc *replicaConn, err error) error {
	if rc != nil {
		s.replicaFailed(err)
	}
	return err
}

// handlerFailed returns err, the Handler's on an upstream's message; on
// the replica connection rc's, it ends the session first (failReplica).
func (s *Session) handlerFailed(rc *replicaConn, err error) error {
	if rc != nil {
		s.failReplica(err)
	}
	return err
}

// replicaFailed decides what a lost replica connection means for the
// session: nothing when the replica was not in use, a retry on the primary
// when the client goroutine waits for a routed request (routeWait), and the
// end of the session otherwise.
func (s *Session) replicaFailed(err error) {
	if !s.rt.onRep.Load() || s.rt.waiting.Load() {
		return
	}
	if s.q.Front() == nil && s.TxStatus() == 'I' {
		return
	}
	s.failReplica(err)
}

// failReplica ends the session: the replica failed with a request in
// flight that cannot be retried.
func (s *Session) failReplica(err error) {
	select {
	case <-s.closing:
		return
	default:
	}
	s.log.Warn("replica failed while serving this session; ending the session", zap.Error(err))
	s.rt.fatal.CompareAndSwap(nil, &ProtocolError{Code: "08006",
		Msg: "pgfence: the replica serving this session's read-only transaction or read failed; reconnect and retry", Err: err})
	s.closeServer()
}

// routeWait waits for the routed request r (sent on the replica) to be
// answered. It reports retry when the replica failed before anything of
// the answer reached the client: the queue is then cleared and the caller
// sends the request to the primary. Client goroutine only.
func (s *Session) routeWait(r *Request) (retry bool, err error) {
	rc := s.rt.rep
	defer s.rt.waiting.Store(false)
	if err := s.sw.Flush(); err != nil {
		// The reader notices too; wait for it below.
		_ = err
	}
	select {
	case <-r.Done():
		return false, nil
	case <-rc.done:
	case <-s.closing:
		return false, errSessionClosing
	}
	// The replica's reader ended with r unanswered.
	if rc.forwarded.Load() {
		return false, &ProtocolError{Code: "08006", Msg: "pgfence: the replica serving this read failed after part of the result was sent; reconnect and retry", Err: rc.err}
	}
	s.log.Info("replica failed before answering; retrying on the primary", zap.Error(rc.err))
	n := int64(0)
	for f := s.q.Front(); f != nil; f = s.q.Front() {
		if f.Type == 'Q' || f.Type == 'S' || f.Type == 'F' {
			n++
		}
		f.Skipped = true
		s.q.Pop()
	}
	s.st.Add(-n)
	s.st.SetTx('I')
	s.sw = s.rt.primarySW
	s.rt.onRep.Store(false)
	s.dropReplica()
	return true, nil
}

// replicaCancelTarget is where a CancelRequest for sess goes while its
// requests run on the replica.
func (s *Session) replicaCancelTarget() (cancelTarget, bool) {
	if !s.rt.onRep.Load() {
		return cancelTarget{}, false
	}
	rc := s.replicaConnNow()
	if rc == nil {
		return cancelTarget{}, false
	}
	addr := rc.conn.RemoteAddr()
	return cancelTarget{addr: addr, network: addr.Network(), pid: rc.pid, upKey: rc.key}, true
}

// fatalError reports whether an ErrorResponse ends the connection.
func fatalError(msg []byte) bool {
	var e pgproto3.ErrorResponse
	if err := e.Decode(msg[headerLen:]); err != nil {
		return false
	}
	return e.SeverityUnlocalized == "FATAL" || e.SeverityUnlocalized == "PANIC" || e.Severity == "FATAL" || e.Severity == "PANIC"
}
