package proxy

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// Console users and their passwords: admins admin and ops, stats user
// watcher, norole with a verifier but in neither list (withConsole).
var consolePasswords = map[string]string{"admin": "admin-pw", "ops": "ops-pw", "bob": "bob-pw", "watcher": "watcher-pw", "norole": "norole-pw"}

// consoleVerifiers are consolePasswords' verifiers, made once.
var consoleVerifiers = sync.OnceValue(func() map[string]string {
	m := map[string]string{}
	for u, pw := range consolePasswords {
		v, err := MakeVerifier(u, pw)
		if err != nil {
			panic(err)
		}
		m[u] = v
	}
	return m
})

// withConsole gives cfg the console users (and, unless set, admin_users
// admin and ops, stats_users watcher).
func withConsole(cfg Config) Config {
	cfg.ConsoleUsers = consoleVerifiers()
	if cfg.AdminUsers == nil {
		cfg.AdminUsers = []string{"admin", "ops"}
	}
	if cfg.StatsUsers == nil {
		cfg.StatsUsers = []string{"watcher"}
	}
	return cfg
}

// newOpsEnv is newFenceEnv with cfg (AdminUsers, MaxClients...) for the
// proxy, and the console users (withConsole).
func newOpsEnv(t *testing.T, cfg Config) *fenceEnv {
	t.Helper()
	return newEnv(t, envSpec{proxy: withConsole(cfg)})
}

// admin connects to the console as user with its password (or a wrong
// one for a user not in consolePasswords), in the simple protocol.
func (e *fenceEnv) admin(t *testing.T, user string) (*pgx.Conn, error) {
	t.Helper()
	return consoleConnect(t, e.proxy, user, consolePassword(user))
}

func consolePassword(user string) string {
	if pw, ok := consolePasswords[user]; ok {
		return pw
	}
	return "not-" + user + "-pw"
}

// consoleConnect connects to p's console as user with password, in the
// simple protocol.
func consoleConnect(t *testing.T, p *testProxy, user, password string) (*pgx.Conn, error) {
	t.Helper()
	cfg, err := pgx.ParseConfig(fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", user, p.addr.Port, AdminDatabase))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Password = password
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	c, err := pgx.ConnectConfig(ctxT(t), cfg)
	if err == nil {
		t.Cleanup(func() { c.Close(context.Background()) })
	}
	return c, err
}

// show runs a console command and returns its rows keyed by column.
func show(t *testing.T, c *pgx.Conn, cmd string) []map[string]string {
	t.Helper()
	rows, err := c.Query(ctxT(t), cmd)
	if err != nil {
		t.Fatalf("%s: %v", cmd, err)
	}
	defer rows.Close()
	var out []map[string]string
	for rows.Next() {
		m := map[string]string{}
		for i, fd := range rows.FieldDescriptions() {
			if fd.DataTypeOID != 25 {
				t.Fatalf("%s: column %s has type %d, want text", cmd, fd.Name, fd.DataTypeOID)
			}
			m[fd.Name] = string(rows.RawValues()[i])
		}
		out = append(out, m)
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("%s: %v", cmd, err)
	}
	return out
}

// stats is SHOW FENCE_STATS (pgfence's counters) as a map.
func stats(t *testing.T, c *pgx.Conn) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	for _, r := range show(t, c, "show fence_stats;") {
		if n, err := strconv.ParseInt(r["value"], 10, 64); err == nil {
			out[r["stat"]] = n
		}
	}
	return out
}

// workload is what the console and metrics tests check their numbers
// against: two workers, three gated commits, one replay, one FN001, one
// FN008, and a gated transaction left open.
type workload struct {
	ja, jb       fence.Lease // ja after the takeover
	wa, wb       *pgx.Conn
	openTx       pgx.Tx
	gated        int64
	commits      int64
	replays      int64
	fn001, fn008 int64
}

func runWorkload(t *testing.T, e *fenceEnv) *workload {
	t.Helper()
	ctx := ctxT(t)
	w := &workload{}
	la := e.acquire(t, "ja", "a", time.Minute)
	w.jb = e.acquire(t, "jb", "b", time.Minute)
	w.wa, w.wb = e.worker(t, &la), e.worker(t, &w.jb)

	// wa: two gated commits (extended protocol), two steps of one token.
	for i, step := range []string{"one", "two"} {
		execOK(t, w.wa, "SET fence.step = '"+step+"'")
		if _, err := w.wa.Exec(ctx, upsert, "ja", step, la.Token+int64(i)); err != nil {
			t.Fatalf("gated upsert %s: %v", step, err)
		}
	}
	// wb: one commit (simple protocol), then the same again: a replay.
	for range 2 {
		if _, err := w.wb.Exec(ctx, "INSERT INTO results VALUES ('jb', 'x', "+strconv.FormatInt(w.jb.Token, 10)+") ON CONFLICT (job_key) DO NOTHING", pgx.QueryExecModeSimpleProtocol); err != nil {
			t.Fatalf("wb insert: %v", err)
		}
	}
	w.gated, w.commits, w.replays = 4, 3, 1
	// wa after a takeover: FN001.
	w.ja = e.takeover(t, "ja", "a2", la)
	execOK(t, w.wa, "SET fence.step = 'three'")
	_, err := w.wa.Exec(ctx, "UPDATE results SET payload = 'zombie' WHERE job_key = 'ja'")
	wantCode(t, err, fence.CodeStale)
	w.fn001 = 1
	// No metadata: FN008.
	anon := e.worker(t, nil)
	_, err = anon.Exec(ctx, "DELETE FROM results")
	wantCode(t, err, fence.CodeFencingRequired)
	w.fn008 = 1
	// wb: a gated transaction left open (a new step, so not a replay).
	execOK(t, w.wb, "SET fence.step = 'open'")
	if w.openTx, err = w.wb.Begin(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := w.openTx.Exec(ctx, "UPDATE results SET payload = 'y' WHERE job_key = 'jb'"); err != nil {
		t.Fatalf("update in open tx: %v", err)
	}
	w.gated++
	return w
}

func TestAdminConsole(t *testing.T) {
	e := newOpsEnv(t, Config{AdminUsers: []string{"admin", "ops"}})
	ctx := ctxT(t)
	w := runWorkload(t, e)
	adm, err := e.admin(t, "admin")
	if err != nil {
		t.Fatalf("admin connect: %v", err)
	}

	t.Run("sessions", func(t *testing.T) {
		byJob := map[string]map[string]string{}
		for _, r := range show(t, adm, "SHOW SESSIONS") {
			if r["database"] != e.db {
				t.Errorf("session in database %q, want %q", r["database"], e.db)
			}
			byJob[r["job_key"]] = r
		}
		if len(byJob) != 3 { // ja, jb, and the anonymous one
			t.Fatalf("got sessions %v, want ja, jb and one without a job", byJob)
		}
		a, b := byJob["ja"], byJob["jb"]
		if a == nil || b == nil {
			t.Fatalf("got sessions %v, want ja and jb", byJob)
		}
		// wa still carries its old token: the proxy shows what the
		// session presents, not the fence's current one.
		if got, want := a["token"], strconv.FormatInt(w.ja.Token-1, 10); got > want || a["gated"] != "false" || a["tx_state"] != "idle" || a["step"] != "three" {
			t.Errorf("ja session %v: want an old token (<= %s), not gated, idle, step three", a, want)
		}
		if b["token"] != strconv.FormatInt(w.jb.Token, 10) || b["epoch"] != strconv.FormatInt(w.jb.Epoch, 10) ||
			b["gated"] != "true" || b["tx_state"] != "in transaction" || b["upstream"] != "primary" || b["backend_pid"] == "0" {
			t.Errorf("jb session %v: want token %d epoch %d, gated, in transaction, primary", b, w.jb.Token, w.jb.Epoch)
		}
	})

	t.Run("fences", func(t *testing.T) {
		got := map[string]map[string]string{}
		for _, r := range show(t, adm, "show fences") {
			got[r["job_key"]] = r
		}
		a, b := got["ja"], got["jb"]
		if a == nil || a["max_issued_token"] != strconv.FormatInt(w.ja.Token, 10) || a["lease_holder"] != "a2" || a["lease_live"] != "true" || a["retired"] != "false" {
			t.Errorf("ja fence %v: want max token %d held by a2", a, w.ja.Token)
		}
		if b == nil || b["max_issued_token"] != strconv.FormatInt(w.jb.Token, 10) || b["epoch"] != strconv.FormatInt(w.jb.Epoch, 10) {
			t.Errorf("jb fence %v: want max token %d", b, w.jb.Token)
		}
		named := show(t, adm, "SHOW FENCES "+e.db)
		if len(named) != 2 {
			t.Errorf("SHOW FENCES %s: got %d rows, want 2", e.db, len(named))
		}
	})

	t.Run("fence_stats", func(t *testing.T) {
		st := stats(t, adm)
		for k, want := range map[string]int64{
			"gate_passed": w.gated, "commits": w.commits, "replays": w.replays,
			"errors_FN001": w.fn001, "errors_FN008": w.fn008, "conflicts": 0, "refusals": w.fn001 + w.fn008,
			"sessions_open": 3, "sessions_total": 3, "gate_step_count": w.gated + w.fn001, "commit_step_count": w.commits + w.replays,
		} {
			if st[k] != want {
				t.Errorf("SHOW STATS %s: got %d, want %d", k, st[k], want)
			}
		}
		// Commit the open transaction: one more commit.
		if err := w.openTx.Commit(ctx); err != nil {
			t.Fatalf("commit: %v", err)
		}
		if got := stats(t, adm)["commits"]; got != w.commits+1 {
			t.Errorf("commits after COMMIT: got %d, want %d", got, w.commits+1)
		}
	})

	t.Run("other commands", func(t *testing.T) {
		if help := show(t, adm, "SHOW HELP"); len(help) != len(adminCommands) {
			t.Errorf("SHOW HELP: got %d rows, want %d", len(help), len(adminCommands))
		}
		up := show(t, adm, "SHOW UPSTREAMS")
		if len(up) != 1 || up[0]["role"] != "primary" || up[0]["healthy"] != "true" || up[0]["addr"] != cluster.Primary.Addr() {
			t.Errorf("SHOW UPSTREAMS: got %v, want one healthy primary at %s", up, cluster.Primary.Addr())
		}
		conf := map[string]string{}
		for _, r := range show(t, adm, "SHOW CONFIG") {
			conf[r["key"]] = r["value"]
		}
		if conf["admin_users"] != "admin,ops" || conf["stats_users"] != "watcher" || conf["max_clients"] != strconv.Itoa(DefaultMaxClients) || conf["gate"] != "true" {
			t.Errorf("SHOW CONFIG: got %v", conf)
		}
		_, err := adm.Exec(ctx, "SHOW NONSENSE")
		wantCode(t, err, "42601")
		if !strings.Contains(err.Error(), "SHOW HELP") {
			t.Errorf("unknown command error %q does not point at SHOW HELP", err)
		}
		_, err = adm.Exec(ctx, "RELOAD")
		wantCode(t, err, "55000") // no Config.Reload in this proxy
		// Extended protocol: a clear error, and the session stays usable.
		_, err = adm.PgConn().ExecParams(ctx, "SHOW STATS", nil, nil, nil, nil).Close()
		wantCode(t, err, "0A000")
		if len(show(t, adm, "SHOW FENCE_STATS")) == 0 {
			t.Error("console unusable after an extended-protocol query")
		}
	})

	t.Run("non-admin refused", func(t *testing.T) {
		_, err := e.admin(t, "norole") // authenticates, but is in neither list
		wantCode(t, err, "42501")
		_, err = e.admin(t, "postgres") // no console verifier
		wantCode(t, err, "28P01")
		if got := stats(t, adm); got["clients_refused_42501"] != 1 || got["clients_refused_28P01"] != 1 {
			t.Errorf("clients_refused_42501, _28P01: got %d, %d, want 1, 1", got["clients_refused_42501"], got["clients_refused_28P01"])
		}
	})

	t.Run("psql", func(t *testing.T) {
		psql := func(cmd string) (string, error) {
			c := exec.CommandContext(ctx, "psql", "-X", "-h", "127.0.0.1", "-p", strconv.Itoa(e.proxy.addr.Port),
				"-U", "ops", "-At", "-F", "|", "-c", cmd, AdminDatabase)
			c.Env = append(os.Environ(), "PGPASSWORD="+consolePasswords["ops"])
			out, err := c.CombinedOutput()
			return string(out), err
		}
		out, err := psql("SHOW SESSIONS")
		if err != nil {
			t.Fatalf("psql: %v: %s", err, out)
		}
		want := fmt.Sprintf("|jb|%d|%d|open|", w.jb.Epoch, w.jb.Token)
		if !strings.Contains(out, want) {
			t.Errorf("psql SHOW SESSIONS:\n%s\nwant a line with %q", out, want)
		}
		out, err = psql("show fence_stats")
		if err != nil || !strings.Contains(out, fmt.Sprintf("replays|%d\n", w.replays)) {
			t.Errorf("psql SHOW FENCE_STATS (%v):\n%s\nwant replays|%d", err, out, w.replays)
		}
		out, err = psql("SHOW FOO")
		if err == nil || !strings.Contains(out, "SHOW HELP") {
			t.Errorf("psql unknown command: %v\n%s", err, out)
		}
	})
}

// TestAdminReload changes the config source and reloads: through
// ReloadFromSource (what SIGHUP calls) and the console's RELOAD.
func TestAdminReload(t *testing.T) {
	var mu sync.Mutex
	next := withConsole(Config{Primary: cluster.Primary.DSN("postgres"), Auth: AuthTrust, MaxClients: 2, AdminUsers: []string{"admin"}, StatsUsers: []string{}})
	source := func() (Config, *ReloadReport, error) {
		mu.Lock()
		defer mu.Unlock()
		return next, &ReloadReport{Applied: []string{"source_setting"}}, nil
	}
	set := func(f func(c *Config)) {
		mu.Lock()
		f(&next)
		mu.Unlock()
	}
	cfg := next
	cfg.Reload = source
	p := startProxy(t, cfg)
	e := &fenceEnv{proxy: p, db: cluster.NewDatabase(t)}
	ctx := ctxT(t)

	// A refused client is counted until its handler returns; wait for
	// that before counting on a free slot.
	settled := func(n int64) {
		t.Helper()
		if err := pgtest.Poll(ctx, func() (bool, error) { return p.srv.clients.Load() == n, nil }); err != nil {
			t.Fatalf("waiting for %d clients: %v", n, err)
		}
	}
	if _, err := e.admin(t, "bob"); pgtest.SQLState(err) != "42501" {
		t.Fatalf("bob before reload: got %v, want 42501", err)
	}
	settled(0)
	adm, err := e.admin(t, "admin")
	if err != nil {
		t.Fatal(err)
	}
	// The console is not counted (issue 30, B-M4: it stays reachable):
	// two clients are the limit of 2.
	connect(t, p.dsn(e.db))
	connect(t, p.dsn(e.db))
	if _, err := pgx.Connect(ctx, p.dsn(e.db)); pgtest.SQLState(err) != "53300" {
		t.Fatalf("third client: got %v, want 53300", err)
	}
	settled(2)

	set(func(c *Config) { c.MaxClients = 4; c.AdminUsers = []string{"bob", "admin"} })
	rep, err := p.srv.ReloadFromSource()
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(rep.Applied, ","); got != "admin_users,max_clients,source_setting" || len(rep.Restart) != 0 {
		t.Fatalf("reload report: applied %v restart %v, want admin_users,max_clients,source_setting and nothing to restart", rep.Applied, rep.Restart)
	}
	connect(t, p.dsn(e.db))
	settled(3)
	if _, err := e.admin(t, "bob"); err != nil {
		t.Fatalf("bob after reload: %v", err)
	}

	// Through the console: a setting that needs a restart is reported,
	// the running value stays.
	set(func(c *Config) {
		c.Primary = cluster.Primary.DSN("template1")
		c.MaxClients = 10
		c.MaxConsoleClients = 1
	})
	res := map[string]string{}
	for _, r := range show(t, adm, "reload;") {
		res[r["setting"]] = r["result"]
	}
	if res["max_clients"] != "applied" || res["max_console_clients"] != "applied" || !strings.Contains(res["primary"], "restart") {
		t.Fatalf("RELOAD: got %v, want max_clients and max_console_clients applied, primary needing a restart", res)
	}
	// admin already has its one console session.
	_, err = e.admin(t, "admin")
	wantConsoleFull(t, err)
	conf := map[string]string{}
	for _, r := range show(t, adm, "SHOW CONFIG") {
		conf[r["key"]] = r["value"]
	}
	if conf["max_clients"] != "10" || !strings.Contains(conf["primary"], "dbname=postgres") {
		t.Fatalf("SHOW CONFIG after RELOAD: got %v, want max_clients 10 and the old primary", conf)
	}

	// An invalid configuration changes nothing.
	set(func(c *Config) { c.MaxClients = 1; c.Auth = AuthSCRAM })
	_, err = adm.Exec(ctx, "RELOAD")
	wantCode(t, err, "F0000")
	if got := show(t, adm, "SHOW CONFIG"); len(got) == 0 {
		t.Fatal("no config")
	}
	connect(t, p.dsn(e.db)) // max_clients is still 10
}
