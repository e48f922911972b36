package proxy

import (
	"fmt"
	"maps"
	"math"
	"net"
	"runtime/debug"
	"runtime/metrics"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
)

// The console's SHOW commands that answer as PgBouncer's do (src/admin.c
// and src/stats.c of PgBouncer 1.25.2): the same names, columns, column
// order and types, so that scripts and exporters written for PgBouncer
// (prometheus-community/pgbouncer_exporter) read pgfence. pgfence's own
// columns come after PgBouncer's. docs/console.md says what each column
// means in pgfence's session mode.

// adminShow answers SHOW <what>.
func (s *Server) adminShow(con *console, st adminStmt) (*adminTable, *pgproto3.ErrorResponse) {
	if v := fakeParam(st.arg); v != "" {
		t := newTable("s", strings.ToLower(st.arg))
		t.add(v)
		return t, nil
	}
	switch st.argWord {
	case "HELP":
		return showHelp(), nil
	case "CLIENTS":
		return s.showClients(con), nil
	case "SERVERS":
		return s.showServers(), nil
	case "POOLS":
		return s.showPools(), nil
	case "DATABASES":
		return s.showDatabases(), nil
	case "USERS":
		return s.showUsers(), nil
	case "STATS":
		return s.showStats(true, true), nil
	case "STATS_TOTALS":
		return s.showStats(true, false), nil
	case "STATS_AVERAGES":
		return s.showStats(false, true), nil
	case "TOTALS":
		return s.showTotals(), nil
	case "LISTS":
		return s.showLists(), nil
	case "MEM":
		return s.showMem(), nil
	case "VERSION":
		t := newTable("s", "version")
		t.add("pgfence " + buildVersion())
		return t, nil
	case "STATE":
		return s.showState(), nil
	case "CONFIG":
		return s.showConfig(false), nil
	case "CONFIG_SOURCES":
		return s.showConfig(true), nil
	case "PEERS":
		return newTable("isii", "peer_id", "host", "port", "pool_size"), nil
	case "PEER_POOLS":
		return newTable("iiiii", "peer_id", "cl_active_cancel_req", "cl_waiting_cancel_req", "sv_active_cancel", "sv_login"), nil
	case "DNS_HOSTS":
		return newTable("sqs", "hostname", "ttl", "addrs"), nil
	case "DNS_ZONES":
		return newTable("sqi", "zonename", "serial", "count"), nil
	case "FDS", "SOCKETS", "ACTIVE_SOCKETS":
		return nil, adminError("0A000", fmt.Sprintf("SHOW %s is not supported by pgfence", st.argWord), "SHOW CLIENTS and SHOW SERVERS show the connections")
	// pgfence's own
	case "SESSIONS":
		return s.showSessions(con), nil
	case "FENCES":
		return s.showFences(con, st.arg2)
	case "FENCE_STATS":
		return s.showFenceStats(), nil
	case "UPSTREAMS":
		return s.showUpstreams(), nil
	}
	return nil, syntaxError(st.text)
}

// fakeParams are the settings PgBouncer's console pretends to have for
// drivers that SHOW or SET them.
var fakeParams = [][2]string{
	{"client_encoding", "UTF-8"}, {"default_transaction_isolation", "read committed"},
	{"standard_conforming_strings", "on"}, {"datestyle", "ISO"}, {"timezone", "GMT"},
}

// fakeParam returns the value of a fake parameter, "" for another name.
func fakeParam(name string) string {
	for _, p := range fakeParams {
		if strings.EqualFold(p[0], name) {
			return p[1]
		}
	}
	return ""
}

// showHelp lists the commands as rows (PgBouncer sends them as a
// notice).
func showHelp() *adminTable {
	t := newTable("ss", "command", "description")
	for _, c := range adminCommands {
		t.add(c[0], c[1])
	}
	return t
}

// buildVersion is the module version and VCS revision pgfence was built
// from.
func buildVersion() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "devel"
	}
	v := bi.Main.Version
	if v == "" || v == "(devel)" {
		v = "devel"
	}
	for _, s := range bi.Settings {
		if s.Key == "vcs.revision" && len(s.Value) >= 12 {
			v += "+" + s.Value[:12]
		}
	}
	return v
}

// addrParts splits an address as PgBouncer shows it: the IP and the port,
// "unix" for a Unix socket.
func addrParts(a net.Addr) (any, int) {
	switch a := a.(type) {
	case *net.TCPAddr:
		return a.IP.String(), a.Port
	case nil:
		return nil, 0
	case *net.UnixAddr:
		return "unix", 0
	}
	host, port, err := net.SplitHostPort(a.String())
	if err != nil {
		return a.String(), 0
	}
	n, _ := strconv.Atoi(port)
	return host, n
}

// ptr is the ptr/link column: an opaque id of a client (or its server).
func ptr(id uint64, server bool) string {
	if server {
		return fmt.Sprintf("0x%x", id<<1|1)
	}
	return fmt.Sprintf("0x%x", id<<1)
}

// waitTime is how long ago mono (a monoNow) was, as PgBouncer's wait and
// wait_us columns; 0, 0 when mono is 0.
func waitTime(mono int64) (int, int) {
	if mono == 0 {
		return 0, 0
	}
	us := (monoNow() - mono) / 1000
	return int(us / 1e6), int(us % 1e6)
}

// socketTypes and socketCols are SHOW CLIENTS' and SHOW SERVERS' columns
// (PgBouncer's socket_header, SKF_STD).
const socketTypes = "ssssssisiTTiiississii"

var socketCols = []string{"type", "user", "database", "replication", "state", "addr", "port", "local_addr", "local_port",
	"connect_time", "request_time", "wait", "wait_us", "close_needed", "ptr", "link", "remote_pid", "tls",
	"application_name", "prepared_statements", "id"}

// requestTime is the session's request_time: its latest request, or its
// connection when it has sent none.
func requestTime(ss *Session) time.Time {
	if n := ss.info.stats.lastRequest.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return ss.info.connectedAt
}

func (s *Server) showClients(con *console) *adminTable {
	t := newTable(socketTypes+"sqqssiis", append(slices.Clone(socketCols),
		"job_key", "epoch", "token", "step", "tx_state", "gated", "replay", "upstream")...)
	for _, ss := range s.openSessions() {
		in := &ss.info
		state := "active"
		hold := in.holdSince.Load()
		if hold != 0 {
			state = "waiting"
		}
		addr, port := addrParts(ss.ClientAddr)
		laddr, lport := addrParts(in.clientLocal)
		w, wus := waitTime(hold)
		gi := sessionGate(ss)
		var job, epoch, token, step any
		if gi.hasGen {
			job, epoch, token, step = gi.gen.JobKey, gi.gen.Epoch, gi.gen.Token, gi.gen.Step
			if con.role != roleAdmin {
				token = nil
			}
		}
		t.add("C", ss.User, ss.Database, "none", state, addr, port, laddr, lport,
			in.connectedAt, requestTime(ss), w, wus, 0, ptr(in.id, false), ptr(in.id, true), 0, in.clientTLS,
			printableName(ss.Params["application_name"]), 0, int64(in.id),
			job, epoch, token, step, txName(ss.TxStatus()), b2i(gi.gated), b2i(gi.replay), ss.Upstream())
	}
	for _, a := range s.admissions() {
		addr, port := addrParts(a.addr)
		laddr, lport := addrParts(a.self)
		w, wus := waitTime(a.mono)
		t.add("C", a.user, a.db, "none", "waiting", addr, port, laddr, lport,
			a.since, a.since, w, wus, 0, ptr(a.id, false), "", 0, "", printableName(a.app), 0, int64(a.id),
			nil, nil, nil, nil, "idle", 0, 0, "")
	}
	for _, c := range s.consolesByID() {
		addr, port := addrParts(c.addr)
		laddr, lport := addrParts(c.self)
		t.add("C", c.user, AdminDatabase, "none", "active", addr, port, laddr, lport,
			c.since, c.since, 0, 0, 0, ptr(c.id, false), "", 0, c.tls, printableName(c.app), 0, int64(c.id),
			nil, nil, nil, nil, "idle", 0, 0, "")
	}
	return t
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (s *Server) showServers() *adminTable {
	t := newTable(socketTypes+"ss", append(slices.Clone(socketCols), "upstream", "tx_state")...)
	for _, ss := range s.openSessions() {
		in := &ss.info
		addr, port := addrParts(in.serverAddr)
		laddr, lport := addrParts(in.serverLocal)
		t.add("S", ss.User, ss.Database, "none", "active", addr, port, laddr, lport,
			in.connectedAt, requestTime(ss), 0, 0, b2i(in.closeNeeded.Load()), ptr(in.id, true), ptr(in.id, false),
			int(ss.BackendPID), in.serverTLS, printableName(ss.Params["application_name"]), 0, int64(in.id),
			ss.Upstream(), txName(ss.TxStatus()))
	}
	return t
}

// openSessions returns the open sessions in the order they were opened.
func (s *Server) openSessions() []*Session {
	sess := s.sessionsOf("")
	sort.Slice(sess, func(i, j int) bool { return sess[i].info.id < sess[j].info.id })
	return sess
}

// admissions returns the new clients waiting for RESUME, oldest first.
func (s *Server) admissions() []*admission {
	p := &s.ops.ctl
	p.mu.Lock()
	out := slices.Collect(maps.Keys(p.admitting))
	p.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].id < out[j].id })
	return out
}

// consolesByID returns the open console sessions, oldest first.
func (s *Server) consolesByID() []*console {
	s.ops.consolesMu.Lock()
	out := slices.Collect(maps.Values(s.ops.consoles))
	s.ops.consolesMu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].id < out[j].id })
	return out
}

// poolRow is a SHOW POOLS row: the clients of one database and user.
type poolRow struct {
	db, user             string
	active, waiting, srv int
	idle                 int   // server connections parked (server_reuse)
	oldestWait           int64 // monoNow of the longest wait, 0: none
	admin                bool
}

func (p *poolRow) waited(mono int64) {
	p.waiting++
	if p.oldestWait == 0 || mono < p.oldestWait {
		p.oldestWait = mono
	}
}

// poolRows groups the clients by database and user, sorted.
func (s *Server) poolRows() []*poolRow {
	m := map[[2]string]*poolRow{}
	get := func(db, user string) *poolRow {
		k := [2]string{db, user}
		if m[k] == nil {
			m[k] = &poolRow{db: db, user: user, admin: db == AdminDatabase}
		}
		return m[k]
	}
	for _, ss := range s.sessionsOf("") {
		p := get(ss.Database, ss.User)
		p.srv++
		if h := ss.info.holdSince.Load(); h != 0 {
			p.waited(h)
		} else {
			p.active++
		}
	}
	for _, a := range s.admissions() {
		get(a.db, a.user).waited(a.mono)
	}
	// Clients waiting for a server connection (pools.go).
	for _, ps := range s.pools.Stats() {
		if ps.Waiting > 0 {
			p := get(ps.Database, ps.User)
			p.waiting += ps.Waiting - 1
			p.waited(monoAt(ps.OldestWait))
		}
		if ps.Idle > 0 {
			get(ps.Database, ps.User).idle = ps.Idle
		}
	}
	for _, c := range s.consolesByID() {
		get(AdminDatabase, c.user).active++
	}
	out := slices.Collect(maps.Values(m))
	sort.Slice(out, func(i, j int) bool {
		if out[i].db != out[j].db {
			return out[i].db < out[j].db
		}
		return out[i].user < out[j].user
	})
	return out
}

func (s *Server) showPools() *adminTable {
	t := newTable("ssiiiiiiiiiiiiiss", "database", "user", "cl_active", "cl_waiting", "cl_active_cancel_req",
		"cl_waiting_cancel_req", "sv_active", "sv_active_cancel", "sv_being_canceled", "sv_idle", "sv_used",
		"sv_tested", "sv_login", "maxwait", "maxwait_us", "pool_mode", "load_balance_hosts")
	for _, p := range s.poolRows() {
		w, wus := waitTime(p.oldestWait)
		mode := "session"
		if p.admin {
			mode = "statement"
		}
		t.add(p.db, p.user, p.active, p.waiting, 0, 0, p.srv, 0, 0, p.idle, 0, 0, 0, w, wus, mode, nil)
	}
	return t
}

// databases returns the databases the console knows: used since start,
// with clients now, paused or disabled, and the console's own.
func (s *Server) databases() []string {
	set := map[string]bool{AdminDatabase: true}
	for db := range s.statsByDB() {
		set[db] = true
	}
	for _, a := range s.admissions() {
		set[a.db] = true
	}
	p := &s.ops.ctl
	p.mu.Lock()
	for db := range p.dbs {
		set[db] = true
	}
	for db := range p.disabled {
		set[db] = true
	}
	p.mu.Unlock()
	return slices.Sorted(maps.Keys(set))
}

func (s *Server) showDatabases() *adminTable {
	t := newTable("ssissiiiissiiiiii", "name", "host", "port", "database", "force_user", "pool_size", "min_pool_size",
		"reserve_pool_size", "server_lifetime", "pool_mode", "load_balance_hosts", "max_connections",
		"current_connections", "max_client_connections", "current_client_connections", "paused", "disabled")
	servers, clients := map[string]int{}, map[string]int{}
	for _, p := range s.poolRows() {
		servers[p.db] += p.srv
		clients[p.db] += p.active + p.waiting
	}
	lim := s.live().poolLimits // the same for every database (pool settings: pools.go)
	ctl := &s.ops.ctl
	for _, db := range s.databases() {
		ctl.mu.Lock()
		paused, disabled := ctl.pausedLocked(db), ctl.disabled[db]
		ctl.mu.Unlock()
		if db == AdminDatabase {
			_, port := addrParts(s.listenAddr())
			t.add(db, nil, port, db, AdminDatabase, 2, 0, 0, 0, "statement", nil, 0, 0, 0, clients[db], 0, 0)
			continue
		}
		t.add(db, s.primary.Host, int(s.primary.Port), db, nil, lim.PoolSize, 0, lim.ReserveSize, int(lim.Lifetime.Seconds()), "session", nil, lim.MaxDB,
			servers[db], 0, clients[db], b2i(paused), b2i(disabled))
	}
	return t
}

// listenAddr returns the address of one of the server's listeners.
func (s *Server) listenAddr() net.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out net.Addr
	for ln := range s.listeners {
		if out == nil || ln.Addr().String() < out.String() {
			out = ln.Addr()
		}
	}
	return out
}

func (s *Server) showUsers() *adminTable {
	t := newTable("ssssiiii", "name", "pool_size", "reserve_pool_size", "pool_mode", "max_user_connections",
		"current_connections", "max_user_client_connections", "current_client_connections")
	servers, clients := map[string]int{}, map[string]int{}
	for _, p := range s.poolRows() {
		servers[p.user] += p.srv
		clients[p.user] += p.active + p.waiting
	}
	live := s.live()
	set := map[string]bool{}
	for u := range live.users {
		set[u] = true
	}
	for u := range live.consoleUsers {
		set[u] = true
	}
	for u := range clients {
		set[u] = true
	}
	for _, u := range slices.Sorted(maps.Keys(set)) {
		// pool_size and reserve_pool_size: a user's own, which pgfence
		// does not have (PgBouncer shows none then); its max_user_connections.
		t.add(u, "", "", nil, live.poolLimits.MaxUser, servers[u], 0, clients[u])
	}
	return t
}

func (s *Server) showLists() *adminTable {
	t := newTable("si", "list", "items")
	pools := s.poolRows()
	clients, servers := 0, 0
	for _, p := range pools {
		clients += p.active + p.waiting
		servers += p.srv
	}
	s.mu.Lock()
	startup := 0
	for _, sess := range s.conns {
		if sess == nil {
			startup++
		}
	}
	s.mu.Unlock()
	// Connections in startup include the consoles and the clients
	// waiting for RESUME, counted above.
	login := max(startup-s.consoleCount()-len(s.admissions()), 0)
	for _, r := range []struct {
		name string
		n    int
	}{
		{"databases", len(s.databases())}, {"users", len(s.showUsers().rows)}, {"peers", 0}, {"pools", len(pools)},
		{"peer_pools", 0}, {"free_clients", 0}, {"used_clients", clients + login}, {"login_clients", login},
		{"free_servers", 0}, {"used_servers", servers}, {"dns_names", 0}, {"dns_zones", 0}, {"dns_queries", 0}, {"dns_pending", 0},
	} {
		t.add(r.name, r.n)
	}
	return t
}

// showMem shows what pgfence allocates: the sessions' buffers and the
// Go heap (PgBouncer: its slab caches). Values over 2^31-1 are clamped to
// fit PgBouncer's int4 columns.
func (s *Server) showMem() *adminTable {
	t := newTable("siiii", "name", "size", "used", "free", "memtotal")
	clamp := func(n uint64) int { return int(min(n, math.MaxInt32)) }
	n := len(s.sessionsOf(""))
	size := 4 * s.cfg.BufferSize
	t.add("session_buffers", size, n, 0, clamp(uint64(size)*uint64(n)))
	samples := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}, {Name: "/memory/classes/heap/free:bytes"},
		{Name: "/memory/classes/heap/unused:bytes"}, {Name: "/memory/classes/total:bytes"}}
	metrics.Read(samples)
	val := func(i int) uint64 {
		if samples[i].Value.Kind() == metrics.KindUint64 {
			return samples[i].Value.Uint64()
		}
		return 0
	}
	t.add("go_heap", 1, clamp(val(0)), clamp(val(1)+val(2)), clamp(val(3)))
	return t
}

func (s *Server) showState() *adminTable {
	t := newTable("ss", "key", "value")
	p := &s.ops.ctl
	p.mu.Lock()
	all := p.all
	p.mu.Unlock()
	yn := map[bool]string{true: "yes", false: "no"}
	t.add("active", yn[!all])
	t.add("paused", yn[all])
	t.add("suspended", "no")
	return t
}

// showStats is SHOW STATS (totals and averages), SHOW STATS_TOTALS and
// SHOW STATS_AVERAGES.
func (s *Server) showStats(totals, avgs bool) *adminTable {
	names := []string{"server_assignment_count", "xact_count", "query_count", "received", "sent", "xact_time",
		"query_time", "wait_time", "client_parse_count", "server_parse_count", "bind_count"}
	var cols []string
	switch {
	case totals && avgs:
		for _, n := range names {
			cols = append(cols, "total_"+n)
		}
		cols[3], cols[4] = "total_received", "total_sent"
		for _, n := range names {
			cols = append(cols, "avg_"+n)
		}
		cols[14], cols[15] = "avg_recv", "avg_sent"
	case totals:
		cols = slices.Clone(names)
		cols[3], cols[4] = "bytes_received", "bytes_sent"
	default:
		cols = slices.Clone(names)
		cols[3], cols[4] = "bytes_received", "bytes_sent"
		cols[8], cols[9], cols[10] = "avg_client_parse_count", "avg_server_parse_count", "avg_bind_count"
	}
	t := newTable("s"+strings.Repeat("N", len(cols)), append([]string{"database"}, cols...)...)
	cur, old, secs := s.statsSnapshot()
	for _, db := range sortedDBs(cur) {
		row := []any{db}
		if totals {
			row = append(row, statValues(cur[db])...)
		}
		if avgs {
			row = append(row, statValues(averages(cur[db], old[db], secs))...)
		}
		t.add(row...)
	}
	return t
}

// statValues are a totals row's numbers in PgBouncer's order (no
// prepared-statement tracking: its three counts are 0).
func statValues(t dbTotals) []any {
	return []any{t.assignments, t.xacts, t.queries, t.recv, t.sent, t.xactUs, t.queryUs, t.waitUs, int64(0), int64(0), int64(0)}
}

// showTotals is SHOW TOTALS: SHOW STATS summed over databases, one value
// per row.
func (s *Server) showTotals() *adminTable {
	cur, old, secs := s.statsSnapshot()
	var c, o dbTotals
	for db, t := range cur {
		c.add(t)
		o.add(old[db])
	}
	a := averages(c, o, secs)
	t := newTable("sN", "name", "value")
	names := []string{"server_assignment_count", "xact_count", "query_count", "client_bytes", "server_bytes",
		"xact_time", "query_time", "wait_time", "ps_client_parse_count", "ps_server_parse_count", "ps_bind_count"}
	for i, v := range statValues(c) {
		t.add("total_"+names[i], v)
	}
	for i, v := range statValues(a) {
		t.add("avg_"+names[i], v)
	}
	return t
}

// configRow is a SHOW CONFIG line of the proxy's own.
type configRow struct {
	key, value, def string
	changeable      bool
}

// showConfig is SHOW CONFIG: PgBouncer's four columns (its exporter
// refuses a fifth), and with sources (SHOW CONFIG_SOURCES) pgfence's
// fifth, where each value came from.
func (s *Server) showConfig(sources bool) *adminTable {
	t := newTable("ssss", "key", "value", "default", "changeable")
	if sources {
		t = newTable("sssss", "key", "value", "default", "changeable", "source")
	}
	row := func(vals ...any) {
		if !sources {
			vals = vals[:4]
		}
		t.add(vals...)
	}
	l := s.live()
	c := s.cfg
	var reps []string
	for _, r := range l.replicas {
		reps = append(reps, redactDSN(r))
	}
	s.ops.hookMu.Lock()
	replicasReload := s.ops.replicaReload != nil
	s.ops.hookMu.Unlock()
	count := func(m map[string]string) string { return fmt.Sprintf("%d users", len(m)) }
	rows := []configRow{
		{"primary", redactDSN(c.Primary), "", false},
		{"replicas", strings.Join(reps, ", "), "", replicasReload},
		{"read_replicas", strconv.FormatBool(!c.NoReplicaReads), "true", false},
		{"replica_poll", c.ReplicaPoll.String(), DefaultReplicaPoll.String(), false},
		{"replica_max_lag", c.ReplicaMaxLag.String(), DefaultReplicaMaxLag.String(), false},
		{"auth", string(l.auth), string(AuthTrust), true},
		{"auth_file", count(l.users), "", true},
		{"upstream_passwords", count(l.upstreamPasswords), "", true},
		{"admin_users", strings.Join(l.admins, ","), "", true},
		{"stats_users", strings.Join(l.stats, ","), "", true},
		{"console_auth_file", count(l.consoleUsers), "", true},
		{"max_clients", strconv.Itoa(l.maxClients), strconv.Itoa(DefaultMaxClients), true},
		{"max_startup_clients", strconv.Itoa(c.MaxStartupClients), strconv.Itoa(DefaultMaxStartupClients), false},
		{"max_console_clients", strconv.Itoa(l.maxConsoleClients), strconv.Itoa(DefaultMaxConsoleClients), true},
		{"tls", strconv.FormatBool(l.tls != nil), "false", true},
		{"max_message_size", strconv.Itoa(c.MaxMessageSize), strconv.Itoa(DefaultMaxMessageSize), false},
		{"shutdown_timeout", c.ShutdownTimeout.String(), DefaultShutdownTimeout.String(), false},
		{"startup_timeout", c.StartupTimeout.String(), DefaultStartupTimeout.String(), false},
		{"client_memory", strconv.Itoa(c.ClientMemory), "memory_budget / 2", false},
		{"message_timeout", c.MessageTimeout.String(), DefaultMessageTimeout.String(), false},
		{"connect_timeout", c.ConnectTimeout.String(), DefaultConnectTimeout.String(), false},
		{"buffer_size", strconv.Itoa(c.BufferSize), strconv.Itoa(DefaultBufferSize), false},
		{"health_interval", c.HealthInterval.String(), DefaultHealthInterval.String(), false},
		{"gate", strconv.FormatBool(s.gateStats() != nil), "true", false},
		{"default_pool_size", strconv.Itoa(l.poolLimits.PoolSize), "0", true},
		{"reserve_pool_size", strconv.Itoa(l.poolLimits.ReserveSize), "0", true},
		{"reserve_pool_timeout", l.poolLimits.ReserveTimeout.String(), DefaultReservePoolTimeout.String(), true},
		{"max_db_connections", strconv.Itoa(l.poolLimits.MaxDB), "0", true},
		{"max_user_connections", strconv.Itoa(l.poolLimits.MaxUser), "0", true},
		{"query_wait_timeout", l.poolLimits.WaitTimeout.String(), DefaultQueryWaitTimeout.String(), true},
		{"server_reuse", strconv.FormatBool(l.serverReuse), "false", true},
		{"server_idle_timeout", l.poolLimits.IdleTimeout.String(), DefaultServerIdleTimeout.String(), true},
		{"server_lifetime", l.poolLimits.Lifetime.String(), DefaultServerLifetime.String(), true},
	}
	yn := map[bool]string{true: "yes", false: "no"}
	for _, r := range rows {
		row(r.key, r.value, r.def, yn[r.changeable], l.sources[r.key])
	}
	for _, e := range l.extra {
		row(e.Key, e.Value, e.Default, yn[e.Reloadable], sourceOf(e, l.sources))
	}
	// PgBouncer's name of max_clients, which its exporter reads.
	row("max_client_conn", strconv.Itoa(l.maxClients), strconv.Itoa(DefaultMaxClients), "yes", l.sources["max_clients"])
	return t
}

func sourceOf(e Setting, sources map[string]string) string {
	if e.Source != "" {
		return e.Source
	}
	return sources[e.Key]
}

// adminSet is SET key = value, for the settings that can change without a
// restart. It lasts until the next RELOAD, which takes the file's value.
func (s *Server) adminSet(con *console, st adminStmt) (*adminTable, *pgproto3.ErrorResponse) {
	s.ops.reloadMu.Lock()
	defer s.ops.reloadMu.Unlock()
	old := s.live()
	nl := *old
	switch st.key {
	case "max_clients", "max_client_conn":
		n, err := strconv.Atoi(st.value)
		if err != nil {
			return nil, adminError("22023", fmt.Sprintf("invalid value for parameter %q: %q", st.key, st.value), "an integer: 0 for the default, negative for no limit")
		}
		if n == 0 {
			n = DefaultMaxClients
		}
		nl.maxClients = n
	case "max_console_clients":
		n, err := strconv.Atoi(st.value)
		if err != nil {
			return nil, adminError("22023", fmt.Sprintf("invalid value for parameter %q: %q", st.key, st.value), "an integer: 0 for the default, negative for no limit")
		}
		if n == 0 {
			n = DefaultMaxConsoleClients
		}
		nl.maxConsoleClients = n
	case "default_pool_size", "reserve_pool_size", "max_db_connections", "max_user_connections":
		n, err := strconv.Atoi(st.value)
		if err != nil || n < 0 {
			return nil, adminError("22023", fmt.Sprintf("invalid value for parameter %q: %q", st.key, st.value), "an integer: 0 for no limit")
		}
		l := &nl.poolLimits
		*map[string]*int{"default_pool_size": &l.PoolSize, "reserve_pool_size": &l.ReserveSize,
			"max_db_connections": &l.MaxDB, "max_user_connections": &l.MaxUser}[st.key] = n
	case "reserve_pool_timeout", "query_wait_timeout", "server_idle_timeout", "server_lifetime":
		d, err := time.ParseDuration(st.value)
		if err != nil || d < 0 {
			return nil, adminError("22023", fmt.Sprintf("invalid value for parameter %q: %q", st.key, st.value), "a duration such as 30s")
		}
		l := &nl.poolLimits
		*map[string]*time.Duration{"reserve_pool_timeout": &l.ReserveTimeout, "query_wait_timeout": &l.WaitTimeout,
			"server_idle_timeout": &l.IdleTimeout, "server_lifetime": &l.Lifetime}[st.key] = d
	case "server_reuse":
		b, err := strconv.ParseBool(st.value)
		if err != nil {
			return nil, adminError("22023", fmt.Sprintf("invalid value for parameter %q: %q", st.key, st.value), "true or false")
		}
		nl.serverReuse = b
	case "admin_users", "stats_users":
		var list []string
		for _, u := range strings.Split(st.value, ",") {
			if u = strings.TrimSpace(u); u != "" {
				list = append(list, u)
			}
		}
		if st.key == "admin_users" {
			nl.admins = sortedList(list)
		} else {
			nl.stats = sortedList(list)
		}
	default:
		i := slices.IndexFunc(old.extra, func(e Setting) bool { return e.Key == st.key })
		switch {
		case i >= 0 && old.extra[i].Set != nil:
			if err := old.extra[i].Set(st.value); err != nil {
				return nil, adminError("22023", fmt.Sprintf("invalid value for parameter %q: %v", st.key, err), "")
			}
			nl.extra = slices.Clone(old.extra)
			nl.extra[i].Value = st.value
		case i >= 0 || slices.Contains(configKeys, st.key):
			return nil, adminError("55P02", fmt.Sprintf("parameter %q cannot be changed with SET", st.key),
				"change it in the configuration file: RELOAD applies the reloadable ones (SHOW CONFIG, changeable), the others need a restart")
		default:
			return nil, adminError("42704", fmt.Sprintf("unrecognized configuration parameter %q", st.key), "SHOW CONFIG lists the settings")
		}
	}
	s.ops.live.Store(&nl)
	s.pools.Regrant()
	con.log.Info("SET command issued", zap.String("key", st.key), zap.String("value", st.value))
	return done("SET " + st.key + "=" + st.value), nil
}

// configKeys are the proxy's own SHOW CONFIG keys.
var configKeys = []string{"primary", "replicas", "read_replicas", "replica_poll", "replica_max_lag", "auth", "auth_file",
	"upstream_passwords", "admin_users", "stats_users", "console_auth_file", "max_clients", "max_startup_clients", "max_console_clients", "tls", "max_message_size",
	"shutdown_timeout", "startup_timeout", "client_memory", "message_timeout", "connect_timeout", "buffer_size", "health_interval", "gate",
	"default_pool_size", "reserve_pool_size", "reserve_pool_timeout", "max_db_connections", "max_user_connections", "query_wait_timeout",
	"server_reuse", "server_idle_timeout", "server_lifetime"}

// printableName is a client's application_name as PostgreSQL shows it
// (pg_stat_activity): each character outside printable ASCII as '?', so
// that a client cannot forge the console's rows or drive the terminal of
// whoever reads them (round 25, BC-L4).
func printableName(s string) string {
	for i := 0; i < len(s); i++ {
		if s[i] < 32 || s[i] > 126 {
			b := []byte(s)
			for j := i; j < len(b); j++ {
				if b[j] < 32 || b[j] > 126 {
					b[j] = '?'
				}
			}
			return string(b)
		}
	}
	return s
}
