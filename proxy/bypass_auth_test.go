package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/xdg-go/scram"
)

// TestBypass/auth: who may connect (issue 18 §5). Every attempt goes
// through the proxy with its default authentication (auth postgres), whose
// primary DSN is a role PostgreSQL makes authenticate with SCRAM; an
// attempt that gets in writes a row to a canary table, which a direct
// connection checks stays empty.
func init() { registerBypass("auth", testBypassAuth) }

// The roles of the auth tests. PostgreSQL demands what each one's group
// says of connections from 127.0.0.1 (TestMain's pg_hba.conf).
const (
	authGroupSCRAM    = "pgfence_test_scram"    // scram-sha-256
	authGroupMD5      = "pgfence_test_md5"      // md5
	authGroupPassword = "pgfence_test_password" // password (cleartext)
)

var authRolesOnce sync.Once

// authRoles creates the auth tests' roles, once per run: roles belong to
// the cluster, not to a test's database.
func authRoles(t *testing.T) {
	t.Helper()
	authRolesOnce.Do(func() {
		c, err := cluster.Primary.Connect(ctxT(t), "postgres")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(context.Background())
		for _, q := range []string{
			"CREATE ROLE " + authGroupSCRAM + " NOLOGIN",
			"CREATE ROLE " + authGroupMD5 + " NOLOGIN",
			"CREATE ROLE " + authGroupPassword + " NOLOGIN",
			"CREATE ROLE auth_alice LOGIN PASSWORD 'alice-pw' IN ROLE " + authGroupSCRAM,
			"CREATE ROLE auth_same LOGIN PASSWORD '" + scramPassword + "' IN ROLE " + authGroupSCRAM,
			"CREATE ROLE auth_nopw LOGIN IN ROLE " + authGroupSCRAM,
			"CREATE ROLE auth_expired LOGIN PASSWORD 'expired-pw' VALID UNTIL '2001-01-01' IN ROLE " + authGroupSCRAM,
			"CREATE ROLE auth_nologin NOLOGIN PASSWORD 'nologin-pw' IN ROLE " + authGroupSCRAM,
			"CREATE ROLE auth_cleartext LOGIN PASSWORD 'cleartext-pw' IN ROLE " + authGroupPassword,
			"SET password_encryption = 'md5'",
			"CREATE ROLE auth_md5 LOGIN PASSWORD 'md5-pw' IN ROLE " + authGroupMD5,
		} {
			if _, err := c.Exec(ctxT(t), q); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
	})
}

// authDSN is the proxy's primary DSN for the auth tests: scram_user, whom
// PostgreSQL makes authenticate, with its password.
func authDSN() string {
	return fmt.Sprintf("postgres://%s:%s@%s/postgres?sslmode=disable", scramUser, url.PathEscape(scramPassword), cluster.Primary.Addr())
}

// authEnv is a proxy with auth postgres and a database with a canary
// table everyone may write.
type authEnv struct {
	p  *testProxy
	db string
}

func newAuthEnv(t *testing.T, cfg Config) *authEnv {
	t.Helper()
	authRoles(t)
	if cfg.Primary == "" {
		cfg.Primary = authDSN()
	}
	if cfg.Auth == "" {
		cfg.Auth = AuthPostgres
	}
	e := &authEnv{p: startProxy(t, cfg), db: cluster.NewDatabase(t)}
	c, err := cluster.Primary.Connect(ctxT(t), e.db)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	execOK(t, c, "CREATE TABLE auth_canary (who text DEFAULT current_user); GRANT ALL ON auth_canary TO PUBLIC")
	return e
}

// try connects through the proxy as user with password and, if that
// succeeds, writes to the canary: it returns the connect error.
func (e *authEnv) try(t *testing.T, user, password string) error {
	t.Helper()
	dsn := fmt.Sprintf("postgres://%s:%s@127.0.0.1:%d/%s?sslmode=disable", url.PathEscape(user), url.PathEscape(password), e.p.addr.Port, e.db)
	c, err := pgconn.Connect(ctxT(t), dsn)
	if err != nil {
		return err
	}
	defer c.Close(context.Background())
	if err := c.Exec(ctxT(t), "INSERT INTO auth_canary DEFAULT VALUES").Close(); err != nil {
		t.Fatalf("%s got in and could not write the canary: %v", user, err)
	}
	return nil
}

// refused asserts that user with password is refused with code, and that
// nothing got written.
func (e *authEnv) refused(t *testing.T, user, password, code string) *pgconn.PgError {
	t.Helper()
	err := e.try(t, user, password)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != code {
		t.Fatalf("%s: got %v, want SQLSTATE %s", user, err, code)
	}
	e.noCanary(t)
	return pe
}

// noCanary checks on a direct connection that no attempt got in.
func (e *authEnv) noCanary(t *testing.T) {
	t.Helper()
	wantRows(t, e.db, "auth_canary", 0)
}

// scramStart opens a raw connection to the proxy as user and returns it
// after the server's AuthenticationSASL.
func (e *authEnv) scramStart(t *testing.T, user string) *rawConn {
	t.Helper()
	r := rawStart(t, e.p.addr.String())
	r.fe.Send(&pgproto3.StartupMessage{ProtocolVersion: pgproto3.ProtocolVersionNumber, Parameters: map[string]string{"user": user, "database": e.db}})
	if err := r.fe.Flush(); err != nil {
		t.Fatal(err)
	}
	r.SetReadDeadline(time.Now().Add(30 * time.Second))
	m, err := r.fe.Receive()
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := m.(*pgproto3.AuthenticationSASL); !ok {
		t.Fatalf("got %T, want AuthenticationSASL", m)
	}
	return r
}

// scramProve starts a SCRAM exchange as role with a client that names
// name and proves password, up to the client's final message (not sent).
func (e *authEnv) scramProve(t *testing.T, role, name, password string) (r *rawConn, first, final string) {
	t.Helper()
	cl, err := scram.SHA256.NewClient(name, password, "")
	if err != nil {
		t.Fatal(err)
	}
	conv := cl.NewConversation()
	first, _ = conv.Step("")
	r = e.scramStart(t, role)
	if final, err = conv.Step(r.step(t, true, first)); err != nil {
		t.Fatal(err)
	}
	return r, first, final
}

// step sends a SCRAM message (the first one as SASLInitialResponse) and
// returns the server's answer: the next SCRAM message, or the
// ErrorResponse's SQLSTATE as "E:code".
func (r *rawConn) step(t *testing.T, first bool, msg string) string {
	t.Helper()
	if first {
		r.fe.Send(&pgproto3.SASLInitialResponse{AuthMechanism: "SCRAM-SHA-256", Data: []byte(msg)})
	} else {
		r.fe.Send(&pgproto3.SASLResponse{Data: []byte(msg)})
	}
	if err := r.fe.Flush(); err != nil {
		t.Fatal(err)
	}
	m, err := r.fe.Receive()
	if err != nil {
		t.Fatal(err)
	}
	switch m := m.(type) {
	case *pgproto3.AuthenticationSASLContinue:
		return string(m.Data)
	case *pgproto3.AuthenticationSASLFinal:
		return string(m.Data)
	case *pgproto3.ErrorResponse:
		return "E:" + m.Code
	}
	t.Fatalf("unexpected %T", m)
	return ""
}

// salt is the s= attribute of a server-first-message.
func salt(t *testing.T, serverFirst string) string {
	for _, f := range strings.Split(serverFirst, ",") {
		if v, ok := strings.CutPrefix(f, "s="); ok {
			return v
		}
	}
	t.Fatalf("no salt in %q", serverFirst)
	return ""
}

func testBypassAuth(t *testing.T) {
	e := newAuthEnv(t, Config{})

	t.Run("dsn_user_without_password", func(t *testing.T) {
		// The primary DSN's own user, with no password: before, the proxy
		// trusted the client and presented the DSN's password for it.
		e.refused(t, scramUser, "", "28P01")
	})
	t.Run("dsn_user_wrong_password", func(t *testing.T) {
		e.refused(t, scramUser, "not the password", "28P01")
	})
	t.Run("dsn_password_for_another_role", func(t *testing.T) {
		// auth_same has the DSN user's password too; the client gives
		// none: the proxy must not answer for it with the DSN's.
		e.refused(t, "auth_same", "", "28P01")
	})
	t.Run("trust_presents_dsn_password_only_for_dsn_user", func(t *testing.T) {
		// Even with auth trust, the DSN's password is presented upstream
		// for the DSN's own user only: a client naming auth_same (same
		// password, SCRAM demanded) is refused upstream.
		te := newAuthEnv(t, Config{Auth: AuthTrust})
		pe := te.refused(t, "auth_same", "", "28000")
		if !strings.Contains(pe.Message, "does not have") {
			t.Fatalf("got %q, want the proxy saying it has no credential for the role", pe.Message)
		}
		if err := te.try(t, scramUser, ""); err != nil {
			t.Fatalf("trust: the DSN's own user: %v", err)
		}
	})
	t.Run("unknown_role", func(t *testing.T) {
		// Exactly like a wrong password: same code, same words, same hint.
		unknown := e.refused(t, "auth_nobody", "whatever", "28P01")
		wrong := e.refused(t, "auth_alice", "wrong", "28P01")
		if strings.ReplaceAll(unknown.Message, "auth_nobody", "X") != strings.ReplaceAll(wrong.Message, "auth_alice", "X") || unknown.Hint != wrong.Hint {
			t.Fatalf("unknown role %q (%q) differs from a wrong password %q (%q)", unknown.Message, unknown.Hint, wrong.Message, wrong.Hint)
		}
	})
	t.Run("unknown_role_salt", func(t *testing.T) {
		// An unknown role's salt is the same on every attempt and
		// differs from another unknown role's, as a real role's does.
		first := func(user string) string {
			r := e.scramStart(t, user)
			s := salt(t, r.step(t, true, "n,,n=,r=fixednonce"))
			if got := r.step(t, false, "c=biws,r=fixednonce-wrong,p=AAAA"); got != "E:28P01" {
				t.Fatalf("bogus proof for %s: got %s, want E:28P01", user, got)
			}
			return s
		}
		a1, a2, b := first("auth_ghost_a"), first("auth_ghost_a"), first("auth_ghost_b")
		real1, real2 := first("auth_alice"), first("auth_alice")
		if a1 != a2 || real1 != real2 || a1 == b || a1 == real1 {
			t.Fatalf("salts: ghost a %s %s, ghost b %s, alice %s %s: an unknown role stands out", a1, a2, b, real1, real2)
		}
		e.noCanary(t)
		// Round 22, attacker AS's L1: and on another proxy with the same
		// configuration (a restart, two proxies behind one address). The
		// salt came from a secret drawn at each start, so only the
		// unknown role's changed.
		t.Run("across_restarts", func(t *testing.T) {
			e2 := newAuthEnv(t, Config{})
			first2 := func(user string) string {
				r := e2.scramStart(t, user)
				s := salt(t, r.step(t, true, "n,,n=,r=fixednonce"))
				r.step(t, false, "c=biws,r=fixednonce-wrong,p=AAAA")
				return s
			}
			if g, r := first2("auth_ghost_a"), first2("auth_alice"); g != a1 || r != real1 {
				t.Fatalf("salts on a second proxy: ghost a %s (first proxy %s), alice %s (first proxy %s): an unknown role stands out", g, a1, r, real1)
			}
		})
	})
	t.Run("role_without_password", func(t *testing.T) {
		pe := e.refused(t, "auth_nopw", "", "28P01")
		if !strings.Contains(pe.Hint, "without a password") {
			t.Fatalf("hint %q does not say why", pe.Hint)
		}
		e.refused(t, "auth_nopw", "anything", "28P01")
	})
	t.Run("expired_password", func(t *testing.T) {
		e.refused(t, "auth_expired", "expired-pw", "28P01")
	})
	t.Run("md5_wrong_password", func(t *testing.T) {
		e.refused(t, "auth_md5", "wrong", "28P01")
	})
	t.Run("nologin_role", func(t *testing.T) {
		// The password is right, but the role may not log in: pg_shadow
		// lists login roles only, so the proxy refuses it as it refuses
		// a role that does not exist.
		e.refused(t, "auth_nologin", "nologin-pw", "28P01")
	})
	t.Run("upstream_wants_cleartext", func(t *testing.T) {
		// The proxy has no password to give: it fails closed.
		pe := e.refused(t, "auth_cleartext", "cleartext-pw", "28000")
		if !strings.Contains(pe.Message, "cleartext") {
			t.Fatalf("got %q, want it to name what PostgreSQL asked for", pe.Message)
		}
	})
	t.Run("replayed_proof", func(t *testing.T) {
		// A recorded exchange replayed: the server nonce differs.
		r, first, final := e.scramProve(t, "auth_alice", "", "alice-pw")
		if got := r.step(t, false, final); !strings.HasPrefix(got, "v=") {
			t.Fatalf("the recorded exchange itself: got %s", got)
		}
		r2 := e.scramStart(t, "auth_alice")
		r2.step(t, true, first)
		if got := r2.step(t, false, final); got != "E:28P01" {
			t.Fatalf("replayed proof: got %s, want E:28P01", got)
		}
		e.noCanary(t)
	})
	t.Run("scram_name_is_not_the_role", func(t *testing.T) {
		// The SCRAM message names scram_user and proves its password; the
		// startup names auth_alice, which is what counts.
		r, _, final := e.scramProve(t, "auth_alice", scramUser, scramPassword)
		if got := r.step(t, false, final); got != "E:28P01" {
			t.Fatalf("proof for another role: got %s, want E:28P01", got)
		}
		e.noCanary(t)
	})
	t.Run("plus_without_tls", func(t *testing.T) {
		r := e.scramStart(t, "auth_alice")
		r.fe.Send(&pgproto3.SASLInitialResponse{AuthMechanism: "SCRAM-SHA-256-PLUS", Data: []byte("p=tls-server-end-point,,n=,r=abc")})
		r.fe.Flush()
		if code := r.closedWith(t); code != "28000" {
			t.Fatalf("SCRAM-SHA-256-PLUS on a plain connection: got %q, want 28000", code)
		}
		e.noCanary(t)
	})
	t.Run("auth_query_injection", func(t *testing.T) {
		e.refused(t, "x' OR '1'='1", "x", "28P01")
	})
	t.Run("trust_on_a_non_loopback_address", func(t *testing.T) {
		// Serve refuses trust on a non-loopback listener ...
		srv, err := New(Config{Primary: authDSN(), Auth: AuthTrust}, nil)
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "0.0.0.0:0")
		if err != nil {
			t.Fatal(err)
		}
		if err := srv.Serve(context.Background(), ln); err == nil || !strings.Contains(err.Error(), "allow_remote_trust") {
			t.Fatalf("Serve with trust on %s: got %v, want a refusal naming allow_remote_trust", ln.Addr(), err)
		}
		// ... and a client reaching the proxy on one is refused even
		// when a reload has turned trust on.
		ip := nonLoopbackIP()
		if ip == nil {
			t.Log("no non-loopback address on this machine: the per-connection check is not exercised")
			return
		}
		te := newAuthEnv(t, Config{})
		srv2, err := New(Config{Primary: authDSN()}, nil)
		if err != nil {
			t.Fatal(err)
		}
		ln2, err := net.Listen("tcp", net.JoinHostPort(ip.String(), "0"))
		if err != nil {
			t.Fatal(err)
		}
		go srv2.Serve(context.Background(), ln2)
		t.Cleanup(func() { srv2.Shutdown(context.Background()) })
		dsn := fmt.Sprintf("postgres://%s:%s@%s/%s?sslmode=disable", scramUser, url.PathEscape(scramPassword), ln2.Addr(), te.db)
		c, err := pgconn.Connect(ctxT(t), dsn) // Serve is running
		if err != nil {
			t.Fatal(err)
		}
		c.Close(context.Background())
		if _, err := srv2.Reload(Config{Primary: authDSN(), Auth: AuthTrust}); err != nil {
			t.Fatal(err)
		}
		dsn = fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", scramUser, ln2.Addr(), te.db)
		_, err = pgconn.Connect(ctxT(t), dsn)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "28000" || !strings.Contains(pe.Message, "non-loopback") {
			t.Fatalf("trust on %s: got %v, want 28000", ln2.Addr(), err)
		}
		te.noCanary(t)
	})
	t.Run("good_passwords_get_in", func(t *testing.T) {
		// The control: the right password gets in, as the role named,
		// for SCRAM and md5 roles and for the DSN's own user; upstream
		// SCRAM is answered with the client's own keys.
		for _, u := range [][2]string{{scramUser, scramPassword}, {"auth_alice", "alice-pw"}, {"auth_same", scramPassword}, {"auth_md5", "md5-pw"}} {
			if err := e.try(t, u[0], u[1]); err != nil {
				t.Fatalf("%s with the right password: %v", u[0], err)
			}
		}
		c, err := cluster.Primary.Connect(ctxT(t), e.db)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(context.Background())
		var who string
		if err := c.QueryRow(ctxT(t), "SELECT string_agg(who, ',' ORDER BY who) FROM auth_canary").Scan(&who); err != nil {
			t.Fatal(err)
		}
		if who != "auth_alice,auth_md5,auth_same,"+scramUser {
			t.Fatalf("canary written by %q, want each role as itself", who)
		}
		c.Exec(ctxT(t), "TRUNCATE auth_canary")
	})
}

// nonLoopbackIP is an IPv4 address of this machine that is not loopback,
// or nil.
func nonLoopbackIP() net.IP {
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && !n.IP.IsLoopback() && n.IP.To4() != nil {
			return n.IP
		}
	}
	return nil
}
