package proxy

// Authenticating upstream as the client's role: what the proxy presents to
// PostgreSQL for a client it authenticated (auth.go), and the upstream
// SCRAM exchange that presents it.

import (
	"context"
	"crypto/md5"
	"crypto/pbkdf2"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/xdg-go/scram"
	"github.com/xdg-go/stringprep"
)

// upstreamAuth is what the proxy presents upstream for one client's role:
// a configured password when there is one, else what the client proved
// (with AuthSCRAM, a users file holding the role's verifier as
// PostgreSQL stores it makes the client's keys good upstream too).
type upstreamAuth struct {
	proof    *Proof
	password string // configured for the role (the DSN's own user's, or upstream_passwords)
}

// upstreamCredentials returns what may be presented upstream to base's
// server for user: what the client proved, and a configured password —
// upstream_passwords[user], or base's DSN password only when user is the
// DSN's own user. Never the DSN's password for another name.
func (s *Server) upstreamCredentials(base *pgconn.Config, user string, proof *Proof) upstreamAuth {
	ua := upstreamAuth{proof: proof}
	if pw, ok := s.live().upstreamPasswords[user]; ok {
		ua.password = pw
	} else if user == base.User {
		ua.password = base.Password
	}
	if ua.proof == nil {
		ua.proof = &Proof{}
	}
	return ua
}

// errConnected ends pgconn's connect once the startup done in
// AfterNetConnect has succeeded (see dialUpstream).
var errConnected = errors.New("connected")

// dialUpstream opens an upstream connection for pc (its user, database and
// startup parameters) and authenticates it with ua. pgconn does the
// network part (host list, DNS, TLS as sslmode says, timeouts); the
// startup and the authentication exchange are the proxy's own, so that it
// can answer SCRAM with the client's keys. Errors from PostgreSQL are
// *pgconn.PgError.
func dialUpstream(ctx context.Context, pc *pgconn.Config, ua upstreamAuth) (*pgconn.HijackedConn, error) {
	pc = pc.Copy()
	validate := pc.ValidateConnect
	pc.ValidateConnect, pc.AfterConnect = nil, nil
	var got *pgconn.HijackedConn
	pc.AfterNetConnect = func(ctx context.Context, cfg *pgconn.Config, conn net.Conn) (net.Conn, error) {
		if got != nil {
			return conn, errConnected // pgconn tries no further host once one is ours
		}
		hj, err := startUpstream(ctx, cfg, conn, ua)
		if err != nil {
			return conn, err // pgconn closes conn and tries the next host if it should
		}
		if validate != nil {
			// target_session_attrs: pgconn's check needs a PgConn.
			c, err := pgconn.Construct(hj)
			if err == nil {
				if err = validate(ctx, c); err == nil {
					hj, err = c.Hijack()
				}
			}
			if err != nil {
				return conn, err
			}
		}
		got = hj
		return noClose{conn}, errConnected
	}
	_, err := pgconn.ConnectConfig(ctx, pc)
	if got != nil {
		return got, nil
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return nil, pg
	}
	return nil, err
}

// noClose is a connection pgconn may "close" after its AfterNetConnect
// took it over.
type noClose struct{ net.Conn }

func (noClose) Close() error { return nil }

// startUpstream sends the startup message on conn (network and TLS set
// up by pgconn), authenticates with ua and reads up to ReadyForQuery.
func startUpstream(ctx context.Context, cfg *pgconn.Config, conn net.Conn, ua upstreamAuth) (*pgconn.HijackedConn, error) {
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
		defer conn.SetDeadline(time.Time{})
	}
	// Read one message at a time (frameReader), never past the
	// ReadyForQuery: what the server sends behind it stays in the
	// socket for the session's relay (dupSockets).
	fe := pgproto3.NewFrontend(&frameReader{r: conn}, conn)
	params := make(map[string]string, len(cfg.RuntimeParams)+2)
	for k, v := range cfg.RuntimeParams {
		params[k] = v
	}
	params["user"] = cfg.User
	if cfg.Database != "" {
		params["database"] = cfg.Database
	}
	fe.Send(&pgproto3.StartupMessage{ProtocolVersion: pgproto3.ProtocolVersionNumber, Parameters: params})
	if err := fe.Flush(); err != nil {
		return nil, fmt.Errorf("write startup message: %w", err)
	}
	hj := &pgconn.HijackedConn{Conn: conn, ParameterStatuses: map[string]string{}, Frontend: fe, Config: cfg, CustomData: map[string]any{}}
	if _, ok := conn.(*tls.Conn); ok {
		hj.TLSConfig = cfg.TLSConfig
	}
	for {
		m, err := fe.Receive()
		if err != nil {
			return nil, fmt.Errorf("read startup response: %w", err)
		}
		switch m := m.(type) {
		case *pgproto3.AuthenticationOk:
		case *pgproto3.AuthenticationCleartextPassword:
			if ua.password == "" {
				return nil, noCredential(cfg.User, "a cleartext password")
			}
			fe.Send(&pgproto3.PasswordMessage{Password: ua.password})
			if err := fe.Flush(); err != nil {
				return nil, err
			}
		case *pgproto3.AuthenticationMD5Password:
			var answer string
			switch {
			case ua.password != "":
				inner := md5.Sum([]byte(ua.password + cfg.User))
				answer = md5Salted(hex.EncodeToString(inner[:]), m.Salt)
			case ua.proof.MD5 != "":
				answer = md5Salted(ua.proof.MD5[3:], m.Salt)
			default:
				return nil, noCredential(cfg.User, "an md5 password")
			}
			fe.Send(&pgproto3.PasswordMessage{Password: answer})
			if err := fe.Flush(); err != nil {
				return nil, err
			}
		case *pgproto3.AuthenticationSASL:
			if err := scramUpstream(fe, conn, cfg, m.AuthMechanisms, ua); err != nil {
				return nil, err
			}
		case *pgproto3.ParameterStatus:
			hj.ParameterStatuses[m.Name] = m.Value
		case *pgproto3.BackendKeyData:
			hj.PID, hj.SecretKey = m.ProcessID, append([]byte(nil), m.SecretKey...)
		case *pgproto3.NoticeResponse:
		case *pgproto3.NegotiateProtocolVersion:
		case *pgproto3.ReadyForQuery:
			hj.TxStatus = m.TxStatus
			return hj, nil
		case *pgproto3.ErrorResponse:
			return nil, pgconn.ErrorResponseToPgError(m)
		default:
			return nil, fmt.Errorf("unexpected message %T during upstream startup", m)
		}
	}
}

// noCredential is the error for an upstream that asks for what the proxy
// does not have for the role.
func noCredential(user, what string) error {
	return &ProtocolError{Code: "28000", Msg: fmt.Sprintf("pgfence: PostgreSQL asks for %s for user %q, which pgfence does not have (use scram-sha-256 in pg_hba.conf for pgfence's connections, or set upstream_passwords)", what, user), Err: ErrAuthFailed}
}

// scramUpstream runs SCRAM-SHA-256 (-PLUS on TLS when offered, as libpq's
// channel_binding, which cfg.ChannelBinding follows) as the client, with
// the configured password, or else the client's keys.
func scramUpstream(fe *pgproto3.Frontend, conn net.Conn, cfg *pgconn.Config, mechs []string, ua upstreamAuth) error {
	clientKey, serverKey := ua.proof.ClientKey, ua.proof.ServerKey
	if ua.password != "" {
		clientKey = nil // derived from it below
	}
	if clientKey == nil && ua.password == "" {
		return noCredential(cfg.User, "a SCRAM-SHA-256 password")
	}
	var cbData []byte
	if tc, ok := conn.(*tls.Conn); ok && cfg.ChannelBinding != "disable" {
		state := tc.ConnectionState()
		if b, err := scram.NewTLSServerEndpointBinding(&state); err == nil {
			cbData = b.Data
		}
	}
	has := func(m string) bool {
		for _, x := range mechs {
			if x == m {
				return true
			}
		}
		return false
	}
	plus := cbData != nil && has("SCRAM-SHA-256-PLUS")
	switch {
	case cfg.ChannelBinding == "require" && !plus:
		return fmt.Errorf("channel binding required but the server does not offer SCRAM-SHA-256-PLUS")
	case !plus && !has("SCRAM-SHA-256"):
		return fmt.Errorf("the server offers no SASL mechanism pgfence supports: %v", mechs)
	}
	mech, gs2 := "SCRAM-SHA-256", "n,,"
	switch {
	case plus:
		mech, gs2 = "SCRAM-SHA-256-PLUS", "p=tls-server-end-point,,"
	case cbData != nil:
		gs2 = "y,,"
	}
	var nb [18]byte
	rand.Read(nb[:])
	nonce := base64.RawStdEncoding.EncodeToString(nb[:])
	bare := "n=,r=" + nonce
	fe.Send(&pgproto3.SASLInitialResponse{AuthMechanism: mech, Data: []byte(gs2 + bare)})
	if err := fe.Flush(); err != nil {
		return err
	}
	m, err := fe.Receive()
	if err != nil {
		return err
	}
	cont, ok := m.(*pgproto3.AuthenticationSASLContinue)
	if !ok {
		return unexpectedAuth(m)
	}
	serverFirst := string(cont.Data)
	rn, salt, iters, err := parseServerFirst(serverFirst)
	if err != nil || !strings.HasPrefix(rn, nonce) || len(rn) == len(nonce) {
		return fmt.Errorf("invalid SCRAM server-first-message")
	}
	if clientKey == nil {
		clientKey, serverKey, err = scramKeys(ua.password, salt, iters)
		if err != nil {
			return err
		}
	}
	cbind := base64.StdEncoding.EncodeToString(append([]byte(gs2), cbData...))
	if !plus {
		cbind = base64.StdEncoding.EncodeToString([]byte(gs2))
	}
	withoutProof := "c=" + cbind + ",r=" + rn
	authMsg := bare + "," + serverFirst + "," + withoutProof
	stored := sha256.Sum256(clientKey)
	proof := make([]byte, sha256.Size)
	subtle.XORBytes(proof, clientKey, hmacSHA256(stored[:], authMsg))
	fe.Send(&pgproto3.SASLResponse{Data: []byte(withoutProof + ",p=" + base64.StdEncoding.EncodeToString(proof))})
	if err := fe.Flush(); err != nil {
		return err
	}
	if m, err = fe.Receive(); err != nil {
		return err
	}
	fin, ok := m.(*pgproto3.AuthenticationSASLFinal)
	if !ok {
		return unexpectedAuth(m)
	}
	want := "v=" + base64.StdEncoding.EncodeToString(hmacSHA256(serverKey, authMsg))
	if subtle.ConstantTimeCompare(fin.Data, []byte(want)) != 1 {
		return errors.New("invalid SCRAM server signature: the upstream server does not know the role's password")
	}
	return nil
}

// unexpectedAuth turns what came instead of the next SCRAM step into an
// error (PostgreSQL's own refusal, typically).
func unexpectedAuth(m pgproto3.BackendMessage) error {
	if e, ok := m.(*pgproto3.ErrorResponse); ok {
		return pgconn.ErrorResponseToPgError(e)
	}
	return fmt.Errorf("unexpected message %T during SCRAM authentication", m)
}

// parseServerFirst reads r=,s=,i= from a SCRAM server-first-message.
func parseServerFirst(s string) (nonce string, salt []byte, iters int, err error) {
	for _, f := range strings.Split(s, ",") {
		k, v, _ := strings.Cut(f, "=")
		switch k {
		case "r":
			nonce = v
		case "s":
			salt, err = base64.StdEncoding.DecodeString(v)
		case "i":
			iters, err = strconv.Atoi(v)
		}
		if err != nil {
			return "", nil, 0, err
		}
	}
	if nonce == "" || len(salt) == 0 || iters <= 0 {
		return "", nil, 0, errors.New("incomplete server-first-message")
	}
	return nonce, salt, iters, nil
}

// scramKeys derives a role's ClientKey and ServerKey from its password,
// as PostgreSQL does (SASLprep, falling back to the raw bytes; PBKDF2
// with HMAC-SHA-256).
func scramKeys(password string, salt []byte, iters int) (clientKey, serverKey []byte, err error) {
	if p, err := stringprep.SASLprep.Prepare(password); err == nil {
		password = p
	}
	salted, err := pbkdf2.Key(sha256.New, password, salt, iters, sha256.Size)
	if err != nil {
		return nil, nil, fmt.Errorf("derive SCRAM keys: %w", err)
	}
	return hmacSHA256(salted, "Client Key"), hmacSHA256(salted, "Server Key"), nil
}

// isConnError reports whether err is the connection's (closed, reset,
// timed out) rather than a message's.
func isConnError(err error) bool {
	var ne net.Error
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) || errors.As(err, &ne)
}
