//go:build unix

package proxy

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// The write gate's waits on the event loop: each park of the client side
// (the causes that used to hand it to a goroutine), what the client
// pipelines meanwhile, and the end of a session while parked.

// wantOnLoop fails t if a client message of r's session was handled off
// the event loop, or if the session parked other than parks times.
func wantOnLoop(t *testing.T, r *relay, parks int64) {
	t.Helper()
	if n := r.s.offLoop.Load(); n != 0 {
		t.Errorf("%d client messages handled off the loop, want 0", n)
	}
	if n := r.intercept.parks.Load(); n != parks {
		t.Errorf("%d parks, want %d", n, parks)
	}
}

// waitParked waits until r's session has parked n times and the backend
// of holder's database waits for advisory lock 42 (pg_locks).
func waitParked(t *testing.T, holder *pgconn.PgConn, r *relay, n int64) {
	t.Helper()
	ctx := ctxT(t)
	if err := pgtest.Poll(ctx, func() (bool, error) { return r.intercept.parks.Load() == n, nil }); err != nil {
		t.Fatalf("the client side never parked %d times: %v", n, err)
	}
	if err := pgtest.Poll(ctx, func() (bool, error) {
		return lastValue(t, holder, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted") == "1", nil
	}); err != nil {
		t.Fatalf("the session's backend never waited for the lock: %v", err)
	}
}

// TestParkPipelinedWrite: a write pipelined behind a SET whose answer a
// lock held elsewhere keeps back parks the client side on the loop; what
// the client pipelines after it waits, unread, and once the lock goes
// every query is answered in order, with the rows written.
func TestParkPipelinedWrite(t *testing.T) {
	_, _, holder, c, r := lockedGateSession(t)
	sendQueries(t, c, "SELECT pg_advisory_lock(42)", "SET fence.step = 'b'", "INSERT INTO t VALUES (1)")
	waitParked(t, holder, r, 1)
	// Pipelined while parked: a write, a read of what is written.
	sendQueries(t, c, "INSERT INTO t VALUES (2)", "SELECT count(*) FROM t")
	if got := lastValue(t, holder, "SELECT count(*) FROM t"); got != "0" {
		t.Fatalf("%s rows written while parked, want 0", got)
	}
	mustExec(t, holder, "SELECT pg_advisory_unlock(42)")
	wantTags(t, c, 5, "SELECT 1,SET,INSERT 0 1,INSERT 0 1,SELECT 1")
	wantValue(t, holder, "SELECT string_agg(v::text, ',' ORDER BY v) FROM t", "1,2")
	wantValue(t, c, "SELECT current_setting('fence.step')", "b")
	wantOnLoop(t, r, 1)
}

// TestParkExtendedBatch: inside an extended-protocol batch, an Execute of
// a write behind the Execute of a SET not yet answered parks the client
// side (having asked the server to flush the batch so far); the batch
// completes in order once the lock goes.
func TestParkExtendedBatch(t *testing.T) {
	_, _, holder, c, r := lockedGateSession(t)
	var raw []byte
	for _, m := range []pgproto3.FrontendMessage{
		&pgproto3.Query{String: "SELECT pg_advisory_lock(42)"},
		&pgproto3.Parse{Query: "SET fence.step = 'e'"}, &pgproto3.Bind{}, &pgproto3.Execute{},
		&pgproto3.Parse{Query: "INSERT INTO t VALUES (5)"}, &pgproto3.Bind{}, &pgproto3.Execute{},
		&pgproto3.Sync{},
	} {
		raw, _ = m.Encode(raw)
	}
	if _, err := c.Conn().Write(raw); err != nil {
		t.Fatal(err)
	}
	waitParked(t, holder, r, 1)
	mustExec(t, holder, "SELECT pg_advisory_unlock(42)")
	wantTags(t, c, 2, "SELECT 1,SET,INSERT 0 1")
	wantValue(t, holder, "SELECT count(*) FROM t WHERE v = 5", "1")
	wantOnLoop(t, r, 1)
}

// TestParkSettingsReadBack: a write after a set_config whose value the
// gate cannot read from its text waits for the settings read back from
// the server (resync): the client side parks on the loop, the write runs
// after, and the setting is the server's.
func TestParkSettingsReadBack(t *testing.T) {
	p := startProxy(t, Config{Interceptor: newGate(t)})
	db := cluster.NewDatabase(t)
	c := connect(t, p.dsn(db))
	r := interceptedRelay(t, p)
	direct := connect(t, cluster.Primary.DSN(db))
	mustExec(t, c, "CREATE TABLE t (v int)")
	mustExec(t, c, "SELECT set_config('fence.step', (SELECT 'read' || 'back'), false)")
	mustExec(t, c, "INSERT INTO t VALUES (7)")
	wantValue(t, direct, "SELECT count(*) FROM t WHERE v = 7", "1")
	wantValue(t, c, "SELECT current_setting('fence.step')", "readback")
	wantOnLoop(t, r, 1)
}

// TestParkLargeMessage: a message larger than the session's buffer is read
// on the loop as it arrives (the buffer grows for it, within the memory
// budget, and shrinks after), with the query pipelined behind it; nothing
// is handled off the loop and the budget is all given back.
func TestParkLargeMessage(t *testing.T) {
	p := startProxy(t, Config{Interceptor: newGate(t), BufferSize: 4096})
	db := cluster.NewDatabase(t)
	c := connect(t, p.dsn(db))
	r := interceptedRelay(t, p)
	direct := connect(t, cluster.Primary.DSN(db))
	mustExec(t, c, "CREATE TABLE big (s text)")
	big := strings.Repeat("x", 100_000)
	raw, _ := (&pgproto3.Query{String: "INSERT INTO big VALUES ('" + big + "')"}).Encode(nil)
	raw, _ = (&pgproto3.Query{String: "SELECT length(s) FROM big"}).Encode(raw)
	// In pieces, so that the message arrives over several events.
	for len(raw) > 0 {
		n := min(len(raw), 7000)
		if _, err := c.Conn().Write(raw[:n]); err != nil {
			t.Fatal(err)
		}
		raw = raw[n:]
	}
	wantTags(t, c, 2, "INSERT 0 1,SELECT 1")
	wantValue(t, direct, "SELECT length(s) FROM big", "100000")
	wantValue(t, c, "SELECT 'after'", "after")
	wantOnLoop(t, r, 0)
	if n := p.srv.mem.used.Load(); n != 0 {
		t.Fatalf("%d bytes of the memory budget still taken, want 0", n)
	}
}

// TestParkSessionEnds: a session that ends while its client side is
// parked in a transaction (the write behind a SET held up by a lock; the
// COMMIT pipelined after it) drops what it waited for: nothing is
// committed, the session and its backend are gone, and the client is
// told why where there is someone to tell. A client that closes while
// parked, having sent no COMMIT, is noticed as PostgreSQL notices it:
// what it sent is handled once the wait is over, and its end then rolls
// the transaction back.
func TestParkSessionEnds(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  func(t *testing.T, p *testProxy, holder *pgconn.PgConn, c *pgconn.PgConn, pid string)
		// code is the SQLSTATE the client reads before the end ("": it is
		// gone; "-": none, as for any session Shutdown closes busy).
		code string
	}{
		{"client closes", func(t *testing.T, _ *testProxy, _, c *pgconn.PgConn, _ string) { c.Conn().Close() }, ""},
		{"shutdown", func(t *testing.T, p *testProxy, _, _ *pgconn.PgConn, _ string) {
			ctx, cancel := context.WithCancel(context.Background())
			cancel() // no grace: the session is busy
			if err := p.srv.Shutdown(ctx); err == nil {
				t.Error("Shutdown reported no busy session, want the parked one closed")
			}
		}, "-"},
		{"upstream terminated", func(t *testing.T, _ *testProxy, holder, _ *pgconn.PgConn, pid string) {
			mustExec(t, holder, "SELECT pg_terminate_backend("+pid+")")
		}, "57P01"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, _, holder, c, r := lockedGateSession(t)
			pid := lastValue(t, c, "SELECT pg_backend_pid()")
			queries := []string{"SELECT pg_advisory_lock(42)", "SET fence.step = 'b'", "BEGIN", "INSERT INTO t VALUES (1)", "COMMIT"}
			gone := tc.name == "client closes"
			if gone {
				queries = queries[:4] // no COMMIT: what it sent is handled after the wait
			}
			sendQueries(t, c, queries...)
			waitParked(t, holder, r, 1)
			tc.end(t, p, holder, c, pid)
			switch got := ""; tc.code {
			case "":
			case "-":
				if got = endCode(t, c); got != "" {
					t.Errorf("the client read an error %s, want the end only", got)
				}
			default:
				if got = endCode(t, c); got != tc.code {
					t.Errorf("the client read %q, want an error %s and the end", got, tc.code)
				}
			}
			ctx := ctxT(t)
			if gone {
				mustExec(t, holder, "SELECT pg_advisory_unlock(42)")
			}
			if err := pgtest.Poll(ctx, func() (bool, error) { return endFlushSession(p) == nil, nil }); err != nil {
				t.Fatalf("the session never ended: %v", err)
			}
			// A backend waiting for a lock notices its client's going only
			// once it has the lock.
			if !gone {
				mustExec(t, holder, "SELECT pg_advisory_unlock(42)")
			}
			if err := pgtest.Poll(ctx, func() (bool, error) {
				return lastValue(t, holder, "SELECT count(*) FROM pg_stat_activity WHERE pid = "+pid) == "0", nil
			}); err != nil {
				t.Fatalf("the session's backend never left: %v", err)
			}
			if got := lastValue(t, holder, "SELECT count(*) FROM t"); got != "0" {
				t.Fatalf("%s rows committed by a session that ended while parked or without its COMMIT, want 0", got)
			}
		})
	}
}

// endCode reads c to its end and returns the SQLSTATE of the last
// ErrorResponse before it ("" if none).
func endCode(t *testing.T, c *pgconn.PgConn) string {
	t.Helper()
	fe := pgproto3.NewFrontend(c.Conn(), c.Conn())
	c.Conn().SetReadDeadline(time.Now().Add(30 * time.Second))
	code := ""
	for {
		m, err := fe.Receive()
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || (err != nil && strings.Contains(err.Error(), "connection reset")) {
			return code
		}
		if err != nil {
			t.Fatalf("reading to the end: %v", err)
		}
		if e, ok := m.(*pgproto3.ErrorResponse); ok {
			code = e.Code
		}
	}
}

// TestParkHeldClientReset: a message PAUSE holds on the loop, whose client
// then resets its connection, is met again by the loop (the reset's
// event) and so has two wake-ups waiting for RESUME. The first handles it
// and parks the client side (a write that waits for the settings read
// back: TestParkSettingsReadBack); the second must leave the parked side
// alone, not handle the message again.
func TestParkHeldClientReset(t *testing.T) {
	p := startProxy(t, withConsole(Config{Interceptor: newGate(t)}))
	db := cluster.NewDatabase(t)
	c := connect(t, p.dsn(db))
	r := interceptedRelay(t, p)
	mustExec(t, c, "CREATE TABLE t (v int)")
	mustExec(t, c, "SELECT set_config('fence.step', (SELECT 'read' || 'back'), false)")
	adm := mustConsole(t, p, "admin")
	obs := mustConsole(t, p, "watcher")
	ctx := ctxT(t)
	if _, err := adm.Exec(ctx, "PAUSE"); err != nil {
		t.Fatalf("PAUSE: %v", err)
	}
	sendQueries(t, c, "INSERT INTO t VALUES (7)")
	waitClientState(t, obs, c, "waiting")
	events := r.intercept.clientEventCount.Load()
	tc := c.Conn().(*net.TCPConn)
	tc.SetLinger(0) // close sends a reset
	tc.Close()
	if err := pgtest.Poll(ctx, func() (bool, error) { return r.intercept.clientEventCount.Load() > events, nil }); err != nil {
		t.Fatalf("the loop never saw the reset: %v", err)
	}
	if _, err := adm.Exec(ctx, "RESUME"); err != nil {
		t.Fatalf("RESUME: %v", err)
	}
	if err := pgtest.Poll(ctx, func() (bool, error) {
		select {
		case <-r.s.closing:
			return !r.l.owns(r), nil
		default:
			return false, nil
		}
	}); err != nil {
		t.Fatalf("the session never ended: %v", err)
	}
	if n := r.intercept.parks.Load(); n != 1 {
		t.Fatalf("%d parks, want 1 (the held message handled once)", n)
	}
}

// parkPanicky is a LoopClient Handler that parks the client side at a
// query saying boom, with a continuation that panics.
type parkPanicky struct{ panicky }

func (parkPanicky) Open(s *Session) (Handler, error) { return parkPanicky{}, nil }
func (parkPanicky) LoopClient() bool                 { return true }
func (parkPanicky) ClientMessage(s *Session, msg []byte) (Verdict, error) {
	if msg[0] == 'Q' && strings.Contains(string(msg), "boom") && s.OnLoop() {
		return Drop, s.parkClient(func() bool { return true }, func() error { panic("boom") })
	}
	return Forward, nil
}

// TestParkContinuationPanic: a Handler's continuation that panics when
// the loop resumes the parked client side ends its own session only; the
// loop and the other sessions go on.
func TestParkContinuationPanic(t *testing.T) {
	p, db, other, bad := panicSessions(t, parkPanicky{})
	r := loopRelayWhere(t, p, "the panicking session", func(r *relay) bool {
		return r.intercept != nil && r.s.cancelPID == bad.PID()
	})
	wantBoomEnds(t, bad)
	if n := r.intercept.parks.Load(); n != 1 {
		t.Fatalf("%d parks, want 1", n)
	}
	wantOthersFine(t, p, db, other)
}
