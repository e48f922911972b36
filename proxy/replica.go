package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
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
//     side switches Session.sw (where requests go) only when nothing
//     is outstanding and the transaction status is idle; a transaction
//     begun on the replica (BEGIN READ ONLY) stays there until it ends.
//   - Both upstream connections are read by the session's event loop
//     (evloop_replica.go), with the same code (upstreamMessage): both
//     match responses against the session's one outstanding-request queue
//     and pass them through the Handler, and both write to the client
//     through the same writer, which locks (clientWriter): the client
//     side's calls off the loop (offClient) may write it too.
//   - A routed request is waited for before the client side reads on
//     (routeThen: the client side parks). If the replica fails before any of its response reached the
//     client, the request is sent again to the primary; if part of it
//     did, or a read-only transaction was open there, the session ends
//     with 08006, as it would if its backend had crashed.
//   - What blocks (dialing the replica, waiting for its poll) runs off
//     the event loop while the client side is parked (offClient).

// clientWriter is the buffered writer to the client. With a replica
// possible (shared), it locks per Write and Flush: the loop thread writes
// it, and so may the client side's blocking calls off the loop
// (offClient) while the client side is parked.
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
	// client (reset by the client side before each routed request).
	forwarded atomic.Bool
	closeOnce sync.Once
	// textMu guards scs and enc: the replica backend's
	// standard_conforming_strings and client_encoding, as it reported
	// them (at startup, and in every ParameterStatus since, which the
	// client never sees: its view is the primary's) or as the client
	// side last set them (replstate.go).
	textMu   sync.Mutex
	scs, enc string
	// defaults: the settings the connection took from the role's and the
	// database's defaults when it opened (defaultsSQL).
	defaults string
	// loop is the session's event loop's hold of the connection
	// (evloop_replica.go): conn is closed, its socket a duplicate the
	// loop watches.
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
// Its owner calls it: the client side dropping rc, or the session's
// end.
func (rc *replicaConn) release() {
	if rc.loop != nil {
		rc.loop.release()
	}
}

// sessionRoute is a Session's routing state.
type sessionRoute struct {
	rep       *replicaConn // the client side writes; readers read under the session's use
	primarySW *bufio.Writer
	onRep     atomic.Bool // requests currently go to the replica
	waiting   atomic.Bool // the client side waits for a routed request (retry possible)
	fatal     atomic.Pointer[ProtocolError]
	mu        sync.Mutex // guards rep for readers outside the client side (cancel, close)
}

// errReplicaUnavailable: the replica could not be used; the caller goes to
// the primary.
var errReplicaUnavailable = errors.New("replica unavailable")

// OnReplica reports whether the session's requests currently go to its
// replica connection. Client side.
func (s *Session) OnReplica() bool { return s.rt.onRep.Load() }

// offClient runs f, a call that may block, and then k with its error. Off
// the loop (a Handler that is not a LoopClient) it calls them in turn; on
// the event loop f runs on a goroutine of its own while the client side
// is parked, and k runs on
// the loop thread once f has returned (evloop_client.go), which may
// be after the ClientMessage that called offClient has returned errParked.
// f must touch nothing the loop thread does; detached: f uses nothing of
// the session's, so the session's end does not wait for it, and drop
// (if not nil) undoes what f did when the session has ended before k
// could run.
func (s *Session) offClient(f func() error, k func(error) error, drop func(), detached bool) error {
	if !s.onLoop {
		return k(f())
	}
	return s.parkOff(f, k, drop, detached)
}

// useReplica makes the replica connection (opening it to r when needed)
// the upstream for the following requests, then runs k with the outcome
// (errReplicaUnavailable: the caller goes to the primary). The caller
// guarantees nothing is outstanding and the transaction status is idle.
// Client side; on the loop the dial runs off it (offClient).
func (s *Session) useReplica(r *replica, k func(error) error) error {
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
	if rc != nil {
		return k(s.switchReplica(rc))
	}
	var hj *pgconn.HijackedConn
	var defaults string
	// The poller's position of r when the dial began: the connection's
	// own must be at least that (replay only moves forward in one
	// postmaster's life). Behind it, the standby restarted (or was
	// rebuilt) since the poller's last look, behind where it was: the
	// position reads are judged by is not this connection's (round 9).
	before := LSN(r.replay.Load())
	dial := func() (err error) {
		hj, err = s.srv.connectAs(r.cfg, s.User, s.Database, s.Params, s.proof, s.closing) // as the primary's (server.go)
		if err != nil {
			return err
		}
		var at LSN
		hj, defaults, at, err = replicaDefaults(hj)
		if err == nil && at != 0 && at < before {
			hj.Conn.Close()
			hj = nil
			select {
			case r.kick <- struct{}{}: // poll it again now
			default:
			}
			err = fmt.Errorf("replica replayed %s, behind the %s it was polled at: restarted", at, before)
		}
		return err
	}
	opened := func(err error) error {
		var rc *replicaConn
		if err == nil {
			rc, err = s.openReplica(r, hj)
		}
		if rc != nil {
			rc.defaults = defaults
		}
		if err != nil {
			s.log.Info("cannot open a replica connection; reading from the primary", zap.String("replica", r.addr), zap.Error(err))
			return k(fmt.Errorf("%w: %w", errReplicaUnavailable, err))
		}
		return k(s.switchReplica(rc))
	}
	return s.offClient(dial, opened, func() {
		if hj != nil {
			hj.Conn.Close()
		}
	}, true)
}

// replicaDefaults reads, on a replica connection just opened, the settings
// it took from the role's and the database's defaults (defaultsSQL): the
// read router uses the connection only if they are the primary session's
// (fenceSession.replicaAgrees), and its replay position then (0: none
// reported). One round trip, when the connection opens, off the loop. A
// connection that cannot answer is not used.
func replicaDefaults(hj *pgconn.HijackedConn) (*pgconn.HijackedConn, string, LSN, error) {
	c, err := pgconn.Construct(hj)
	if err != nil {
		hj.Conn.Close()
		return nil, "", 0, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := c.Exec(ctx, "SELECT "+defaultsSQL+", coalesce(pg_catalog.pg_last_wal_replay_lsn()::pg_catalog.text, '')").ReadAll()
	if err == nil && (len(res) != 1 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) != 2) {
		err = errors.New("unexpected answer reading the replica connection's defaults")
	}
	var at LSN
	if err == nil {
		if v := string(res[0].Rows[0][1]); v != "" {
			at, err = parseLSN(v)
		}
	}
	if err != nil {
		c.Close(context.Background())
		return nil, "", 0, err
	}
	defaults := string(res[0].Rows[0][0])
	hj, err = c.Hijack()
	if err != nil {
		return nil, "", 0, err
	}
	return hj, defaults, at, nil
}

// replicaDefaults is the replica connection's defaults as it read them
// when it opened (ok false: no connection).
func (s *Session) replicaDefaults() (string, bool) {
	if rc := s.rt.rep; rc != nil {
		return rc.defaults, true
	}
	return "", false
}

// switchReplica makes rc the upstream requests go to.
func (s *Session) switchReplica(rc *replicaConn) error {
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
// Client side.
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

// dropReplica closes the replica connection. Client side, with the
// replica not in use; on the loop thread the loop lets go of it at once
// (endOnLoop) rather than be waited for.
func (s *Session) dropReplica() {
	s.rt.mu.Lock()
	rc := s.rt.rep
	s.rt.rep = nil
	s.rt.mu.Unlock()
	if rc != nil {
		if rc.loop != nil && s.onLoop {
			rc.loop.endOnLoop() // evloop_replica.go
		}
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

// openReplica makes hj, dialed to r as the client's user and database
// with the client's startup parameters (as Server.open dials the
// primary), the session's replica connection.
func (s *Session) openReplica(r *replica, hj *pgconn.HijackedConn) (*replicaConn, error) {
	size := s.srv.cfg.BufferSize
	rc := &replicaConn{r: r, conn: hj.Conn, pid: hj.PID, key: hj.SecretKey, done: make(chan struct{}),
		sw:  bufio.NewWriterSize(hj.Conn, size),
		scs: hj.ParameterStatuses["standard_conforming_strings"], enc: hj.ParameterStatuses["client_encoding"]}
	rc.sf = wire.Framer{R: bufio.NewReaderSize(hj.Conn, size), Flush: s.cw.Flush, From: "replica", Count: &s.info.stats.sent}
	// The session's event loop reads it (evloop_replica.go).
	if err := s.replicaOnLoop(rc); err != nil {
		rc.close()
		return nil, err
	}
	s.rt.mu.Lock()
	s.rt.rep = rc
	s.rt.mu.Unlock()
	s.log.Debug("replica connection open", zap.String("replica", r.addr), zap.Uint32("replica_pid", hj.PID))
	return rc, nil
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
// when the client side waits for a routed request (routeThen), and the
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

// routeThen runs k once the routed request r (sent on the replica) has
// been answered, or the replica connection has ended first: then k's
// retry says the replica failed before anything of the answer reached
// the client, the queue has been cleared and the caller sends the request
// to the primary. On a goroutine it blocks until then; on the loop it
// parks the client side (parkClient), whose end stays unread until then
// (only a reset ends the session meanwhile). Client side only.
func (s *Session) routeThen(r *Request, k func(retry bool) error) error {
	rc := s.rt.rep
	// A failure to write is the reader's to notice: it ends rc.
	_ = s.sw.Flush()
	ended := func() bool { return isClosed(r.Done()) || isClosed(rc.done) }
	answered := func() error {
		retry, err := s.routed(r, rc)
		if err != nil {
			return err
		}
		return k(retry)
	}
	switch {
	case ended():
	case s.onLoop:
		return s.parkClient(ended, answered)
	default:
		select {
		case <-r.Done():
		case <-rc.done:
		case <-s.closing:
			s.rt.waiting.Store(false)
			return errSessionClosing
		}
	}
	return answered()
}

// routed is the outcome of the routed request r, answered or ended with
// its replica connection rc (routeThen).
func (s *Session) routed(r *Request, rc *replicaConn) (retry bool, err error) {
	defer s.rt.waiting.Store(false)
	if isClosed(r.Done()) {
		return false, nil
	}
	// The replica connection ended with r unanswered.
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

// isClosed reports whether ch is closed.
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
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

// replicaText: see gateConn.
func (s *Session) replicaText() (scs, enc string, ok bool) {
	rc := s.rt.rep
	if rc == nil {
		return "", "", false
	}
	rc.textMu.Lock()
	defer rc.textMu.Unlock()
	return rc.scs, rc.enc, true
}

func (s *Session) setReplicaText(scs, enc string) {
	if rc := s.rt.rep; rc != nil {
		rc.textMu.Lock()
		rc.scs, rc.enc = scs, enc
		rc.textMu.Unlock()
	}
}

// replicaReport takes a ParameterStatus of the replica connection rc that
// says how its backend reads text: recorded, never passed on (the
// client's and the gate's view of the session is the primary's). It
// reports whether msg was one.
func replicaReport(rc *replicaConn, msg []byte) bool {
	var ps pgproto3.ParameterStatus
	if err := ps.Decode(msg[headerLen:]); err != nil {
		return false
	}
	switch ps.Name {
	case "standard_conforming_strings":
		rc.textMu.Lock()
		rc.scs = ps.Value
		rc.textMu.Unlock()
	case "client_encoding":
		rc.textMu.Lock()
		rc.enc = ps.Value
		rc.textMu.Unlock()
	default:
		return false
	}
	return true
}
