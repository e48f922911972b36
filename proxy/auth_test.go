package proxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/xdg-go/scram"

	"github.com/pgfence/pgfence/internal/pgtest"
)

var (
	primaryTLSOnce sync.Once
	primaryTLSCert tls.Certificate
)

// primaryTLS turns TLS on in the test cluster's primary (once per run) and
// returns its certificate, which the proxy may serve too. PostgreSQL
// writes the files itself (lo_export), so that they belong to its user
// (the tests may run as root, PostgreSQL as another user).
// The other tests' connections say sslmode=disable and are not affected.
func primaryTLS(t *testing.T) tls.Certificate {
	t.Helper()
	primaryTLSOnce.Do(func() {
		cert := testCert(t)
		key, err := x509.MarshalPKCS8PrivateKey(cert.PrivateKey)
		if err != nil {
			t.Fatal(err)
		}
		ctx := ctxT(t)
		c, err := cluster.Primary.Connect(ctx, "postgres")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(context.Background())
		crt, kf := filepath.Join(cluster.Primary.DataDir, "pgfence_test.crt"), filepath.Join(cluster.Primary.DataDir, "pgfence_test.key")
		for path, data := range map[string][]byte{
			crt: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Certificate[0]}),
			kf:  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: key}),
		} {
			var oid uint32
			err := c.QueryRow(ctx, "SELECT lo_from_bytea(0, $1)", data).Scan(&oid)
			if err == nil {
				_, err = c.Exec(ctx, "SELECT lo_export($1, $2), lo_unlink($1)", oid, path)
			}
			if err != nil {
				t.Fatalf("write %s: %v", path, err)
			}
			// lo_export makes it 0644; PostgreSQL wants its key private.
			if err := os.Chmod(path, 0o600); err != nil {
				t.Fatal(err)
			}
		}
		for _, q := range []string{
			fmt.Sprintf("ALTER SYSTEM SET ssl_cert_file = '%s'", crt),
			fmt.Sprintf("ALTER SYSTEM SET ssl_key_file = '%s'", kf),
			"ALTER SYSTEM SET ssl = on",
			"SELECT pg_reload_conf()",
		} {
			if _, err := c.Exec(ctx, q); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		dsn := fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=require", cluster.Primary.Addr())
		if err := pgtest.Poll(ctx, func() (bool, error) {
			c, err := pgconn.Connect(ctx, dsn)
			if err != nil {
				return false, nil
			}
			c.Close(ctx)
			return true, nil
		}); err != nil {
			t.Fatalf("the primary does not take TLS connections: %v", err)
		}
		primaryTLSCert = cert
	})
	if primaryTLSCert.Certificate == nil {
		t.Fatal("TLS on the primary failed earlier")
	}
	return primaryTLSCert
}

// TestAuthTLS: with TLS on both legs (client to proxy, proxy to
// PostgreSQL) and channel binding required on both, libpq (psql) and pgx
// log in through the proxy with auth postgres: the proxy offers
// SCRAM-SHA-256-PLUS bound to its own certificate, and answers
// PostgreSQL's SCRAM-SHA-256-PLUS, bound to PostgreSQL's, with the
// client's keys. The last case shows why the client's exchange is not
// relayed instead.
func TestAuthTLS(t *testing.T) {
	cert := primaryTLS(t)
	dsn := fmt.Sprintf("postgres://%s:%s@%s/postgres?sslmode=require&channel_binding=require", scramUser, url.PathEscape(scramPassword), cluster.Primary.Addr())
	e := newAuthEnv(t, Config{Primary: dsn, TLS: &tls.Config{Certificates: []tls.Certificate{cert}}})
	onTLS := "SELECT 'upstream-tls-' || ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"

	t.Run("psql_channel_binding_require", func(t *testing.T) {
		out, err := runPsql(t, e.p.addr.Port, "auth_alice", e.db, onTLS, "PGPASSWORD=alice-pw", "PGSSLMODE=require", "PGCHANNELBINDING=require")
		if err != nil || !strings.Contains(out, "upstream-tls-true") {
			t.Fatalf("psql, channel binding required: %v\n%s", err, out)
		}
	})
	t.Run("psql_default", func(t *testing.T) {
		// libpq's default channel_binding=prefer, over TLS.
		out, err := runPsql(t, e.p.addr.Port, "auth_alice", e.db, onTLS, "PGPASSWORD=alice-pw", "PGSSLMODE=require")
		if err != nil || !strings.Contains(out, "upstream-tls-true") {
			t.Fatalf("psql over TLS: %v\n%s", err, out)
		}
		out, err = runPsql(t, e.p.addr.Port, "auth_alice", e.db, onTLS, "PGPASSWORD=wrong", "PGSSLMODE=require")
		if err == nil || !strings.Contains(out, "password authentication failed") {
			t.Fatalf("psql with a wrong password over TLS: %v\n%s", err, out)
		}
	})
	t.Run("pgx", func(t *testing.T) {
		c := connect(t, fmt.Sprintf("postgres://auth_alice:alice-pw@127.0.0.1:%d/%s?sslmode=require&channel_binding=require", e.p.addr.Port, e.db))
		if _, ok := c.Conn().(*tls.Conn); !ok {
			t.Fatalf("client connection is %T, want TLS", c.Conn())
		}
		res, err := c.Exec(ctxT(t), onTLS).ReadAll()
		if err != nil || len(res) != 1 || len(res[0].Rows) != 1 || string(res[0].Rows[0][0]) != "upstream-tls-true" {
			t.Fatalf("got %v (%v), want upstream-tls-true", res, err)
		}
	})
	t.Run("a_relay_would_break", func(t *testing.T) {
		// libpq on TLS, offered SCRAM-SHA-256 only (a relaying proxy
		// cannot offer -PLUS: it cannot bind to PostgreSQL's channel),
		// sends the GS2 flag "y": it could bind, the server did not
		// offer to. PostgreSQL, which offered -PLUS on its TLS
		// connection, takes that flag for a downgrade attack (28000,
		// "The client supports SCRAM channel binding but thinks the
		// server does not."). The flag is signed into the proof, so a
		// relay cannot change it.
		c, err := net.Dial("tcp", cluster.Primary.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(30 * time.Second))
		c.Write([]byte{0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f})
		var b [1]byte
		if _, err := c.Read(b[:]); err != nil || b[0] != 'S' {
			t.Fatalf("SSLRequest: %q %v", b, err)
		}
		tc := tls.Client(c, &tls.Config{InsecureSkipVerify: true})
		fe := pgproto3.NewFrontend(tc, tc)
		fe.Send(&pgproto3.StartupMessage{ProtocolVersion: pgproto3.ProtocolVersionNumber, Parameters: map[string]string{"user": "auth_alice", "database": e.db}})
		fe.Flush()
		m, err := fe.Receive()
		if sasl, ok := m.(*pgproto3.AuthenticationSASL); err != nil || !ok || sasl.AuthMechanisms[0] != "SCRAM-SHA-256-PLUS" {
			t.Fatalf("PostgreSQL over TLS offered %v (%v), want SCRAM-SHA-256-PLUS first", m, err)
		}
		fe.Send(&pgproto3.SASLInitialResponse{AuthMechanism: "SCRAM-SHA-256", Data: []byte("y,,n=,r=libpqnonce")})
		fe.Flush()
		m, err = fe.Receive()
		if er, ok := m.(*pgproto3.ErrorResponse); err != nil || !ok || er.Code != "28000" || er.Message != "SCRAM channel binding negotiation error" {
			t.Fatalf("PostgreSQL answered %#v (%v), want 28000 SCRAM channel binding negotiation error", m, err)
		}
	})
	e.noCanary(t)
}

// TestUpstreamHosts: the proxy's own startup keeps pgconn's handling of
// the DSN's host list and target_session_attrs: with the replica listed
// first and read-write asked for, sessions land on the primary.
func TestUpstreamHosts(t *testing.T) {
	dsn := fmt.Sprintf("postgres://postgres@%s,%s/postgres?sslmode=disable&target_session_attrs=read-write", cluster.Replica.Addr(), cluster.Primary.Addr())
	p := startProxy(t, Config{Primary: dsn})
	c := connect(t, p.dsn(cluster.NewDatabase(t)))
	res, err := c.Exec(ctxT(t), "SELECT pg_is_in_recovery()").ReadAll()
	if err != nil || string(res[0].Rows[0][0]) != "f" {
		t.Fatalf("got %v %v, want a session on the primary", res, err)
	}
}

// FuzzSCRAMExchange: whatever a client sends as its two SCRAM messages
// (and whatever length it claims), the server side never panics, never
// reads past the exchange's messages, and never lets it in without the
// password; with the real messages of a client that knows it, it does,
// and recovers the role's ClientKey.
func FuzzSCRAMExchange(f *testing.F) {
	f.Add([]byte("n,,n=,r=abc"), []byte("c=biws,r=abcdef,p=AAAA"), false)
	f.Add([]byte("p=tls-server-end-point,,n=,r=abc"), []byte("c=cD10bHM=,r=abc,p="), true)
	f.Add([]byte("y,,n=x,r=a"), []byte(""), false)
	f.Add([]byte(""), []byte(",p="), true)
	v, err := MakeVerifier("", "secret")
	if err != nil {
		f.Fatal(err)
	}
	sc, _ := parseVerifier(v)
	f.Fuzz(func(t *testing.T, first, final []byte, plus bool) {
		mech := "SCRAM-SHA-256"
		if plus {
			mech = "SCRAM-SHA-256-PLUS"
		}
		var in []byte
		in, _ = (&pgproto3.SASLInitialResponse{AuthMechanism: mech, Data: first}).Encode(in)
		in, _ = (&pgproto3.SASLResponse{Data: final}).Encode(in)
		in = append(in, "next"...)
		r := bytes.NewReader(in)
		be := NewAuthBackend(struct {
			io.Reader
			io.Writer
		}{r, io.Discard})
		if _, err := SCRAMExchange(be, "u", sc, true, scram.ChannelBinding{}); err == nil {
			t.Fatalf("a client without the password got in: %q %q", first, final)
		}
		if rest, _ := io.ReadAll(r); len(rest) < len("next") || !bytes.HasSuffix(rest, []byte("next")) {
			t.Fatalf("the exchange read past its messages: %d bytes left", len(rest))
		}
	})
}

// TestSCRAMExchangeKey: a real client gets in, and the key the exchange
// recovers is the role's ClientKey.
func TestSCRAMExchangeKey(t *testing.T) {
	v, err := MakeVerifier("", "secret")
	if err != nil {
		t.Fatal(err)
	}
	sc, _ := parseVerifier(v)
	cl, _ := scram.SHA256.NewClient("", "secret", "")
	conv := cl.NewConversation()
	first, _ := conv.Step("")
	cr, cw := io.Pipe()
	sr, sw := io.Pipe()
	done := make(chan *Proof, 1)
	go func() {
		p, err := SCRAMExchange(NewAuthBackend(struct {
			io.Reader
			io.Writer
		}{cr, sw}), "u", sc, true, scram.ChannelBinding{})
		if err != nil {
			t.Error(err)
		}
		sw.Close()
		done <- p
	}()
	fe := pgproto3.NewFrontend(sr, cw)
	fe.Receive() // AuthenticationSASL
	fe.Send(&pgproto3.SASLInitialResponse{AuthMechanism: "SCRAM-SHA-256", Data: []byte(first)})
	fe.Flush()
	m, _ := fe.Receive()
	final, err := conv.Step(string(m.(*pgproto3.AuthenticationSASLContinue).Data))
	if err != nil {
		t.Fatal(err)
	}
	fe.Send(&pgproto3.SASLResponse{Data: []byte(final)})
	fe.Flush()
	go io.Copy(io.Discard, sr)
	p := <-done
	salt, _ := base64.StdEncoding.DecodeString(strings.Split(strings.Split(v, "$")[1], ":")[1])
	key, _, err := scramKeys("secret", salt, DefaultSCRAMIterations)
	if err != nil || p == nil || !bytes.Equal(p.ClientKey, key) || !bytes.Equal(p.ServerKey, sc.ServerKey) {
		t.Fatalf("recovered %x, want the role's ClientKey %x", p, key)
	}
}
