package proxy

import (
	"errors"
	"sync"
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
	// Drop; to hold, copy msg, return Drop and send it later from this
	// same goroutine (e.g. in the next ClientMessage call, or after
	// waiting on an injected Request's Done).
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
// to wait (for the answer to an earlier request, or for room on a socket
// it cannot buffer), it returns ErrWait before it has sent or changed
// anything, and the same message is delivered again on a goroutine, where
// it may wait. Session.OnLoop tells which case a call is. The session's
// client messages then stay on that goroutine until the client has
// nothing more to read, and return to the loop.
//
// A Handler that does not implement LoopClient (or returns false) always
// gets ClientMessage on a goroutine.
type LoopClient interface {
	LoopClient() bool
}

// ErrWait is returned by a LoopClient's ClientMessage, called on the
// event loop, that must wait: see LoopClient.
var ErrWait = errors.New("proxy: client message must wait: handle it on a goroutine")

// Request is one outstanding request in a session's queue: a client
// message that produces a response, or an injected one. Responses are
// matched to requests in order, as PgBouncer's outstanding_requests:
//
//	Parse→ParseComplete, Bind→BindComplete, Close→CloseComplete,
//	Describe→(ParameterDescription) RowDescription|NoData,
//	Execute→CommandComplete|EmptyQueryResponse|PortalSuspended (after
//	DataRows / COPY), Query/Sync/FunctionCall→ReadyForQuery.
//
// An ErrorResponse ends an extended-protocol request and makes PostgreSQL
// skip every request up to the next Sync; those are completed with
// Skipped set.
type Request struct {
	Type     byte // the request's message type: Q P B D E C S F
	Injected bool // sent by the Handler; its responses are swallowed
	// Visible marks an injected request whose responses reach the client
	// as a client request's do (subject to the Handler's verdict): the
	// Handler sent the client's own message on its behalf, to tag it or
	// to wait for it.
	Visible bool
	// Tag is free for the Handler (e.g. which gate step this is).
	Tag any

	// Set by the server goroutine before Done is closed.
	Error   []byte // a copy of the ErrorResponse it got, if any
	Skipped bool   // skipped by PostgreSQL after an earlier error

	done chan struct{}
}

// Done is closed when the request's response has been fully received.
// Only injected requests have one; it is nil for client requests.
func (r *Request) Done() <-chan struct{} { return r.done }

// queue is the outstanding-request FIFO. The client goroutine pushes, the
// server goroutine matches and pops.
type queue struct {
	mu   sync.Mutex
	reqs []*Request
	head int
	// skipping: an extended-protocol error was answered before the
	// client goroutine had queued the batch's Sync, so requests pushed
	// until that Sync were written after the failed one and PostgreSQL
	// discards them: they complete at once, skipped.
	skipping bool
}

func (q *queue) push(r *Request) {
	q.mu.Lock()
	if q.skipping {
		if r.Type != 'S' {
			q.mu.Unlock()
			r.Skipped = true
			finish(r)
			return
		}
		q.skipping = false
	}
	if q.head > 0 && q.head == len(q.reqs) {
		q.reqs, q.head = q.reqs[:0], 0
	}
	q.reqs = append(q.reqs, r)
	q.mu.Unlock()
}

func (q *queue) front() *Request {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.head == len(q.reqs) {
		return nil
	}
	return q.reqs[q.head]
}

func (q *queue) pop() {
	q.mu.Lock()
	r := q.reqs[q.head]
	q.reqs[q.head] = nil
	q.head++
	q.mu.Unlock()
	finish(r)
}

// skipToSync completes every request after the head up to (not including)
// the next Sync, as skipped: PostgreSQL discards them after an error.
func (q *queue) skipToSync() {
	q.mu.Lock()
	var skipped []*Request
	for q.head < len(q.reqs) && q.reqs[q.head].Type != 'S' {
		skipped = append(skipped, q.reqs[q.head])
		q.reqs[q.head] = nil
		q.head++
	}
	q.skipping = q.head == len(q.reqs)
	q.mu.Unlock()
	for _, r := range skipped {
		r.Skipped = true
		finish(r)
	}
}

// drain completes everything (session end).
func (q *queue) drain() {
	for q.front() != nil {
		q.front().Skipped = true
		q.pop()
	}
}

func finish(r *Request) {
	if r.done != nil {
		close(r.done)
	}
}

// matchResult says what a server message did to the head request.
type matchResult int

const (
	matchAsync    matchResult = iota // not a response (Notice, Notification, ParameterStatus)
	matchPart                        // part of the head request's response
	matchComplete                    // completes the head request
	matchError                       // ErrorResponse completing an extended request: skip to Sync
)

// match classifies server message type t against the head request type
// (0 when the queue is empty).
func match(head, t byte) matchResult {
	switch t {
	case 'N', 'A', 'S':
		return matchAsync
	}
	switch head {
	case 'Q', 'S', 'F':
		if t == 'Z' {
			return matchComplete
		}
		return matchPart
	case 'P':
		if t == '1' {
			return matchComplete
		}
	case 'B':
		if t == '2' {
			return matchComplete
		}
	case 'C':
		if t == '3' {
			return matchComplete
		}
	case 'D':
		if t == 'T' || t == 'n' {
			return matchComplete
		}
	case 'E':
		if t == 'C' || t == 'I' || t == 's' {
			return matchComplete
		}
	case 0:
		return matchAsync
	}
	if t == 'E' {
		return matchError
	}
	return matchPart
}
