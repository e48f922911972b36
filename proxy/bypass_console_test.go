package proxy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/xdg-go/scram"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// The class console: getting into the admin console, or doing more there
// than one's role allows (issue 18, section 5). Every attempt is made
// against a proxy whose clients authenticate by trust (the console must
// not care) with a worker holding a lease and a gated transaction open,
// and asserts the exact SQLSTATE; then, from an admin's console and a
// direct connection, that nothing changed: no pause, no database
// disabled, no setting changed, the worker's session and backend the
// same, no server marked for closing, the fence row the same.
func init() { registerBypass("console", bypassConsole) }

// consoleEnv is the proxy, its admin console connection for the checks,
// and the worker's lease.
type consoleEnv struct {
	*fenceEnv
	adm   *pgx.Conn
	lease fence.Lease
	w     *pgx.Conn
	tx    pgx.Tx
}

func bypassConsole(t *testing.T) {
	// ghost is an admin without a verifier.
	e := &consoleEnv{fenceEnv: newOpsEnv(t, Config{AdminUsers: []string{"admin", "ghost"}})}
	ctx := ctxT(t)
	e.lease = e.acquire(t, "cj", "w", time.Hour)
	e.w = e.worker(t, &e.lease)
	var err error
	if e.tx, err = e.w.Begin(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := e.tx.Exec(ctx, upsert, "cj", "x", e.lease.Token); err != nil {
		t.Fatalf("gated write: %v", err)
	}
	if e.adm, err = e.admin(t, "admin"); err != nil {
		t.Fatal(err)
	}
	before := consoleSnapshot(t, e)
	attempt := func(name string, f func(t *testing.T)) {
		t.Run(name, func(t *testing.T) {
			f(t)
			if after := consoleSnapshot(t, e); after != before {
				t.Fatalf("the attempt changed the proxy:\nbefore %s\nafter  %s", before, after)
			}
		})
	}

	attempt("no_password", func(t *testing.T) {
		// An empty password message where SCRAM is expected.
		c := consoleStartup(t, e.proxy, "user", "admin")
		c.expectSASL(t)
		c.send(t, 'p', []byte{0})
		c.wantError(t, "08P01")
	})
	attempt("no_password_driver", func(t *testing.T) {
		// A driver without a password runs SCRAM with an empty one.
		_, err := consoleConnect(t, e.proxy, "admin", "")
		wantCode(t, err, "28P01")
	})
	attempt("query_instead_of_password", func(t *testing.T) {
		c := consoleStartup(t, e.proxy, "user", "admin")
		c.expectSASL(t)
		c.write(t, &pgproto3.Query{String: "PAUSE"})
		c.wantError(t, "08P01")
	})
	attempt("wrong_password", func(t *testing.T) {
		_, err := consoleConnect(t, e.proxy, "admin", "guess")
		wantCode(t, err, "28P01")
	})
	attempt("unknown_user", func(t *testing.T) {
		_, err := consoleConnect(t, e.proxy, "mallory", "guess")
		wantCode(t, err, "28P01")
		_, err2 := consoleConnect(t, e.proxy, "admin", "guess")
		if a, b := strings.ReplaceAll(err.Error(), "mallory", "U"), strings.ReplaceAll(err2.Error(), "admin", "U"); a != b {
			t.Errorf("an unknown user's refusal differs from a wrong password's:\n%s\n%s", a, b)
		}
	})
	attempt("admin_without_verifier", func(t *testing.T) {
		_, err := consoleConnect(t, e.proxy, "ghost", "")
		wantCode(t, err, "28P01")
	})
	attempt("verifier_without_role", func(t *testing.T) {
		_, err := e.admin(t, "norole")
		wantCode(t, err, "42501")
	})
	attempt("client_password_for_console", func(t *testing.T) {
		// The upstream's own password for a role that exists there opens
		// a session there, never the console.
		_, err := consoleConnect(t, e.proxy, scramUser, scramPassword)
		wantCode(t, err, "28P01")
	})
	attempt("console_name_variants", func(t *testing.T) {
		// Only the exact name is the console: the others are ordinary
		// databases, and do not exist upstream.
		for _, db := range []string{"PGFENCE", "pgfence ", "pgfence\t", `"pgfence"`} {
			cfg, _ := pgconn.ParseConfig(e.proxy.dsn("x"))
			cfg.Database = db // as postgres, who exists upstream
			_, err := pgconn.ConnectConfig(ctxT(t), cfg)
			wantCode(t, err, "3D000")
		}
	})
	attempt("replication_to_console", func(t *testing.T) {
		c := consoleStartup(t, e.proxy, "user", "admin", "database", AdminDatabase, "replication", "database")
		c.wantError(t, "0A000")
	})

	// The stats user's admin commands: each refused.
	wid := consoleClientID(t, e.adm, e.w.PgConn())
	for _, c := range [][2]string{
		{"PAUSE", "PAUSE"}, {"PAUSE_db", "PAUSE " + e.db}, {"RESUME", "RESUME"}, {"RESUME_db", "RESUME " + e.db},
		{"KILL", "KILL"}, {"KILL_db", "KILL " + e.db}, {"KILL_CLIENT", "KILL_CLIENT " + wid},
		{"DISABLE", "DISABLE " + e.db}, {"ENABLE", "ENABLE " + e.db}, {"RECONNECT", "RECONNECT"},
		{"RECONNECT_db", "RECONNECT " + e.db}, {"WAIT_CLOSE", "WAIT_CLOSE"}, {"SET_max_clients", "SET max_clients = 1"},
		{"SET_admin_users", "SET admin_users = 'watcher'"}, {"SET_quoted_key", `SET "stats_users" TO 'watcher,mallory'`},
		{"RELOAD", "RELOAD"}, {"SHUTDOWN", "SHUTDOWN"}, {"SHUTDOWN_WAIT_FOR_SERVERS", "SHUTDOWN WAIT_FOR_SERVERS"},
		{"SUSPEND", "SUSPEND"}, {"quoted_verb", `"PAUSE"`}, {"lower_case", "pause"}, {"mixed_case", "ShUtDoWn"},
	} {
		attempt("stats_user_"+c[0], func(t *testing.T) {
			w := mustConsole(t, e.proxy, "watcher")
			_, err = w.Exec(ctxT(t), c[1])
			wantCode(t, err, "42501")
		})
	}
	attempt("stats_user_admin_command_after_show", func(t *testing.T) {
		// A permitted command first, in the same query, changes nothing.
		w := mustConsole(t, e.proxy, "watcher")
		_, err = w.PgConn().Exec(ctxT(t), "SHOW STATE; PAUSE; SHOW STATE").ReadAll()
		wantCode(t, err, "42501")
	})
	attempt("stats_user_extended_protocol", func(t *testing.T) {
		w := mustConsole(t, e.proxy, "watcher")
		_, err = w.PgConn().ExecParams(ctxT(t), "PAUSE", nil, nil, nil, nil).Close()
		wantCode(t, err, "0A000")
	})
	attempt("stats_user_reads_tokens", func(t *testing.T) {
		w := mustConsole(t, e.proxy, "watcher")
		tok := strconv.FormatInt(e.lease.Token, 10)
		for _, cmd := range []string{"SHOW SESSIONS", "SHOW CLIENTS", "SHOW FENCES", "SHOW FENCES " + e.db} {
			fds, rows := rawRows(t, w, cmd)
			if len(rows) == 0 {
				t.Fatalf("%s: no rows", cmd)
			}
			for _, r := range rows {
				for i, v := range r {
					if name := fds[i].Name; strings.Contains(name, "token") && v != nil {
						t.Errorf("%s: the stats user sees %s = %s", cmd, name, *v)
					}
				}
			}
		}
		// The admin does see it.
		found := false
		for _, r := range table(t, e.adm, "SHOW CLIENTS") {
			found = found || r["token"] == tok
		}
		if !found {
			t.Errorf("the admin does not see the worker's token %s in SHOW CLIENTS", tok)
		}
		_, err = w.Exec(ctxT(t), "SHOW FDS")
		wantCode(t, err, "0A000")
	})
	attempt("startup_parameters_claim_admin", func(t *testing.T) {
		// role, session_authorization, options and a second user
		// parameter (the last one is the user, as in PostgreSQL).
		c := consoleStartup(t, e.proxy, "user", "admin", "role", "admin", "session_authorization", "admin",
			"options", "-c role=admin -c session_authorization=admin", "user", "watcher")
		c.scram(t, "watcher", "", consolePasswords["watcher"])
		c.wantReady(t)
		if code := c.run(t, "PAUSE"); code != "42501" {
			t.Errorf("PAUSE as the stats user claiming admin: %q, want 42501", code)
		}
	})
	attempt("startup_user_admin_last", func(t *testing.T) {
		// The identity is the last user parameter: admin, so watcher's
		// password does not fit.
		c := consoleStartup(t, e.proxy, "user", "watcher", "user", "admin")
		c.scram(t, "watcher", "", consolePasswords["watcher"])
		c.wantError(t, "28P01")
	})
	attempt("scram_names_admin", func(t *testing.T) {
		// The SCRAM message names admin; the startup packet's user is
		// the identity: watcher, a stats user.
		c := consoleStartup(t, e.proxy, "user", "watcher")
		c.scram(t, "admin", "", consolePasswords["watcher"])
		c.wantReady(t)
		if code := c.run(t, "KILL"); code != "42501" {
			t.Errorf("KILL after a SCRAM exchange naming admin: %q, want 42501", code)
		}
	})
	attempt("scram_authzid_admin", func(t *testing.T) {
		c := consoleStartup(t, e.proxy, "user", "watcher")
		c.scram(t, "watcher", "admin", consolePasswords["watcher"])
		c.wantReady(t)
		if code := c.run(t, "DISABLE "+e.db); code != "42501" {
			t.Errorf("DISABLE with authorization identity admin: %q, want 42501", code)
		}
	})
	attempt("scram_names_watcher_as_admin", func(t *testing.T) {
		// Startup as admin, SCRAM naming watcher with watcher's password.
		c := consoleStartup(t, e.proxy, "user", "admin")
		c.scram(t, "watcher", "", consolePasswords["watcher"])
		c.wantError(t, "28P01")
	})
	// Each console user's authenticated sessions are bounded
	// (max_console_clients, 10 by default; issue 30, F-M1): a stats user
	// cannot take the proxy's file descriptors with console sessions,
	// and its flood keeps out neither an admin nor an ordinary client.
	attempt("stats_user_console_flood", func(t *testing.T) {
		consoleSettled(t, e.adm, "watcher", 0)
		var ws []*pgx.Conn
		for range DefaultMaxConsoleClients {
			ws = append(ws, mustConsole(t, e.proxy, "watcher"))
		}
		_, err := e.admin(t, "watcher")
		wantConsoleFull(t, err)
		if _, err := e.admin(t, "admin"); err != nil {
			t.Fatalf("an admin while the stats user is at its bound: %v", err)
		}
		servers := len(table(t, e.adm, "SHOW SERVERS"))
		var one int
		c := e.worker(t, nil)
		if err := c.QueryRow(ctxT(t), "SELECT 1").Scan(&one); err != nil {
			t.Fatalf("an ordinary client while the stats user is at its bound: %v", err)
		}
		c.Close(ctxT(t))
		if err := pgtest.Poll(ctxT(t), func() (bool, error) { return len(table(t, e.adm, "SHOW SERVERS")) == servers, nil }); err != nil {
			t.Fatalf("waiting for the ordinary client's session to end: %v", err)
		}
		// A session that ends frees its place, and only that one.
		ws[0].Close(ctxT(t))
		consoleSettled(t, e.adm, "watcher", DefaultMaxConsoleClients-1)
		mustConsole(t, e.proxy, "watcher")
		_, err = e.admin(t, "watcher")
		wantConsoleFull(t, err)
	})
	attempt("console_bound_per_user_with_max_clients_full", func(t *testing.T) {
		// Ordinary clients at max_clients leave the console reachable;
		// the bound is each user's, admins' too.
		p := startProxy(t, withConsole(Config{MaxClients: 1, MaxConsoleClients: 2}))
		connect(t, p.dsn(e.db))
		_, err := pgconn.Connect(ctxT(t), p.dsn(e.db))
		wantCode(t, err, "53300")
		for _, u := range []string{"watcher", "admin"} {
			mustConsole(t, p, u)
			mustConsole(t, p, u)
			_, err := consoleConnect(t, p, u, consolePasswords[u])
			wantConsoleFull(t, err)
		}
		adm := mustConsole(t, p, "ops")
		if n := consoleSessions(t, adm, "watcher"); n != 2 {
			t.Errorf("SHOW CLIENTS: %d console sessions of watcher, want 2", n)
		}
	})
	attempt("console_bound_raw_wire", func(t *testing.T) {
		// The refusal comes after authentication, as PostgreSQL's for
		// too many connections of a role: a password is needed to
		// take a place, and a wrong one takes none.
		p := startProxy(t, withConsole(Config{MaxConsoleClients: 1}))
		for range 3 {
			_, err := consoleConnect(t, p, "watcher", "guess")
			wantCode(t, err, "28P01")
		}
		mustConsole(t, p, "watcher")
		c := consoleStartup(t, p, "user", "watcher")
		c.scram(t, "watcher", "", consolePasswords["watcher"])
	auth:
		for {
			switch m := c.next(t).(type) {
			case *pgproto3.AuthenticationOk:
				break auth
			case *pgproto3.ErrorResponse:
				t.Fatalf("refused before AuthenticationOk: %s %s", m.Code, m.Message)
			}
		}
		c.wantError(t, "53300")
	})
	attempt("console_without_users_file", func(t *testing.T) {
		// A proxy with admin_users but no console users: closed.
		p := startProxy(t, Config{AdminUsers: []string{"admin"}, StatsUsers: []string{"watcher"}})
		_, err := consoleConnect(t, p, "admin", consolePasswords["admin"])
		wantCode(t, err, "28000")
	})

	if err := e.tx.Commit(ctx); err != nil {
		t.Fatalf("the worker's transaction after the attempts: %v", err)
	}
}

// consoleSnapshot is what no attempt may change, as text.
func consoleSnapshot(t *testing.T, e *consoleEnv) string {
	t.Helper()
	var b strings.Builder
	for _, r := range table(t, e.adm, "SHOW STATE") {
		fmt.Fprintf(&b, "%s=%s ", r["key"], r["value"])
	}
	for _, r := range table(t, e.adm, "SHOW DATABASES") {
		fmt.Fprintf(&b, "db %s paused=%s disabled=%s; ", r["name"], r["paused"], r["disabled"])
	}
	for _, r := range table(t, e.adm, "SHOW CONFIG") {
		if r["changeable"] == "yes" {
			fmt.Fprintf(&b, "%s=%s ", r["key"], r["value"])
		}
	}
	for _, r := range table(t, e.adm, "SHOW SERVERS") {
		fmt.Fprintf(&b, "server %s %s close_needed=%s tx=%s; ", r["database"], r["remote_pid"], r["close_needed"], r["tx_state"])
	}
	var epoch, tok int64
	if err := e.direct(t).QueryRow(ctxT(t), "SELECT epoch, max_issued_token FROM fence.fences WHERE job_key = 'cj'").Scan(&epoch, &tok); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(&b, "fence cj %d/%d", epoch, tok)
	return b.String()
}

// consoleSessions is how many console sessions of user SHOW CLIENTS
// shows.
func consoleSessions(t *testing.T, adm *pgx.Conn, user string) int {
	t.Helper()
	n := 0
	for _, r := range table(t, adm, "SHOW CLIENTS") {
		if r["database"] == AdminDatabase && r["user"] == user {
			n++
		}
	}
	return n
}

// consoleSettled waits until user has n console sessions (one a client
// closed is counted until the proxy has seen it go).
func consoleSettled(t *testing.T, adm *pgx.Conn, user string, n int) {
	t.Helper()
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return consoleSessions(t, adm, user) == n, nil }); err != nil {
		t.Fatalf("waiting for %d console sessions of %s: %v", n, user, err)
	}
}

// wantConsoleFull checks err is the refusal of a console session over
// max_console_clients, telling what to do.
func wantConsoleFull(t *testing.T, err error) {
	t.Helper()
	wantCode(t, err, "53300")
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		t.Fatalf("refusal %v: not a server error", err)
	}
	if !strings.Contains(pe.Message, "max_console_clients") || !strings.Contains(pe.Hint, "SHOW CLIENTS") {
		t.Fatalf("refusal %q (hint %q): want it to name max_console_clients and a hint naming SHOW CLIENTS", pe.Message, pe.Hint)
	}
}

// consoleClientID is the SHOW CLIENTS id of client c.
func consoleClientID(t *testing.T, adm *pgx.Conn, c *pgconn.PgConn) string {
	t.Helper()
	for _, r := range table(t, adm, "SHOW CLIENTS") {
		if r["addr"]+":"+r["port"] == c.Conn().LocalAddr().String() {
			return r["id"]
		}
	}
	t.Fatalf("client %s not in SHOW CLIENTS", c.Conn().LocalAddr())
	return ""
}

// consoleWire is a raw connection to the console, for attempts no driver
// makes.
type consoleWire struct {
	c      net.Conn
	fe     *pgproto3.Frontend
	unread pgproto3.BackendMessage // read by scram but not expected there
}

// consoleStartup opens a raw connection to p and sends a startup packet
// with the parameters kv (name, value, ... in order; database pgfence
// unless given).
func consoleStartup(t *testing.T, p *testProxy, kv ...string) *consoleWire {
	t.Helper()
	c, err := net.Dial("tcp", p.addr.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	hasDB := false
	body := binary.BigEndian.AppendUint32(nil, protocol30)
	for i := 0; i+1 < len(kv); i += 2 {
		hasDB = hasDB || kv[i] == "database"
		body = append(append(append(append(body, kv[i]...), 0), kv[i+1]...), 0)
	}
	if !hasDB {
		body = append(append(append(append(body, "database"...), 0), AdminDatabase...), 0)
	}
	body = append(body, 0)
	if _, err := c.Write(append(binary.BigEndian.AppendUint32(nil, uint32(len(body)+4)), body...)); err != nil {
		t.Fatal(err)
	}
	return &consoleWire{c: c, fe: pgproto3.NewFrontend(c, c)}
}

func (w *consoleWire) send(t *testing.T, typ byte, body []byte) {
	t.Helper()
	msg := append([]byte{typ}, binary.BigEndian.AppendUint32(nil, uint32(len(body)+4))...)
	if _, err := w.c.Write(append(msg, body...)); err != nil {
		t.Fatal(err)
	}
}

func (w *consoleWire) write(t *testing.T, m pgproto3.FrontendMessage) {
	t.Helper()
	b, err := m.Encode(nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.c.Write(b); err != nil {
		t.Fatal(err)
	}
}

// next returns the next message (the one scram kept first).
func (w *consoleWire) next(t *testing.T) pgproto3.BackendMessage {
	t.Helper()
	if m := w.unread; m != nil {
		w.unread = nil
		return m
	}
	m, err := w.fe.Receive()
	if err != nil {
		t.Fatalf("receive: %v", err)
	}
	return m
}

func (w *consoleWire) expectSASL(t *testing.T) {
	t.Helper()
	if m, ok := w.next(t).(*pgproto3.AuthenticationSASL); !ok {
		t.Fatalf("got %T, want AuthenticationSASL", m)
	}
}

// scram runs the client side of SCRAM-SHA-256, naming user (and
// authorization identity authzID) in its messages, with password.
func (w *consoleWire) scram(t *testing.T, user, authzID, password string) {
	t.Helper()
	w.expectSASL(t)
	cl, err := scram.SHA256.NewClient(user, password, authzID)
	if err != nil {
		t.Fatal(err)
	}
	conv := cl.NewConversation()
	first, err := conv.Step("")
	if err != nil {
		t.Fatal(err)
	}
	w.write(t, &pgproto3.SASLInitialResponse{AuthMechanism: "SCRAM-SHA-256", Data: []byte(first)})
	m := w.next(t)
	cont, ok := m.(*pgproto3.AuthenticationSASLContinue)
	if !ok {
		w.unread = m // an ErrorResponse, for wantError
		return
	}
	final, err := conv.Step(string(cont.Data))
	if err != nil {
		t.Fatal(err)
	}
	w.write(t, &pgproto3.SASLResponse{Data: []byte(final)})
}

// wantError reads up to an ErrorResponse and checks its SQLSTATE; the
// connection must then close without letting the client in.
func (w *consoleWire) wantError(t *testing.T, code string) {
	t.Helper()
	for {
		switch m := w.next(t).(type) {
		case *pgproto3.ErrorResponse:
			if m.Code != code {
				t.Fatalf("error %s %q, want SQLSTATE %s", m.Code, m.Message, code)
			}
			if _, err := w.fe.Receive(); err == nil {
				t.Fatal("the connection stays open after the refusal")
			}
			return
		case *pgproto3.AuthenticationOk, *pgproto3.ReadyForQuery:
			t.Fatalf("got %T, want ErrorResponse %s", m, code)
		}
	}
}

// wantReady reads up to ReadyForQuery (the console let us in).
func (w *consoleWire) wantReady(t *testing.T) {
	t.Helper()
	for {
		switch m := w.next(t).(type) {
		case *pgproto3.ErrorResponse:
			t.Fatalf("refused: %s %s", m.Code, m.Message)
		case *pgproto3.ReadyForQuery:
			return
		}
	}
}

// run sends a Query and returns the SQLSTATE of its error ("" for none).
func (w *consoleWire) run(t *testing.T, sql string) string {
	t.Helper()
	w.write(t, &pgproto3.Query{String: sql})
	code := ""
	for {
		switch m := w.next(t).(type) {
		case *pgproto3.ErrorResponse:
			code = m.Code
		case *pgproto3.ReadyForQuery:
			return code
		}
	}
}
