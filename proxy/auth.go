package proxy

import (
	"bufio"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/xdg-go/scram"
)

// ErrAuthFailed is the cause logged when a client fails authentication.
var ErrAuthFailed = errors.New("authentication failed")

// DefaultSCRAMIterations is the iteration count MakeVerifier uses, as
// PostgreSQL's scram_iterations default.
const DefaultSCRAMIterations = 4096

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

// authenticate runs client authentication on c (no read-ahead) for user.
// It sends AuthenticationOk on success; on failure the caller reports the
// returned error to the client.
func (s *Server) authenticate(c net.Conn, user string) error {
	var out []byte
	live := s.live()
	if live.auth == AuthTrust {
		_, err := c.Write(encode(out, &pgproto3.AuthenticationOk{}))
		return err
	}
	verifier, known := live.users[user]
	return s.scramExchange(c, user, verifier, known)
}

// scramExchange runs a server-side SCRAM-SHA-256 exchange on c (no
// read-ahead) for user against verifier, and sends AuthenticationOk when
// it succeeds. For an unknown user (!known) it runs the whole exchange
// against a dummy verifier and fails as a wrong password does, so the
// answer does not reveal which users exist. The user name in the
// client's SCRAM message is ignored, as PostgreSQL ignores it: user is
// the startup packet's.
func (s *Server) scramExchange(c net.Conn, user, verifier string, known bool) error {
	var out []byte
	sc, err := parseVerifier(verifier)
	if !known || err != nil {
		sc = s.dummy
	}
	srv, err := scram.SHA256.NewServer(func(string) (scram.StoredCredentials, error) { return sc, nil })
	if err != nil {
		return fmt.Errorf("scram server: %w", err)
	}
	conv := srv.NewConversation()
	if _, err := c.Write(encode(out, &pgproto3.AuthenticationSASL{AuthMechanisms: []string{"SCRAM-SHA-256"}})); err != nil {
		return err
	}
	var buf []byte
	body, err := readAuthMessage(c, buf)
	if err != nil {
		return err
	}
	var init pgproto3.SASLInitialResponse
	if err := init.Decode(body); err != nil {
		return &ProtocolError{Code: "08P01", Msg: "malformed SASLInitialResponse"}
	}
	if init.AuthMechanism != "SCRAM-SHA-256" {
		return &ProtocolError{Code: "28000", Msg: fmt.Sprintf("client selected an invalid SASL authentication mechanism %q", init.AuthMechanism)}
	}
	first, err := conv.Step(string(init.Data))
	if err != nil {
		return &ProtocolError{Code: "28P01", Msg: fmt.Sprintf("password authentication failed for user %q", user), Err: ErrAuthFailed}
	}
	if _, err := c.Write(encode(out, &pgproto3.AuthenticationSASLContinue{Data: []byte(first)})); err != nil {
		return err
	}
	body, err = readAuthMessage(c, buf)
	if err != nil {
		return err
	}
	final, err := conv.Step(string(body))
	if err != nil || !conv.Valid() || !known {
		return &ProtocolError{Code: "28P01", Msg: fmt.Sprintf("password authentication failed for user %q", user), Err: ErrAuthFailed}
	}
	out = encode(out, &pgproto3.AuthenticationSASLFinal{Data: []byte(final)})
	out = encode(out, &pgproto3.AuthenticationOk{})
	_, err = c.Write(out)
	return err
}

// readAuthMessage reads one 'p' message body during authentication.
func readAuthMessage(c net.Conn, buf []byte) ([]byte, error) {
	var h [headerLen]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return nil, err
	}
	if h[0] != 'p' {
		return nil, &ProtocolError{Code: "08P01", Msg: fmt.Sprintf("expected password response, got message type %q", h[0])}
	}
	_, total, err := parseHeader(h[:], maxStartLen, "client")
	if err != nil {
		return nil, err
	}
	n := total - headerLen
	if cap(buf) < n {
		buf = make([]byte, n)
	}
	buf = buf[:n]
	if _, err := io.ReadFull(c, buf); err != nil {
		return nil, err
	}
	return buf, nil
}

// dummyCredentials are used for unknown users so their exchange looks real.
func dummyCredentials() scram.StoredCredentials {
	v, err := MakeVerifier("", "pgfence-unknown-user")
	if err == nil {
		if sc, err := parseVerifier(v); err == nil {
			return sc
		}
	}
	return scram.StoredCredentials{KeyFactors: scram.KeyFactors{Salt: "pgfence", Iters: DefaultSCRAMIterations}, StoredKey: make([]byte, 32), ServerKey: make([]byte, 32)}
}
