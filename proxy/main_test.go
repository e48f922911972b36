package proxy

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/testbin"
	"github.com/pgfence/pgfence/migrations"
)

var cluster *pgtest.Cluster

const (
	scramUser     = "scram_user"
	scramPassword = "correct horse battery staple"
)

func TestMain(m *testing.M) {
	flag.Parse()
	if fuzzing() {
		// Fuzz targets are pure; do not start PostgreSQL in every worker.
		os.Exit(m.Run())
	}
	code := pgtest.Run(m, pgtest.Options{
		// Read routing's tests need a streaming replica (route_test.go);
		// everything else uses the primary.
		Replica: true,
		// Prepared transactions are on, as a DBA may have them for other
		// applications: the database then refuses PREPARE after a fenced
		// write itself (0A000), which TestBypass/prepare attacks, and every
		// gated session runs with that guard.
		Settings: map[string]string{"max_prepared_transactions": "4"},
		// The upstream demands SCRAM for this role, so tests prove the
		// proxy authenticates upstream with the configured password.
		// The auth tests' roles get what their group says
		// (bypass_auth_test.go).
		HBA: []string{
			"host all " + scramUser + " 127.0.0.1/32 scram-sha-256",
			"host all +" + authGroupSCRAM + " 127.0.0.1/32 scram-sha-256",
			"host all +" + authGroupMD5 + " 127.0.0.1/32 md5",
			"host all +" + authGroupPassword + " 127.0.0.1/32 password",
		},
	}, func(ctx context.Context, conn *pgx.Conn) error {
		if _, err := conn.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN SUPERUSER PASSWORD '%s'", scramUser, scramPassword)); err != nil {
			return err
		}
		// The write gate's tests need the fence schema.
		return migrations.Prepare(ctx, conn)
	}, &cluster)
	// Built once for the tests that run pgfence serve (startFenceServe).
	testbin.Remove()
	os.Exit(code)
}

func fuzzing() bool {
	fz, w := flag.Lookup("test.fuzz"), flag.Lookup("test.fuzzworker")
	return (fz != nil && fz.Value.String() != "") || (w != nil && w.Value.String() == "true")
}

// testProxy is a running proxy in front of the test cluster.
type testProxy struct {
	srv  *Server
	addr *net.TCPAddr
	done chan error
}

// startProxy starts a proxy with cfg (Primary filled in when empty).
func startProxy(t testing.TB, cfg Config) *testProxy {
	t.Helper()
	return startProxyLog(t, cfg, zaptest.NewLogger(t))
}

// startProxyLog is startProxy logging to log (benchmarks keep the
// per-message debug logging of zaptest out of their figures).
func startProxyLog(t testing.TB, cfg Config, log *zap.Logger) *testProxy {
	t.Helper()
	if cfg.Primary == "" {
		cfg.Primary = cluster.Primary.DSN("postgres")
	}
	if cfg.Poller == "" {
		cfg.Poller = testPoller
	}
	if cfg.Auth == "" {
		// The tests connect as roles without passwords unless they test
		// authentication, which they then name (the default is
		// AuthPostgres).
		cfg.Auth = AuthTrust
	}
	srv, err := New(cfg, log)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &testProxy{srv: srv, addr: ln.Addr().(*net.TCPAddr), done: make(chan error, 1)}
	started.Store(t, p)
	go func() { p.done <- srv.Serve(context.Background(), ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Logf("shutdown: %v", err)
		}
		if err := <-p.done; !errors.Is(err, ErrServerClosed) {
			t.Errorf("Serve returned %v, want ErrServerClosed", err)
		}
	})
	return p
}

// started is the last proxy each test started (bothRelays checks it).
var started sync.Map // testing.TB → *testProxy

// testPoller is the Config.Poller of every test proxy whose Config names
// none: PGFENCE_TEST_POLLER=poll runs the package's tests, the event
// loop's all included, on the poll(2) poller.
var testPoller = os.Getenv("PGFENCE_TEST_POLLER")

// bothRelays runs f four times: pass-through sessions relayed by the
// event loop thread waiting in the platform's default poller (epoll on
// Linux) and in poll(2) (Config.Poller "poll"); then the same with the
// write gate intercepting every message, as pgfence serve runs (no table
// is protected, so the gate must be invisible). It checks that each mode
// was really the one used: every session the test's proxy opened was on
// the loop (counted once its proxy has shut down, when every session has
// ended), on the mode's poller. f must build its proxy's Config with
// withRelay.
func bothRelays(t *testing.T, f func(t *testing.T, relay Config)) {
	for _, mode := range []struct {
		name string
		cfg  Config
		gate bool
	}{
		{"event_loop", Config{}, false},
		{"poll", Config{Poller: "poll"}, false},
		{"gate_event_loop", Config{}, true},
		{"gate_poll", Config{Poller: "poll"}, true},
	} {
		t.Run(mode.name, func(t *testing.T) {
			cfg := mode.cfg
			if mode.gate {
				cfg.Interceptor = newGate(t)
			}
			var tp *testProxy
			// Registered first, so run last: after the proxy's Shutdown.
			t.Cleanup(func() {
				if tp == nil {
					return
				}
				st := &tp.srv.ops.stats
				looped, total := st.SessionsLoop.Load(), st.SessionsTotal.Load()
				if looped == 0 || looped != total {
					t.Errorf("%d of %d sessions used the event loop, want all", looped, total)
				}
			})
			f(t, cfg)
			v, ok := started.LoadAndDelete(t)
			if !ok {
				t.Fatal("the test did not start a proxy with startProxy")
			}
			tp = v.(*testProxy)
			if tp.srv.cfg.Interceptor != cfg.Interceptor {
				t.Fatal("the test's proxy does not have the mode's interceptor (build its Config with withRelay)")
			}
			tp.srv.loop.mu.Lock() // get sets used under it, on the first session's goroutine
			used := tp.srv.loop.used
			tp.srv.loop.mu.Unlock()
			if used != wantPoller(tp.srv.cfg.Poller) {
				t.Errorf("the event loop ran with poller %q, want %q", used, wantPoller(tp.srv.cfg.Poller))
			}
		})
	}
}

// newGate is a write gate for the test cluster, closed at the end of t.
func newGate(t testing.TB) *Fence { return newGateWith(t, FenceConfig{}, nil) }

// newGateWith is newGate with cfg (its Primary is the test cluster's) and
// log (zaptest's when nil).
func newGateWith(t testing.TB, cfg FenceConfig, log *zap.Logger) *Fence {
	t.Helper()
	cfg.Primary = cluster.Primary.DSN("postgres")
	if log == nil {
		log = zaptest.NewLogger(t)
	}
	gate, err := NewFence(cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(gate.Close)
	return gate
}

// wantPoller is the poller a loop runs with Config.Poller kind.
func wantPoller(kind string) string {
	if kind == "" {
		return defaultPoller
	}
	return kind
}

// withRelay is cfg with the relay mode of bothRelays (and its write gate,
// unless cfg has an Interceptor of its own).
func withRelay(relay, cfg Config) Config {
	if cfg.Poller == "" {
		cfg.Poller = relay.Poller
	}
	if cfg.Interceptor == nil {
		cfg.Interceptor = relay.Interceptor
	}
	return cfg
}

// dsn is a connection string for db through the proxy as postgres.
func (p *testProxy) dsn(db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", p.addr.Port, db)
}

// relayed is a proxy started with cfg in relay's mode (withRelay), and a
// fresh database.
func relayed(t *testing.T, relay, cfg Config) (*testProxy, string) {
	t.Helper()
	return startProxy(t, withRelay(relay, cfg)), cluster.NewDatabase(t)
}

// relayedConn is a connection through a proxy in relay's mode to a fresh
// database.
func relayedConn(t *testing.T, relay Config) *pgconn.PgConn {
	t.Helper()
	p, db := relayed(t, relay, Config{})
	return connect(t, p.dsn(db))
}

// mustExec runs sql, a simple query, on c; every statement must succeed.
func mustExec(t *testing.T, c *pgconn.PgConn, sql string) {
	t.Helper()
	if _, err := c.Exec(ctxT(t), sql).ReadAll(); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// lastValue runs sql, a simple query, on c and returns the first value of
// its last result.
func lastValue(t *testing.T, c *pgconn.PgConn, sql string) string {
	t.Helper()
	res, err := c.Exec(ctxT(t), sql).ReadAll()
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	if last := res[len(res)-1]; len(last.Rows) > 0 {
		return string(last.Rows[0][0])
	}
	t.Fatalf("%s: no row", sql)
	return ""
}

// wantValue checks that sql, a simple query, on c returns want as the
// first value of its last result.
func wantValue(t *testing.T, c *pgconn.PgConn, sql, want string) {
	t.Helper()
	if got := lastValue(t, c, sql); got != want {
		t.Fatalf("%s: got %q, want %q", sql, got, want)
	}
}

func connect(t testing.TB, dsn string) *pgconn.PgConn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pgconn.Connect(ctx, dsn)
	return connected(t, c, err, dsn)
}

// connectConfig connects with cfg, failing t when it cannot, and closes
// the connection when t ends.
func connectConfig(t testing.TB, cfg *pgconn.Config) *pgconn.PgConn {
	t.Helper()
	c, err := pgconn.ConnectConfig(ctxT(t), cfg)
	return connected(t, c, err, connTarget(cfg))
}

// connectPgx is connectConfig for a pgx connection.
func connectPgx(t testing.TB, cfg *pgx.ConnConfig) *pgx.Conn {
	t.Helper()
	c, err := pgx.ConnectConfig(ctxT(t), cfg)
	return connected(t, c, err, connTarget(&cfg.Config))
}

// connected is what the connect helpers do with what they connected: it
// fails t on err, naming the target, or has c closed when t ends.
func connected[C interface{ Close(context.Context) error }](t testing.TB, c C, err error, target string) C {
	t.Helper()
	if err != nil {
		t.Fatalf("connect %s: %v", target, err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

// connTarget names the server and database cfg connects to, as a failure
// says it.
func connTarget(cfg *pgconn.Config) string {
	return fmt.Sprintf("%s@%s:%d/%s", cfg.User, cfg.Host, cfg.Port, cfg.Database)
}

// pollFind polls find until it finds something and returns it, failing t
// (there is no <what>) if nothing turns up before ctxT's deadline.
func pollFind[T any](t *testing.T, what string, find func() (T, bool)) T {
	t.Helper()
	var out T
	err := pgtest.Poll(ctxT(t), func() (bool, error) {
		v, ok := find()
		if ok {
			out = v
		}
		return ok, nil
	})
	if err != nil {
		t.Fatalf("no %s: %v", what, err)
	}
	return out
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}
