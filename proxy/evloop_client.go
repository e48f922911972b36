package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/pgfence/pgfence/internal/wire"
)

// This file holds the client side of an intercepted session on the loop
// (evloop_intercept.go): reading and handling the client's messages
// (clientInline, clientSteps), the park of the client side where the
// Handler waits and its resumption (parkClient, resumeClient), the
// blocking calls it makes off the loop meanwhile (offClient, deliverOff),
// and messages larger than the buffer, read as they arrive (growClient,
// streamSteps).

// clientPark is what a parked client side waits for (ready) and what it
// does then (k; nil: handle the message again). mid: k is in the middle
// of a message passed on in pieces (clientStream), which is not done
// when k is.
type clientPark struct {
	ready func() bool
	k     func() error
	mid   bool
}

// offCall is a blocking call of the client side that runs on a goroutine
// of its own while the client side is parked (offClient). Its fields are
// the loop thread's: f's error reaches it in the task the goroutine posts
// there when f has returned.
type offCall struct {
	f    func() error
	drop func() // undoes what f did when the session has ended before k could run
	// detached: f uses nothing of the session's (a dial, a replica's
	// poll): the session's end does not wait for it.
	detached bool
	err      error
	done     bool // f has returned: the park is over
}

// parkOff parks the client side of a session on the loop while f runs on
// a goroutine, and runs k with f's error on the loop thread once it has
// returned (see offClient). The goroutine starts once the client side has
// stopped (clientStopped), so that it never runs beside it.
func (s *Session) parkOff(f func() error, k func(error) error, drop func(), detached bool) error {
	c := &offCall{f: f, drop: drop, detached: detached}
	ic := s.loopRelay.intercept
	ic.off = c
	ic.park = &clientPark{ready: func() bool { return c.done }, k: func() error { return k(c.err) }}
	return errParked
}

// startOff runs the blocking call c on a goroutine of its own; its end
// is posted to the loop thread, which resumes the client side there
// (resumeClient), or, if the session has left the loop meanwhile, drops
// what f did. Loop thread, with the client side parked on c.
func (l *evloop) startOff(r *relay, c *offCall) {
	ic := r.intercept
	ic.offCalls.Add(1)
	if !c.detached {
		ic.offs.Add(1)
	}
	go func() {
		err := r.s.guard("client", c.f)
		if !c.detached {
			ic.offs.Done()
		}
		l.tasks.post(func() {
			if !l.owns(r) {
				if c.drop != nil {
					c.drop()
				}
				return
			}
			c.err, c.done = err, true
			l.onLoopThread(r, func() error {
				if err := r.s.guard("client", func() error { return l.resumeClient(r) }); err != nil {
					return err
				}
				return l.interceptInterest(r)
			})
		})
	}()
}

// deliverOff passes msg to a Handler that is not a LoopClient (its
// ClientMessage may block) off the loop (offClient), parking the client
// side meanwhile. Its messages keep their order: the client is not read
// until it has returned. Loop thread (Session.deliver).
func (s *Session) deliverOff(msg []byte) error {
	return s.parkOff(func() error { return s.deliver(msg) }, func(err error) error {
		if err == nil && msg[0] == 'X' {
			s.sw.Flush()
			return errClientTerminate
		}
		return err
	}, nil, false)
}

// clientStream is a client message the loop passes on in pieces as they
// arrive (left bytes to go; total is 0 when there is none: a stream
// whose last piece is with the Handler off the loop has none left): a CopyData larger than the buffer, each piece
// to the Handler (as Session.copyPieces), or one over MaxMessageSize
// (over), dropped and then answered (Session.oversize), or a message the
// memory budget cannot hold (overBudget), dropped and then the end.
type clientStream struct {
	typ                         byte
	total, left                 int
	over, overBudget, overShare bool
}

// clientInline handles the client messages that have arrived on the loop
// (a LoopClient Handler), until the client has no more, the server has
// no room for more, or the client side parks. A parked client side is
// left alone: resumeClient goes on with it (a wake-up of PAUSE may come
// meanwhile, one for each time the loop met its held message).
func (l *evloop) clientInline(r *relay) error {
	if r.intercept.park != nil {
		return nil
	}
	s := r.s
	s.onLoop = true
	err := func() error {
		defer func() { s.onLoop = false }() // a Handler's panic too
		return r.clientSteps()
	}()
	return l.clientStopped(r, err)
}

// clientStopped sets the client's watch for why clientSteps (or a
// continuation) stopped: no more bytes, the server's room, PAUSE, a park.
func (l *evloop) clientStopped(r *relay, err error) error {
	ic := r.intercept
	switch err {
	case errWouldBlock:
		if len(ic.serverPending) > 0 || r.replicaPending() {
			// Read on once the upstream has taken it (interceptEvent,
			// replicaEvent).
			return l.watchClient(r, clientOff)
		}
		return l.watchClient(r, clientLevel)
	case errPaused:
		return l.watchClient(r, clientOff)
	case errHold:
		return l.parkIntercepted(r) // admin_pause_loop.go
	case errParked:
		ic.parks.Add(1)
		r.s.srv.ops.stats.ClientParks.Add(1)
		if c := ic.off; c != nil {
			ic.off = nil
			l.startOff(r, c)
		}
		return l.watchClient(r, clientOff)
	}
	return err
}

// parkClient parks the client side of a session on the loop (see
// gateConn): the Handler returns what it returns, and the loop runs k
// once ready reports true (resumeClient).
func (s *Session) parkClient(ready func() bool, k func() error) error {
	s.loopRelay.intercept.park = &clientPark{ready: ready, k: k}
	if k == nil {
		return ErrWait
	}
	return errParked
}

// resumeClient goes on with a parked client side once what it waits for
// has happened: it runs the continuation on the loop thread (which may
// park again) or handles the message again, then reads the client on.
// Its condition changes only on this thread, as the server side's
// messages are handled, so the loop asks after each of its events.
func (l *evloop) resumeClient(r *relay) error {
	s, ic := r.s, r.intercept
	p := ic.park
	if !p.ready() {
		return nil
	}
	ic.park = nil
	s.onLoop = true
	err := func() error {
		defer func() { s.onLoop = false }()
		if p.k == nil {
			return ErrWait
		}
		return p.k()
	}()
	switch {
	case err == ErrWait:
		// Handled again from the start (the message is still whole in
		// the framer); a continuation had kept it counted.
		if p.k != nil {
			s.releaseMessage(false)
		}
	case err == errParked:
		return l.clientStopped(r, err)
	case err != nil:
		return err
	case !p.mid:
		r.messageDone(ic.parkedLen)
	}
	return l.clientInline(r)
}

// messageDone consumes the n bytes of a handled message left in the
// client framer, ends its count (releaseMessage) and gives a buffer grown
// for it back (shrinkClient).
func (r *relay) messageDone(n int) {
	if n > 0 {
		r.s.cf.Discard(n)
	}
	r.s.releaseMessage(true)
	r.shrinkClient()
}

// watchClient sets the loop's watch of an intercepted session's client
// reads to ev (clientLevel, clientOff), changing the
// registration only when it differs. Loop thread only.
func (l *evloop) watchClient(r *relay, ev uint32) error {
	ic := r.intercept
	if ic.clientWatchEv == ev {
		return nil
	}
	if err := l.p.modify(ic.clientReadFD, ev); err != nil {
		return err
	}
	ic.clientWatchEv = ev
	return nil
}

// clientSteps handles, on the loop, the client messages that have
// arrived, reading the socket without blocking. It returns errWouldBlock
// when the client has nothing more (a message may be partly read: it
// stays buffered), errParked when the client side parks in a message
// (which stays buffered too).
func (r *relay) clientSteps() error {
	s, ic := r.s, r.intercept
	for {
		if len(ic.serverPending) > 0 || r.replicaPending() {
			return errPaused
		}
		if ic.stream.total > 0 {
			if err := r.streamSteps(); err != nil {
				return err
			}
			continue
		}
		if r.backlogged() {
			// Stopped as if the client had sent nothing more, and so
			// flushed as the framer does before a read that would block:
			// every request counted is then with PostgreSQL, which
			// answers it without more from the client (see backlogged).
			if err := s.sw.Flush(); err != nil {
				return fmt.Errorf("server: %w", err)
			}
			return errPaused
		}
		typ, total, err := s.nextClient()
		if err != nil {
			return err
		}
		if s.holdMessage(typ) { // PAUSE: admin_pause.go
			return errHold
		}
		switch {
		case total-headerLen > s.cf.Max:
			ic.stream = clientStream{typ: typ, total: total, left: total, over: true}
			continue
		case typ == 'd' && total > ic.clientSize:
			s.cf.Discard(headerLen) // in pieces, as copyPieces
			ic.stream = clientStream{typ: typ, total: total, left: total - headerLen}
			continue
		case total > s.cf.R.Size():
			switch r.growClient(total) {
			case growBudget:
				ic.stream = clientStream{typ: typ, total: total, left: total, overBudget: true}
				r.armHeldTimer() // dropped as it arrives, then the end: within message_timeout
				continue
			case growShare:
				ic.stream = clientStream{typ: typ, total: total, left: total, overBudget: true, overShare: true}
				r.armHeldTimer()
				continue
			}
		}
		err = s.interceptClient(total)
		if !errors.Is(err, errWouldBlock) {
			r.stopHeldTimer() // the message has all arrived
		}
		switch {
		case err == nil:
		case errors.Is(err, errWouldBlock):
			s.releaseMessage(false) // not whole yet: handled again
			return errWouldBlock
		case err == ErrWait:
			s.releaseMessage(false) // handled again once parked
			if ic.park == nil {
				// A Handler that did not say what it waits for: the
				// answer to the oldest request outstanding.
				front := s.q.Front()
				if front == nil {
					return errors.New("client message must wait with nothing outstanding")
				}
				ic.park = &clientPark{ready: func() bool { return isDone(front) }}
			}
			return errParked
		case err == errParked:
			ic.parkedLen = total // consumed when its continuation is done
			return errParked
		default:
			return err
		}
		s.releaseMessage(true)
		r.shrinkClient()
		if typ == 'X' {
			s.sw.Flush()
			return errClientTerminate
		}
	}
}

// The bounds of a client's unread answers (issue 30, B-M3): while
// maxOutstanding of its requests wait for their answers, or clientBacklog
// times the server buffer's size of answers wait in clientPending for it
// to read them, the client is not read (clientSteps), as PostgreSQL stops
// reading a client that does not read (it blocks on send); it is read
// again once the backlog is below half of that (interceptEvent). Without
// them a client that pipelines without reading made the proxy hold a
// request (about 150 bytes of heap) for every 8-byte Close it sent, for
// as long as the sockets' buffers took them (730 MB for 23 MB sent).
//
// The bound never stalls a client that reads its answers: when it stops
// reading the client, it has flushed what it forwarded (clientSteps), so
// every outstanding request is with PostgreSQL or answered, and
// PostgreSQL answers each without more input from the client, except
// that it keeps up to 8 KiB of answers unsent until a Sync, a Flush or
// more answers (PQ_SEND_BUFFER_SIZE): at most 1,638 requests (an answer
// is 5 bytes or more), fewer than the 2,048 at which the client is read
// again. The first version did not flush: up to a buffer of requests
// stayed in the proxy, unanswerable, and a client writing a large batch
// with its Sync at the end (pgx's TestConnExecBatchHuge) hung.
const (
	maxOutstanding = 4096
	clientBacklog  = 4
)

// backlogged reports whether the client is not to be read for its backlog
// of unread answers (see maxOutstanding), recording it in backlogPaused:
// one at the bounds is paused until its backlog is below half of them.
// Its cost on the path of every client message is a queue-length read.
func (r *relay) backlogged() bool {
	ic := r.intercept
	maxQ, maxP := maxOutstanding, clientBacklog*r.s.sf.R.Size()
	if ic.backlogPaused {
		maxQ, maxP = maxQ/2, maxP/2
	}
	ic.backlogPaused = r.s.q.Len() >= maxQ || len(ic.clientPending) >= maxP
	return ic.backlogPaused
}

// isDone reports whether req has been answered.
func isDone(req *Request) bool {
	select {
	case <-req.Done():
		return true
	default:
		return false
	}
}

// streamSteps goes on with the client message the loop passes on in
// pieces (clientStream) as far as its bytes have arrived; errWouldBlock
// when they have not all, errParked when the Handler is given a piece
// off the loop (deliverOff: the stream goes on once it has taken it).
func (r *relay) streamSteps() error {
	s, st := r.s, &r.intercept.stream
	for st.left > 0 {
		n := st.left
		if !st.over && !st.overBudget {
			n = min(n, r.intercept.clientSize-headerLen)
		}
		b, err := s.cf.Piece(n)
		if err != nil {
			if err == errWouldBlock {
				return err
			}
			return fmt.Errorf("client: %w", err)
		}
		k := len(b)
		if st.over || st.overBudget {
			s.cf.Discard(k)
		} else {
			if cap(s.scratch) < r.intercept.clientSize {
				s.scratch = make([]byte, 0, r.intercept.clientSize)
			}
			piece := append(s.scratch[:headerLen], b...)
			wire.PutHeader(piece, 'd', k)
			s.cf.Discard(k)
			st.left -= k
			if err := s.deliver(piece); err != nil {
				if err == errParked {
					r.intercept.park.mid = true
				}
				return err
			}
			continue
		}
		st.left -= k
	}
	done := *st
	*st = clientStream{}
	var err error
	switch {
	case done.overShare:
		return s.srv.overShare(done.total)
	case done.overBudget:
		return s.srv.overBudget(done.total)
	case done.over:
		err = s.substituteOversized(done.typ, done.total) // limits.go
	}
	switch err {
	case nil:
		s.releaseMessage(true)
		return nil
	case errParked:
		r.intercept.parkedLen = 0 // nothing of it left in the framer
	}
	return err
}

// growClient's answers: the buffer holds the message, or the memory
// budget cannot hold it, or it would take more than the session's share
// of the budget (Config.ClientMemory).
const (
	growOK = iota
	growBudget
	growShare
)

// growClient makes the client buffer hold a message of total bytes,
// larger than it, so that the message is read whole on the loop as it
// arrives, within the session's share of the memory budget and the
// budget. shrinkClient gives it back once the message is done. The
// message must all arrive within message_timeout (heldTimer), so that a
// client that stops half-way does not keep the memory.
func (r *relay) growClient(total int) int {
	s, ic := r.s, r.intercept
	want := heldCost(total - headerLen)
	if want > int64(s.srv.cfg.ClientMemory) {
		return growShare
	}
	cost := want - ic.grown
	if !s.srv.mem.take(cost) {
		return growBudget
	}
	ic.grown += cost
	r.resizeClient(total)
	r.armHeldTimer()
	return growOK
}

// armHeldTimer starts the message_timeout of a message held whole (or
// dropped before the session ends for the budget).
func (r *relay) armHeldTimer() {
	s, ic := r.s, r.intercept
	if ic.heldTimer == nil && s.srv.cfg.MessageTimeout > 0 {
		ic.heldTimer = time.AfterFunc(s.srv.cfg.MessageTimeout, s.messageTimedOut)
	}
}

// stopHeldTimer stops the message_timeout of a message held whole: it
// has arrived, or the session ends.
func (r *relay) stopHeldTimer() {
	if t := r.intercept.heldTimer; t != nil {
		t.Stop()
		r.intercept.heldTimer = nil
	}
}

// messageTimedOut ends a session whose client has not sent the rest of a
// message held whole within message_timeout. Any goroutine (a timer's).
func (s *Session) messageTimedOut() {
	s.info.killed.CompareAndSwap(nil, &ProtocolError{Code: "57P05",
		Msg:  fmt.Sprintf("pgfence: terminating connection: the client did not send the rest of a message larger than buffer_size within message_timeout (%s)", s.srv.cfg.MessageTimeout),
		Hint: "Send each message whole and promptly, or raise message_timeout."})
	s.srv.ops.stats.MessageTimeouts.Add(1)
	s.closeServer()
}

// shrinkClient gives a buffer grown for a message back, once what is
// left in it fits the usual size.
func (r *relay) shrinkClient() {
	s, ic := r.s, r.intercept
	if ic.grown == 0 || s.cf.R.Buffered() > ic.clientSize {
		return
	}
	r.stopHeldTimer()
	r.resizeClient(ic.clientSize)
	s.srv.mem.give(ic.grown)
	ic.grown = 0
}

// resizeClient replaces the client buffer by one of size bytes, keeping
// what it holds.
func (r *relay) resizeClient(size int) {
	s := r.s
	src := r.intercept.clientSrc
	if n := s.cf.R.Buffered(); n > 0 {
		b, _ := s.cf.R.Peek(n)
		src = io.MultiReader(bytes.NewReader(bytes.Clone(b)), src)
	}
	s.cf.R = bufio.NewReaderSize(src, size)
}
