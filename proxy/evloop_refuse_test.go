//go:build unix

package proxy

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestRefusedWithoutLoop: there is one relay engine, the event loop, so a
// session the loop cannot take is refused, never relayed some other way.
// While the loop cannot be started (its poller wants a descriptor the
// process is out of, stood in for by start), a client is refused with
// 53000 and a hint at the cause, and no upstream backend is opened for
// it; once the loop can start again, the next client is served by it.
// (With a fallback relay instead, the first client would be served.)
func TestRefusedWithoutLoop(t *testing.T) {
	for _, gate := range []bool{false, true} {
		t.Run(fmt.Sprintf("gate=%v", gate), func(t *testing.T) {
			cfg := Config{}
			if gate {
				cfg.Interceptor = newGate(t)
			}
			p, db := relayed(t, Config{}, cfg)
			setLoopStart(p, func(string) (*evloop, error) { return nil, syscall.EMFILE })

			_, err := pgconn.Connect(ctxT(t), p.dsn(db)+"&application_name=refused")
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != "53000" || !strings.Contains(pe.Hint, "ulimit -n") {
				t.Fatalf("connect while the loop cannot start: %v, want 53000 with a hint at ulimit -n", err)
			}
			if !strings.Contains(pe.Message, "cannot relay") {
				t.Fatalf("message %q does not say the session cannot be relayed", pe.Message)
			}
			if n := p.srv.ops.stats.Refused()["53000"]; n != 1 {
				t.Fatalf("refusals counted with 53000: %d, want 1", n)
			}
			// Seen on a separate connection: the refused client got no
			// backend (none was opened for it, so there is none to wait
			// for).
			admin := cluster.Primary.MustConnect(t, db)
			var backends int
			if err := admin.QueryRow(ctxT(t), "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'refused'").Scan(&backends); err != nil {
				t.Fatal(err)
			}
			if backends != 0 {
				t.Fatalf("%d backends for the refused client, want 0", backends)
			}

			setLoopStart(p, nil) // newEvloop: the loop can start now
			c, err := pgx.Connect(ctxT(t), p.dsn(db))
			if err != nil {
				t.Fatalf("connect once the loop can start: %v", err)
			}
			defer c.Close(ctxT(t))
			var one int
			if err := c.QueryRow(ctxT(t), "SELECT 1").Scan(&one); err != nil || one != 1 {
				t.Fatalf("SELECT 1 on the loop: %v %d", err, one)
			}
			if p.srv.ops.stats.SessionsLoop.Load() != 1 {
				t.Fatal("the session after the failure was not on the loop")
			}
		})
	}
}

// setLoopStart has p's Server start its event loop with start (nil:
// newEvloop) from its next session on.
func setLoopStart(p *testProxy, start func(string) (*evloop, error)) {
	p.srv.loop.mu.Lock()
	p.srv.loop.start = start
	p.srv.loop.mu.Unlock()
}

// TestNoEventLoopSelectsPoll: DisableEventLoop (no_event_loop), which once
// selected the goroutine relay, is deprecated: it selects the poll poller,
// says so in a warning, and sessions are relayed by the loop waiting in
// poll(2). Asked together with poller "epoll" it is a configuration error
// rather than one of the two silently winning.
func TestNoEventLoopSelectsPoll(t *testing.T) {
	core, logs := observer.New(zapcore.WarnLevel)
	p := startProxyLog(t, Config{DisableEventLoop: true}, zap.New(core))
	if logs.FilterMessageSnippet("no_event_loop is deprecated").Len() != 1 {
		t.Fatalf("warnings: %v, want one that no_event_loop is deprecated", logs.All())
	}
	c := connect(t, p.dsn(cluster.NewDatabase(t)))
	mustExec(t, c, "SELECT 1")
	p.srv.loop.mu.Lock()
	used := p.srv.loop.used
	p.srv.loop.mu.Unlock()
	if used != "poll" {
		t.Fatalf("the loop runs poller %q, want poll", used)
	}
	if runtime.GOOS == "linux" {
		_, err := New(Config{Primary: cluster.Primary.DSN("postgres"), DisableEventLoop: true, Poller: "epoll"}, nil)
		if err == nil || !strings.Contains(err.Error(), "no_event_loop") {
			t.Fatalf("DisableEventLoop with poller epoll: %v, want a configuration error naming no_event_loop", err)
		}
	}
}
