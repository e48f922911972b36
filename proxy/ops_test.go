package proxy

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// testCert makes a self-signed certificate for 127.0.0.1.
func testCert(t *testing.T) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "pgfence test"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

func TestTLSClientToProxy(t *testing.T) {
	cert := testCert(t)
	p := startProxy(t, Config{TLS: &tls.Config{Certificates: []tls.Certificate{cert}}})
	db := cluster.NewDatabase(t)
	c := connect(t, fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=require", p.addr.Port, db))
	if _, ok := c.Conn().(*tls.Conn); !ok {
		t.Fatalf("client connection is %T, want *tls.Conn", c.Conn())
	}
	res, err := c.Exec(ctxT(t), "SELECT 1").ReadAll()
	if err != nil || string(res[0].Rows[0][0]) != "1" {
		t.Fatalf("query over TLS: %v %v", res, err)
	}
	// Without a certificate, SSLRequest is answered N: sslmode=require
	// fails, prefer falls back to plain.
	plain := startProxy(t, Config{})
	if _, err := pgconn.Connect(ctxT(t), fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=require", plain.addr.Port, db)); err == nil {
		t.Fatal("sslmode=require succeeded against a proxy without TLS")
	}
	c2 := connect(t, fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=prefer", plain.addr.Port, db))
	if _, ok := c2.Conn().(*tls.Conn); ok {
		t.Fatal("got TLS from a proxy without a certificate")
	}
}

func scramConfig(t *testing.T) Config {
	v, err := MakeVerifier(scramUser, scramPassword)
	if err != nil {
		t.Fatal(err)
	}
	return Config{
		Auth:              AuthSCRAM,
		Users:             map[string]string{scramUser: v},
		UpstreamPasswords: map[string]string{scramUser: scramPassword},
	}
}

func TestSCRAM(t *testing.T) {
	p := startProxy(t, scramConfig(t))
	db := cluster.NewDatabase(t)
	dsn := func(user, pw string) string {
		return fmt.Sprintf("postgres://%s:%s@127.0.0.1:%d/%s?sslmode=disable", user, pw, p.addr.Port, db)
	}
	t.Run("success", func(t *testing.T) {
		c := connect(t, dsn(scramUser, strings.ReplaceAll(scramPassword, " ", "%20")))
		wantValue(t, c, "SELECT current_user", scramUser)
	})
	t.Run("wrong password", func(t *testing.T) {
		_, err := pgconn.Connect(ctxT(t), dsn(scramUser, "wrong"))
		if pgtest.SQLState(err) != "28P01" {
			t.Fatalf("got %v, want 28P01", err)
		}
	})
	t.Run("unknown user", func(t *testing.T) {
		_, err := pgconn.Connect(ctxT(t), dsn("postgres", "whatever"))
		if pgtest.SQLState(err) != "28P01" {
			t.Fatalf("got %v, want 28P01", err)
		}
	})
	t.Run("psql", func(t *testing.T) {
		out, err := runPsql(t, p.addr.Port, scramUser, db, "SELECT 'ok-' || current_user", "PGPASSWORD="+scramPassword)
		if err != nil || !strings.Contains(out, "ok-"+scramUser) {
			t.Fatalf("psql with SCRAM: %v\n%s", err, out)
		}
	})
}

func TestUpstreamRefusalReachesClient(t *testing.T) {
	p := startProxy(t, Config{})
	_, err := pgconn.Connect(ctxT(t), p.dsn("no_such_database"))
	if pgtest.SQLState(err) != "3D000" {
		t.Fatalf("got %v, want 3D000 from PostgreSQL", err)
	}
	// Upstream SCRAM without the password configured fails upstream.
	_, err = pgconn.Connect(ctxT(t), fmt.Sprintf("postgres://%s@127.0.0.1:%d/postgres?sslmode=disable", scramUser, p.addr.Port))
	if err == nil {
		t.Fatal("connected upstream without a password")
	}
}

func TestTooManyClients(t *testing.T) { bothRelays(t, testTooManyClients) }

func testTooManyClients(t *testing.T, relay Config) {
	p, db := relayed(t, relay, Config{MaxClients: 2})
	a := connect(t, p.dsn(db))
	connect(t, p.dsn(db))
	_, err := pgconn.Connect(ctxT(t), p.dsn(db))
	if pgtest.SQLState(err) != "53300" {
		t.Fatalf("third client: got %v, want 53300", err)
	}
	a.Close(ctxT(t))
	// The slot frees once the first session has ended.
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return p.srv.clients.Load() < 2, nil }); err != nil {
		t.Fatal(err)
	}
	connect(t, p.dsn(db))
}

// backendGone polls pg_stat_activity until pid has left, or fails after d.
func backendGone(t *testing.T, pid uint32, d time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	admin, err := cluster.Primary.Connect(ctxT(t), "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	err = pgtest.Poll(ctx, func() (bool, error) {
		var n int
		err := admin.QueryRow(ctxT(t), "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid).Scan(&n)
		return n == 0, err
	})
	if err != nil {
		t.Fatalf("backend %d still in pg_stat_activity after %v: %v", pid, d, err)
	}
}

func TestClientDisconnectMidTransaction(t *testing.T) {
	bothRelays(t, testClientDisconnectMidTransaction)
}

func testClientDisconnectMidTransaction(t *testing.T, relay Config) {
	p, db := relayed(t, relay, Config{})
	c := connect(t, p.dsn(db))
	mustExec(t, c, "CREATE TABLE t(a int)")
	pid, _ := strconvU32(lastValue(t, c, "BEGIN; INSERT INTO t VALUES (1); SELECT pg_backend_pid()"))
	if c.TxStatus() != 'T' {
		t.Fatalf("tx status %c, want T", c.TxStatus())
	}
	// Vanish without Terminate, as a crashed worker would.
	c.Conn().Close()
	backendGone(t, pid, time.Second)
	d := connect(t, cluster.Primary.DSN(db))
	wantValue(t, d, "SELECT count(*) FROM t", "0")
}

func strconvU32(s string) (uint32, error) {
	var v uint32
	_, err := fmt.Sscan(s, &v)
	return v, err
}

// rawStartup dials the proxy and sends b as the first bytes.
func rawDial(t *testing.T, p *testProxy) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", p.addr.String())
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	t.Cleanup(func() { c.Close() })
	return c
}

func startupBytes(version uint32, params ...string) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint32(b[4:], version)
	for _, p := range params {
		b = append(append(b, p...), 0)
	}
	b = append(b, 0)
	binary.BigEndian.PutUint32(b, uint32(len(b)))
	return b
}

// readErrorResponse reads until an ErrorResponse or EOF; it returns the
// SQLSTATE ("" at EOF without one).
func readErrorResponse(t *testing.T, c net.Conn) string {
	t.Helper()
	fe := pgproto3.NewFrontend(c, c)
	for {
		m, err := fe.Receive()
		if err != nil {
			return ""
		}
		if e, ok := m.(*pgproto3.ErrorResponse); ok {
			return e.Code
		}
	}
}

func TestBadInput(t *testing.T) { bothRelays(t, testBadInput) }

func testBadInput(t *testing.T, relay Config) {
	p, db := relayed(t, relay, Config{})
	survivor := connect(t, p.dsn(db))
	cases := []struct {
		name string
		send []byte
		code string // "" means closed without a response
	}{
		{"garbage", []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), "08P01"},
		{"impossible length", []byte{0xff, 0xff, 0xff, 0xff, 0, 3, 0, 0}, "08P01"},
		{"short length", []byte{0, 0, 0, 2, 0, 0}, "08P01"},
		{"protocol 2", startupBytes(2<<16, "user", "postgres"), "0A000"},
		{"no user", startupBytes(3<<16, "database", db), "28000"},
		{"unterminated", []byte{0, 0, 0, 12, 0, 3, 0, 0, 'u', 's', 'e', 'r'}, "08P01"},
		{"no value", startupBytes(3<<16, "user"), "08P01"},
		{"replication", startupBytes(3<<16, "user", "postgres", "database", db, "replication", "database"), "0A000"},
		{"replication true", startupBytes(3<<16, "user", "postgres", "replication", "true"), "0A000"},
		{"truncated", []byte{0, 0, 0, 40, 0, 3, 0, 0}, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := rawDial(t, p)
			c.Write(tc.send)
			if tc.name == "truncated" {
				c.(*net.TCPConn).CloseWrite()
			}
			if got := readErrorResponse(t, c); got != tc.code {
				t.Fatalf("got SQLSTATE %q, want %q", got, tc.code)
			}
		})
	}
	t.Run("after startup", func(t *testing.T) {
		for _, msg := range [][]byte{
			{'Q', 0xff, 0xff, 0xff, 0xf0},          // impossible length
			{'Q', 0, 0, 0, 1},                      // length below 4
			{'!', 0, 0, 0, 4},                      // unknown type
			{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},      // zeros
			[]byte("\x16\x03\x01\x02\x00\x01\x00"), // a TLS ClientHello
		} {
			_, nc := raw(t, p.dsn(db))
			nc.Write(msg)
			if got := readErrorResponse(t, nc); got != "08P01" {
				t.Errorf("message %q: got SQLSTATE %q, want 08P01", msg, got)
			}
		}
	})
	if _, err := survivor.Exec(ctxT(t), "SELECT 1").ReadAll(); err != nil {
		t.Fatalf("other session affected: %v", err)
	}
}

func TestStartupNegotiation(t *testing.T) {
	p := startProxy(t, Config{})
	db := cluster.NewDatabase(t)
	t.Run("GSSENCRequest then SSLRequest then 3.2 with options", func(t *testing.T) {
		c := rawDial(t, p)
		var one [1]byte
		c.Write([]byte{0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x30})
		if _, err := io.ReadFull(c, one[:]); err != nil || one[0] != 'N' {
			t.Fatalf("GSSENCRequest: got %q %v, want N", one, err)
		}
		c.Write([]byte{0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f})
		if _, err := io.ReadFull(c, one[:]); err != nil || one[0] != 'N' {
			t.Fatalf("SSLRequest: got %q %v, want N", one, err)
		}
		c.Write(startupBytes(3<<16|2, "user", "postgres", "database", db, "_pq_.frobnicate", "on"))
		fe := pgproto3.NewFrontend(c, c)
		m, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		npv, ok := m.(*pgproto3.NegotiateProtocolVersion)
		if !ok || npv.NewestMinorProtocol != 0 || len(npv.UnrecognizedOptions) != 1 || npv.UnrecognizedOptions[0] != "_pq_.frobnicate" {
			t.Fatalf("got %#v, want NegotiateProtocolVersion 0 [_pq_.frobnicate]", m)
		}
		var types []byte
		for {
			m, err := fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			types = append(types, backendType(m))
			if bk, ok := m.(*pgproto3.BackendKeyData); ok && len(bk.SecretKey) != 4 {
				t.Fatalf("secret key %d bytes, want 4 (protocol 3.0)", len(bk.SecretKey))
			}
			if m, ok := m.(*pgproto3.ReadyForQuery); ok {
				if m.TxStatus != 'I' {
					t.Fatalf("tx status %c", m.TxStatus)
				}
				break
			}
		}
		if types[0] != 'R' || !strings.Contains(string(types), "SK") {
			t.Fatalf("got %q, want R S... K Z", types)
		}
	})
	t.Run("pgconn max_protocol_version=3.2", func(t *testing.T) {
		c, err := pgconn.Connect(ctxT(t), p.dsn(db)+"&max_protocol_version=3.2")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(ctxT(t))
		mustExec(t, c, "SELECT 1")
	})
}

func TestGracefulShutdown(t *testing.T) { bothRelays(t, testGracefulShutdown) }

func testGracefulShutdown(t *testing.T, relay Config) {
	p, db := relayed(t, relay, Config{})
	ctx := ctxT(t)
	idle := connect(t, p.dsn(db))
	idlePID, _ := strconvU32(lastValue(t, idle, "SELECT pg_backend_pid()"))
	busy := connect(t, p.dsn(db))
	mustExec(t, busy, "CREATE TABLE t(a int); BEGIN; INSERT INTO t VALUES (1)")
	done := make(chan error, 1)
	go func() { done <- p.srv.Shutdown(ctx) }()
	// The idle session is closed promptly, upstream and with 57P01 to
	// the client.
	backendGone(t, idlePID, 5*time.Second)
	if _, err := idle.Exec(ctx, "SELECT 1").ReadAll(); pgtest.SQLState(err) != "57P01" {
		t.Fatalf("idle session after shutdown: got %v, want 57P01", err)
	}
	// New clients are refused.
	if err := pgtest.Poll(ctx, func() (bool, error) {
		_, err := pgconn.Connect(ctx, p.dsn(db))
		return err != nil, nil
	}); err != nil {
		t.Fatal(err)
	}
	// The session in a transaction may finish it.
	if err := busy.Exec(ctx, "INSERT INTO t VALUES (2)").Close(); err != nil {
		t.Fatalf("statement inside transaction during shutdown: %v", err)
	}
	select {
	case err := <-done:
		t.Fatalf("shutdown returned %v while a transaction was open", err)
	default:
	}
	if err := busy.Exec(ctx, "COMMIT").Close(); err != nil {
		t.Fatalf("commit during shutdown: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	d := connect(t, cluster.Primary.DSN(db))
	wantValue(t, d, "SELECT count(*) FROM t", "2")
}

func TestShutdownTimeoutClosesOpenTransactions(t *testing.T) {
	bothRelays(t, testShutdownTimeoutClosesOpenTransactions)
}

func testShutdownTimeoutClosesOpenTransactions(t *testing.T, relay Config) {
	p, db := relayed(t, relay, Config{ShutdownTimeout: 200 * time.Millisecond})
	ctx := ctxT(t)
	busy := connect(t, p.dsn(db))
	pid, _ := strconvU32(lastValue(t, busy, "BEGIN; SELECT pg_backend_pid()"))
	if err := p.srv.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("shutdown: got %v, want deadline exceeded", err)
	}
	backendGone(t, pid, 5*time.Second)
}

// TestSessionLogFields: a session's open and close are logged once each,
// with the client's address, user, database and backend pid (each field
// once: a field repeated in one entry is ambiguous to log processors), and
// the close with the session's duration.
func TestSessionLogFields(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	p := startProxyLog(t, Config{}, zap.New(core))
	c := connect(t, p.dsn("postgres"))
	// The upstream backend's pid (the client's key data is the proxy's).
	rows, err := c.Exec(ctxT(t), "SELECT pg_backend_pid()").ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.ParseUint(string(rows[0].Rows[0][0]), 10, 32)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Close(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	// Shutdown waits for the session to end, so its close is logged.
	ctx, cancel := context.WithTimeout(ctxT(t), 10*time.Second)
	defer cancel()
	if err := p.srv.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	for _, msg := range []string{"session open", "session closed"} {
		entries := logs.FilterMessage(msg).All()
		if len(entries) != 1 {
			t.Fatalf("%d %q entries, want 1", len(entries), msg)
		}
		seen := map[string]int{}
		for _, f := range entries[0].Context {
			seen[f.Key]++
		}
		want := []string{"client", "user", "database", "backend_pid"}
		if msg == "session closed" {
			want = append(want, "duration_ms")
		}
		for _, k := range want {
			if seen[k] != 1 {
				t.Errorf("%q: field %q appears %d times, want once (fields %v)", msg, k, seen[k], entries[0].Context)
			}
		}
		m := entries[0].ContextMap()
		if m["user"] != "postgres" || m["database"] != "postgres" || m["backend_pid"] != uint32(pid) {
			t.Errorf("%q: fields %v, want user and database postgres, backend_pid %d", msg, m, pid)
		}
	}
}
