//go:build linux

package proxy

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"golang.org/x/sys/unix"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// The tests of a session with read routing on the event loop: the
// primary's server side, the replica connection and the client side all
// on the loop (evloop_replica.go). Each runs on both pollers.

// replicaModes are the pollers a routed session's loop can wait in.
var replicaModes = []struct {
	name  string
	relay Config
}{
	{"event_loop", Config{}},
	{"poll", Config{Poller: "poll"}},
}

// routeSchema is fenceSchema with a table the tests lock on the primary:
// the lock, replayed, holds a replica read back before it has sent
// anything.
const routeSchema = fenceSchema + `
CREATE TABLE held (n int);
INSERT INTO held VALUES (1);
`

// newRouteEnvRelay is newRouteEnvMode (tracked, routeSchema) with the
// proxy in relay's mode.
func newRouteEnvRelay(t *testing.T, relay Config) *routeEnv {
	t.Helper()
	return newRouteEnvReplica(t, relay, cluster.Replica.DSN("postgres"))
}

// newRouteEnvReplica is newRouteEnvRelay with the replica at replicaDSN.
func newRouteEnvReplica(t *testing.T, relay Config, replicaDSN string) *routeEnv {
	t.Helper()
	db := cluster.NewDatabaseWith(t, ddlTriggerSQL+routeSchema)
	if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	gate := newGate(t)
	p := startProxy(t, withRelay(relay, Config{Interceptor: gate, Replicas: []string{replicaDSN},
		ReplicaPoll: 10 * time.Millisecond, ReplicaMaxLag: time.Minute}))
	connect(t, p.dsn(db))
	waitHealthy(t, p)
	waitCatalogReplayed(t, p, gate, db)
	return &routeEnv{&fenceEnv{db: db, proxy: p, gate: gate}}
}

// wantRelayMode checks that s runs in relay's mode: on the loop with
// relay's poller, its replica connection (open) read by the loop.
func wantRelayMode(t *testing.T, s *Session, relay Config) *replicaConn {
	t.Helper()
	onLoop := loopRelayNow(s) != nil
	rc := s.replicaConnNow()
	if rc == nil {
		t.Fatal("the session has no replica connection")
	}
	if !onLoop || rc.loop == nil {
		t.Fatalf("session on the loop %v, its replica read by the loop %v; want both", onLoop, rc.loop != nil)
	}
	s.srv.loop.mu.Lock()
	used := s.srv.loop.used
	s.srv.loop.mu.Unlock()
	if used != wantPoller(relay.Poller) {
		t.Fatalf("the loop runs poller %q, want %q", used, wantPoller(relay.Poller))
	}
	return rc
}

// replicaBackend is the pid of the backend, on the server rep is
// connected to, running a query that contains marker, once it waits for
// wait (a wait_event_type).
func replicaBackend(t *testing.T, rep *pgx.Conn, marker, wait string) int {
	t.Helper()
	return pollFind(t, "the query on the replica", func() (int, bool) {
		var pid int
		err := rep.QueryRow(ctxT(t), `SELECT pid FROM pg_stat_activity
			WHERE query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid() AND wait_event_type = $2`, marker, wait).Scan(&pid)
		return pid, err == nil
	})
}

// holdTable locks held on the primary (ACCESS EXCLUSIVE, in a transaction
// left open) and waits until the replica has replayed the lock: a read of
// held there then waits before it sends anything. It returns the
// primary's transaction, whose end releases the lock.
func holdTable(t *testing.T, e *routeEnv, rep *pgx.Conn) pgx.Tx {
	t.Helper()
	ctx := ctxT(t)
	prim, err := pgx.Connect(ctx, cluster.Primary.DSN(e.db))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prim.Close(context.Background()) })
	tx, err := prim.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "LOCK TABLE held IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	if err := pgtest.Poll(ctx, func() (bool, error) {
		var n int
		err := rep.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
			WHERE c.relname = 'held' AND l.mode = 'AccessExclusiveLock' AND l.granted`).Scan(&n)
		return n > 0, err
	}); err != nil {
		t.Fatalf("the replica never replayed the lock: %v", err)
	}
	return tx
}

// readHeld takes holdTable's lock and starts a read of held, marked
// marker, on c, a routed session of e; it returns the lock's transaction,
// the read's answer channel and the replica backend running the read, once
// that waits for the lock; the backend must be rc's.
func readHeld(t *testing.T, e *routeEnv, c *pgconn.PgConn, rc *replicaConn, rep *pgx.Conn, marker string) (pgx.Tx, <-chan readResultErr, int) {
	t.Helper()
	tx := holdTable(t, e, rep)
	res := readAsync(t, c, "SELECT n, pg_is_in_recovery() FROM held /* "+marker+" */")
	pid := replicaBackend(t, rep, marker, "Lock")
	if pid != int(rc.pid) {
		t.Fatalf("the read runs in replica backend %d, the session's replica connection is %d", pid, rc.pid)
	}
	return tx, res, pid
}

// retryHeldOnPrimary terminates the replica backend pid, which runs
// readHeld's read marked marker, and waits until the read, retried, waits
// for the same lock on e's primary.
func retryHeldOnPrimary(t *testing.T, e *routeEnv, rep *pgx.Conn, pid int, marker string) {
	t.Helper()
	ctx := ctxT(t)
	if _, err := rep.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	prim, err := pgx.Connect(ctx, cluster.Primary.DSN(e.db))
	if err != nil {
		t.Fatal(err)
	}
	defer prim.Close(ctx)
	replicaBackend(t, prim, marker, "Lock")
}

// heldAnswer releases readHeld's lock (tx) and waits for res, readHeld's
// answer, which must succeed with pg_is_in_recovery() = recovery: from
// the replica ("t") or the primary ("f"), as where says.
func heldAnswer(t *testing.T, tx pgx.Tx, res <-chan readResultErr, recovery, where string) {
	t.Helper()
	if err := tx.Rollback(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatalf("read: %v, want %s", r.err, where)
	}
	if got := string(r.rs[0].Rows[0][1]); got != recovery {
		t.Fatalf("pg_is_in_recovery() %s, want %s (%s)", got, recovery, where)
	}
}

// replicaReader is a reader's session of a new routeEnv in relay's mode,
// once the replica answers it.
func replicaReader(t *testing.T, relay Config) (*routeEnv, *pgconn.PgConn) {
	t.Helper()
	e := newRouteEnvRelay(t, relay)
	c := e.reader(t, nil)
	waitReplicaRead(t, c, "SELECT 1, pg_is_in_recovery()")
	return e, c
}

// routedReader is replicaReader's session with its replica connection
// (checked to be in relay's mode) and a direct connection to the replica.
func routedReader(t *testing.T, relay Config) (e *routeEnv, c *pgconn.PgConn, rc *replicaConn, rep *pgx.Conn) {
	t.Helper()
	e, c = replicaReader(t, relay)
	rc = wantRelayMode(t, sessionOf(t, e.proxy, c), relay)
	return e, c, rc, replicaConnOf(t, e)
}

// replicaConnOf is a direct connection to e's database on the replica.
func replicaConnOf(t *testing.T, e *routeEnv) *pgx.Conn {
	t.Helper()
	rep, err := pgx.Connect(ctxT(t), cluster.Replica.DSN(e.db))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rep.Close(context.Background()) })
	return rep
}

// readAsync runs sql on c (simple protocol) on a goroutine; the results
// arrive on the channel.
func readAsync(t *testing.T, c *pgconn.PgConn, sql string) <-chan readResultErr {
	ch := make(chan readResultErr, 1)
	go func() {
		rs, err := c.Exec(ctxT(t), sql).ReadAll()
		ch <- readResultErr{rs, err}
	}()
	return ch
}

type readResultErr struct {
	rs  []*pgconn.Result
	err error
}

// TestReplicaSessionOnLoop: a session with read routing runs on the event
// loop, its reads answered by the replica connection the loop reads, its
// writes by the primary through the gate. (It fails with sessions of a
// proxy with replicas kept off the loop, as they were.)
func TestReplicaSessionOnLoop(t *testing.T) {
	for _, m := range replicaModes {
		t.Run(m.name, func(t *testing.T) {
			e, c := replicaReader(t, m.relay)
			mustWhere(t, c, "SELECT count(*), pg_is_in_recovery() FROM audit", true)
			mustExec(t, c, "INSERT INTO audit (note) VALUES ('w')")
			mustWhere(t, c, "SELECT nextval('audit_id_seq'), pg_is_in_recovery()", false)
			mustWhere(t, c, "SELECT 1, pg_is_in_recovery()", true)
			wantRelayMode(t, sessionOf(t, e.proxy, c), m.relay)
			if looped := e.proxy.srv.ops.stats.SessionsLoop.Load(); looped == 0 {
				t.Fatal("no session was on the loop")
			}
		})
	}
}

// TestReplicaLargeResult: results far larger than every buffer (many
// rows, and one row of several MB) stream intact from the replica.
func TestReplicaLargeResult(t *testing.T) {
	for _, m := range replicaModes {
		t.Run(m.name, func(t *testing.T) {
			e, c := replicaReader(t, m.relay)
			for _, q := range []struct {
				sql        string
				rows, size int
			}{
				{"SELECT lpad(n::text, 1000, 'x'), pg_is_in_recovery() FROM generate_series(1, 8000) n", 8000, 1000},
				{"SELECT lpad(n::text, 6 << 20, 'y'), pg_is_in_recovery() FROM generate_series(1, 2) n", 2, 6 << 20},
			} {
				rs, err := c.Exec(ctxT(t), q.sql).ReadAll()
				if err != nil {
					t.Fatal(err)
				}
				rows := rs[0].Rows
				if len(rows) != q.rows {
					t.Fatalf("%d rows, want %d", len(rows), q.rows)
				}
				for i, row := range rows {
					v := string(row[0])
					if len(v) != q.size || !strings.HasSuffix(v, fmt.Sprint(i+1)) || string(row[1]) != "t" {
						t.Fatalf("row %d: %d bytes ending %q, replica %s; want %d bytes ending %d, from the replica",
							i, len(v), v[max(0, len(v)-8):], row[1], q.size, i+1)
					}
				}
			}
			wantRelayMode(t, sessionOf(t, e.proxy, c), m.relay)
			mustWhere(t, c, "SELECT 1, pg_is_in_recovery()", true) // the stream is in step
		})
	}
}

// TestReplicaTerminatedBeforeAnswer: the replica backend ends (FATAL,
// then the end of the stream) while the read waits there before sending
// anything: the read is answered by the primary.
func TestReplicaTerminatedBeforeAnswer(t *testing.T) {
	for _, m := range replicaModes {
		t.Run(m.name, func(t *testing.T) {
			e, c, rc, rep := routedReader(t, m.relay)
			retries := e.proxy.srv.RouteStats().Retries.Load()
			tx, res, pid := readHeld(t, e, c, rc, rep, "before_answer")
			retryHeldOnPrimary(t, e, rep, pid, "before_answer")
			heldAnswer(t, tx, res, "f", "the primary's answer: retried there")
			if n := e.proxy.srv.RouteStats().Retries.Load() - retries; n != 1 {
				t.Fatalf("%d retries, want 1", n)
			}
			// The replica connection ended, and the next read opens another.
			select {
			case <-rc.done:
			default:
				t.Fatal("the failed replica connection has not ended")
			}
			waitReplicaRead(t, c, "SELECT 1, pg_is_in_recovery()")
		})
	}
}

// TestReplicaTerminatedMidResult: the replica backend ends after part of
// the result reached the client: the session ends with 08006. The client
// does not read meanwhile, so the backend waits to send the rest (the
// proxy does not read a replica while the client is behind), and is
// ended there.
func TestReplicaTerminatedMidResult(t *testing.T) {
	for _, m := range replicaModes {
		t.Run(m.name, func(t *testing.T) {
			_, c, rc, rep := routedReader(t, m.relay)
			ctx := ctxT(t)
			sendRaw(t, c, "SELECT repeat('z', 1000), pg_is_in_recovery() FROM generate_series(1, 50000) /* mid_result */")
			pid := replicaBackend(t, rep, "mid_result", "Client")
			if pid != int(rc.pid) {
				t.Fatalf("the read runs in replica backend %d, the session's replica connection is %d", pid, rc.pid)
			}
			if rc.loop != nil {
				// On the loop: because the client is behind.
				if err := pgtest.Poll(ctx, func() (bool, error) { return rc.loop.readsPaused.Load(), nil }); err != nil {
					t.Fatalf("the loop never stopped reading the replica for a client that does not read: %v", err)
				}
			}
			if _, err := rep.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
				t.Fatal(err)
			}
			rows, ended := 0, false
			err := receiveEach(c, time.Minute, func(msg pgproto3.BackendMessage) bool {
				if ended {
					t.Fatal("the session goes on after 08006")
				}
				switch msg := msg.(type) {
				case *pgproto3.DataRow:
					if string(msg.Values[1]) != "t" {
						t.Fatalf("row %d from the primary", rows)
					}
					rows++
				case *pgproto3.ErrorResponse:
					if msg.Code != "08006" || rows == 0 || rows == 50000 {
						t.Fatalf("error %s (%s) after %d rows, want 08006 after some of 50000", msg.Code, msg.Message, rows)
					}
					ended = true // and the session with it: nothing may follow
				case *pgproto3.RowDescription:
				default:
					t.Fatalf("%T after %d rows, want the rows then an ErrorResponse 08006", msg, rows)
				}
				return true
			})
			if !ended {
				t.Fatalf("after %d rows: %v, want an ErrorResponse 08006", rows, err)
			}
			<-rc.done
		})
	}
}

// TestReplicaCancel: a CancelRequest for a query running on the replica
// reaches the replica backend; the session goes on.
func TestReplicaCancel(t *testing.T) {
	for _, m := range replicaModes {
		t.Run(m.name, func(t *testing.T) {
			e, c, rc, rep := routedReader(t, m.relay)
			ctx := ctxT(t)
			tx, res, _ := readHeld(t, e, c, rc, rep, "cancelled")
			defer tx.Rollback(ctx)
			if err := c.CancelRequest(ctx); err != nil {
				t.Fatal(err)
			}
			r := <-res
			wantCode(t, r.err, "57014")
			mustWhere(t, c, "SELECT 1, pg_is_in_recovery()", true)
			if got := wantRelayMode(t, sessionOf(t, e.proxy, c), m.relay); got != rc {
				t.Fatal("the session opened another replica connection after the cancel")
			}
		})
	}
}

// TestReplicaShutdown: Shutdown while a session's read runs on the
// replica lets it finish, then ends the session (57P01) and its replica
// connection, gracefully.
func TestReplicaShutdown(t *testing.T) {
	for _, m := range replicaModes {
		t.Run(m.name, func(t *testing.T) {
			e, c, rc, rep := routedReader(t, m.relay)
			ctx := ctxT(t)
			tx, res, _ := readHeld(t, e, c, rc, rep, "at_shutdown")
			shut := make(chan error, 1)
			go func() { shut <- e.proxy.srv.Shutdown(ctx) }()
			if err := pgtest.Poll(ctx, func() (bool, error) { return e.proxy.srv.draining.Load(), nil }); err != nil {
				t.Fatal(err)
			}
			heldAnswer(t, tx, res, "t", "the replica's answer before the shutdown")
			if err := <-shut; err != nil {
				t.Fatalf("Shutdown: %v, want a graceful end", err)
			}
			_, err := c.Exec(ctx, "SELECT 1").ReadAll()
			wantCode(t, err, "57P01")
			<-rc.done
			// The replica backend ended with the session.
			if err := pgtest.Poll(ctx, func() (bool, error) {
				var n int
				err := rep.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", int(rc.pid)).Scan(&n)
				return n == 0, err
			}); err != nil {
				t.Fatalf("the replica backend outlived the session: %v", err)
			}
		})
	}
}

// TestReplicaTerminatedIdle: the replica connection of an idle session
// whose last read ran there ends (its backend terminated); the next read
// opens another and is answered by it.
func TestReplicaTerminatedIdle(t *testing.T) {
	for _, m := range replicaModes {
		t.Run(m.name, func(t *testing.T) {
			e := newRouteEnvRelay(t, m.relay)
			ctx := ctxT(t)
			rep := replicaConnOf(t, e)
			fds := openFDs(t)
			c := e.reader(t, nil)
			waitReplicaRead(t, c, "SELECT 1, pg_is_in_recovery()")
			s := sessionOf(t, e.proxy, c)
			rc := wantRelayMode(t, s, m.relay)
			if _, err := rep.Exec(ctx, "SELECT pg_terminate_backend($1)", int(rc.pid)); err != nil {
				t.Fatal(err)
			}
			<-rc.done
			mustWhere(t, c, "SELECT 2, pg_is_in_recovery()", true)
			if got := wantRelayMode(t, s, m.relay); got == rc {
				t.Fatal("the read ran without a new replica connection")
			}
			// Both replica connections' sockets are closed with the
			// session: the process has the descriptors it had before.
			c.Close(ctx)
			if err := pgtest.Poll(ctx, func() (bool, error) { return openFDs(t) == fds, nil }); err != nil {
				t.Fatalf("%d descriptors open after the session, %d before: %v", openFDs(t), fds, err)
			}
		})
	}
}

// TestReplicaMessageNotCut: a message of the primary (a notification)
// that arrives while a replica's row larger than every buffer is on its
// way to a client that does not read reaches the client after that row,
// never inside it: on the loop, the primary is not read while the
// replica's message is passed on in pieces.
func TestReplicaMessageNotCut(t *testing.T) {
	for _, m := range replicaModes {
		t.Run(m.name, func(t *testing.T) {
			e := newRouteEnvRelay(t, m.relay)
			ctx := ctxT(t)
			c := e.reader(t, nil)
			mustExec(t, c, "LISTEN ch") // on the primary
			waitReplicaRead(t, c, "SELECT 1, pg_is_in_recovery()")
			s := sessionOf(t, e.proxy, c)
			wantRelayMode(t, s, m.relay)
			sendBigReplicaRow(t, e, c, "not_cut")
			prim, err := pgx.Connect(ctx, cluster.Primary.DSN(e.db))
			if err != nil {
				t.Fatal(err)
			}
			defer prim.Close(ctx)
			if _, err := prim.Exec(ctx, "NOTIFY ch, 'hello'"); err != nil {
				t.Fatal(err)
			}
			waitPrimaryBytes(t, s, "the notification")
			got, err := bigRowAnswers(t, c, 5)
			if err != nil {
				t.Fatalf("after %v: %v", got, err)
			}
			for _, a := range got {
				if a != "row" && a != "notify:hello" && a != "ready" && a != "-" {
					t.Fatalf("after %v: %s", got, a)
				}
			}
			if w := strings.Join(got, " "); !strings.Contains(w, "row") || !strings.Contains(w, "notify:hello") || !strings.Contains(w, "ready") {
				t.Fatalf("got %s, want the row, the notification and ReadyForQuery", w)
			}
		})
	}
}

// bigRow is the size of the replica row the message-order tests read: far
// larger than every buffer, so that it is passed on in pieces.
const bigRow = 32 << 20

// sendBigReplicaRow sends on c, a routed session of e, a read of one
// replica row of bigRow bytes marked marker, and returns once the replica
// waits to send the rest of it to c, which does not read.
func sendBigReplicaRow(t *testing.T, e *routeEnv, c *pgconn.PgConn, marker string) {
	t.Helper()
	sendRaw(t, c, fmt.Sprintf("SELECT repeat('w', %d), pg_is_in_recovery() /* %s */", bigRow, marker))
	replicaBackend(t, replicaConnOf(t, e), marker, "Client")
}

// bigRowAnswers reads c's answers to sendBigReplicaRow's read, naming
// each: "row" (checked to be the replica's row, whole), "notify:PAYLOAD",
// "error:SQLSTATE", "ready", "notice", "parameter", or "-" for a
// RowDescription or a CommandComplete; another type fails t. It stops at
// n names (n < 0: none) or at the connection's end, whose error it
// returns.
func bigRowAnswers(t *testing.T, c *pgconn.PgConn, n int) ([]string, error) {
	t.Helper()
	var got []string
	err := receiveEach(c, time.Minute, func(msg pgproto3.BackendMessage) bool {
		switch msg := msg.(type) {
		case *pgproto3.DataRow:
			if len(msg.Values) != 2 || len(msg.Values[0]) != bigRow || string(msg.Values[1]) != "t" {
				t.Fatalf("after %v: a row of %d values, not the replica's of %d bytes", got, len(msg.Values), bigRow)
			}
			got = append(got, "row")
		case *pgproto3.NotificationResponse:
			got = append(got, "notify:"+msg.Payload)
		case *pgproto3.ErrorResponse:
			got = append(got, "error:"+msg.Code)
		case *pgproto3.ReadyForQuery:
			got = append(got, "ready")
		case *pgproto3.NoticeResponse:
			got = append(got, "notice")
		case *pgproto3.ParameterStatus:
			got = append(got, "parameter")
		case *pgproto3.RowDescription, *pgproto3.CommandComplete:
			got = append(got, "-")
		default:
			t.Fatalf("after %v: %T", got, msg)
		}
		return n < 0 || len(got) < n
	})
	return got, err
}

// waitPrimaryBytes waits until what (bytes the primary sent) waits unread
// in the proxy's socket to the primary of s, a session on the loop.
func waitPrimaryBytes(t *testing.T, s *Session, what string) {
	t.Helper()
	s.connMu.Lock()
	fd := s.loopRelay.serverFD
	s.connMu.Unlock()
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		n, err := unix.IoctlGetInt(fd, unix.SIOCINQ)
		return n > 0, err
	}); err != nil {
		t.Fatalf("%s never reached the proxy: %v", what, err)
	}
}

// openFDs is the number of descriptors the test process has open.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// replicaTLSOnce turns TLS on on the test cluster's replica, once: its
// certificate written into the replica's data directory (a standby
// cannot lo_export, as primaryTLS does on the primary), ssl set in its
// postgresql.auto.conf, and the configuration reloaded.
var replicaTLSOnce struct {
	sync.Once
	err error
}

func replicaTLS(t *testing.T) {
	t.Helper()
	replicaTLSOnce.Do(func() {
		replicaTLSOnce.err = func() error {
			cert := testCert(t)
			key, err := x509.MarshalPKCS8PrivateKey(cert.PrivateKey)
			if err != nil {
				return err
			}
			dir := cluster.Replica.DataDir
			var st unix.Stat_t
			if err := unix.Stat(dir, &st); err != nil {
				return err
			}
			crt, kf := filepath.Join(dir, "pgfence_test.crt"), filepath.Join(dir, "pgfence_test.key")
			for path, data := range map[string][]byte{
				crt: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Certificate[0]}),
				kf:  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: key}),
			} {
				if err := os.WriteFile(path, data, 0o600); err != nil {
					return err
				}
				if err := os.Chown(path, int(st.Uid), int(st.Gid)); err != nil {
					return err
				}
			}
			conf, err := os.OpenFile(filepath.Join(dir, "postgresql.auto.conf"), os.O_APPEND|os.O_WRONLY, 0)
			if err != nil {
				return err
			}
			_, err = fmt.Fprintf(conf, "ssl = on\nssl_cert_file = '%s'\nssl_key_file = '%s'\n", crt, kf)
			if cerr := conf.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return err
			}
			ctx := ctxT(t)
			c, err := pgconn.Connect(ctx, cluster.Replica.DSN("postgres"))
			if err != nil {
				return err
			}
			defer c.Close(context.Background())
			if _, err := c.Exec(ctx, "SELECT pg_reload_conf()").ReadAll(); err != nil {
				return err
			}
			return pgtest.Poll(ctx, func() (bool, error) {
				c, err := pgconn.Connect(ctx, replicaTLSDSN("postgres"))
				if err != nil {
					return false, nil
				}
				c.Close(ctx)
				return true, nil
			})
		}()
	})
	if replicaTLSOnce.err != nil {
		t.Fatalf("TLS on the replica: %v", replicaTLSOnce.err)
	}
}

// replicaTLSDSN is the replica's DSN for db, with TLS required.
func replicaTLSDSN(db string) string {
	return strings.Replace(cluster.Replica.DSN(db), "sslmode=disable", "sslmode=require", 1)
}

// TestReplicaTLS: a routed session whose replica connection is TLS reads
// from the replica on the loop, through the replica's tls.Conn, results
// larger than every buffer and TLS record included; and its replica
// backend leaves with the session. (With the loop refusing a TLS replica
// connection, as it did, every read goes to the primary and it fails.)
func TestReplicaTLS(t *testing.T) {
	replicaTLS(t)
	for _, m := range replicaModes {
		t.Run(m.name, func(t *testing.T) {
			e := newRouteEnvReplica(t, m.relay, replicaTLSDSN("postgres"))
			p := e.proxy
			c := e.reader(t, nil)
			waitReplicaRead(t, c, "SELECT 1, pg_is_in_recovery()")
			// A read-only transaction runs on the replica, functions and all.
			mustExec(t, c, "BEGIN READ ONLY")
			if got := lastValue(t, c, "SELECT ssl::text || ' ' || pg_is_in_recovery()::text || ' ' || pid FROM pg_stat_ssl WHERE pid = pg_backend_pid()"); !strings.HasPrefix(got, "true true ") {
				t.Fatalf("the replica connection's ssl and recovery: %q, want true true", got)
			}
			pid := lastValue(t, c, "SELECT pg_backend_pid()")
			mustExec(t, c, "COMMIT")
			rc := wantRelayMode(t, sessionOf(t, p, c), m.relay)
			if rc.loop.sock.tls == nil {
				t.Fatal("the loop reads the replica connection without its tls.Conn")
			}
			rs, err := c.Exec(ctxT(t), "SELECT lpad(n::text, 3 << 20, 'z'), pg_is_in_recovery() FROM generate_series(1, 3) n").ReadAll()
			if err != nil {
				t.Fatal(err)
			}
			if rows := rs[0].Rows; len(rows) != 3 || len(rows[2][0]) != 3<<20 || !strings.HasSuffix(string(rows[2][0]), "3") || string(rows[2][1]) != "t" {
				t.Fatalf("%d rows, not the 3 of 3 MB from the replica", len(rows))
			}
			mustExec(t, c, "INSERT INTO audit (note) VALUES ('tls')")
			mustWhere(t, c, "SELECT 1, pg_is_in_recovery()", true)
			c.Close(ctxT(t))
			rep := replicaConnOf(t, e)
			if err := pgtest.Poll(ctxT(t), func() (bool, error) {
				var n int
				err := rep.QueryRow(ctxT(t), "SELECT count(*) FROM pg_stat_activity WHERE pid = "+pid).Scan(&n)
				return n == 0, err
			}); err != nil {
				t.Fatalf("the replica backend %s never left with its session: %v", pid, err)
			}
		})
	}
}

// TestReplicaMessageNotCutByPrimaryEnd: the session's primary backend is
// terminated (its FATAL and its end reach the proxy) while a replica row
// larger than every buffer is passed on to a client that does not read:
// the row reaches the client whole, and the primary's end after it, never
// inside it. (Reading a hung-up primary into the replica's message cut
// the row with the FATAL.)
func TestReplicaMessageNotCutByPrimaryEnd(t *testing.T) {
	m := replicaModes[0]
	e, c := replicaReader(t, m.relay)
	s := sessionOf(t, e.proxy, c)
	wantRelayMode(t, s, m.relay)
	sendBigReplicaRow(t, e, c, "not_cut_end")
	prim := connect(t, cluster.Primary.DSN(e.db))
	mustExec(t, prim, fmt.Sprintf("SELECT pg_terminate_backend(%d)", s.BackendPID))
	waitPrimaryBytes(t, s, "the primary's FATAL")
	all, err := bigRowAnswers(t, c, -1)
	var got []string // the answers that say something: the rest passed over
	for _, a := range all {
		switch {
		case a == "row", a == "ready", strings.HasPrefix(a, "error:"):
			got = append(got, a)
		case a == "-", a == "notice", a == "parameter":
		default:
			t.Fatalf("after %v: %s", got, a)
		}
	}
	if len(got) == 0 || got[len(got)-1] != "error:57P01" {
		t.Fatalf("after %v: %v, want the replica's row, its end and then the primary's FATAL", got, err)
	}
	if w := strings.Join(got, " "); !strings.HasPrefix(w, "row ready") {
		t.Fatalf("got %s, want the row and its ReadyForQuery before the primary's end", w)
	}
}
