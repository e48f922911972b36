package proxy

import (
	"errors"

	"github.com/pgfence/pgfence/internal/wire"
	"go.uber.org/zap"
)

// gateConn is the whole of what the write gate (Fence's Handler,
// fence_*.go and route.go) uses of its Session: the gate's code takes a
// gateConn, not a *Session, so the compiler holds it to this surface.
// *Session implements it.
//
// It is an unexported interface rather than more exported Session
// methods: its first part is the Handler API any Interceptor has (the
// exported methods, documented on Session); the rest is what only the
// gate needs and the proxy does not promise to other Handlers — visible
// injection and the head of the request queue, the session's in-flight
// state for the idle watchdog, ending the session with an error, and read
// routing's switch between the primary and the replica connection, whose
// replica type is internal. A Handler outside this package gets the
// first part; one inside it that routes reads (ReadRouter) gets it all.
type gateConn interface {
	// The Handler API (session.go).
	Inject(msg []byte, tag any) (*Request, error)
	ForwardMessage(msg []byte) error
	FlushServer() error
	WriteClient(msg []byte) error
	OnLoop() bool
	TxStatus() byte
	Logger() *zap.Logger

	// Sending and matching (client side: inject; server side: head).
	inject(msg []byte, tag any, visible bool) (*Request, error)
	head() *Request
	// ending is closed when the session starts to end: a wait gives up.
	ending() <-chan struct{}
	// parkClient, on the event loop (OnLoop), parks the client side until
	// ready reports true, then runs k on the loop's thread (k nil: the
	// message is handled again); it returns ErrWait for k nil, else
	// errParked, for ClientMessage to return (evloop_intercept.go).
	parkClient(ready func() bool, k func() error) error

	// Who the session is, for the gate's log lines: the id the client
	// was given (BackendKeyData's process id), and the backend's pid.
	sessionID() uint32
	backendPID() uint32
	// clientHoldsUp: the server waits for the client to take its answers
	// (Session.answersHeld).
	clientHoldsUp() bool

	// For the idle watchdog (any goroutine): requests whose
	// ReadyForQuery has not arrived, and whether the server is working on
	// one (the queue is not empty).
	inFlight() int64
	outstanding() bool
	// endWith ends the session: the client is told pe (unless the
	// session already has a reason to end), and the upstream connection
	// is closed, so PostgreSQL rolls its transaction back.
	endWith(pe *ProtocolError)

	// Read routing (replica.go; client side).
	readRouter() *replicas // nil: read routing is off
	OnReplica() bool
	// replicaInUse is the replica the session's replica connection is
	// to, while that replica is healthy; else nil.
	replicaInUse() *replica
	// replicaOpen is the replica the session's replica connection is to,
	// healthy or not; nil when it has none.
	replicaOpen() *replica
	// useReplica and routeThen run their continuation once done, on the
	// loop after a park (replica.go); offClient runs a blocking call off
	// the loop, the client side parked meanwhile.
	useReplica(r *replica, k func(error) error) error
	usePrimary() error
	// startRouted marks that the client side is about to wait for a
	// routed request (routeThen may retry it on the primary); fresh: it
	// is the client's, so none of its answer has reached the client yet.
	// stopRouted undoes it when the request could not be sent.
	startRouted(fresh bool)
	stopRouted()
	routeThen(r *Request, k func(retry bool) error) error
	offClient(f func() error, k func(error) error, drop func(), detached bool) error
	// replicaText is what the replica connection's backend last reported
	// (or was last set to) of standard_conforming_strings and
	// client_encoding; ok is false without a replica connection.
	// setReplicaText records a change the client side sends it.
	replicaText() (scs, enc string, ok bool)
	// replicaDefaults is what the replica connection took from the role's
	// and database's defaults when it opened; ok is false without one.
	replicaDefaults() (defaults string, ok bool)
	// dropReplica closes the replica connection (not in use): the next
	// routed read opens a new one.
	dropReplica()
	setReplicaText(scs, enc string)
}

var _ gateConn = (*Session)(nil)

// errSessionClosing ends a Handler's wait when its session is ending.
// errParked is what a LoopClient's ClientMessage returns on the loop when
// it has parked the client side with the rest of its work (parkClient).
var (
	errSessionClosing = errors.New("session closing")
	errParked         = errors.New("client side parked until an answer arrives")
)

// inject sends msg upstream like Inject; with visible its responses reach
// the client as those of a client request do. Client goroutine only.
func (s *Session) inject(msg []byte, tag any, visible bool) (*Request, error) {
	if !s.account(msg[0]) {
		return nil, errShutdown
	}
	var r *Request
	if wire.ProducesResponse(msg[0]) {
		r = wire.NewInjected(msg[0], tag, visible)
		s.q.Push(r)
	}
	if _, err := s.sw.Write(msg); err != nil {
		return nil, err
	}
	return r, nil
}

// head is the request whose responses are arriving. Server goroutine only.
func (s *Session) head() *Request { return s.q.Front() }

func (s *Session) ending() <-chan struct{} { return s.closing }

func (s *Session) sessionID() uint32   { return s.cancelPID }
func (s *Session) backendPID() uint32  { return s.BackendPID }
func (s *Session) clientHoldsUp() bool { return s.answersHeld.Load() }

func (s *Session) inFlight() int64   { return s.st.Pending() }
func (s *Session) outstanding() bool { return s.q.Front() != nil }

func (s *Session) endWith(pe *ProtocolError) {
	s.rt.fatal.CompareAndSwap(nil, pe)
	s.closeServer()
}

func (s *Session) readRouter() *replicas { return s.srv.rs }

func (s *Session) replicaInUse() *replica {
	if rc := s.rt.rep; rc != nil && rc.r.healthy.Load() {
		return rc.r
	}
	return nil
}

func (s *Session) replicaOpen() *replica {
	if rc := s.rt.rep; rc != nil {
		return rc.r
	}
	return nil
}

func (s *Session) startRouted(fresh bool) {
	if fresh {
		s.rt.rep.forwarded.Store(false)
	}
	s.rt.waiting.Store(true)
}

func (s *Session) stopRouted() { s.rt.waiting.Store(false) }
