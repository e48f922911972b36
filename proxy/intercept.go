package proxy

import (
	"errors"

	"github.com/pgfence/pgfence/internal/wire"
)

// Verdict is what an Interceptor decides for one message.
type Verdict int

const (
	// Forward passes the message on unchanged.
	Forward Verdict = iota
	// Drop does not pass the message on. The handler has held it (copied
	// it to send later), replaced it (sent something else through the
	// Session) or answered it itself.
	Drop
)

// Interceptor is the seam through which the write gate acts on sessions.
// With Config.Interceptor nil the wire loop is pure pass-through and never
// calls into it.
type Interceptor interface {
	// Open is called once per session, after the upstream connection is
	// ready and before the client's first message. A nil Handler leaves
	// the session in pass-through.
	Open(s *Session) (Handler, error)
}

// Handler sees one session's messages. ClientMessage calls never overlap
// each other, nor do ServerMessage calls, but the two sides may run
// concurrently (on the event loop, the server side runs on the loop's
// thread; so may the client side, see LoopClient), so state shared
// between them needs synchronisation. A returned error ends
// the session (ProtocolError and pgconn.PgError values are reported to the
// client).
type Handler interface {
	// ClientMessage is called for every client message, whole (type,
	// length, body), before it is forwarded. msg is only valid during the
	// call: copy what you keep. To inject, call s.Inject before returning
	// Forward; to replace, call s.Inject or s.ForwardMessage and return
	// Drop; to hold, copy msg, return Drop and send it later from a
	// ClientMessage call (this one, after waiting on an injected
	// Request's Done, or the next).
	ClientMessage(s *Session, msg []byte) (Verdict, error)

	// ServerMessage is called for every server message. req is the
	// outstanding request it answers (nil for asynchronous messages:
	// NoticeResponse, NotificationResponse, ParameterStatus, and for
	// messages with no request queued). Responses to injected requests are
	// never forwarded whatever the verdict. msg is only valid during the
	// call; for a message larger than Config.BufferSize it holds only the
	// 5-byte header (len(msg) < int(MessageLen(msg))+1) and the body is
	// streamed to the client after the call. s.WriteClient may be used to
	// send synthetic messages to the client here.
	ServerMessage(s *Session, msg []byte, req *Request) (Verdict, error)

	// Close is called once when the session ends.
	Close(s *Session)
}

// LoopClient is implemented by a Handler whose ClientMessage may run on
// the event loop. There it must not block: when handling a message needs
// to wait for the answer to an earlier request, it returns ErrWait before
// it has sent or changed anything, and the loop delivers the same
// message again, on its own thread, once the oldest request outstanding
// then has been answered. Session.OnLoop tells whether a call runs on the
// loop. (The write gate, in this package, parks instead: it names what it
// waits for and the rest of its work, which the loop runs when it has
// happened.) Meanwhile the loop does not read the client: its bytes wait,
// in order.
//
// A Handler that does not implement LoopClient (or returns false) gets
// ClientMessage off the event loop's thread, where it may block, and
// Session.OnLoop reports false. That is a goroutine started for each
// message: calls never overlap, each starts after the
// previous one has returned (and sees what it did), and while one runs the
// session's client is not read, so its messages keep their order; the
// server side goes on meanwhile. The session's end waits for a call in
// progress (its upstream closed first, so a write there fails), so a
// call that blocks must also wait on Session.Closing, which the end
// closes first. Every call costs a
// goroutine's start and a wake-up of the loop; a Handler that never
// blocks is cheaper as a LoopClient.
type LoopClient interface {
	LoopClient() bool
}

// ErrWait is returned by a LoopClient's ClientMessage, called on the
// event loop, that must wait: see LoopClient.
var ErrWait = errors.New("proxy: client message must wait: handle it again later")

// Request is one outstanding request in a session's queue: a client
// message that produces a response, or an injected one (wire.Request,
// which says how responses are matched to it).
type Request = wire.Request
