package proxy

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestBackendIdentity: in session mode the client is told the real
// upstream backend PID (issue 19 §4), so pg_backend_pid(), its own
// notifications and pg_stat_activity agree with BackendKeyData; the cancel
// secret is the proxy's, so cancels still go through the proxy, which
// checks it, and cannot be forged; when the backend goes, the client is
// closed, never handed another backend.
func TestBackendIdentity(t *testing.T) { bothRelays(t, testBackendIdentity) }

func testBackendIdentity(t *testing.T, relay Config) {
	p, db := relayed(t, relay, Config{})
	ctx := ctxT(t)
	var notified chan *pgconn.Notification
	cfg, err := pgconn.ParseConfig(p.dsn(db) + "&application_name=identity")
	if err != nil {
		t.Fatal(err)
	}
	notified = make(chan *pgconn.Notification, 1)
	cfg.OnNotification = func(_ *pgconn.PgConn, n *pgconn.Notification) { notified <- n }
	c, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	pid := c.PID()
	admin, err := cluster.Primary.Connect(ctx, db) // advisory locks are per database
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())

	scalar := func(sql string) string {
		t.Helper()
		res, err := c.Exec(ctx, sql).ReadAll()
		if err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return string(res[len(res)-1].Rows[0][0])
	}
	if got := scalar("SELECT pg_backend_pid()"); got != strconv.FormatUint(uint64(pid), 10) {
		t.Fatalf("pg_backend_pid() %s, BackendKeyData %d", got, pid)
	}
	var seen uint32
	if err := admin.QueryRow(ctx, "SELECT pid FROM pg_stat_activity WHERE application_name = 'identity' AND datname = $1", db).Scan(&seen); err != nil || seen != pid {
		t.Fatalf("pg_stat_activity: pid %d (%v), want %d", seen, err, pid)
	}
	scalar("LISTEN ch; NOTIFY ch, 'self'; SELECT 1")
	select {
	case n := <-notified:
		if n.PID != pid || n.Payload != "self" {
			t.Fatalf("own notification from pid %d (%q), want %d", n.PID, n.Payload, pid)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no notification")
	}

	// Cancel: a forged request (the right PID, a wrong secret) sent to the
	// proxy, and one sent straight to PostgreSQL with the proxy's secret,
	// cancel nothing; the driver's own request does.
	execOK(t, admin, "SELECT pg_advisory_lock(4242)")
	blocked := c.Exec(ctx, "SELECT pg_advisory_lock(4242)")
	pgtest.WaitLockWait(t, admin, pid)
	cancelRaw(t, p.addr.String(), pid, 0xdeadbeef)
	cancelRaw(t, cluster.Primary.Addr(), pid, p.cancelSecret(pid))
	pgtest.WaitLockWait(t, admin, pid) // still waiting
	if err := c.CancelRequest(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := blocked.ReadAll(); pgtest.SQLState(err) != "57014" {
		t.Fatalf("cancelled query: got %v, want 57014", err)
	}
	admin.Exec(ctx, "SELECT pg_advisory_unlock(4242)")

	// The backend ends: the client connection is closed with PostgreSQL's
	// word for it, and a new connection gets a backend of its own.
	execOK(t, admin, "SELECT pg_terminate_backend($1)", pid)
	_, err = c.Exec(ctx, "SELECT 1").ReadAll()
	if err == nil {
		t.Fatal("the session went on after its backend was terminated")
	}
	select {
	case <-c.CleanupDone():
	case <-time.After(10 * time.Second):
		t.Fatal("the client connection was not closed when its backend ended")
	}
	c2 := connect(t, p.dsn(db))
	if c2.PID() == pid {
		t.Fatalf("the new session has the old backend's pid %d", pid)
	}
	// pg_terminate_backend of one's own PID, as the driver knows it.
	_, err = c2.Exec(ctx, "SELECT pg_terminate_backend("+strconv.FormatUint(uint64(c2.PID()), 10)+")").ReadAll()
	if pgtest.SQLState(err) != "57P01" {
		t.Fatalf("terminating one's own backend: got %v, want 57P01", err)
	}
	if p.cancelSecret(pid) != 0 {
		t.Fatal("the ended session's cancel key is still known")
	}
}

// cancelRaw sends a CancelRequest for pid and secret to addr and waits
// until the other side has handled it (it closes the connection).
func cancelRaw(t *testing.T, addr string, pid, secret uint32) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var pkt [16]byte
	binary.BigEndian.PutUint32(pkt[0:], 16)
	binary.BigEndian.PutUint32(pkt[4:], codeCancel)
	binary.BigEndian.PutUint32(pkt[8:], pid)
	binary.BigEndian.PutUint32(pkt[12:], secret)
	if _, err := c.Write(pkt[:]); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil && !errors.Is(err, net.ErrClosed) {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("cancel request to %s not handled", addr)
		}
	}
}

// TestBackendPIDOnPrimary: with read routing on, pg_backend_pid() is
// answered by the primary backend the client was told of, never by a
// replica connection.
func TestBackendPIDOnPrimary(t *testing.T) {
	e := newRouteEnv(t)
	c := e.reader(t, nil)
	for _, sql := range []string{
		"SELECT pg_backend_pid(), pg_is_in_recovery()",
		"SELECT pid, pg_is_in_recovery() FROM pg_stat_activity WHERE pid = pg_backend_pid()",
	} {
		vals := mustWhere(t, c, sql, false)
		if vals[0] != strconv.FormatUint(uint64(c.PID()), 10) {
			t.Fatalf("%s: pid %s, BackendKeyData %d", sql, vals[0], c.PID())
		}
	}
}

// cancelSecret is the secret the proxy gave the client of backend pid (0:
// none known).
func (p *testProxy) cancelSecret(pid uint32) uint32 {
	p.srv.mu.Lock()
	defer p.srv.mu.Unlock()
	return p.srv.cancels[uint64(pid)].secret
}
