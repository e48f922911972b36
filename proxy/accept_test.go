package proxy

import (
	"context"
	"errors"
	"net"
	"net/http/httptest"
	"os"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"
)

// failingListener returns the errors queued in errs from Accept, one per
// call, before it accepts a connection.
type failingListener struct {
	net.Listener
	errs chan error
}

func (l *failingListener) Accept() (net.Conn, error) {
	select {
	case err := <-l.errs:
		return nil, err
	default:
		return l.Listener.Accept()
	}
}

// acceptErr is err as a TCP listener's Accept returns it.
func acceptErr(errno syscall.Errno) error {
	return &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", errno)}
}

// TestAcceptErrorsBackOff: accept errors for want of descriptors or
// memory, or of a connection that failed before it was taken, do not
// end Serve: it waits and accepts again, logs an episode once, however
// many accepts failed in it, and its end once (a second episode soon
// after is not logged again), and counts every failure in SHOW
// FENCE_STATS and /metrics. Another error still ends Serve.
func TestAcceptErrorsBackOff(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	log := zap.New(zapcore.NewTee(zaptest.NewLogger(t).Core(), core))
	srv, err := New(withConsole(Config{Primary: cluster.Primary.DSN("postgres"), Auth: AuthTrust, Poller: testPoller,
		Interceptor: newGate(t)}), log)
	if err != nil {
		t.Fatal(err)
	}
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inner.Close() })
	ln := &failingListener{Listener: inner, errs: make(chan error, 16)}
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.EMFILE, syscall.ENFILE, syscall.EMFILE} {
		ln.errs <- acceptErr(e)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(context.Background(), ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	})
	p := &testProxy{srv: srv, addr: inner.Addr().(*net.TCPAddr), done: done}
	db := cluster.NewDatabase(t)

	// The first episode: four failures, then this client.
	wantValue(t, connect(t, p.dsn(db)), "SELECT 1", "1")
	starts := logs.FilterMessageSnippet("accept failing")
	ends := logs.FilterMessageSnippet("accepting again")
	if starts.Len() != 1 || ends.Len() != 1 {
		t.Fatalf("%d log lines \"accept failing\" and %d \"accepting again\" after one episode of 4 failures, want 1 of each", starts.Len(), ends.Len())
	}
	if got := ends.All()[0].ContextMap()["failed_accepts"]; got != int64(4) {
		t.Errorf("accepting again: failed_accepts %v, want 4", got)
	}

	// A second episode soon after (a connection aborted, kernel memory
	// short): counted, not logged again. Serve is in Accept now: the
	// next client is accepted, then the errors come, then the client
	// after ends the episode.
	ln.errs <- acceptErr(syscall.ECONNABORTED)
	ln.errs <- acceptErr(syscall.ENOBUFS)
	wantValue(t, connect(t, p.dsn(db)), "SELECT 2", "2")
	wantValue(t, connect(t, p.dsn(db)), "SELECT 3", "3")
	if n, m := logs.FilterMessageSnippet("accept failing").Len(), logs.FilterMessageSnippet("accepting again").Len(); n != 1 || m != 1 {
		t.Errorf("after a second episode within %s: %d log lines \"accept failing\" and %d \"accepting again\", want 1 of each", acceptLogEvery, n, m)
	}

	adm, err := consoleConnect(t, p, "admin", consolePassword("admin"))
	if err != nil {
		t.Fatal(err)
	}
	if got := stats(t, adm)["accept_errors"]; got != 6 {
		t.Errorf("SHOW FENCE_STATS accept_errors: got %d, want 6", got)
	}
	hs := httptest.NewServer(srv.MetricsHandler())
	t.Cleanup(hs.Close)
	_, body := scrape(t, hs.URL+"/metrics")
	if got := metric(t, body, "pgfence_accept_errors_total"); got != 6 {
		t.Errorf("pgfence_accept_errors_total: got %v, want 6", got)
	}

	// Any other error ends Serve, as before.
	boom := errors.New("listener broke")
	ln.errs <- boom
	connect(t, p.dsn(db)) // accepted; the next Accept returns boom
	if err := <-done; !errors.Is(err, boom) {
		t.Errorf("Serve returned %v, want %v", err, boom)
	}
}
