package wire

import "sync"

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

// NewInjected returns an injected request of type typ (see Request),
// which has a Done channel.
func NewInjected(typ byte, tag any, visible bool) *Request {
	return &Request{Type: typ, Injected: true, Visible: visible, Tag: tag, done: make(chan struct{})}
}

// Done is closed when the request's response has been fully received.
// Only injected requests have one; it is nil for client requests.
func (r *Request) Done() <-chan struct{} { return r.done }

// Queue is the outstanding-request FIFO. The client side pushes, the
// server side matches and pops; it is safe for the two to run at once.
type Queue struct {
	mu   sync.Mutex
	reqs []*Request
	head int
	// skipping: an extended-protocol error was answered before the
	// client side had queued the batch's Sync, so requests pushed until
	// that Sync were written after the failed one and PostgreSQL discards
	// them: they complete at once, skipped.
	skipping bool
}

// Push queues r, sent upstream.
func (q *Queue) Push(r *Request) {
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
	switch {
	case q.head > 0 && q.head == len(q.reqs):
		q.reqs, q.head = q.reqs[:0], 0
	case q.head >= 1024 && q.head*2 >= len(q.reqs):
		// Never empty (a client pipelining without pause): move what is
		// outstanding down, so that the array does not grow for ever.
		n := copy(q.reqs, q.reqs[q.head:])
		clear(q.reqs[n:])
		q.reqs, q.head = q.reqs[:n], 0
	}
	q.reqs = append(q.reqs, r)
	q.mu.Unlock()
}

// Len is the number of requests outstanding.
func (q *Queue) Len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.reqs) - q.head
}

// Front returns the request whose responses are arriving, nil when none
// is outstanding.
func (q *Queue) Front() *Request {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.head == len(q.reqs) {
		return nil
	}
	return q.reqs[q.head]
}

// Pop completes the front request.
func (q *Queue) Pop() {
	q.mu.Lock()
	r := q.reqs[q.head]
	q.reqs[q.head] = nil
	q.head++
	q.mu.Unlock()
	finish(r)
}

// skipToSync completes every request after the head up to (not including)
// the next Sync, as skipped: PostgreSQL discards them after an error.
func (q *Queue) skipToSync() {
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

// Drain completes everything, as skipped (the session's end).
func (q *Queue) Drain() {
	for q.Front() != nil {
		q.Front().Skipped = true
		q.Pop()
	}
}

func finish(r *Request) {
	if r.done != nil {
		close(r.done)
	}
}

// Match says what a server message does to the request at the front.
type Match int

const (
	Async    Match = iota // not a response (Notice, Notification, ParameterStatus), or nothing is queued
	Part                  // part of the front request's response
	Complete              // completes the front request
	Failed                // an ErrorResponse completing an extended request: PostgreSQL skips to the Sync
)

// Answering returns the request a server message of type t answers (nil
// for one that answers none: Async) and what it does to it. The caller
// hands the message on, then calls Advance with the Match.
func (q *Queue) Answering(t byte) (*Request, Match) {
	head := q.Front()
	var ht byte
	if head != nil {
		ht = head.Type
	}
	m := match(ht, t)
	if m == Async {
		return nil, m
	}
	return head, m
}

// Advance completes what a server message matched m (Answering)
// completed: the front request, and after an extended-protocol error the
// requests PostgreSQL skips up to the next Sync.
func (q *Queue) Advance(m Match) {
	switch m {
	case Complete:
		q.Pop()
	case Failed:
		q.Pop()
		q.skipToSync()
	}
}

// match classifies server message type t against the head request type
// (0 when the queue is empty).
func match(head, t byte) Match {
	switch t {
	case 'N', 'A', 'S':
		return Async
	}
	switch head {
	case 'Q', 'S', 'F':
		if t == 'Z' {
			return Complete
		}
		return Part
	case 'P':
		if t == '1' {
			return Complete
		}
	case 'B':
		if t == '2' {
			return Complete
		}
	case 'C':
		if t == '3' {
			return Complete
		}
	case 'D':
		if t == 'T' || t == 'n' {
			return Complete
		}
	case 'E':
		if t == 'C' || t == 'I' || t == 's' {
			return Complete
		}
	case 0:
		return Async
	}
	if t == 'E' {
		return Failed
	}
	return Part
}
