package proxy

import (
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestClientMemoryShare: one slow message cannot take the memory budget
// from every other session (issue 30, B-M2). The attacker's form: a
// logged-in client sends a Query header claiming 64 MiB - 100 bytes and a
// few bytes, then stops; before, its held cost was the whole default
// budget, and every other session's message over buffer_size got 53200.
// Now a session may hold at most client_memory (half of the budget by
// default): the claim over it is dropped as it arrives, never held, and
// its session ends (53200 naming client_memory, or 57P05 once it has
// stalled for message_timeout); a claim within it is held, and the
// others' messages still fit beside it.
func TestClientMemoryShare(t *testing.T) {
	p := startProxy(t, Config{Interceptor: newGate(t), MessageTimeout: 2 * time.Second})
	db := cluster.NewDatabase(t)
	other := connect(t, p.dsn(db))
	bigQuery := "SELECT length('" + strings.Repeat("x", 100<<10) + "')"
	othersFit := func(t *testing.T) {
		t.Helper()
		res, err := other.Exec(ctxT(t), bigQuery).ReadAll()
		if err != nil || string(res[0].Rows[0][0]) != "102400" {
			t.Fatalf("another session's 100 KiB query beside the attacker: %v %v", res, err)
		}
	}

	t.Run("claim_over_share_refused", func(t *testing.T) {
		a := rawConnect(t, p.dsn(db))
		a.Write(append(memoryHeader('Q', 64<<20-100), "SELECT "...))
		if used := p.srv.mem.used.Load(); used != 0 {
			t.Fatalf("the claim over the share took %d bytes of the budget", used)
		}
		othersFit(t)
		code, msg := a.closedWithMessage(t)
		if code != "57P05" || !strings.Contains(msg, "message_timeout") {
			t.Fatalf("the stalled claim over the share: got %q %q, want 57P05 naming message_timeout", code, msg)
		}
		// Sent whole, the claim over the share is refused naming it.
		b := rawConnect(t, p.dsn(db))
		b.send(t, &pgproto3.Query{String: "SELECT '" + strings.Repeat("z", 33<<20) + "'"})
		if code, msg := b.closedWithMessage(t); code != "53200" || !strings.Contains(msg, "client_memory") {
			t.Fatalf("a whole message over the share: got %q %q, want 53200 naming client_memory", code, msg)
		}
		if used := p.srv.mem.used.Load(); used != 0 {
			t.Fatalf("%d bytes of the budget still taken", used)
		}
	})
	t.Run("claim_within_share_leaves_the_rest", func(t *testing.T) {
		a := rawConnect(t, p.dsn(db))
		n := 31 << 20 // held: 248 MiB of the 256 MiB share
		a.Write(append(memoryHeader('Q', n), "SELECT "...))
		if err := pgtest.Poll(ctxT(t), func() (bool, error) { return p.srv.mem.used.Load() == heldCost(n), nil }); err != nil {
			t.Fatalf("the attacker's message not held: in use %d, want %d", p.srv.mem.used.Load(), heldCost(n))
		}
		othersFit(t)
		a.Close()
		if err := pgtest.Poll(ctxT(t), func() (bool, error) { return p.srv.mem.used.Load() == 0, nil }); err != nil {
			t.Fatalf("%d bytes still taken after the attacker left", p.srv.mem.used.Load())
		}
	})
}

// TestMessageTimeout: a client that stops half-way through a message held
// whole has its session ended after message_timeout (57P05), and the
// budget it took given back (issue 30, B-M2).
func TestMessageTimeout(t *testing.T) {
	p := startProxy(t, Config{Interceptor: newGate(t), MessageTimeout: 200 * time.Millisecond})
	db := cluster.NewDatabase(t)
	before := p.srv.ops.stats.MessageTimeouts.Load()
	a := rawConnect(t, p.dsn(db))
	a.Write(append(memoryHeader('Q', 1<<20), "SELECT "...))
	code, msg := a.closedWithMessage(t)
	if code != "57P05" || !strings.Contains(msg, "message_timeout") {
		t.Fatalf("a stalled message: got %q %q, want 57P05 naming message_timeout", code, msg)
	}
	if got := p.srv.ops.stats.MessageTimeouts.Load(); got != before+1 {
		t.Fatalf("message timeouts: got %d, want %d", got, before+1)
	}
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return p.srv.mem.used.Load() == 0, nil }); err != nil {
		t.Fatalf("%d bytes still taken after the timeout", p.srv.mem.used.Load())
	}
	// A message that arrives whole in time is not cut off, however long
	// the session then waits.
	c := connect(t, p.dsn(db))
	if _, err := c.Exec(ctxT(t), "SELECT length('"+strings.Repeat("y", 100<<10)+"'), pg_sleep(0.5)").ReadAll(); err != nil {
		t.Fatalf("a whole message answered after message_timeout: %v", err)
	}
}

// closedWithMessage reads until the connection ends and returns the last
// ErrorResponse's SQLSTATE and message.
func (r *rawConn) closedWithMessage(t testing.TB) (string, string) {
	t.Helper()
	r.SetReadDeadline(time.Now().Add(30 * time.Second))
	code, msg := "", ""
	for {
		m, err := r.fe.Receive()
		if err != nil {
			return code, msg
		}
		if e, ok := m.(*pgproto3.ErrorResponse); ok {
			code, msg = e.Code, e.Message
		}
	}
}
