package proxy

import (
	"context"
	"encoding/binary"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/wire"
)

// TestBypass/memory: clients cannot make the proxy hold more than its
// limits (issue 18 §6). Before authentication only startup-sized messages
// are read; after it, a message held whole for the write gate must fit
// the memory budget before its body is read, else its session gets 53200
// and is closed, and no other session notices. Each attempt that would
// write does so to a canary table, which a direct connection checks.
func init() { registerBypass("memory", testBypassMemory) }

// memoryHuge is the length the unauthenticated attempts claim: 48 MiB,
// the issue's.
const memoryHuge = 48 << 20

// memoryHeader is a message header claiming n body bytes.
func memoryHeader(typ byte, n int) []byte {
	h := make([]byte, headerLen)
	wire.PutHeader(h, typ, n)
	return h
}

func testBypassMemory(t *testing.T) {
	ae := newAuthEnv(t, Config{})
	ae.p.srv.mem.peak.Store(0)

	// startup sends a raw startup packet for user to the auth proxy.
	startup := func(t *testing.T, user string) *rawConn {
		t.Helper()
		r := rawStart(t, ae.p.addr.String())
		if user != "" {
			r.fe.Send(&pgproto3.StartupMessage{ProtocolVersion: pgproto3.ProtocolVersionNumber, Parameters: map[string]string{"user": user, "database": ae.db}})
			r.fe.Flush()
		}
		return r
	}
	// expectAuth reads the server's first authentication request, which
	// must be of want's type (nil: AuthenticationSASL).
	expectAuth := func(t *testing.T, r *rawConn, want pgproto3.BackendMessage) {
		t.Helper()
		if want == nil {
			want = &pgproto3.AuthenticationSASL{}
		}
		r.SetReadDeadline(time.Now().Add(30 * time.Second))
		m, err := r.fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprintf("%T", m) != fmt.Sprintf("%T", want) {
			t.Fatalf("got %T, want %T", m, want)
		}
	}
	refusedUnread := func(t *testing.T, r *rawConn, what string) {
		t.Helper()
		if code := r.closedWith(t); code != "08P01" {
			t.Fatalf("%s: got %q, want 08P01 and the connection closed", what, code)
		}
		if peak := ae.p.srv.mem.peak.Load(); peak != 0 {
			t.Fatalf("%s: %d bytes of the budget taken before authentication", what, peak)
		}
		ae.noCanary(t)
	}

	// hugeStartup is the start of a startup packet claiming 48 MiB.
	hugeStartup := make([]byte, 8)
	binary.BigEndian.PutUint32(hugeStartup, memoryHuge)
	binary.BigEndian.PutUint32(hugeStartup[4:], protocol30)

	t.Run("startup_packet_48MiB", func(t *testing.T) {
		r := startup(t, "")
		r.Write(hugeStartup)
		refusedUnread(t, r, "a 48 MiB startup packet")
	})
	t.Run("ssl_request_then_48MiB", func(t *testing.T) {
		r := startup(t, "")
		r.Write([]byte{0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f})
		var b [1]byte
		if _, err := r.Read(b[:]); err != nil || b[0] != 'N' {
			t.Fatalf("SSLRequest: got %q %v, want N", b, err)
		}
		r.Write(hugeStartup)
		refusedUnread(t, r, "a 48 MiB startup packet after SSLRequest")
	})
	// Where the password goes: a 48 MiB message of type typ, after the
	// server's first request (auth) and, for scramFirst, the client-first
	// SCRAM round.
	for _, c := range []struct {
		name, user string
		auth       pgproto3.BackendMessage
		scramFirst bool
		typ        byte
		what       string
	}{
		{"sasl_initial_48MiB", "auth_alice", nil, false, 'p', "a 48 MiB SASLInitialResponse"},
		{"sasl_response_48MiB", "auth_alice", nil, true, 'p', "a 48 MiB SASLResponse"},
		{"md5_password_48MiB", "auth_md5", &pgproto3.AuthenticationMD5Password{}, false, 'p', "a 48 MiB PasswordMessage"},
		{"query_before_authentication", "auth_alice", nil, false, 'Q', "a 48 MiB Query instead of the password"},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := startup(t, c.user)
			expectAuth(t, r, c.auth)
			if c.scramFirst {
				if got := r.step(t, true, "n,,n=,r=abcdef"); !strings.HasPrefix(got, "r=abcdef") {
					t.Fatalf("server-first: %s", got)
				}
			}
			r.Write(memoryHeader(c.typ, memoryHuge))
			refusedUnread(t, r, c.what)
		})
	}

	// After authentication: the write gate holds big messages whole.
	const budget = 2 << 20
	// ClientMemory: the whole budget, so that one session's held message
	// can fill it (the share itself: TestClientMemoryShare).
	p := startProxy(t, Config{MemoryBudget: budget, ClientMemory: budget, MaxMessageSize: 1 << 20, Interceptor: newGate(t)})
	db := ae.db
	other := connect(t, p.dsn(db))
	big := func(n int) string { return "'" + strings.Repeat("x", n) + "'" }
	insert := func(n int) string { return "INSERT INTO auth_canary VALUES (" + big(n) + ")" }
	overBudget := func(t *testing.T, r *rawConn, what string) {
		t.Helper()
		if code := r.closedWith(t); code != "53200" {
			t.Fatalf("%s: got %q, want 53200 and the session closed", what, code)
		}
		if used := p.srv.mem.used.Load(); used != 0 {
			t.Fatalf("%s: %d bytes of the budget still taken", what, used)
		}
		if _, err := other.Exec(ctxT(t), "SELECT 1").ReadAll(); err != nil {
			t.Fatalf("%s: another session: %v", what, err)
		}
		ae.noCanary(t)
	}
	over := budget/heldMessageCost + 1 // held, it would not fit

	t.Run("held_query_over_budget", func(t *testing.T) {
		r := rawConnect(t, p.dsn(db))
		r.send(t, &pgproto3.Query{String: insert(over)})
		overBudget(t, r, "a Query over the budget")
	})
	t.Run("held_parse_over_budget", func(t *testing.T) {
		r := rawConnect(t, p.dsn(db))
		r.send(t, &pgproto3.Parse{Query: insert(over)}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{})
		overBudget(t, r, "a Parse over the budget")
	})
	t.Run("held_bind_over_budget", func(t *testing.T) {
		r := rawConnect(t, p.dsn(db))
		r.send(t, &pgproto3.Parse{Query: "INSERT INTO auth_canary VALUES ($1)"},
			&pgproto3.Bind{Parameters: [][]byte{[]byte(strings.Repeat("y", over))}}, &pgproto3.Execute{}, &pgproto3.Sync{})
		overBudget(t, r, "a Bind over the budget")
	})
	t.Run("slow_sender_holds_only_its_share", func(t *testing.T) {
		// A sends most of a big INSERT and stops: its message is held,
		// taking its share. B's big query does not fit beside it: B is
		// refused, A and everyone else go on; A's INSERT lands.
		n := over / 2
		a := rawConnect(t, p.dsn(db))
		msg, _ := (&pgproto3.Query{String: insert(n)}).Encode(nil)
		a.Write(msg[:len(msg)-1])
		cost := heldCost(len(msg) - headerLen)
		if err := pgtest.Poll(ctxT(t), func() (bool, error) { return p.srv.mem.used.Load() == cost, nil }); err != nil {
			t.Fatalf("A's message not held: budget in use %d, want %d", p.srv.mem.used.Load(), cost)
		}
		b := rawConnect(t, p.dsn(db))
		b.send(t, &pgproto3.Query{String: insert(n + 1000)})
		if code := b.closedWith(t); code != "53200" {
			t.Fatalf("B beside A: got %q, want 53200", code)
		}
		if _, err := other.Exec(ctxT(t), "SELECT 1").ReadAll(); err != nil {
			t.Fatalf("another session: %v", err)
		}
		ae.noCanary(t)
		a.Write(msg[len(msg)-1:])
		got, _ := a.untilReady(t)
		want(t, "A's INSERT", got, "CommandComplete", "Z:I")
		wantRows(t, db, "auth_canary", 1)
		if used := p.srv.mem.used.Load(); used != 0 {
			t.Fatalf("%d bytes of the budget still taken after A", used)
		}
		c, _ := cluster.Primary.Connect(ctxT(t), db)
		c.Exec(ctxT(t), "TRUNCATE auth_canary")
		c.Close(context.Background())
	})
	t.Run("pipelined_big_queries_held_one_at_a_time", func(t *testing.T) {
		// Four queries that fit the budget one at a time but not
		// together, pipelined on one session: each is held alone.
		p.srv.mem.peak.Store(0)
		r := rawConnect(t, p.dsn(db))
		n := over / 2
		var msgs []pgproto3.FrontendMessage
		for range 4 {
			msgs = append(msgs, &pgproto3.Query{String: "SELECT length(" + big(n) + ")"})
		}
		r.send(t, msgs...)
		for range 4 {
			got, _ := r.untilReady(t)
			want(t, "a pipelined big query", got, "RowDescription", "DataRow", "CommandComplete", "Z:I")
		}
		if peak := p.srv.mem.peak.Load(); peak > budget/2+budget/heldMessageCost {
			t.Fatalf("peak budget use %d: more than one query held at once", peak)
		}
		ae.noCanary(t)
	})
	t.Run("over_the_limit_never_held", func(t *testing.T) {
		// A message over max_message_size is dropped as it arrives and
		// answered with 54000: it takes nothing from the budget.
		p.srv.mem.peak.Store(0)
		r := rawConnect(t, p.dsn(db))
		r.send(t, &pgproto3.Query{String: insert(8 << 20)})
		got, _ := r.untilReady(t)
		want(t, "an 8 MiB query over the 1 MiB limit", got, "E:54000", "Z:I")
		if peak := p.srv.mem.peak.Load(); peak != 0 {
			t.Fatalf("the oversized message took %d bytes of the budget", peak)
		}
		ae.noCanary(t)
	})
}
