package proxy

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgfence/pgfence/internal/wire"
	"go.uber.org/zap"
)

var errClientTerminate = errors.New("client sent Terminate")
var errShutdown = errors.New("server shutting down")

// Session is one client connection and its upstream connection. Its
// exported methods are for Handlers (see Interceptor); each documents the
// goroutine it may be called on.
type Session struct {
	srv *Server
	log *zap.Logger

	User       string
	Database   string
	ClientAddr net.Addr
	// Params are the client's startup parameters (user and database
	// included). Read-only.
	Params map[string]string

	// The upstream connection: its socket, framer, BackendPID,
	// ServerParams and transaction status (backend.go).
	backend

	client net.Conn
	cf     wire.Framer   // client → proxy
	cw     *clientWriter // locks when a replica connection may write too (replica.go)
	sw     *bufio.Writer // the upstream requests go to: the primary, or the replica (replica.go)

	h       Handler
	q       wire.Queue
	scratch []byte // a large CopyData's piece, header and body (evloop_client.go: streamSteps)

	// proof is what the client proved at login, presented upstream for
	// its role (the replica connections are opened with it too).
	proof *Proof
	// oversized is set once the client side has answered a message over
	// MaxMessageSize with a substitute: the server side then turns the
	// substitute's error into the proxy's 54000 (oversizedError).
	oversized atomic.Bool

	cancelPID    uint32 // the upstream backend's PID
	cancelSecret uint32 // the proxy's own secret given with it
	// onLoop: the Handler's ClientMessage is running on the event loop,
	// where it must not block (see LoopClient). offLoop counts the
	// ClientMessage calls that ran elsewhere, on a goroutine (for
	// observation: tests).
	onLoop  bool
	offLoop atomic.Int64
	// blocking: the Handler is not a LoopClient, so its ClientMessage
	// may block; on the event loop it runs off it (deliverOff).
	blocking bool

	// connMu orders closeServer (graceful shutdown runs it from another
	// goroutine) against itself and against moving the session onto the
	// event loop.
	connMu    sync.Mutex
	loopRelay *relay // set when the event loop relays the session (evloop.go)
	// answersHeld: the loop holds as many answers for the client as it
	// takes before it stops reading the server (evloop_intercept.go):
	// the server waits for the client, not the other way round. For the
	// gate's idle watchdog (fence_idle.go).
	answersHeld atomic.Bool
	// closing is closed when the session starts to end, so a Handler
	// waiting on a Request can give up.
	closing chan struct{}

	rt sessionRoute // read routing: the replica connection (replica.go)

	// Server reuse (pools.go). upKey is the backend's real cancel key,
	// born when it was opened, sig the client's startup signature, warm
	// whether it came parked. keepServer: the session's end may leave the
	// backend open for the next client (Session.end decides it before
	// the teardown); kept: it did, keptFD being its socket, now the
	// session goroutine's to park (Server.park).
	upKey      []byte
	born       time.Time
	sig        string
	warm       bool
	keepServer bool
	kept       bool
	keptFD     int

	info sessionInfo // admin console: connected_at, upstream (admin.go)
}

// TxStatus returns the transaction status of the last ReadyForQuery: 'I'
// idle, 'T' in a transaction, 'E' in a failed transaction. Any goroutine.
func (s *Session) TxStatus() byte { return s.st.Tx() }

// OnLoop reports whether the current ClientMessage call runs on the event
// loop, where it must not block: a Handler that would wait returns
// ErrWait instead (see LoopClient). Client side only.
func (s *Session) OnLoop() bool { return s.onLoop }

// Closing is closed when the session starts to end (the client or the
// server gone, the console's KILL, Shutdown). A Handler that blocks (one
// that is not a LoopClient: see LoopClient) must wait on it too, whatever
// else it waits for, a Request's Done included: the session's end waits
// for a ClientMessage in progress to return before it drains the queue,
// which is what closes the Done of a Request never answered. Any
// goroutine.
func (s *Session) Closing() <-chan struct{} { return s.closing }

// Logger returns the session's logger (with client, user and database).
func (s *Session) Logger() *zap.Logger { return s.log }

// ForwardMessage sends a client-format message upstream as if the client
// had sent it (it joins the outstanding queue as a client request, whose
// responses reach the client). Client goroutine only (inside
// ClientMessage).
func (s *Session) ForwardMessage(msg []byte) error {
	if !s.account(msg[0]) {
		return errShutdown
	}
	if wire.ProducesResponse(msg[0]) {
		s.q.Push(&Request{Type: msg[0]})
	}
	_, err := s.sw.Write(msg)
	return err
}

// ForwardIgnored passes msg upstream as it is, awaiting no answer: a
// message PostgreSQL reads and ignores where it is (a Sync during a
// simple query's COPY data). Client goroutine only.
func (s *Session) ForwardIgnored(msg []byte) error {
	if !s.account(msg[0]) {
		return errShutdown
	}
	_, err := s.sw.Write(msg)
	return err
}

// Inject sends a message upstream on the proxy's own behalf; its responses
// are matched by the queue and swallowed, delivered to the Handler's
// ServerMessage with the returned Request. For a message type without a
// response (Flush) the Request is nil. Client goroutine only. The message
// is buffered: call FlushServer before waiting on Done.
func (s *Session) Inject(msg []byte, tag any) (*Request, error) {
	return s.inject(msg, tag, false) // inject.go
}

// FlushServer flushes messages buffered for the upstream. Client goroutine
// only.
func (s *Session) FlushServer() error { return s.sw.Flush() }

// WriteClient sends a message to the client. Server goroutine only (inside
// ServerMessage); it is flushed with the forwarded traffic.
func (s *Session) WriteClient(msg []byte) error {
	_, err := s.cw.Write(msg)
	return err
}

// account tracks requests sent upstream whose ReadyForQuery is due, for
// graceful shutdown; every message written upstream passes here. It reports
// false when the session has been closed for shutdown.
func (s *Session) account(t byte) bool { return s.st.Sent(t) }

// tryCloseIdle closes the session for shutdown if it is idle: not in a
// transaction and nothing in flight (wire.Status.CloseIdle).
func (s *Session) tryCloseIdle() bool { return s.st.CloseIdle() }

// ready records a ReadyForQuery from upstream with status tx, on every
// path (the goroutines, the event loop, the replica reader): the status,
// the count in flight, PAUSE's hook. It reports true when graceful
// shutdown has closed the session, idle now: the caller ends it.
func (s *Session) ready(tx byte) bool {
	n := s.st.Ready(tx)
	s.readyForQuery(n) // admin_pause.go
	return n == 0 && s.srv.draining.Load() && s.tryCloseIdle()
}

// run relays s on its Server's event loop l until either side ends, then
// closes both connections. It returns the error that ended the session
// (nil for a clean client exit). A session the loop cannot take (the
// loop, a bridge or a duplicate socket cannot be had: the proxy is out
// of descriptors or memory) is refused with 53000 rather than relayed
// some other way: there is one relay engine (evloop.go).
func (s *Session) run(l *evloop) error {
	br, err := s.bridgeConns() // evloop_bridge.go
	if err != nil {
		return s.refuse(err)
	}
	if s.h != nil {
		err = s.runIntercepted(l) // evloop_intercept.go
	} else {
		err = s.runPassThrough(l) // evloop_relay.go
	}
	br.wait() // the client has what the session sent it
	return err
}

// refuse ends s, which could not come onto the loop because of err, and
// tells the client why (relayRefusal).
func (s *Session) refuse(err error) error {
	if err = relayRefusal(err); !errors.Is(err, errShutdown) {
		s.log.Error("cannot relay the session on the event loop", zap.Error(err))
	}
	return s.end(unrelayedEnd{s}, err)
}

// relayRefusal is what a client is told when its session cannot come
// onto the event loop because of err: 57P01 (errShutdown) when the
// server is shutting down, else 53000 (insufficient_resources), as
// PostgreSQL says when it cannot start a backend for want of resources.
// No other engine relays it instead: there is one.
func relayRefusal(err error) error {
	if errors.Is(err, errShutdown) || errors.Is(err, errLoopStopped) {
		return &ProtocolError{Code: "57P01", Msg: "terminating connection: pgfence is shutting down", Err: errShutdown}
	}
	return &ProtocolError{Code: "53000", Msg: "pgfence cannot relay this session",
		Hint: "the proxy may be out of file descriptors (raise its ulimit -n) or memory; its log says which", Err: err}
}

// endReason turns the error that ended the session (and the other side's,
// if any) into what the client is told (nil: nothing) and what run
// returns (nil for a clean client exit).
func (s *Session) endReason(err, second error) ([]byte, error) {
	if pe := s.killedReason(); pe != nil {
		err = pe // the admin console ended it (admin_pause.go)
	} else if errors.Is(err, errShutdown) || errors.Is(second, errShutdown) || s.st.Closed() {
		err = errShutdown
	} else if pe := s.rt.fatal.Load(); pe != nil {
		err = pe // the replica failed mid-request (replica.go)
	} else if s.tellLost {
		err = &ProtocolError{Code: "08006", Msg: upstreamLostMsg, Hint: upstreamLostHint, Err: err}
	}
	var msg []byte
	var pe *ProtocolError
	if errors.As(err, &pe) || err == errShutdown {
		if err == errShutdown {
			err = &ProtocolError{Code: "57P01", Msg: "terminating connection: pgfence is shutting down", Err: errShutdown}
		}
		msg = encode(nil, errorResponse(err))
	}
	if errors.Is(err, errClientTerminate) || errors.Is(err, io.EOF) {
		return msg, nil
	}
	return msg, err
}

// The client's words when its upstream connection ends under it: the
// server was stopped or crashed, or the primary failed over (a session is
// not moved to the new primary: its transaction and session state were
// the old server's). What an open transaction did is lost, as PostgreSQL's
// own failover loses it; a COMMIT sent and not answered may or may not
// have committed there, and a retry under the same generation and step
// learns which (docs/failover.md).
const (
	upstreamLostMsg  = "pgfence: the connection to PostgreSQL was lost (the server ended, or the primary failed over); this session has ended"
	upstreamLostHint = "reconnect: a new session goes to the server the primary DSN finds now. A transaction that was open is lost unless its COMMIT was answered; retry one whose COMMIT went unanswered under the same fence generation and step: a commit that survived is answered as a replay (FN00R), one issued before a failover that lost it is refused (FN015)"
)

// upstreamLost reports whether err, what ended a session's relay, is its
// upstream connection's end or failure (every relay names that side
// "server: ..."), rather than the client's or the proxy's doing.
func upstreamLost(err error) bool {
	var pe *ProtocolError
	return err != nil && !errors.As(err, &pe) && strings.HasPrefix(err.Error(), "server: ")
}

// mayTellUpstreamLost reports whether the client may be told that the
// upstream connection was lost: only an intercepted session's, whose
// every primary message the proxy frames, and only when the last one was
// whole and not an ErrorResponse (a backend that ends a session says why
// itself, FATAL, as the last thing it sends), and not when the proxy
// closed it (Shutdown, the console, the watchdog: they say why, or, for a
// busy session closed by Shutdown, nothing). A pass-through relay does
// not look at each message, and a message of the proxy's own after part
// of one would be read as its rest: there the closed socket says it).
func (s *Session) mayTellUpstreamLost() bool {
	s.connMu.Lock()
	r, stopped := s.loopRelay, s.serverStopped
	s.connMu.Unlock()
	return !stopped && r != nil && r.intercept != nil && r.intercept.big.left == 0 && s.lastServerType != 'E'
}

// closeServer tells the backend to end (Terminate), then closes the
// upstream socket. Closing is what matters: a backend whose client socket
// is gone rolls back and exits.
func (s *Session) closeServer() {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	s.serverStopped = true // the end is the proxy's doing (mayTellUpstreamLost)
	if s.loopRelay != nil {
		s.loopRelay.stopServer() // evloop.go
		return
	}
	if s.serverClosed {
		return
	}
	s.serverClosed = true
	// A session the proxy ends (endWith) is not told Terminate: in COPY
	// IN the backend answers it with an error (08P01, unexpected message
	// during COPY) that could reach the client ahead of the proxy's own
	// reason. Closing is enough.
	if s.rt.fatal.Load() == nil {
		s.server.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
		s.server.Write(wire.Terminate)
	}
	s.server.Close()
}

// guard turns a panic into an error, so one bad session never takes the
// proxy down.
func (s *Session) guard(side string, f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			s.log.Error("panic in session", zap.String("side", side), zap.Any("panic", r), zap.ByteString("stack", debug.Stack()))
			err = fmt.Errorf("%s loop panic: %v", side, r)
		}
	}()
	return f()
}

// nextClient reads the header of the client's next message, checked as
// a client's (wire.Framer.Client). errWouldBlock (the event loop's reader
// has nothing more) is returned as is. A message over MaxMessageSize is
// returned (its caller answers it, see oversize) when it is one of the
// types PostgreSQL answers with an error and goes on; another one is a
// protocol error.
func (s *Session) nextClient() (typ byte, total int, err error) {
	typ, total, err = s.cf.Next()
	switch {
	case err == errWouldBlock:
		return 0, 0, err
	case err != nil:
		return 0, 0, fmt.Errorf("client: %w", err)
	}
	return typ, total, nil
}

// interceptClient gives the client's next message, of total bytes,
// whole in the client framer's buffer (clientSteps has grown the buffer
// to hold it, within the memory budget: growClient), to the Handler.
func (s *Session) interceptClient(total int) error {
	msg, err := s.cf.Whole(total)
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	if err := s.deliver(msg); err != nil {
		return err // the message stays unconsumed (ErrWait: handled again; errParked: consumed when its continuation is done)
	}
	s.cf.Discard(total)
	return nil
}

// deliver passes a whole client message to the Handler and forwards it
// if the Handler says so.
func (s *Session) deliver(msg []byte) error {
	if s.onLoop && s.blocking {
		return s.deliverOff(msg) // evloop_client.go
	}
	if !s.onLoop {
		s.offLoop.Add(1)
	}
	v, err := s.h.ClientMessage(s, msg)
	if err != nil {
		return err
	}
	if v == Forward {
		if msg[0] == 'X' && s.srv.live().serverReuse {
			// The session's end tells the backend to end (closeServer),
			// or parks it for the next client (pools.go).
			return nil
		}
		if !s.account(msg[0]) {
			return errShutdown
		}
		if wire.ProducesResponse(msg[0]) {
			s.q.Push(&Request{Type: msg[0]})
		}
		if _, err := s.sw.Write(msg); err != nil {
			return fmt.Errorf("server: %w", err)
		}
	}
	return nil
}

// serverMessage forwards one server message of an intercepted session to
// the client through its Handler. The server socket is the loop's,
// non-blocking: it returns errWouldBlock, having consumed nothing, when
// the message has not arrived whole, and a message larger than the
// buffer is passed on (or dropped) in pieces as they come, tracked in
// big.
func (s *Session) serverMessage(big *bigMessage) error { return s.upstreamMessage(&s.sf, nil, big) }

// upstreamMessage is serverMessage for the upstream sf frames: the
// primary's (rc nil) or the replica connection rc's, whose messages
// follow the replica's rules as well: those that answer
// nothing of the session's are dropped (replicaDrop), forwarding one sets
// rc.forwarded, and a failure is the replica's (replicaFailed,
// failReplica) before it is returned.
func (s *Session) upstreamMessage(sf *wire.Framer, rc *replicaConn, big *bigMessage) error {
	if big.left > 0 {
		return s.serverPiece(sf, rc, big)
	}
	size := sf.R.Size()
	typ, total, err := sf.Next()
	if err != nil {
		if err == errWouldBlock {
			return err
		}
		s.cw.Flush()
		return s.upstreamFailed(rc, fmt.Errorf("%s: %w", sf.From, err))
	}
	if rc == nil {
		s.lastServerType = typ // mayTellUpstreamLost
	}
	if total > size {
		h, _ := sf.Whole(headerLen) // next has read it
		fwd := false
		if rc == nil || s.replicaAnswers() {
			if fwd, err = s.interceptServer(h); err != nil {
				return s.handlerFailed(rc, err)
			}
		}
		if err := s.forward(rc, h, fwd); err != nil {
			return err
		}
		sf.Discard(headerLen)
		big.left, big.fwd = total-headerLen, fwd
		return s.serverPiece(sf, rc, big)
	}
	msg, err := sf.Whole(total)
	if err != nil {
		if err == errWouldBlock {
			return err
		}
		return s.upstreamFailed(rc, fmt.Errorf("%s: %w", sf.From, err))
	}
	if typ == 'E' && s.oversized.Load() {
		msg = s.srv.oversizedError(msg)
	}
	if rc != nil && typ == 'S' && replicaReport(rc, msg) {
		sf.Discard(total)
		return nil
	}
	if rc != nil && s.replicaDrop(rc, typ, msg) {
		sf.Discard(total)
		return nil
	}
	fwd, err := s.interceptServer(msg)
	if err != nil {
		return s.handlerFailed(rc, err)
	}
	if err := s.forward(rc, msg, fwd); err != nil {
		return err
	}
	if tx, ok := wire.ReadyStatus(msg); ok {
		sf.Discard(total)
		if s.ready(tx) {
			s.cw.Flush()
			if rc != nil {
				s.closeServer() // the session ends with its primary
			}
			return errShutdown
		}
		return nil
	}
	sf.Discard(total)
	return nil
}

// forward writes msg, an upstream's message (or a large one's header),
// to the client when the Handler let it through (fwd); one of the replica
// connection rc's marks that its answer has begun to reach the client.
func (s *Session) forward(rc *replicaConn, msg []byte, fwd bool) error {
	if !fwd {
		return nil
	}
	if rc != nil {
		rc.forwarded.Store(true)
	}
	if _, err := s.cw.Write(msg); err != nil {
		return fmt.Errorf("client: %w", err)
	}
	return nil
}

// bigMessage is the part of a large server message (larger than the
// buffer) still to be passed on by the event loop.
type bigMessage struct {
	left int
	fwd  bool // false: dropped (a response to an injected request)
}

// serverPiece passes on (or drops) what has arrived of big's message
// from the upstream sf frames (rc's, when not nil).
func (s *Session) serverPiece(sf *wire.Framer, rc *replicaConn, big *bigMessage) error {
	for big.left > 0 {
		b, err := sf.Piece(big.left)
		if err != nil {
			if err == errWouldBlock {
				return err
			}
			return s.upstreamFailed(rc, fmt.Errorf("%s: %w", sf.From, err))
		}
		if big.fwd {
			if _, err := s.cw.Write(b); err != nil {
				return fmt.Errorf("client: %w", err)
			}
		}
		sf.Discard(len(b))
		big.left -= len(b)
	}
	return nil
}

// errWouldBlock is what the event loop's non-blocking server reader
// returns when nothing more has arrived.
var errWouldBlock = errors.New("would block")

// interceptServer matches msg against the outstanding queue and asks the
// handler; it reports whether to forward msg.
func (s *Session) interceptServer(msg []byte) (bool, error) {
	req, m := s.q.Answering(msg[0])
	if req != nil && msg[0] == 'E' && req.Injected && len(msg) >= headerLen {
		req.Error = append([]byte(nil), msg...)
	}
	v, err := s.h.ServerMessage(s, msg, req)
	if err != nil {
		return false, err
	}
	fwd := v == Forward && (req == nil || !req.Injected || req.Visible)
	s.q.Advance(m)
	return fwd, nil
}

// MessageLen returns the length field of a message header.
func MessageLen(msg []byte) uint32 { return binary.BigEndian.Uint32(msg[1:5]) }
