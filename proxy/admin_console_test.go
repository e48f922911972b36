package proxy

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// pgbouncerColumns are the columns of PgBouncer 1.25.2's console, as
// src/admin.c and src/stats.c declare them: names in order and the
// tupdesc type letters (s text, i int4, q int8, N numeric, T timestamp
// sent as text). Transcribed from PgBouncer, not from pgfence's code, so
// that a change on either side shows.
var pgbouncerColumns = map[string]struct {
	types string
	cols  string
}{
	"CLIENTS":   {"ssssssisiTTiiississii", "type user database replication state addr port local_addr local_port connect_time request_time wait wait_us close_needed ptr link remote_pid tls application_name prepared_statements id"},
	"SERVERS":   {"ssssssisiTTiiississii", "type user database replication state addr port local_addr local_port connect_time request_time wait wait_us close_needed ptr link remote_pid tls application_name prepared_statements id"},
	"POOLS":     {"ssiiiiiiiiiiiiiss", "database user cl_active cl_waiting cl_active_cancel_req cl_waiting_cancel_req sv_active sv_active_cancel sv_being_canceled sv_idle sv_used sv_tested sv_login maxwait maxwait_us pool_mode load_balance_hosts"},
	"DATABASES": {"ssissiiiissiiiiii", "name host port database force_user pool_size min_pool_size reserve_pool_size server_lifetime pool_mode load_balance_hosts max_connections current_connections max_client_connections current_client_connections paused disabled"},
	"USERS":     {"ssssiiii", "name pool_size reserve_pool_size pool_mode max_user_connections current_connections max_user_client_connections current_client_connections"},
	"STATS": {"sNNNNNNNNNNNNNNNNNNNNNN", "database total_server_assignment_count total_xact_count total_query_count total_received total_sent total_xact_time total_query_time total_wait_time total_client_parse_count total_server_parse_count total_bind_count " +
		"avg_server_assignment_count avg_xact_count avg_query_count avg_recv avg_sent avg_xact_time avg_query_time avg_wait_time avg_client_parse_count avg_server_parse_count avg_bind_count"},
	"STATS_TOTALS":   {"sNNNNNNNNNNN", "database server_assignment_count xact_count query_count bytes_received bytes_sent xact_time query_time wait_time client_parse_count server_parse_count bind_count"},
	"STATS_AVERAGES": {"sNNNNNNNNNNN", "database server_assignment_count xact_count query_count bytes_received bytes_sent xact_time query_time wait_time avg_client_parse_count avg_server_parse_count avg_bind_count"},
	"TOTALS":         {"sN", "name value"},
	"LISTS":          {"si", "list items"},
	"MEM":            {"siiii", "name size used free memtotal"},
	"VERSION":        {"s", "version"},
	"STATE":          {"ss", "key value"},
	"CONFIG":         {"ssss", "key value default changeable"},
	"PEERS":          {"isii", "peer_id host port pool_size"},
	"PEER_POOLS":     {"iiiii", "peer_id cl_active_cancel_req cl_waiting_cancel_req sv_active_cancel sv_login"},
	"DNS_HOSTS":      {"sqs", "hostname ttl addrs"},
	"DNS_ZONES":      {"sqi", "zonename serial count"},
}

// pgfenceColumns are the columns pgfence adds after PgBouncer's. None
// for SHOW CONFIG: pgbouncer_exporter refuses a SHOW CONFIG of other than
// three or four columns (its scrape fails: pgbouncer_up 0, measured), so
// the source column is SHOW CONFIG_SOURCES'.
var pgfenceColumns = map[string]string{
	"CLIENTS": "job_key epoch token step tx_state gated replay upstream",
	"SERVERS": "upstream tx_state",
}

var typeOIDs = map[byte]uint32{'s': 25, 'T': 25, 'i': 23, 'q': 20, 'N': 1700}

// rawRows runs a console command and returns its columns and rows as
// text (nil for NULL).
func rawRows(t *testing.T, c *pgx.Conn, cmd string) ([]pgconn.FieldDescription, [][]*string) {
	t.Helper()
	mrr := c.PgConn().Exec(ctxT(t), cmd)
	defer mrr.Close()
	var fds []pgconn.FieldDescription
	var rows [][]*string
	n := 0
	for mrr.NextResult() {
		n++
		rr := mrr.ResultReader()
		fds = slices.Clone(rr.FieldDescriptions()) // also without rows
		for rr.NextRow() {
			row := make([]*string, len(rr.Values()))
			for i, v := range rr.Values() {
				if v != nil {
					s := string(v)
					row[i] = &s
				}
			}
			rows = append(rows, row)
		}
		if _, err := rr.Close(); err != nil {
			t.Fatalf("%s: %v", cmd, err)
		}
	}
	if err := mrr.Close(); err != nil {
		t.Fatalf("%s: %v", cmd, err)
	}
	if n != 1 {
		t.Fatalf("%s: %d results, want 1", cmd, n)
	}
	return fds, rows
}

// table runs a console command and returns its rows keyed by column (a
// NULL is absent from its row).
func table(t *testing.T, c *pgx.Conn, cmd string) []map[string]string {
	t.Helper()
	fds, rows := rawRows(t, c, cmd)
	var out []map[string]string
	for _, r := range rows {
		m := map[string]string{}
		for i, fd := range fds {
			if r[i] != nil {
				m[fd.Name] = *r[i]
			}
		}
		out = append(out, m)
	}
	return out
}

// TestConsolePgBouncerColumns checks every PgBouncer command pgfence
// answers: the same column names, order and types as PgBouncer, then
// pgfence's own.
func TestConsolePgBouncerColumns(t *testing.T) {
	e := newOpsEnv(t, Config{})
	adm := mustConsole(t, e.proxy, "admin")
	for cmd, want := range pgbouncerColumns {
		t.Run(cmd, func(t *testing.T) {
			fds, _ := rawRows(t, adm, "SHOW "+cmd)
			wantCols := strings.Fields(want.cols)
			if extra := pgfenceColumns[cmd]; extra != "" {
				wantCols = append(wantCols, strings.Fields(extra)...)
			}
			var got []string
			for i, fd := range fds {
				got = append(got, fd.Name)
				if i < len(want.types) && fd.DataTypeOID != typeOIDs[want.types[i]] {
					t.Errorf("column %s: type %d, want %d (%c)", fd.Name, fd.DataTypeOID, typeOIDs[want.types[i]], want.types[i])
				}
			}
			if !slices.Equal(got, wantCols) {
				t.Errorf("columns\n got %v\nwant %v", got, wantCols)
			}
		})
	}
}

// TestConsoleShow checks what the PgBouncer commands answer about a
// workload: sessions with fence state, one of them gated in an open
// transaction; through pgx and psql, as an admin and as a stats user.
func TestConsoleShow(t *testing.T) {
	e := newOpsEnv(t, Config{Sources: map[string]string{"max_clients": "file", "admin_users": "env"}})
	ctx := ctxT(t)
	w := runWorkload(t, e) // leaves wb in a gated transaction
	adm := mustConsole(t, e.proxy, "admin")
	watcher := mustConsole(t, e.proxy, "watcher")
	wbAddr := w.wb.PgConn().Conn().LocalAddr().String()

	t.Run("clients", func(t *testing.T) {
		clients := table(t, adm, "SHOW CLIENTS")
		var jb, console map[string]string
		n := 0
		for _, r := range clients {
			if r["database"] == e.db {
				n++
			}
			if r["job_key"] == "jb" {
				jb = r
			}
			if r["database"] == AdminDatabase && r["user"] == "admin" {
				console = r
			}
		}
		if n != 3 || jb == nil || console == nil {
			t.Fatalf("SHOW CLIENTS: %d clients of %s (want 3), jb %v, console %v:\n%v", n, e.db, jb, console, clients)
		}
		if got := jb["addr"] + ":" + jb["port"]; got != wbAddr || jb["type"] != "C" || jb["state"] != "active" || jb["user"] != "postgres" ||
			jb["token"] != strconv.FormatInt(w.jb.Token, 10) || jb["epoch"] != strconv.FormatInt(w.jb.Epoch, 10) ||
			jb["gated"] != "1" || jb["tx_state"] != "in transaction" || jb["step"] != "open" || jb["upstream"] != "primary" ||
			jb["replication"] != "none" || jb["wait"] != "0" || jb["local_port"] != strconv.Itoa(e.proxy.addr.Port) {
			t.Errorf("jb's client row: %v (want addr %s, token %d, gated, in transaction)", jb, wbAddr, w.jb.Token)
		}
		if _, err := time.ParseInLocation("2006-01-02 15:04:05 MST", jb["connect_time"], time.Local); err != nil {
			t.Errorf("connect_time %q: %v", jb["connect_time"], err)
		}
		// The stats user sees the same, but no token.
		for _, r := range table(t, watcher, "SHOW CLIENTS") {
			if r["job_key"] == "jb" {
				if _, ok := r["token"]; ok || r["epoch"] != jb["epoch"] {
					t.Errorf("stats user's jb row: %v, want epoch %s and no token", r, jb["epoch"])
				}
			}
		}
	})

	t.Run("servers", func(t *testing.T) {
		var jbServer map[string]string
		var realPID string
		if err := w.wb.QueryRow(ctxT(t), "SELECT pg_backend_pid()::text").Scan(&realPID); err != nil {
			t.Fatal(err)
		}
		seen := false
		for _, r := range table(t, adm, "SHOW SERVERS") {
			// The client was told the backend's real PID (issue 19 §4):
			// SHOW SERVERS shows that backend under it.
			if r["database"] == e.db && r["remote_pid"] == strconv.FormatUint(uint64(w.wb.PgConn().PID()), 10) {
				seen = true
				if r["remote_pid"] != realPID {
					t.Errorf("SHOW SERVERS remote_pid %s, the backend says %s", r["remote_pid"], realPID)
				}
			}
			if r["tx_state"] == "in transaction" {
				jbServer = r
			}
		}
		if !seen {
			t.Errorf("SHOW SERVERS has no row for the backend pid %d the client was given", w.wb.PgConn().PID())
		}
		if jbServer == nil || jbServer["type"] != "S" || jbServer["addr"]+":"+jbServer["port"] != cluster.Primary.Addr() || jbServer["state"] != "active" ||
			jbServer["close_needed"] != "0" || jbServer["remote_pid"] == "0" {
			t.Fatalf("jb's server row: %v, want an active server at %s", jbServer, cluster.Primary.Addr())
		}
		var running int
		obs := e.direct(t)
		if err := obs.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'idle in transaction'", mustAtoi(t, jbServer["remote_pid"])).Scan(&running); err != nil || running != 1 {
			t.Errorf("remote_pid %s is not the backend idle in jb's transaction (%d, %v)", jbServer["remote_pid"], running, err)
		}
	})

	t.Run("pools, databases, users, lists", func(t *testing.T) {
		pools := table(t, adm, "SHOW POOLS")
		var pool map[string]string
		for _, r := range pools {
			if r["database"] == e.db {
				pool = r
			}
		}
		if pool == nil || pool["user"] != "postgres" || pool["cl_active"] != "3" || pool["cl_waiting"] != "0" || pool["sv_active"] != "3" || pool["pool_mode"] != "session" {
			t.Errorf("SHOW POOLS: %v", pools)
		}
		dbs := map[string]map[string]string{}
		for _, r := range table(t, adm, "SHOW DATABASES") {
			dbs[r["name"]] = r
		}
		if d := dbs[e.db]; d == nil || d["current_connections"] != "3" || d["current_client_connections"] != "3" || d["paused"] != "0" || d["disabled"] != "0" ||
			d["host"]+":"+d["port"] != cluster.Primary.Addr() || d["database"] != e.db {
			t.Errorf("SHOW DATABASES %s: %v", e.db, d)
		}
		if d := dbs[AdminDatabase]; d == nil || d["current_client_connections"] != "2" {
			t.Errorf("SHOW DATABASES %s: %v, want the two console clients", AdminDatabase, d)
		}
		users := map[string]map[string]string{}
		for _, r := range table(t, adm, "SHOW USERS") {
			users[r["name"]] = r
		}
		if u := users["postgres"]; u == nil || u["current_connections"] != "3" || u["current_client_connections"] != "3" {
			t.Errorf("SHOW USERS postgres: %v", u)
		}
		if users["watcher"] == nil || users["admin"] == nil {
			t.Errorf("SHOW USERS: no console users in %v", users)
		}
		lists := map[string]string{}
		for _, r := range table(t, adm, "SHOW LISTS") {
			lists[r["list"]] = r["items"]
		}
		if lists["pools"] != strconv.Itoa(len(pools)) || lists["used_servers"] != "3" || lists["used_clients"] != "5" || lists["login_clients"] != "0" || lists["databases"] != strconv.Itoa(len(dbs)) {
			t.Errorf("SHOW LISTS: %v", lists)
		}
	})

	t.Run("config, version, state, mem", func(t *testing.T) {
		conf := map[string]map[string]string{}
		for _, r := range table(t, adm, "SHOW CONFIG_SOURCES") {
			conf[r["key"]] = r
		}
		if fds, _ := rawRows(t, adm, "SHOW CONFIG_SOURCES"); len(fds) != 5 || fds[4].Name != "source" {
			t.Errorf("SHOW CONFIG_SOURCES columns: %v, want SHOW CONFIG's and source", fds)
		}
		if plain := table(t, adm, "SHOW CONFIG"); len(plain) != len(conf) {
			t.Errorf("SHOW CONFIG: %d rows, SHOW CONFIG_SOURCES %d", len(plain), len(conf))
		}
		if r := conf["max_clients"]; r["value"] != strconv.Itoa(DefaultMaxClients) || r["default"] != strconv.Itoa(DefaultMaxClients) || r["changeable"] != "yes" || r["source"] != "file" {
			t.Errorf("SHOW CONFIG max_clients: %v", r)
		}
		if r := conf["admin_users"]; r["value"] != "admin,ops" || r["source"] != "env" {
			t.Errorf("SHOW CONFIG admin_users: %v", r)
		}
		if r := conf["primary"]; r["changeable"] != "no" || strings.Contains(r["value"], "password") {
			t.Errorf("SHOW CONFIG primary: %v", r)
		}
		if r := conf["max_client_conn"]; r["value"] != strconv.Itoa(DefaultMaxClients) {
			t.Errorf("SHOW CONFIG max_client_conn (PgBouncer's name): %v", r)
		}
		if v := table(t, adm, "SHOW VERSION"); len(v) != 1 || !strings.HasPrefix(v[0]["version"], "pgfence ") {
			t.Errorf("SHOW VERSION: %v", v)
		}
		state := map[string]string{}
		for _, r := range table(t, adm, "show state") {
			state[r["key"]] = r["value"]
		}
		if state["active"] != "yes" || state["paused"] != "no" || state["suspended"] != "no" {
			t.Errorf("SHOW STATE: %v", state)
		}
		mem := table(t, adm, "SHOW MEM")
		if len(mem) != 2 || mem[0]["name"] != "session_buffers" || mem[0]["used"] != "3" {
			t.Errorf("SHOW MEM: %v", mem)
		}
		// Drivers' fake settings, as PgBouncer.
		if v := table(t, watcher, "SHOW client_encoding"); len(v) != 1 || v[0]["client_encoding"] != "UTF-8" {
			t.Errorf("SHOW client_encoding: %v", v)
		}
	})

	t.Run("psql", func(t *testing.T) {
		out, err := consolePsql(t, e.proxy, "watcher", "-c", "SHOW POOLS", "-c", "SHOW STATS_TOTALS", "-c", "SHOW CLIENTS")
		if err != nil {
			t.Fatalf("psql: %v\n%s", err, out)
		}
		for _, want := range []string{
			"database|user|cl_active|cl_waiting|",
			e.db + "|postgres|3|0|0|0|3|",
			"database|server_assignment_count|xact_count|query_count|bytes_received|bytes_sent|",
			"type|user|database|replication|state|addr|port|",
			"C|postgres|" + e.db + "|none|active|127.0.0.1|",
		} {
			if !strings.Contains(out, want) {
				t.Errorf("psql output lacks %q:\n%s", want, out)
			}
		}
		// The token column, by its position in SHOW CLIENTS' header: empty
		// (NULL) in every row for the stats user.
		tokenCol := -1
		for _, line := range strings.Split(out, "\n") {
			f := strings.Split(line, "|")
			if len(f) > 0 && f[0] == "type" {
				tokenCol = slices.Index(f, "token")
				continue
			}
			if tokenCol >= 0 && len(f) > tokenCol && f[0] == "C" && f[tokenCol] != "" {
				t.Errorf("the stats user's psql SHOW CLIENTS shows token %q: %s", f[tokenCol], line)
			}
		}
		if tokenCol < 0 {
			t.Errorf("no token column in psql SHOW CLIENTS:\n%s", out)
		}
	})
}

// TestConsoleStats checks SHOW STATS' counts against a known workload, on
// every relay path: the counting hooks are in each.
func TestConsoleStats(t *testing.T) {
	bothRelays(t, func(t *testing.T, relay Config) {
		p := startProxy(t, withRelay(relay, withConsole(Config{})))
		db := cluster.NewDatabase(t)
		ctx := ctxT(t)
		c := connect(t, p.dsn(db))
		// 7 queries (a Query message with two statements is one), 5
		// transactions, 103 bytes from the client.
		for _, sql := range []string{"SELECT 1", "SELECT 1", "SELECT 1", "BEGIN", "SELECT 1", "COMMIT", "SELECT 1; SELECT 2"} {
			if _, err := c.Exec(ctx, sql).ReadAll(); err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
		}
		adm := mustConsole(t, p, "admin")
		var row map[string]string
		for _, r := range table(t, adm, "SHOW STATS") {
			if r["database"] == db {
				row = r
			}
		}
		n := func(k string) int { return mustAtoi(t, row[k]) }
		if row == nil || n("total_server_assignment_count") != 1 || n("total_query_count") != 7 || n("total_xact_count") != 5 ||
			n("total_received") != 103 || n("total_sent") == 0 || n("total_query_time") == 0 || n("total_xact_time") < n("total_query_time")*5/7 ||
			n("total_wait_time") != 0 || n("avg_query_count") < 0 {
			t.Fatalf("SHOW STATS %s: %v\nwant 1 assignment, 7 queries, 5 transactions, 103 bytes received", db, row)
		}
		// A session's counts stay with its database when it ends.
		sent := n("total_sent")
		c.Close(ctx)
		if err := pgtest.Poll(ctx, func() (bool, error) { return len(p.srv.sessionsOf(db)) == 0, nil }); err != nil {
			t.Fatal(err)
		}
		for _, r := range table(t, adm, "SHOW STATS_TOTALS") {
			if r["database"] == db && (r["query_count"] != "7" || r["bytes_received"] != "108" || mustAtoi(t, r["bytes_sent"]) != sent) {
				t.Errorf("after the session ended, SHOW STATS_TOTALS: %v, want 7 queries, 108 bytes received (Terminate too), %d sent", r, sent)
			}
		}
		totals := map[string]string{}
		for _, r := range table(t, adm, "SHOW TOTALS") {
			totals[r["name"]] = r["value"]
		}
		if totals["total_query_count"] != "7" || totals["total_xact_count"] != "5" || totals["total_server_assignment_count"] != "1" {
			t.Errorf("SHOW TOTALS: %v", totals)
		}
	})
}

// consolePsql runs psql against p's console as user (with its password),
// unaligned with | between fields, column names printed.
func consolePsql(t *testing.T, p *testProxy, user string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := exec.CommandContext(ctx, "psql", append([]string{"-X", "-h", "127.0.0.1", "-p", strconv.Itoa(p.addr.Port), "-U", user,
		"-A", "-F", "|", "-v", "ON_ERROR_STOP=1", "-d", AdminDatabase}, args...)...)
	c.Env = append(os.Environ(), "PGPASSWORD="+consolePassword(user), "PGCONNECT_TIMEOUT=10")
	out, err := c.CombinedOutput()
	return string(out), err
}

func mustAtoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatalf("%q: %v", s, err)
	}
	return n
}

// TestConsoleSet changes settings with SET, as PgBouncer's console does:
// reloadable ones apply at once, the others are refused, the drivers'
// fake ones are ignored.
func TestConsoleSet(t *testing.T) {
	e := newOpsEnv(t, Config{})
	ctx := ctxT(t)
	adm := mustConsole(t, e.proxy, "admin")
	res, err := adm.PgConn().Exec(ctx, "SET max_clients = 3").ReadAll()
	if err != nil || string(res[0].CommandTag.String()) != "SET max_clients=3" {
		t.Fatalf("SET max_clients: %v %v", res, err)
	}
	// The console is not counted (issue 30, B-M4: it stays reachable);
	// three clients fit, the fourth is refused.
	connect(t, e.proxy.dsn(e.db))
	connect(t, e.proxy.dsn(e.db))
	connect(t, e.proxy.dsn(e.db))
	if err := pgtest.Poll(ctx, func() (bool, error) { return e.proxy.srv.clients.Load() == 3, nil }); err != nil {
		t.Fatal(err)
	}
	_, err = pgconn.Connect(ctx, e.proxy.dsn(e.db))
	wantCode(t, err, "53300")
	for stmt, code := range map[string]string{
		"SET max_clients = many":       "22023",
		"SET primary = 'host=x'":       "55P02",
		"SET max_message_size TO 1024": "55P02",
		"SET nonsense = 1":             "42704",
		"SET max_clients":              "42601",
	} {
		_, err := adm.Exec(ctx, stmt)
		wantCode(t, err, code)
	}
	execOK(t, adm, "SET stats_users = 'watcher,bob'")
	conf := map[string]string{}
	for _, r := range table(t, adm, "SHOW CONFIG") {
		conf[r["key"]] = r["value"]
	}
	if conf["max_clients"] != "3" || conf["stats_users"] != "bob,watcher" {
		t.Errorf("SHOW CONFIG after SET: max_clients %s stats_users %s", conf["max_clients"], conf["stats_users"])
	}
	// bob, a stats user now, gets in once there is room.
	execOK(t, adm, "SET max_clients = 10")
	bob, err := e.admin(t, "bob")
	if err != nil {
		t.Fatalf("bob after SET stats_users: %v", err)
	}
	_, err = bob.Exec(ctx, "SET max_clients = 100")
	wantCode(t, err, "42501")
	// max_console_clients: each console user's sessions (bob has one).
	execOK(t, adm, "SET max_console_clients = 2")
	mustConsole(t, e.proxy, "bob")
	_, err = e.admin(t, "bob")
	wantConsoleFull(t, err)
	_, err = bob.Exec(ctx, "SET max_console_clients = '-1'")
	wantCode(t, err, "42501")
	_, err = adm.Exec(ctx, "SET max_console_clients = some")
	wantCode(t, err, "22023")
	execOK(t, adm, "SET max_console_clients = '-1'") // no limit
	mustConsole(t, e.proxy, "bob")
	for _, r := range table(t, adm, "SHOW CONFIG") {
		if r["key"] == "max_console_clients" && (r["value"] != "-1" || r["default"] != "10" || r["changeable"] != "yes") {
			t.Errorf("SHOW CONFIG max_console_clients: %v", r)
		}
	}
	// client_encoding and the like: ignored with a notice, for everybody.
	rawSend(t, bob.PgConn(), "SET client_encoding = 'UTF8'")
	fe := pgproto3.NewFrontend(bob.PgConn().Conn(), bob.PgConn().Conn())
	var got []string
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		switch m := m.(type) {
		case *pgproto3.NoticeResponse:
			got = append(got, "notice "+m.Message)
		case *pgproto3.CommandComplete:
			got = append(got, string(m.CommandTag))
		case *pgproto3.ErrorResponse:
			got = append(got, "error "+m.Code)
		}
		if _, ok := m.(*pgproto3.ReadyForQuery); ok {
			break
		}
	}
	if strings.Join(got, ", ") != "notice SET ignored, SET" {
		t.Errorf("stats user's SET client_encoding: %v, want the notice SET ignored and SET", got)
	}
}

// TestConsoleParse checks the grammar: PgBouncer's (a word and an
// argument, SET key = value) and pgfence's several statements per query.
func TestConsoleParse(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []adminStmt // nil: a syntax error
	}{
		{"show clients", []adminStmt{{verb: "SHOW", arg: "clients", argWord: "CLIENTS"}}},
		{"  SHOW\tCLIENTS ; ", []adminStmt{{verb: "SHOW", arg: "CLIENTS", argWord: "CLIENTS"}}},
		{`PAUSE "My DB"`, []adminStmt{{verb: "PAUSE", arg: "My DB"}}},
		{`KILL "a""b"`, []adminStmt{{verb: "KILL", arg: `a"b`}}},
		{"pause MyDb", []adminStmt{{verb: "PAUSE", arg: "MyDb", argWord: "MYDB"}}},
		{"SHOW FENCES app", []adminStmt{{verb: "SHOW", arg: "FENCES", argWord: "FENCES", arg2: "app"}}},
		{"SET max_clients = 10", []adminStmt{{verb: "SET", key: "max_clients", value: "10"}}},
		{"set Max_Clients to '10'", []adminStmt{{verb: "SET", key: "max_clients", value: "10"}}},
		{"SET stats_users = 'a,b;c'; SHOW STATE", []adminStmt{{verb: "SET", key: "stats_users", value: "a,b;c"}, {verb: "SHOW", arg: "STATE", argWord: "STATE"}}},
		{"SET x = 'it''s'", []adminStmt{{verb: "SET", key: "x", value: "it's"}}},
		{"SHOW a b c", nil},
		{"SHOW clients;x", []adminStmt{{verb: "SHOW", arg: "clients", argWord: "CLIENTS"}, {verb: "X"}}},
		{"PAUSE db-name", nil},
		{`PAUSE ""`, nil},
		{"SET x", nil},
		{"SET x = ", nil},
		{"SET x = 'open", nil},
		{"'SHOW'", nil},
	} {
		var got []adminStmt
		ok := true
		for _, text := range splitAdmin(c.in) {
			st, good := parseAdmin(text)
			if !good {
				ok = false
				break
			}
			st.text = ""
			got = append(got, st)
		}
		if !ok {
			got = nil
		}
		if fmt.Sprint(got) != fmt.Sprint(c.want) {
			t.Errorf("%q: got %+v, want %+v", c.in, got, c.want)
		}
	}
}

// TestConsolePsqlControl runs the control commands with psql, as a DBA
// types them, and checks psql's output.
func TestConsolePsqlControl(t *testing.T) {
	e := newOpsEnv(t, Config{})
	w := e.worker(t, nil)
	for _, c := range []struct{ cmd, want string }{
		{"PAUSE " + e.db, "PAUSE"},
		{"SHOW DATABASES", "|1|0\n"}, // paused, not disabled
		{"SHOW STATE", "paused|no"},  // a database paused, not everything
		{"RESUME " + e.db, "RESUME"},
		{"DISABLE " + e.db, "DISABLE"},
		{"SHOW DATABASES", "|0|1\n"},
		{"ENABLE " + e.db, "ENABLE"},
		{"RECONNECT " + e.db, "RECONNECT"},
		{"SHOW SERVERS", "|0|0|1|0x"}, // wait, wait_us, close_needed, ptr
		{"SET max_clients = 50", "SET max_clients=50"},
		{"SHOW CONFIG", "max_clients|50|1000|yes"},
		{"KILL " + e.db, "KILL"},
		{"RESUME " + e.db, "RESUME"},
		{"WAIT_CLOSE " + e.db, "WAIT_CLOSE"}, // the marked session was killed
		{"PAUSE", "PAUSE"},
		{"SHOW STATE", "paused|yes"},
		{"RESUME", "RESUME"},
	} {
		out, err := consolePsql(t, e.proxy, "admin", "-t", "-c", c.cmd)
		if err != nil || !strings.Contains(out, c.want) {
			t.Errorf("psql -c %q (%v):\n%s\nwant %q", c.cmd, err, out, c.want)
		}
	}
	if _, err := w.Exec(ctxT(t), "SELECT 1"); pgtest.SQLState(err) != "57P01" {
		t.Errorf("the worker after KILL: %v, want 57P01", err)
	}
	out, err := consolePsql(t, e.proxy, "watcher", "-c", "PAUSE")
	if err == nil || !strings.Contains(out, "ERROR:  admin access needed") {
		t.Errorf("psql PAUSE as the stats user (%v):\n%s", err, out)
	}
}
