package proxy

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// Nobody pins the fence row (issue 18 §4): a client that falls silent
// while its transaction holds its job's fence row has the session ended
// after GateIdleTimeout, the transaction rolled back, and FN012 when it
// next reads; a takeover waiting behind it goes on.
func init() { registerBypass("idle", bypassIdle) }

const idleBound = 400 * time.Millisecond

// newIdleEnv is newReservedEnv with a gate whose idle bound is short.
func newIdleEnv(t *testing.T) *reservedEnv {
	t.Helper()
	e := newEnv(t, envSpec{gate: FenceConfig{GateIdleTimeout: idleBound}})
	return &reservedEnv{fenceEnv: e, lease: e.acquire(t, "r", "w1", time.Minute)}
}

// waitRowFree waits until job r's fence row can be locked (the holder's
// transaction is gone), or fails after a generous deadline.
func (e *reservedEnv) waitRowFree(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*idleBound+10*time.Second)
	defer cancel()
	if err := pgtest.Poll(ctx, func() (bool, error) { return e.fenceRowFree(t, "r"), nil }); err != nil {
		t.Fatalf("the fence row is still held: %v", err)
	}
}

// wantHeld checks the holder has the fence row right now.
func (e *reservedEnv) wantHeld(t *testing.T) {
	t.Helper()
	if e.fenceRowFree(t, "r") {
		t.Fatal("the holder does not hold the fence row")
	}
}

func bypassIdle(t *testing.T) {
	ins := func(e *reservedEnv) string {
		return fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'idle', %d)", e.lease.Token)
	}
	// Each case leaves the holder silent while it holds the row; then
	// the row must come free, nothing be committed, and the holder's
	// next request fail with FN012.
	cases := []struct {
		name string
		hold func(t *testing.T, e *reservedEnv, c *pgx.Conn)
	}{
		{"idle_in_transaction_simple", func(t *testing.T, e *reservedEnv, c *pgx.Conn) {
			idleExec(t, c, pgx.QueryExecModeSimpleProtocol, "BEGIN", ins(e))
		}},
		{"idle_in_transaction_extended", func(t *testing.T, e *reservedEnv, c *pgx.Conn) {
			idleExec(t, c, pgx.QueryExecModeCacheStatement, "BEGIN", ins(e))
		}},
		{"execute_without_sync", func(t *testing.T, e *reservedEnv, c *pgx.Conn) {
			rawUntil(t, c.PgConn(), 'C', &pgproto3.Parse{Query: ins(e)}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Flush{})
		}},
		{"suspended_portal_without_sync", func(t *testing.T, e *reservedEnv, c *pgx.Conn) {
			idleExec(t, c, pgx.QueryExecModeSimpleProtocol, "BEGIN", ins(e))
			rawUntil(t, c.PgConn(), 's', &pgproto3.Parse{Query: "SELECT generate_series(1, 10)"}, &pgproto3.Bind{}, &pgproto3.Execute{MaxRows: 1}, &pgproto3.Flush{})
		}},
		{"copy_from_without_data", func(t *testing.T, e *reservedEnv, c *pgx.Conn) {
			idleExec(t, c, pgx.QueryExecModeSimpleProtocol, "BEGIN", ins(e))
			rawUntil(t, c.PgConn(), 'G', &pgproto3.Query{String: "COPY results (job_key, payload, token) FROM STDIN"})
		}},
		{"gated_copy_from_partial_data", func(t *testing.T, e *reservedEnv, c *pgx.Conn) {
			rawUntil(t, c.PgConn(), 'G', &pgproto3.Query{String: "COPY results (job_key, payload, token) FROM STDIN"})
			fe := c.PgConn().Frontend()
			fe.Send(&pgproto3.CopyData{Data: []byte(fmt.Sprintf("r\tcopy\t%d\n", e.lease.Token))})
			if err := fe.Flush(); err != nil {
				t.Fatal(err)
			}
		}},
		{"fence_gate_called_without_metadata", func(t *testing.T, e *reservedEnv, c *pgx.Conn) {
			idleExec(t, c, pgx.QueryExecModeSimpleProtocol, "BEGIN",
				fmt.Sprintf("SELECT fence.gate('r', %d, %d, '')", e.lease.Epoch, e.lease.Token))
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newIdleEnv(t)
			lease := &e.lease
			if strings.HasPrefix(c.name, "fence_gate_called") {
				lease = nil
			}
			conn := e.mustConnect(t, client{lease: lease})
			before := e.snapshot(t)
			c.hold(t, e, conn)
			e.wantHeld(t)
			e.waitRowFree(t)
			e.unchanged(t, before)
			// Its next request gets the reason.
			_, err := conn.Exec(ctxT(t), "SELECT 1")
			wantCode(t, err, fence.CodeGateTimeout)
		})
	}

	// Round 3, H-M2: a holder that pipelines requests and never reads
	// their answers keeps the server waiting for it, not working for it:
	// silent all the same, it is ended after the bound.
	t.Run("pipelines_never_reads", func(t *testing.T) {
		t.Parallel()
		e := newIdleEnv(t)
		conn := e.mustConnect(t, client{lease: &e.lease})
		before := e.snapshot(t)
		idleExec(t, conn, pgx.QueryExecModeSimpleProtocol, "BEGIN", ins(e))
		e.wantHeld(t)
		fe := conn.PgConn().Frontend()
		sent := make(chan struct{})
		go func() {
			defer close(sent)
			// A few requests whose answers fill every buffer between
			// the server and the client: it is silent at once. Its
			// writes would block once the proxy stops reading it; the
			// session's end unblocks them.
			for i := 0; i < 200; i++ {
				fe.Send(&pgproto3.Query{String: "SELECT repeat('x', 1000000)"})
			}
			fe.Flush()
		}()
		e.waitRowFree(t)
		<-sent // before the connection's cleanup uses its frontend
		e.unchanged(t, before)
	})

	// Round 4, I-M1: a holder whose last batch has no Sync or Flush: the
	// server answers nothing until the client sends one; silent.
	t.Run("batch_left_open", func(t *testing.T) {
		t.Parallel()
		e := newIdleEnv(t)
		conn := e.mustConnect(t, client{lease: &e.lease})
		before := e.snapshot(t)
		idleExec(t, conn, pgx.QueryExecModeSimpleProtocol, "BEGIN", ins(e))
		e.wantHeld(t)
		fe := conn.PgConn().Frontend()
		fe.Send(&pgproto3.Parse{Query: "SELECT 1"})
		fe.Send(&pgproto3.Bind{})
		fe.Send(&pgproto3.Execute{})
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		e.waitRowFree(t)
		e.unchanged(t, before)
	})

	// Keepalives are not talk: a client that holds the row and sends only
	// messages that ask the server for nothing new (Flush, Sync, Describe
	// or Close of what it already has, empty COPY data) is as silent as one
	// that sends nothing, and is ended after the bound too (issue 30: a
	// Flush every few seconds after an Execute kept the row locked).
	keepalives := []struct {
		name string
		hold func(t *testing.T, e *reservedEnv, c *pgx.Conn)
		ping []pgproto3.FrontendMessage
	}{
		{"flush_after_execute", func(t *testing.T, e *reservedEnv, c *pgx.Conn) {
			rawUntil(t, c.PgConn(), 'C', &pgproto3.Parse{Query: ins(e)}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Flush{})
		}, []pgproto3.FrontendMessage{&pgproto3.Flush{}}},
		{"sync_in_transaction", func(t *testing.T, e *reservedEnv, c *pgx.Conn) {
			idleExec(t, c, pgx.QueryExecModeSimpleProtocol, "BEGIN", ins(e))
		}, []pgproto3.FrontendMessage{&pgproto3.Sync{}}},
		{"describe_statement", func(t *testing.T, e *reservedEnv, c *pgx.Conn) {
			idleExec(t, c, pgx.QueryExecModeSimpleProtocol, "BEGIN", ins(e))
			rawUntil(t, c.PgConn(), 'Z', &pgproto3.Parse{Name: "ka", Query: "SELECT 1"}, &pgproto3.Sync{})
		}, []pgproto3.FrontendMessage{&pgproto3.Describe{ObjectType: 'S', Name: "ka"}, &pgproto3.Flush{}}},
		{"close_unknown_portal", func(t *testing.T, e *reservedEnv, c *pgx.Conn) {
			idleExec(t, c, pgx.QueryExecModeSimpleProtocol, "BEGIN", ins(e))
		}, []pgproto3.FrontendMessage{&pgproto3.Close{ObjectType: 'P', Name: "nothing"}, &pgproto3.Flush{}}},
		{"empty_copy_data", func(t *testing.T, e *reservedEnv, c *pgx.Conn) {
			rawUntil(t, c.PgConn(), 'G', &pgproto3.Query{String: "COPY results (job_key, payload, token) FROM STDIN"})
		}, []pgproto3.FrontendMessage{&pgproto3.CopyData{Data: []byte{}}}},
	}
	for _, c := range keepalives {
		t.Run("keepalive_"+c.name, func(t *testing.T) {
			t.Parallel()
			e := newIdleEnv(t)
			conn := e.mustConnect(t, client{lease: &e.lease})
			before := e.snapshot(t)
			c.hold(t, e, conn)
			e.wantHeld(t)
			stop := make(chan struct{})
			pinged := make(chan struct{})
			go func() {
				defer close(pinged)
				fe := conn.PgConn().Frontend()
				for {
					select {
					case <-stop:
						return
					case <-time.After(idleBound / 4): // pacing the client's own traffic, not ordering events
					}
					for _, m := range c.ping {
						fe.Send(m)
					}
					if fe.Flush() != nil {
						return
					}
				}
			}()
			e.waitRowFree(t)
			close(stop)
			<-pinged
			e.unchanged(t, before)
			wantEndedWith(t, conn.PgConn(), fence.CodeGateTimeout)
		})
	}

	// Round 8 (O-M1): a COMMIT the server completed, without a Sync
	// after it, then silence: if the watchdog ends the session, it must
	// not say the transaction was rolled back (it committed; a client
	// that believed it could redo the work under a new lease).
	t.Run("commit_without_sync_not_told_rolled_back", func(t *testing.T) {
		t.Parallel()
		e := newIdleEnv(t)
		conn := e.mustConnect(t, client{lease: &e.lease})
		pc := conn.PgConn()
		rawUntilN(t, pc, 'C', 2, &pgproto3.Parse{Query: ins(e)}, &pgproto3.Bind{}, &pgproto3.Execute{},
			&pgproto3.Parse{Query: "COMMIT"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Flush{})
		e.wantCommittedWithReceipt(t, "idle")
		pc.Conn().SetReadDeadline(time.Now().Add(10 * idleBound))
		for {
			m, err := pc.Frontend().Receive()
			if err != nil {
				return // not ended, or ended without a word: nothing untrue said
			}
			if er, ok := m.(*pgproto3.ErrorResponse); ok {
				if strings.Contains(er.Message, "rolled back") {
					t.Fatalf("told %s %q after its COMMIT committed", er.Code, er.Message)
				}
				return
			}
		}
	})

	// Not ended: a holder whose server is working (a slow statement), and
	// a holder that keeps talking.
	t.Run("busy_server_not_ended", func(t *testing.T) {
		t.Parallel()
		e := newIdleEnv(t)
		c := e.mustConnect(t, client{lease: &e.lease, mode: pgx.QueryExecModeSimpleProtocol})
		idleExec(t, c, pgx.QueryExecModeSimpleProtocol, "BEGIN", ins(e),
			fmt.Sprintf("SELECT pg_sleep(%f)", (3*idleBound).Seconds()), "COMMIT")
		e.wantCommittedWithReceipt(t, "idle")
	})
	t.Run("talking_client_not_ended", func(t *testing.T) {
		t.Parallel()
		e := newIdleEnv(t)
		c := e.mustConnect(t, client{lease: &e.lease, mode: pgx.QueryExecModeSimpleProtocol})
		idleExec(t, c, pgx.QueryExecModeSimpleProtocol, "BEGIN", ins(e))
		for end := time.Now().Add(3 * idleBound); time.Now().Before(end); {
			time.Sleep(idleBound / 4) // pacing the client's own traffic, not ordering events
			idleExec(t, c, pgx.QueryExecModeSimpleProtocol, "SELECT 1")
		}
		idleExec(t, c, pgx.QueryExecModeSimpleProtocol, "COMMIT")
		e.wantCommittedWithReceipt(t, "idle")
	})
}

func idleExec(t *testing.T, c *pgx.Conn, mode pgx.QueryExecMode, sqls ...string) {
	t.Helper()
	for _, q := range sqls {
		if _, err := c.Exec(ctxT(t), q, mode); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
}

// rawUntil sends msgs on c's connection and reads until a message of type
// want (ParseComplete '1', CommandComplete 'C', PortalSuspended 's',
// CopyInResponse 'G', ReadyForQuery 'Z'), failing on an error.
func rawUntil(t *testing.T, c *pgconn.PgConn, want byte, msgs ...pgproto3.FrontendMessage) {
	t.Helper()
	fe := c.Frontend()
	for _, m := range msgs {
		fe.Send(m)
	}
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		var got byte
		switch m := m.(type) {
		case *pgproto3.ErrorResponse:
			t.Fatalf("error %s: %s", m.Code, m.Message)
		case *pgproto3.CommandComplete:
			got = 'C'
		case *pgproto3.PortalSuspended:
			got = 's'
		case *pgproto3.CopyInResponse:
			got = 'G'
		case *pgproto3.ReadyForQuery:
			got = 'Z'
		}
		if got == want {
			return
		}
	}
}

// wantEndedWith reads c's connection, skipping what the server answered
// before, until the error that ended the session, and checks its code.
func wantEndedWith(t *testing.T, c *pgconn.PgConn, code string) {
	t.Helper()
	fe := c.Frontend()
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatalf("the session ended without an error (want %s): %v", code, err)
		}
		if e, ok := m.(*pgproto3.ErrorResponse); ok {
			if e.Code != code {
				t.Fatalf("got error %s (%s), want %s", e.Code, e.Message, code)
			}
			return
		}
	}
}
