//go:build linux

package proxy

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// The client side of the sessions that used to keep a client goroutine on
// the event loop, and run on it now: a session with read routing (its
// waits park: routeThen; the replica's dial and the polls of
// fence.read_policy=wait run off the loop: offClient), and a Handler that
// is not a LoopClient (each of its messages off the loop: deliverOff).

// wantNoClientGoroutine fails t if s has run the gate's ClientMessage
// off the loop.
func wantNoClientGoroutine(t *testing.T, p *testProxy, s *Session) {
	t.Helper()
	if s != nil {
		if n := s.offLoop.Load(); n != 0 {
			t.Errorf("%d client messages handled off the loop, want 0", n)
		}
	}
}

// loopRelayOf is the relay of c's session, which must be on p's loop. A
// session comes onto the loop just after its client has been told it is
// ready (Server.open, then Session.run), so a client that has only just
// connected may be found before it is there: its relay is waited for.
func loopRelayOf(t *testing.T, p *testProxy, c *pgconn.PgConn) *relay {
	t.Helper()
	s := sessionOf(t, p, c)
	r := pollFind(t, "the session on the event loop", func() (*relay, bool) {
		r := loopRelayNow(s)
		return r, r != nil
	})
	if r.intercept == nil {
		t.Fatal("the session is not an intercepted session on the event loop")
	}
	return r
}

// queryRows reads c's answers up to the n-th ReadyForQuery and returns,
// per query, its first row's values joined by spaces, or its command tag
// without rows; an ErrorResponse is its SQLSTATE (the last answer when
// the session ends after it).
func queryRows(t *testing.T, c *pgconn.PgConn, n int) []string {
	t.Helper()
	var out []string
	cur := ""
	rfq := 0
	err := receiveEach(c, 30*time.Second, func(m pgproto3.BackendMessage) bool {
		switch m := m.(type) {
		case *pgproto3.DataRow:
			if cur == "" {
				var vals []string
				for _, v := range m.Values {
					vals = append(vals, string(v))
				}
				cur = strings.Join(vals, " ")
			}
		case *pgproto3.CommandComplete:
			if cur == "" {
				cur = string(m.CommandTag)
			}
		case *pgproto3.ErrorResponse:
			cur = m.Code
		case *pgproto3.ReadyForQuery:
			out = append(out, cur)
			cur = ""
			rfq++
		}
		return rfq < n
	})
	if err != nil {
		if len(cur) == 5 {
			return append(out, cur) // a SQLSTATE, then the end
		}
		t.Fatalf("after %v: %v", out, err)
	}
	return out
}

// TestRouteLoopReads: a routed session's client side is on the loop:
// reads answered by the replica, writes by the primary, a read-only
// transaction on the replica in the extended protocol, and a pipelined
// batch of reads and writes answered in order. Its routed reads park the
// client side and its replica connection is dialed off the loop; no
// client goroutine. (With routed sessions' client side on a goroutine, as
// before, offLoop counts it.)
func TestRouteLoopReads(t *testing.T) {
	e, c, _, _ := routedReader(t, Config{})
	ctx := ctxT(t)
	r := loopRelayOf(t, e.proxy, c)
	if n := r.intercept.offCalls.Load(); n < 1 {
		t.Errorf("%d calls off the loop, want the replica connection's dial", n)
	}
	mustWhere(t, c, "SELECT count(*), pg_is_in_recovery() FROM audit", true)
	mustExec(t, c, "INSERT INTO audit (note) VALUES ('w')")
	mustWhere(t, c, "SELECT nextval('audit_id_seq'), pg_is_in_recovery()", false)

	// The extended protocol: on the primary, but inside a read-only
	// transaction begun on the replica.
	rs := c.ExecParams(ctx, "SELECT $1::int, pg_is_in_recovery()", [][]byte{[]byte("7")}, nil, nil, nil).Read()
	if rs.Err != nil || string(rs.Rows[0][1]) != "f" {
		t.Fatalf("extended read outside a transaction: %v %v, want the primary's", rs.Rows, rs.Err)
	}
	mustExec(t, c, "BEGIN READ ONLY")
	rs = c.ExecParams(ctx, "SELECT $1::int, pg_is_in_recovery()", [][]byte{[]byte("8")}, nil, nil, nil).Read()
	if rs.Err != nil || string(rs.Rows[0][0]) != "8" || string(rs.Rows[0][1]) != "t" {
		t.Fatalf("extended read in a read-only transaction: %v %v, want 8 from the replica", rs.Rows, rs.Err)
	}
	mustExec(t, c, "COMMIT")

	// Pipelined: reads and writes sent at once, answered in order.
	parks := r.intercept.parks.Load()
	// In a database with protected tables a request that may write is a
	// barrier (round 8, O-H3: a write the proxy cannot see may be a
	// replay that rolls back the step): the requests after the INSERT
	// wait for its answer, and are then routed as if sent after it, the
	// last read to the replica. (Before the barrier, reads behind a write
	// in flight went to the primary with it.)
	sendQueries(t, c, "SELECT 1, pg_is_in_recovery()", "SELECT 2, pg_is_in_recovery()", "INSERT INTO audit (note) VALUES ('p')",
		"SELECT nextval('audit_id_seq') > 0, pg_is_in_recovery()", "SELECT 3, pg_is_in_recovery()")
	got := strings.Join(queryRows(t, c, 5), ",")
	if want := "1 t,2 t,INSERT 0 1,t f,3 t"; got != want {
		t.Fatalf("pipelined answers %s, want %s", got, want)
	}
	if n := r.intercept.parks.Load() - parks; n < 1 {
		t.Errorf("%d parks for the pipelined routed reads, want some", n)
	}
	wantNoClientGoroutine(t, e.proxy, r.s)
}

// TestRouteLoopWaitForReplay: under fence.read_policy=wait a read that
// waits for a paused replica's replay parks its client side, its polls
// off the loop, while another session on the same loop goes on; once
// replay resumes the replica answers it. (With the polls on the loop
// thread the other session stalls until the wait ends: the test times
// out.)
func TestRouteLoopWaitForReplay(t *testing.T) {
	e := newRouteEnvRelay(t, Config{})
	b := e.scenario(t) // replay paused, B's result on the primary only
	e.waitTakeover(t, e.gate, "job", b.Token)
	rw := e.reader(t, nil, opts("job", b.Token, "-c fence.read_policy=wait", "-c fence.read_wait=10min")...)
	r := loopRelayOf(t, e.proxy, rw)
	parks := r.intercept.parks.Load()
	res := readAsync(t, rw, readResult)
	stats := e.proxy.srv.RouteStats()
	waitReplayWait(t, stats, res)
	// The loop goes on with another session meanwhile, writes and reads.
	other := e.reader(t, nil)
	if loopRelayOf(t, e.proxy, other).l != r.l {
		t.Fatal("the other session is on another loop")
	}
	for i := range 5 {
		mustExec(t, other, fmt.Sprintf("INSERT INTO audit (note) VALUES ('meanwhile %d')", i))
		mustWhere(t, other, "SELECT 1, pg_is_in_recovery()", true)
	}
	select {
	case a := <-res:
		t.Fatalf("the wait ended before replay resumed: %+v", a)
	default:
	}
	if n := r.intercept.parks.Load() - parks; n < 1 {
		t.Fatal("the waiting session's client side did not park")
	}
	if err := cluster.ResumeReplay(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	a := <-res
	if a.err != nil {
		t.Fatalf("wait policy: %v", a.err)
	}
	row := a.rs[0].Rows[0]
	if got, want := fmt.Sprintf("%s %s %s", row[0], row[1], row[2]), fmt.Sprintf("B %d t", b.Token); got != want {
		t.Fatalf("read %s, want %s (the new generation, from the replica)", got, want)
	}
	if n := r.intercept.offCalls.Load(); n < 2 {
		t.Errorf("%d calls off the loop, want the dial and the replay wait", n)
	}
	wantNoClientGoroutine(t, e.proxy, r.s)
}

// TestRouteLoopEndWhileWaiting: a session whose read waits for replay
// (read_wait far beyond the test's time) ends at once when the proxy
// shuts down, when the console kills it, and when its client resets the
// connection: the poll off the loop gives up with it.
func TestRouteLoopEndWhileWaiting(t *testing.T) {
	for _, how := range []string{"shutdown", "kill", "reset"} {
		t.Run(how, func(t *testing.T) {
			e := newRouteEnvRelay(t, Config{})
			b := e.scenario(t)
			e.waitTakeover(t, e.gate, "job", b.Token)
			rw := e.reader(t, nil, opts("job", b.Token, "-c fence.read_policy=wait", "-c fence.read_wait=10min")...)
			s := sessionOf(t, e.proxy, rw)
			res := readAsync(t, rw, readResult)
			stats := e.proxy.srv.RouteStats()
			waitReplayWait(t, stats, res)
			ctx := ctxT(t)
			switch how {
			case "shutdown":
				now, cancel := context.WithCancel(ctx)
				cancel() // no grace: busy sessions are closed at once
				shut := make(chan error, 1)
				go func() { shut <- e.proxy.srv.Shutdown(now) }()
				if a := <-res; a.err == nil {
					t.Fatalf("read answered %v at the shutdown, want its end", a.rs)
				}
				// Shutdown returns once its sessions have ended.
				select {
				case err := <-shut:
					if err == nil {
						t.Fatal("Shutdown reported no busy session; the read was waiting")
					}
				case <-ctx.Done():
					t.Fatal("Shutdown never returned: the session's end waits for its wait for replay")
				}
			case "kill":
				s.kill("test")
				wantCode(t, (<-res).err, "57P01")
			case "reset":
				rw.Conn().(*net.TCPConn).SetLinger(0)
				rw.Conn().Close()
				<-res
			}
			if err := pgtest.Poll(ctx, func() (bool, error) {
				for _, ss := range e.proxy.srv.sessions() {
					if ss == s {
						return false, nil
					}
				}
				return stats.Waiting.Load() == 0, nil
			}); err != nil {
				t.Fatalf("the session, or its wait, outlived its end: %v", err)
			}
			wantNoClientGoroutine(t, e.proxy, s)
		})
	}
}

// TestRouteLoopReplicaFails: on the loop, a replica that fails before
// answering has the read retried on the primary, and one that fails after
// part of the answer reached the client ends the session with 08006; the
// client side on the loop throughout.
func TestRouteLoopReplicaFails(t *testing.T) {
	t.Run("before_answer", func(t *testing.T) {
		e, c, rc, rep := routedReader(t, Config{})
		r := loopRelayOf(t, e.proxy, c)
		// The read's one park: none for a freshness marker first.
		holdCurrent(catalogOf(t, e.gate, e.db))
		parks := r.intercept.parks.Load()
		tx, res, pid := readHeld(t, e, c, rc, rep, "loop_before_answer")
		if n := r.intercept.parks.Load() - parks; n != 1 {
			t.Fatalf("%d parks for the routed read, want 1", n)
		}
		retryHeldOnPrimary(t, e, rep, pid, "loop_before_answer")
		heldAnswer(t, tx, res, "f", "the primary's answer")
		waitReplicaRead(t, c, "SELECT 1, pg_is_in_recovery()")
		wantNoClientGoroutine(t, e.proxy, r.s)
	})
	t.Run("mid_result", func(t *testing.T) {
		e, c, rc, rep := routedReader(t, Config{})
		r := loopRelayOf(t, e.proxy, c)
		sendRaw(t, c, "SELECT repeat('z', 1000), pg_is_in_recovery() FROM generate_series(1, 50000) /* loop_mid_result */")
		pid := replicaBackend(t, rep, "loop_mid_result", "Client")
		if err := pgtest.Poll(ctxT(t), func() (bool, error) { return rc.loop.readsPaused.Load(), nil }); err != nil {
			t.Fatalf("the loop never stopped reading the replica for a client that does not read: %v", err)
		}
		if _, err := rep.Exec(ctxT(t), "SELECT pg_terminate_backend($1)", pid); err != nil {
			t.Fatal(err)
		}
		got := queryRows(t, c, 1)
		if got[0] != "08006" {
			t.Fatalf("answer %v, want 08006", got)
		}
		<-rc.done
		wantNoClientGoroutine(t, e.proxy, r.s)
	})
}

// TestRouteLoopReplicaWritesHeld: requests the replica's socket does not
// take (a batch of many MB pipelined in a read-only transaction there,
// behind a read the replica holds on a lock) wait in the loop's pending
// bytes, and the client is not read meanwhile, instead of the loop
// thread blocking on the socket: another session goes on, and once the
// lock goes every request is answered. (With the loop writing the replica
// blocking, writesHeld is never set and the other session stalls.)
func TestRouteLoopReplicaWritesHeld(t *testing.T) {
	e, c, rc, rep := routedReader(t, Config{})
	ctx := ctxT(t)
	tx := holdTable(t, e, rep)
	mustExec(t, c, "BEGIN READ ONLY")
	if got := lastValue(t, c, "SELECT pg_is_in_recovery()"); got != "t" {
		t.Fatalf("pg_is_in_recovery() %s in the read-only transaction, want t", got)
	}
	const n = 2000
	pad := strings.Repeat("x", 8000)
	var batch []byte
	batch, _ = (&pgproto3.Parse{Query: "SELECT n FROM held"}).Encode(batch)
	batch, _ = (&pgproto3.Bind{}).Encode(batch)
	batch, _ = (&pgproto3.Execute{}).Encode(batch)
	for range n {
		batch, _ = (&pgproto3.Parse{Query: "SELECT 1 /* " + pad + " */"}).Encode(batch)
		batch, _ = (&pgproto3.Bind{}).Encode(batch)
		batch, _ = (&pgproto3.Execute{}).Encode(batch)
	}
	batch, _ = (&pgproto3.Sync{}).Encode(batch)
	sent := make(chan error, 1)
	go func() { _, err := c.Conn().Write(batch); sent <- err }()
	if err := pgtest.Poll(ctx, func() (bool, error) { return rc.loop.writesHeld.Load(), nil }); err != nil {
		t.Fatalf("the replica's socket never held requests back: %v", err)
	}
	other := e.reader(t, nil)
	mustWhere(t, other, "SELECT 1, pg_is_in_recovery()", true)
	mustExec(t, other, "INSERT INTO audit (note) VALUES ('meanwhile')")
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	tags := commandTags(t, c, 1)
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	if len(tags) != n+1 {
		t.Fatalf("%d answers, want %d", len(tags), n+1)
	}
	mustExec(t, c, "COMMIT")
	wantNoClientGoroutine(t, e.proxy, sessionOf(t, e.proxy, c))
}

// blocker is a Handler that is not a LoopClient: its ClientMessage blocks
// on a Query naming 'block' until the test releases it, and it records
// the queries each session gives it, in order.
type blocker struct {
	blocked chan struct{}
	release chan struct{}
	mu      sync.Mutex
	seen    map[*Session][]string
}

func (b *blocker) Open(*Session) (Handler, error) { return b, nil }
func (b *blocker) Close(*Session)                 {}
func (b *blocker) ClientMessage(s *Session, msg []byte) (Verdict, error) {
	if msg[0] != 'Q' {
		return Forward, nil
	}
	q := string(msg[headerLen : len(msg)-1])
	b.mu.Lock()
	b.seen[s] = append(b.seen[s], q)
	b.mu.Unlock()
	if strings.Contains(q, "'block'") {
		b.blocked <- struct{}{}
		select {
		case <-b.release:
		case <-s.Closing():
		}
	}
	return Forward, nil
}
func (b *blocker) ServerMessage(*Session, []byte, *Request) (Verdict, error) { return Forward, nil }

func (b *blocker) queries(s *Session) []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.seen[s]...)
}

// TestBlockingHandlerOffLoop: a Handler that is not a LoopClient and
// blocks in ClientMessage does not stall the other sessions on its loop;
// the blocked session's messages wait, unread, and are handled in their
// order once it returns. (With ClientMessage called on the loop thread
// the other session never gets an answer.)
func TestBlockingHandlerOffLoop(t *testing.T) {
	b := &blocker{blocked: make(chan struct{}, 1), release: make(chan struct{}), seen: map[*Session][]string{}}
	p := startProxy(t, Config{Interceptor: b})
	db := cluster.NewDatabase(t)
	c1, c2 := connect(t, p.dsn(db)), connect(t, p.dsn(db))
	r1, r2 := loopRelayOf(t, p, c1), loopRelayOf(t, p, c2)
	if r1.l != r2.l {
		t.Fatal("the sessions are on different loops")
	}
	sendQueries(t, c1, "SELECT 'block'", "SELECT 'after'", "SELECT 3")
	<-b.blocked
	answered := make(chan error, 1)
	go func() {
		for i := range 10 {
			rs, err := c2.Exec(context.Background(), fmt.Sprintf("SELECT %d", i)).ReadAll()
			if err == nil && string(rs[0].Rows[0][0]) != fmt.Sprint(i) {
				err = fmt.Errorf("read %s, want %d", rs[0].Rows[0][0], i)
			}
			if err != nil {
				answered <- err
				return
			}
		}
		answered <- nil
	}()
	select {
	case err := <-answered:
		if err != nil {
			t.Fatalf("the other session: %v", err)
		}
	case <-time.After(20 * time.Second):
		// A bound, not an order: a loop stalled by the blocked call
		// never answers. Released, so that the test ends.
		close(b.release)
		t.Fatal("the other session got no answer while a Handler blocked: the loop is stalled")
	}
	if got := b.queries(r1.s); len(got) != 1 {
		t.Fatalf("the blocked session's Handler was given %v meanwhile, want only its first query", got)
	}
	close(b.release)
	if got, want := strings.Join(queryRows(t, c1, 3), ","), "block,after,3"; got != want {
		t.Fatalf("answers %s, want %s", got, want)
	}
	if got, want := strings.Join(b.queries(r1.s), ","), "SELECT 'block',SELECT 'after',SELECT 3"; got != want {
		t.Fatalf("the Handler was given %s, want %s", got, want)
	}
	if n := r1.intercept.offCalls.Load(); n < 3 {
		t.Errorf("%d calls off the loop, want one per message", n)
	}
}
