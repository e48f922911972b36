package proxy

import (
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// injectWaiter is a Handler that is not a LoopClient: for a query with
// 'wait' in it, its ClientMessage injects a query of its own and blocks
// until that is answered or the session is closing (Session.Closing).
type injectWaiter struct {
	inject  string        // the query it injects
	waiting chan struct{} // sent once it blocks
	gaveUp  atomic.Bool   // it returned because the session was closing
}

func (w *injectWaiter) Open(*Session) (Handler, error) { return w, nil }
func (w *injectWaiter) Close(*Session)                 {}
func (w *injectWaiter) ServerMessage(*Session, []byte, *Request) (Verdict, error) {
	return Forward, nil
}

func (w *injectWaiter) ClientMessage(s *Session, msg []byte) (Verdict, error) {
	if msg[0] != 'Q' || !strings.Contains(string(msg), "'wait'") {
		return Forward, nil
	}
	q, _ := (&pgproto3.Query{String: w.inject}).Encode(nil)
	r, err := s.Inject(q, nil)
	if err != nil {
		return Forward, err
	}
	if err := s.FlushServer(); err != nil {
		return Forward, err
	}
	w.waiting <- struct{}{}
	select {
	case <-r.Done():
	case <-s.Closing():
		w.gaveUp.Store(true)
		return Forward, errSessionClosing
	}
	return Forward, nil
}

// TestBlockingHandlerSessionEnds: a Handler that blocks in ClientMessage
// on a request it injected, which will never be answered (its backend is
// terminated while the request waits for a lock), is released by
// Session.Closing, and the session ends: its end closes Closing before it
// waits for the call in progress, and drains the queue (every Done) only
// after. (Waiting on the Request's Done alone, the end and the Handler
// waited for each other for good.)
func TestBlockingHandlerSessionEnds(t *testing.T) {
	w := &injectWaiter{inject: "SELECT pg_advisory_lock(77)", waiting: make(chan struct{}, 1)}
	p := startProxy(t, Config{Interceptor: w})
	db := cluster.NewDatabase(t)
	holder := connect(t, cluster.Primary.DSN(db))
	mustExec(t, holder, "SELECT pg_advisory_lock(77)")
	c := connect(t, p.dsn(db))
	pid := lastValue(t, c, "SELECT pg_backend_pid()")
	sendQueries(t, c, "SELECT 'wait'")
	<-w.waiting
	// The injected query waits for the lock upstream.
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		return lastValue(t, holder, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND pid = "+pid) == "1", nil
	}); err != nil {
		t.Fatalf("the injected query never waited for the lock: %v", err)
	}
	mustExec(t, holder, "SELECT pg_terminate_backend("+pid+")")
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return endFlushSession(p) == nil, nil }); err != nil {
		t.Fatalf("the session never ended while its Handler waited: %v", err)
	}
	if !w.gaveUp.Load() {
		t.Fatal("the Handler returned, but not because the session was closing")
	}
}
