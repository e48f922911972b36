package proxy

import "time"

// This file holds the end of a session, written once: Session.end orders
// the steps, and a teardown does each step the way its relay must (the
// event loop's pass-through and intercepted relays, in evloop_relay.go
// and evloop_intercept.go; a session refused before it came onto the
// loop, unrelayedEnd, here).

// teardown is what differs, by relay, at the end of a session.
type teardown interface {
	// stop makes whatever still works for the session return: the
	// client side's calls off the loop (offClient), which may be blocked
	// writing the upstream (closeServer ends it).
	stop()
	// wait waits until they have returned and reports an error of
	// theirs to consider with the first (nil if none had one to say).
	wait() error
	// endServer passes on what is still buffered for the upstream, tells
	// the backend to end (Terminate) and closes the upstream socket.
	endServer()
	// flushClient passes on what is still buffered for the client.
	flushClient()
	// tellClient writes msg, why the session ends, to the client,
	// waiting a bounded time for room.
	tellClient(msg []byte)
	// closeClient closes the client's socket(s).
	closeClient()
}

// end ends s once its relay has ended with err (the loop has let go of
// it), and returns what run returns (nil for a clean client exit). The
// order is the rules':
//
//   - closing is closed first, so a Handler waiting on a Request gives up
//     (Session.Closing) rather than keeping its call from returning;
//   - what still works for the session (calls off the loop) is stopped,
//     and waited for, before anything else: from then on nothing else
//     reads or writes the session's buffers and sockets, and its error is
//     known (endReason looks at both: a shutdown seen by either is a
//     shutdown);
//   - the upstream gets what was buffered for it, then Terminate, then
//     the close: a Terminate after the close would be lost, and one
//     before buffered bytes would cut them off. The event loop's
//     pass-through relay does this in endServer, its buffer being the
//     only one left; an intercepted session (and one refused before it
//     came onto the loop) sends Terminate and closes in stop
//     (closeServer, stopServer), as the way to unblock a call off the
//     loop writing the upstream: what it has not written upstream by
//     then is dropped, as a backend being ended would drop it;
//   - the client gets what was buffered for it before the reason, so the
//     error it reads last is why its session ended, and the reason
//     before the close of its socket;
//   - the Handler's Close comes last, after the queue has been drained
//     (every Request's Done is closed), so a Handler sees no request
//     outstanding when it is closed.
func (s *Session) end(t teardown, err error) error {
	close(s.closing)
	// Before stop, whose closeServer is the end's own.
	s.tellLost = upstreamLost(err) && s.mayTellUpstreamLost()
	s.keepServer = s.mayKeepServer(err) // pools.go
	t.stop()
	msg, err := s.endReason(err, t.wait())
	t.endServer()
	t.flushClient()
	if msg != nil {
		t.tellClient(msg)
	}
	t.closeClient()
	if s.h != nil {
		s.q.Drain()
		s.h.Close(s)
	}
	return err
}

// unrelayedEnd is the end of a session that never came onto the loop
// (Session.refuse): nothing relays it, so there is no side to stop or
// wait for, and nothing is buffered but what the writers hold.
type unrelayedEnd struct{ s *Session }

func (e unrelayedEnd) stop() {
	e.s.closeServer()  // Terminate and close: the upstream is done with here
	e.s.closeReplica() // replica.go
}

func (unrelayedEnd) wait() error  { return nil }
func (unrelayedEnd) endServer()   {} // stop has closed it (closeServer)
func (unrelayedEnd) flushClient() {} // dupSockets or bridgeConns flushed it, or the client is gone

func (e unrelayedEnd) tellClient(msg []byte) {
	e.s.client.SetWriteDeadline(time.Now().Add(time.Second))
	e.s.client.Write(msg)
}

func (e unrelayedEnd) closeClient() { e.s.client.Close() }
