package proxy

import (
	"bufio"
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/md5"
	"crypto/rand"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"maps"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/xdg-go/scram"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/internal/ctlconn"
)

// Client authentication (docs/proxy.md, "Who may connect").
//
// With AuthPostgres (the default) the proxy authenticates each client
// against the password PostgreSQL itself stores for the role the client
// names: it looks the verifier up with Config.AuthQuery on a connection of
// its own (as the primary DSN's user), runs SCRAM-SHA-256 (or md5, for an
// md5 verifier) with the client, and then authenticates upstream *as that
// role* with what the exchange proved, never with a password of its own:
// the SCRAM ClientKey, recovered from the client's proof
// (ClientKey = ClientProof XOR HMAC(StoredKey, AuthMessage)), or the md5
// hash. The upstream leg is a SCRAM exchange of its own, over its own TLS
// and with its own channel binding, which is why the client's exchange is
// not relayed: libpq on TLS, offered only SCRAM-SHA-256, signs the GS2 flag
// "y" into its proof, and PostgreSQL on a TLS connection of its own refuses
// that flag; a relay also cannot pre-authenticate server connections, which
// transaction pooling will need. This is PgBouncer's auth_query with its
// reuse of the client's SCRAM keys (src/scram.c).

// ErrAuthFailed is the cause logged when a client fails authentication.
var ErrAuthFailed = errors.New("authentication failed")

// DefaultSCRAMIterations is the iteration count MakeVerifier uses, as
// PostgreSQL's scram_iterations default.
const DefaultSCRAMIterations = 4096

// DefaultAuthQuery is the query Config.AuthQuery defaults to: PgBouncer's
// auth_query, with expired passwords left out as PostgreSQL refuses them.
const DefaultAuthQuery = "SELECT usename, passwd FROM pg_catalog.pg_shadow WHERE usename OPERATOR(pg_catalog.=) $1 AND (valuntil IS NULL OR valuntil OPERATOR(pg_catalog.>) pg_catalog.now())"

// authHint is told to every client that fails authentication: it says
// why without saying whether the role exists.
const authHint = "pgfence checks the password PostgreSQL stores for the role (auth = postgres): a role without a password, or with an expired one, cannot log in through pgfence"

// MakeVerifier returns a SCRAM-SHA-256 verifier for password, in the format
// PostgreSQL stores: SCRAM-SHA-256$<iter>:<salt>$<StoredKey>:<ServerKey>.
func MakeVerifier(user, password string) (string, error) {
	salt := make([]byte, 16)
	if _, err := rand.Read(salt); err != nil {
		return "", fmt.Errorf("salt: %w", err)
	}
	c, err := scram.SHA256.NewClient(user, password, "")
	if err != nil {
		return "", fmt.Errorf("prepare password: %w", err)
	}
	sc, err := c.GetStoredCredentialsWithError(scram.KeyFactors{Salt: string(salt), Iters: DefaultSCRAMIterations})
	if err != nil {
		return "", fmt.Errorf("derive keys: %w", err)
	}
	enc := base64.StdEncoding.EncodeToString
	return fmt.Sprintf("SCRAM-SHA-256$%d:%s$%s:%s", sc.Iters, enc(salt), enc(sc.StoredKey), enc(sc.ServerKey)), nil
}

// parseVerifier decodes a SCRAM-SHA-256 verifier.
func parseVerifier(v string) (scram.StoredCredentials, error) {
	var sc scram.StoredCredentials
	rest, ok := strings.CutPrefix(v, "SCRAM-SHA-256$")
	if !ok {
		return sc, errors.New("not a SCRAM-SHA-256 verifier (want SCRAM-SHA-256$<iter>:<salt>$<StoredKey>:<ServerKey>; see pgfence passwd)")
	}
	params, keys, ok := strings.Cut(rest, "$")
	iter, salt, ok2 := strings.Cut(params, ":")
	stored, server, ok3 := strings.Cut(keys, ":")
	if !ok || !ok2 || !ok3 {
		return sc, errors.New("malformed SCRAM-SHA-256 verifier")
	}
	n, err := strconv.Atoi(iter)
	if err != nil || n <= 0 {
		return sc, errors.New("malformed SCRAM-SHA-256 verifier: bad iteration count")
	}
	dec := base64.StdEncoding.DecodeString
	s, err1 := dec(salt)
	sk, err2 := dec(stored)
	vk, err3 := dec(server)
	if err := errors.Join(err1, err2, err3); err != nil || len(sk) != 32 || len(vk) != 32 {
		return sc, errors.New("malformed SCRAM-SHA-256 verifier: bad base64 or key length")
	}
	sc.Salt, sc.Iters, sc.StoredKey, sc.ServerKey = string(s), n, sk, vk
	return sc, nil
}

// isMD5Hash reports whether v is an md5 password hash as PostgreSQL
// stores it: "md5" and 32 lower-case hex digits.
func isMD5Hash(v string) bool {
	if len(v) != 35 || !strings.HasPrefix(v, "md5") {
		return false
	}
	_, err := hex.DecodeString(v[3:])
	return err == nil && strings.ToLower(v) == v
}

// LoadUsers reads a users file in PgBouncer's auth_file format: one
// `"user" "verifier"` per line; a doubled quote inside quotes is a quote;
// blank lines and lines starting with ; or # are ignored.
func LoadUsers(path string) (map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("users file: %w", err)
	}
	defer f.Close()
	return parseUsers(f, path)
}

func parseUsers(r io.Reader, name string) (map[string]string, error) {
	users := make(map[string]string)
	sc := bufio.NewScanner(r)
	for ln := 1; sc.Scan(); ln++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == ';' || line[0] == '#' {
			continue
		}
		user, rest, err := quoted(line)
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %w", name, ln, err)
		}
		verifier, _, err := quoted(strings.TrimSpace(rest))
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %w", name, ln, err)
		}
		if _, err := parseVerifier(verifier); err != nil {
			return nil, fmt.Errorf("%s:%d: user %q: %w", name, ln, user, err)
		}
		users[user] = verifier
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return users, nil
}

// quoted reads one "..." field ("" is an escaped quote).
func quoted(s string) (string, string, error) {
	if !strings.HasPrefix(s, `"`) {
		return "", s, errors.New(`expected a "quoted" field`)
	}
	var b strings.Builder
	for i := 1; i < len(s); i++ {
		if s[i] == '"' {
			if i+1 < len(s) && s[i+1] == '"' {
				b.WriteByte('"')
				i++
				continue
			}
			return b.String(), s[i+1:], nil
		}
		b.WriteByte(s[i])
	}
	return "", s, errors.New("unterminated quoted field")
}

// QuoteUserLine formats a users-file line.
func QuoteUserLine(user, verifier string) string {
	q := func(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }
	return q(user) + " " + q(verifier)
}

// ---------------------------------------------------------------------------
// The client's exchange

// Proof is what a client proved in its authentication exchange: the
// credential the proxy may present upstream as that client's role.
type Proof struct {
	// ClientKey and ServerKey are the role's SCRAM keys (a SCRAM
	// exchange); the proxy answers an upstream SCRAM exchange with them.
	ClientKey, ServerKey []byte
	// MD5 is the role's md5 hash ("md5..."), after an md5 exchange.
	MD5 string
}

// authFailed is the error for a failed exchange: the same for a wrong
// password, an unknown role and a role without a password.
func authFailed(user string) error {
	return &ProtocolError{Code: "28P01", Msg: fmt.Sprintf("password authentication failed for user %q", user), Err: ErrAuthFailed}
}

// NewAuthBackend returns a pgproto3 Backend for an authentication exchange
// on c. It reads one message at a time, never past its end (what follows
// stays for the session), and refuses messages longer than a startup
// packet: an unauthenticated client cannot make the proxy buffer more.
func NewAuthBackend(c io.ReadWriter) *pgproto3.Backend {
	be := pgproto3.NewBackend(&frameReader{r: c}, c)
	be.SetMaxBodyLen(maxStartLen)
	return be
}

// frameReader passes r's bytes on at most one message at a time: a read
// never goes past the end of the current message's header or body.
type frameReader struct {
	r    io.Reader
	hdr  [headerLen]byte
	hn   int // header bytes passed on
	left int // body bytes of the current message still to pass on
}

func (f *frameReader) Read(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	if f.left == 0 {
		n, err := f.r.Read(b[:min(len(b), headerLen-f.hn)])
		copy(f.hdr[f.hn:], b[:n])
		if f.hn += n; f.hn == headerLen {
			f.hn = 0
			f.left = max(int(int32(binary.BigEndian.Uint32(f.hdr[1:])))-4, 0)
		}
		return n, err
	}
	n, err := f.r.Read(b[:min(len(b), f.left)])
	f.left -= n
	return n, err
}

// receiveAuth reads the client's next authentication message, expecting
// a 'p' message decoded as authType says.
func receiveAuth(be *pgproto3.Backend, authType uint32) (pgproto3.FrontendMessage, error) {
	be.SetAuthType(authType)
	m, err := be.Receive()
	var tooBig *pgproto3.ExceededMaxBodyLenErr
	switch {
	case errors.As(err, &tooBig):
		return nil, &ProtocolError{Code: "08P01", Msg: fmt.Sprintf("authentication message of %d bytes is over the limit of %d bytes before authentication", tooBig.ActualBodyLen, tooBig.MaxExpectedBodyLen)}
	case err != nil && strings.HasPrefix(err.Error(), "unknown message type"):
		return nil, &ProtocolError{Code: "08P01", Msg: "expected password response: " + err.Error()}
	case err != nil && !isConnError(err):
		// A message that arrived whole but does not decode (an empty
		// SASLInitialResponse, say): malformed, as PostgreSQL says.
		return nil, &ProtocolError{Code: "08P01", Msg: "malformed authentication response: " + err.Error()}
	case err != nil:
		return nil, err
	}
	switch m.(type) {
	case *pgproto3.SASLInitialResponse, *pgproto3.SASLResponse, *pgproto3.PasswordMessage:
		return m, nil
	case *pgproto3.Terminate:
		return nil, io.EOF
	}
	return nil, &ProtocolError{Code: "08P01", Msg: fmt.Sprintf("expected password response, got %T", m)}
}

// authRound sends the client the authentication request req (of
// authType) and returns its answer, which must be a T.
func authRound[T pgproto3.FrontendMessage](be *pgproto3.Backend, req pgproto3.BackendMessage, authType uint32) (T, error) {
	var answer T
	be.Send(req)
	if err := be.Flush(); err != nil {
		return answer, err
	}
	m, err := receiveAuth(be, authType)
	if err != nil {
		return answer, err
	}
	answer, ok := m.(T)
	if !ok {
		return answer, &ProtocolError{Code: "08P01", Msg: "expected " + strings.TrimPrefix(fmt.Sprintf("%T", answer), "*pgproto3.")}
	}
	return answer, nil
}

// SCRAMExchange runs a SCRAM-SHA-256 exchange with a client over be, as
// the server, against sc (known false: sc is a dummy and the exchange
// fails at its end, like a wrong password). With cb supported (a TLS
// connection), SCRAM-SHA-256-PLUS is offered too. It does not send
// AuthenticationOk. On success it returns the role's SCRAM keys.
func SCRAMExchange(be *pgproto3.Backend, user string, sc scram.StoredCredentials, known bool, cb scram.ChannelBinding) (*Proof, error) {
	srv, err := scram.SHA256.NewServer(func(string) (scram.StoredCredentials, error) { return sc, nil })
	if err != nil {
		return nil, fmt.Errorf("scram server: %w", err)
	}
	mechs := []string{"SCRAM-SHA-256"}
	conv := srv.NewConversation()
	if cb.IsSupported() {
		mechs = []string{"SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"}
		conv = srv.NewConversationWithChannelBinding(cb)
	}
	init, err := authRound[*pgproto3.SASLInitialResponse](be, &pgproto3.AuthenticationSASL{AuthMechanisms: mechs}, pgproto3.AuthTypeSASL)
	if err != nil {
		return nil, err
	}
	if init.AuthMechanism != "SCRAM-SHA-256" && (init.AuthMechanism != "SCRAM-SHA-256-PLUS" || !cb.IsSupported()) {
		return nil, &ProtocolError{Code: "28000", Msg: fmt.Sprintf("client selected an invalid SASL authentication mechanism %q", init.AuthMechanism)}
	}
	if (init.AuthMechanism == "SCRAM-SHA-256-PLUS") != bytes.HasPrefix(init.Data, []byte("p=")) {
		return nil, &ProtocolError{Code: "08P01", Msg: "SCRAM channel binding negotiation error: the mechanism and the GS2 header disagree"}
	}
	clientFirst := string(init.Data) // copied: be reuses its buffer
	first, err := conv.Step(clientFirst)
	if err != nil {
		return nil, authFailed(user)
	}
	resp, err := authRound[*pgproto3.SASLResponse](be, &pgproto3.AuthenticationSASLContinue{Data: []byte(first)}, pgproto3.AuthTypeSASLContinue)
	if err != nil {
		return nil, err
	}
	clientFinal := string(resp.Data)
	final, err := conv.Step(clientFinal)
	if err != nil || !conv.Valid() || !known {
		return nil, authFailed(user)
	}
	key, err := recoverClientKey(sc, clientFirst, first, clientFinal)
	if err != nil {
		return nil, fmt.Errorf("recover client key: %w", err)
	}
	be.Send(&pgproto3.AuthenticationSASLFinal{Data: []byte(final)})
	return &Proof{ClientKey: key, ServerKey: sc.ServerKey}, nil
}

// recoverClientKey computes the client's ClientKey from a successful
// exchange: ClientKey = ClientProof XOR HMAC(StoredKey, AuthMessage), and
// checks that it hashes to StoredKey.
func recoverClientKey(sc scram.StoredCredentials, clientFirst, serverFirst, clientFinal string) ([]byte, error) {
	// client-first-message is gs2-header client-first-message-bare; the
	// header is "flag,[a=authzid]," (two commas).
	i := strings.IndexByte(clientFirst, ',')
	j := -1
	if i >= 0 {
		j = strings.IndexByte(clientFirst[i+1:], ',')
	}
	p := strings.LastIndex(clientFinal, ",p=")
	if j < 0 || p < 0 {
		return nil, errors.New("malformed SCRAM messages")
	}
	bare := clientFirst[i+1+j+1:]
	proof, err := base64.StdEncoding.DecodeString(clientFinal[p+3:])
	if err != nil || len(proof) != sha256.Size {
		return nil, errors.New("malformed client proof")
	}
	sig := hmacSHA256(sc.StoredKey, bare+","+serverFirst+","+clientFinal[:p])
	key := make([]byte, sha256.Size)
	subtle.XORBytes(key, proof, sig)
	if h := sha256.Sum256(key); subtle.ConstantTimeCompare(h[:], sc.StoredKey) != 1 {
		return nil, errors.New("client key does not match the stored key")
	}
	return key, nil
}

func hmacSHA256(key []byte, msg string) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(msg))
	return m.Sum(nil)
}

// MD5Exchange runs an md5 password exchange with a client over be, as the
// server, against the stored md5 hash (known false: always fails, like
// a wrong password). It does not send AuthenticationOk.
func MD5Exchange(be *pgproto3.Backend, user, stored string, known bool) (*Proof, error) {
	var salt [4]byte
	rand.Read(salt[:])
	pm, err := authRound[*pgproto3.PasswordMessage](be, &pgproto3.AuthenticationMD5Password{Salt: salt}, pgproto3.AuthTypeMD5Password)
	if err != nil {
		return nil, err
	}
	if !known || len(stored) < 3 || subtle.ConstantTimeCompare([]byte(pm.Password), []byte(md5Salted(stored[3:], salt))) != 1 {
		return nil, authFailed(user)
	}
	return &Proof{MD5: stored}, nil
}

// md5Salted is the md5 exchange's answer for a stored hash's hex digits
// (md5(password || user)) and the server's salt.
func md5Salted(inner string, salt [4]byte) string {
	h := md5.Sum(append([]byte(inner), salt[:]...))
	return "md5" + hex.EncodeToString(h[:])
}

// dummyCredentials is the verifier an unknown role is checked against. As
// PostgreSQL's mock authentication, its salt is derived from the user name
// and a secret of the server, so that a role that does not exist gets
// the same salt on every attempt, and a different one from other roles:
// nothing tells it from a real one.
func (s *Server) dummyCredentials(user string) scram.StoredCredentials {
	m := hmac.New(sha256.New, s.mockSecret[:])
	m.Write([]byte(user))
	salt := m.Sum(nil)[:16]
	keys := m.Sum(salt) // any 32 bytes: no client key hashes to them
	return scram.StoredCredentials{
		KeyFactors: scram.KeyFactors{Salt: string(salt), Iters: DefaultSCRAMIterations},
		StoredKey:  keys[16:48], ServerKey: keys[16:48],
	}
}

// mockSecret is the server secret dummyCredentials derives salts from.
// PostgreSQL keeps its own in pg_control (mock_auth_nonce), so an
// unknown role's salt stays the same across restarts. A secret drawn at
// each start told a client with no credentials which names are real: a
// real role's salt, from its stored verifier, is the same before and
// after a restart, or on two proxies behind one address; an unknown
// one's was not (round 22, AS-L1). So it is derived from what the
// configuration holds and no client can read: the passwords of the
// primary's and replicas' DSNs and of UpstreamPasswords, the users'
// verifiers, the TLS private key. Proxies with the same configuration
// give the same salts. With none of these (a control DSN with peer or
// trust authentication and no TLS) it is drawn at random, and the log
// says what that tells.
func mockSecret(cfg Config, primary *pgconn.Config, replicas []*pgconn.Config, log *zap.Logger) (secret [32]byte) {
	m := hmac.New(sha256.New, []byte("pgfence mock authentication v1"))
	n := 0
	add := func(what string, b []byte) {
		if len(b) == 0 {
			return
		}
		n++
		var l [8]byte
		binary.BigEndian.PutUint64(l[:], uint64(len(what)))
		m.Write(l[:])
		m.Write([]byte(what))
		binary.BigEndian.PutUint64(l[:], uint64(len(b)))
		m.Write(l[:])
		m.Write(b)
	}
	for i, pc := range append([]*pgconn.Config{primary}, replicas...) {
		if pc != nil {
			add(fmt.Sprintf("dsn %d", i), []byte(pc.Password))
		}
	}
	for _, k := range slices.Sorted(maps.Keys(cfg.UpstreamPasswords)) {
		add("upstream "+k, []byte(cfg.UpstreamPasswords[k]))
	}
	for _, k := range slices.Sorted(maps.Keys(cfg.Users)) {
		add("user "+k, []byte(cfg.Users[k]))
	}
	if cfg.TLS != nil {
		for _, c := range cfg.TLS.Certificates {
			if b, err := x509.MarshalPKCS8PrivateKey(c.PrivateKey); err == nil {
				add("tls key", b)
			}
		}
	}
	if n == 0 {
		rand.Read(secret[:])
		if cfg.Auth == AuthTrust {
			return secret // no exchange, no dummy verifier
		}
		log.Warn("no secret in the configuration (no password in the primary DSN, no TLS key): the dummy verifiers of unknown roles are salted anew at each start, so a client that compares an unknown role's salt before and after a restart can tell it does not exist; give the primary DSN a password to keep them stable")
		return secret
	}
	copy(secret[:], m.Sum(nil))
	return secret
}

// serverEndPoint returns the tls-server-end-point channel binding of the
// proxy's own certificate (RFC 5929: a hash of it, SHA-256 for MD5 and
// SHA-1 signatures), or no binding when it cannot be computed.
func serverEndPoint(cfg *tls.Config) scram.ChannelBinding {
	if cfg == nil || len(cfg.Certificates) == 0 || len(cfg.Certificates[0].Certificate) == 0 {
		return scram.ChannelBinding{}
	}
	cert := cfg.Certificates[0].Leaf
	if cert == nil {
		var err error
		if cert, err = x509.ParseCertificate(cfg.Certificates[0].Certificate[0]); err != nil {
			return scram.ChannelBinding{}
		}
	}
	var h hash.Hash
	switch cert.SignatureAlgorithm {
	case x509.SHA384WithRSA, x509.SHA384WithRSAPSS, x509.ECDSAWithSHA384:
		h = sha512.New384()
	case x509.SHA512WithRSA, x509.SHA512WithRSAPSS, x509.ECDSAWithSHA512:
		h = sha512.New()
	case x509.PureEd25519, x509.UnknownSignatureAlgorithm:
		return scram.ChannelBinding{} // no hash to use (PostgreSQL offers no -PLUS either)
	default:
		h = sha256.New()
	}
	h.Write(cert.Raw)
	return scram.ChannelBinding{Type: scram.ChannelBindingTLSServerEndpoint, Data: h.Sum(nil)}
}

// ---------------------------------------------------------------------------
// The role's verifier, from PostgreSQL

// authLookup runs Config.AuthQuery on a control connection of its own, as
// the primary DSN's user, in the DSN's database. One connection, used by
// one login at a time: logins are rare next to queries, and a login never
// waits for more than one lookup.
type authLookup struct {
	cfg   *pgconn.Config
	query string
	log   *zap.Logger

	conn ctlconn.Conn[*pgconn.PgConn]
}

// errAuthLookup marks a failure to look the role up: the client is
// refused (fail closed) with 08006 and the reason is logged.
var errAuthLookup = errors.New("cannot look up the role's password in PostgreSQL")

// lookup returns the role's stored password (verifier or md5 hash), and
// whether the query found the role with one. A role without a password
// (NULL) is not found. A query that fails in PostgreSQL (a bad
// auth_query, no privilege) is not asked again; one whose kept connection
// broke (PostgreSQL restarted) is asked once more on a new one.
func (l *authLookup) lookup(ctx context.Context, user string) (string, bool, error) {
	// The lookup's connection speaks UTF-8: a name that is not (a 63-byte
	// cut inside a character, or any such bytes) names no role it could
	// find, and is refused as any unknown role is, not with the query's
	// 22021 and a log line per attempt (round 19, attacker AL's L3).
	if !utf8.ValidString(user) {
		return "", false, nil
	}
	var stored []byte
	err := l.conn.Do(ctx, l.connect, func(c *pgconn.PgConn) error {
		res := c.ExecParams(ctx, l.query, [][]byte{[]byte(user)}, nil, nil, nil).Read()
		if res.Err != nil {
			return fmt.Errorf("auth query: %w", res.Err)
		}
		if len(res.Rows) > 0 && len(res.Rows[0]) >= 2 {
			stored = res.Rows[0][1]
		}
		return nil
	})
	if err != nil {
		return "", false, fmt.Errorf("%w: %w", errAuthLookup, err)
	}
	return string(stored), stored != nil, nil
}

// connect opens the lookup's control connection, its settings pinned
// (dialControl): a custom auth_query names its objects by schema.
func (l *authLookup) connect(ctx context.Context) (*pgconn.PgConn, error) {
	return dialControl(ctx, l.cfg, "", authAppName, l.log, nil)
}

// authAppName names the auth lookup's connection in pg_stat_activity.
const authAppName = "pgfence auth lookup"

func init() { own("auth lookup (the default auth_query)", onControl, DefaultAuthQuery) }

func (l *authLookup) close() { l.conn.Close() }

// ---------------------------------------------------------------------------
// Authenticating a client

// authenticate runs client authentication on c for the startup st, as
// Config.Auth says, and sends AuthenticationOk on success. It returns what
// the proxy may present upstream for the client. On failure the caller
// reports the error to the client.
func (s *Server) authenticate(c net.Conn, st *startup, log *zap.Logger) (*Proof, error) {
	user := st.params["user"]
	live := s.live()
	be := NewAuthBackend(c)
	var proof *Proof
	switch live.auth {
	case AuthTrust:
		if !s.cfg.AllowRemoteTrust && !isLoopback(c.LocalAddr()) {
			return nil, &ProtocolError{Code: "28000", Msg: "pgfence: auth trust is refused on a non-loopback address (set allow_remote_trust to accept it)", Err: ErrAuthFailed}
		}
		proof = &Proof{}
	case AuthSCRAM:
		verifier, known := live.users[user]
		sc, err := parseVerifier(verifier)
		if !known || err != nil {
			sc, known = s.dummyCredentials(user), false
		}
		if proof, err = SCRAMExchange(be, user, sc, known, s.channelBinding(c)); err != nil {
			return nil, err
		}
	default: // AuthPostgres
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.StartupTimeout)
		defer cancel()
		stored, found, err := s.auth.lookup(ctx, user)
		if err != nil {
			log.Warn("auth query failed", zap.Error(err))
			if pe := resourceRefusal(err, "its connection for looking up passwords"); pe != nil { // accept.go
				return nil, pe
			}
			return nil, &ProtocolError{Code: "08006", Msg: "pgfence: " + errAuthLookup.Error() + "; see the proxy's log", Err: err}
		}
		if !found {
			log.Info("login refused: the role does not exist, or has no password or an expired one")
		}
		if found && isMD5Hash(stored) {
			proof, err = MD5Exchange(be, user, stored, true)
		} else {
			sc, perr := parseVerifier(stored)
			known := found && perr == nil
			if found && perr != nil {
				log.Warn("login refused: the role's stored password is neither SCRAM-SHA-256 nor md5")
			}
			if !known {
				sc = s.dummyCredentials(user)
			}
			proof, err = SCRAMExchange(be, user, sc, known, s.channelBinding(c))
		}
		var pe *ProtocolError
		if errors.As(err, &pe) && errors.Is(err, ErrAuthFailed) {
			pe.Hint = authHint // whatever the reason, without saying which
		}
		if err != nil {
			return nil, err
		}
	}
	be.Send(&pgproto3.AuthenticationOk{})
	if err := be.Flush(); err != nil {
		return nil, err
	}
	return proof, nil
}

// channelBinding is what SCRAM-SHA-256-PLUS binds to on c: the proxy's
// certificate, on a TLS connection.
func (s *Server) channelBinding(c net.Conn) scram.ChannelBinding {
	if _, ok := c.(*tls.Conn); !ok {
		return scram.ChannelBinding{}
	}
	return serverEndPoint(s.live().tls)
}

// isLoopback reports whether addr is a loopback TCP address (or not TCP:
// a Unix socket is local).
func isLoopback(addr net.Addr) bool {
	ta, ok := addr.(*net.TCPAddr)
	if !ok {
		return addr != nil && addr.Network() == "unix"
	}
	return ta.IP.IsLoopback()
}
