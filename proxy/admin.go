package proxy

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/pool"
)

// AdminDatabase is the virtual database of the admin console: a client
// that connects to it (`psql -U admin pgfence`) talks to the proxy itself,
// as PgBouncer's console, and gets no upstream connection. A real database
// of that name cannot be reached through pgfence.
const AdminDatabase = "pgfence"

// ops is the server's operations state: the settings a reload may change,
// counters, health, and the hooks other parts of the proxy install.
type ops struct {
	live   atomic.Pointer[liveConfig]
	stats  ServerStats
	health health

	reloadMu sync.Mutex // one reload (or console SET) at a time

	started time.Time
	nextID  atomic.Uint64 // SHOW CLIENTS/SERVERS id of sessions and waiting clients
	ctl     dbControl     // PAUSE, DISABLE, RECONNECT (admin_pause.go)
	dbStats dbStats       // SHOW STATS (admin_stats.go)
	// consoles are the open console sessions, by their cancel key;
	// consolesOf counts them by user (max_console_clients).
	consolesMu sync.Mutex
	consoles   map[uint32]*console
	consolesOf map[string]int
	// shutdownDone is closed when a shutdown the console started ends.
	shutdownMu   sync.Mutex
	shutdownDone chan struct{}

	hookMu        sync.Mutex
	replicaStatus func(context.Context) []UpstreamStatus
	replicaReload func(replicas []string) error
}

// liveConfig is the part of Config a reload may replace. It is swapped
// whole; readers load it once per use.
type liveConfig struct {
	sources           map[string]string
	auth              AuthMethod
	users             map[string]string
	upstreamPasswords map[string]string
	admins            []string // sorted
	stats             []string // sorted
	consoleUsers      map[string]string
	maxClients        int
	maxConsoleClients int
	poolLimits        pool.Limits // the same for every pool
	serverReuse       bool        // pools.go
	tls               *tls.Config
	replicas          []string
	extra             []Setting
}

func newLive(c Config) *liveConfig {
	return &liveConfig{
		sources:           c.Sources,
		auth:              c.Auth,
		users:             c.Users,
		upstreamPasswords: c.UpstreamPasswords,
		admins:            sortedList(c.AdminUsers),
		stats:             sortedList(c.StatsUsers),
		consoleUsers:      c.ConsoleUsers,
		maxClients:        c.MaxClients,
		maxConsoleClients: c.MaxConsoleClients,
		poolLimits: pool.Limits{PoolSize: c.PoolSize, ReserveSize: c.ReservePoolSize, ReserveTimeout: c.ReservePoolTimeout,
			MaxDB: c.MaxDBConnections, MaxUser: c.MaxUserConnections, WaitTimeout: max(c.QueryWaitTimeout, 0),
			IdleTimeout: max(c.ServerIdleTimeout, 0), Lifetime: max(c.ServerLifetime, 0)},
		serverReuse: c.ServerReuse,
		tls:         c.TLS,
		replicas:    c.Replicas,
		extra:       c.ExtraSettings,
	}
}

// sortedList returns l sorted, without duplicates.
func sortedList(l []string) []string {
	l = slices.Clone(l)
	sort.Strings(l)
	return slices.Compact(l)
}

// initOps prepares the operations state from the validated config.
func (s *Server) initOps() {
	s.ops.live.Store(newLive(s.cfg))
	s.ops.started = time.Now()
	if len(s.cfg.ConsoleUsers) == 0 && len(s.cfg.AdminUsers)+len(s.cfg.StatsUsers) > 0 {
		s.log.Warn("admin_users/stats_users are set but the console has no users file: every console connection is refused (set console_auth_file, see docs/console.md)")
	}
}

// live returns the current reloadable settings.
func (s *Server) live() *liveConfig { return s.ops.live.Load() }

// Stats returns the server's counters.
func (s *Server) Stats() *ServerStats { return &s.ops.stats }

// SetReplicaStatus installs the function SHOW UPSTREAMS and the metrics
// call for the replicas' health and replay lag (read routing provides
// it). Without one, SHOW UPSTREAMS pings each configured replica.
func (s *Server) SetReplicaStatus(f func(context.Context) []UpstreamStatus) {
	s.ops.hookMu.Lock()
	s.ops.replicaStatus = f
	s.ops.hookMu.Unlock()
}

// SetReplicaReloader installs the function a reload calls with a changed
// replica list (read routing provides it). Without one, a changed replica
// list needs a restart.
func (s *Server) SetReplicaReloader(f func(replicas []string) error) {
	s.ops.hookMu.Lock()
	s.ops.replicaReload = f
	s.ops.hookMu.Unlock()
}

func (s *Server) replicaStatusFunc() func(context.Context) []UpstreamStatus {
	s.ops.hookMu.Lock()
	defer s.ops.hookMu.Unlock()
	return s.ops.replicaStatus
}

// sessionInfo is what the admin console keeps about a session.
type sessionInfo struct {
	connectedAt time.Time
	upstream    atomic.Pointer[string]

	id uint64 // SHOW CLIENTS/SERVERS id
	// The four ends of the session's two connections, and their TLS.
	clientLocal, serverAddr, serverLocal net.Addr
	clientTLS, serverTLS                 string

	stats       sessionStats                  // SHOW STATS (admin_stats.go)
	holdSince   atomic.Int64                  // monoNow when PAUSE began to hold its message, 0: not held
	killed      atomic.Pointer[ProtocolError] // why the console ended it (KILL, SHUTDOWN)
	closeNeeded atomic.Bool                   // RECONNECT: close when released
	ended       atomic.Bool                   // its relay has ended
}

// initSessionInfo fills in what the console shows of a session just
// opened on client and server (the upstream connection), and makes its
// framers count the bytes they pass.
func (s *Server) initSessionInfo(sess *Session, client, server net.Conn) {
	in := &sess.info
	in.connectedAt = time.Now()
	in.id = s.ops.nextID.Add(1)
	in.clientLocal, in.serverAddr, in.serverLocal = client.LocalAddr(), server.RemoteAddr(), server.LocalAddr()
	in.clientTLS, in.serverTLS = tlsInfo(client), tlsInfo(server)
	sess.cf.Count, sess.sf.Count = &in.stats.recv, &in.stats.sent
	s.ops.dbStats.assigned(sess.Database)
}

// tlsInfo describes c's TLS as PgBouncer's SHOW CLIENTS does
// ("TLSv1.3/TLS_AES_256_GCM_SHA384"), "" without TLS.
func tlsInfo(c net.Conn) string {
	tc, ok := c.(*tls.Conn)
	if !ok {
		return ""
	}
	cs := tc.ConnectionState()
	return tls.VersionName(cs.Version) + "/" + tls.CipherSuiteName(cs.CipherSuite)
}

// SetUpstream records what serves the session now, shown by SHOW
// SESSIONS ("primary" when never set), e.g. "replica 10.0.0.2:5432".
// Any goroutine.
func (s *Session) SetUpstream(label string) { s.info.upstream.Store(&label) }

// Upstream returns what SetUpstream recorded, or "primary".
func (s *Session) Upstream() string {
	if p := s.info.upstream.Load(); p != nil {
		return *p
	}
	return "primary"
}

// sessions returns the open proxied sessions.
func (s *Server) sessions() []*Session {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*Session, 0, len(s.conns))
	for _, sess := range s.conns {
		if sess != nil {
			out = append(out, sess)
		}
	}
	return out
}

// countRefusal counts a client refused before its session started.
func (s *Server) countRefusal(err error) {
	var pe *ProtocolError
	var pg *pgconn.PgError
	switch {
	case errors.As(err, &pe):
		s.ops.stats.refusedClient(pe.Code)
	case errors.As(err, &pg):
		s.ops.stats.refusedClient(pg.Code)
	case errors.Is(err, errUpstream):
		s.ops.stats.UpstreamErrors.Add(1)
		s.ops.stats.refusedClient("08006")
	}
}

// gateInfo is a session's fence state (GateState) as the console reads it.
type gateInfo struct {
	gen           fence.Generation
	hasGen        bool
	gated, replay bool
}

// GateState implements GateReporter.
func (h *fenceSession) GateState() GateState {
	h.mu.Lock()
	defer h.mu.Unlock()
	var gs GateState
	gs.Gen, gs.HasGen = h.st.Generation()
	g := h.st.Gate()
	gs.Gated, gs.Replay = g.Gated, g.Replay
	if g.Gated && !gs.HasGen {
		gs.Gen, gs.HasGen = g.Gen, true
	}
	return gs
}

// ---------------------------------------------------------------------------
// Reload

// ReloadReport says what a reload did.
type ReloadReport struct {
	// Applied lists the settings that changed and now apply (to new
	// sessions; open sessions keep what they negotiated).
	Applied []string
	// Restart lists the settings that changed but need a restart; the
	// running value stays.
	Restart []string
}

func (r *ReloadReport) merge(o *ReloadReport) {
	if o == nil {
		return
	}
	r.Applied = append(r.Applied, o.Applied...)
	r.Restart = append(r.Restart, o.Restart...)
}

// ErrNoReloadSource is returned by ReloadFromSource when Config.Reload is
// nil.
var ErrNoReloadSource = errors.New("no configuration source to reload (started without Config.Reload)")

// ReloadFromSource re-reads the configuration through Config.Reload and
// applies it with Reload. The admin console's RELOAD and SIGHUP in `pgfence
// serve` call it.
func (s *Server) ReloadFromSource() (*ReloadReport, error) {
	if s.cfg.Reload == nil {
		return nil, ErrNoReloadSource
	}
	s.ops.reloadMu.Lock()
	defer s.ops.reloadMu.Unlock()
	next, extra, err := s.cfg.Reload()
	if err != nil {
		return nil, fmt.Errorf("reload: %w", err)
	}
	rep, err := s.reload(next)
	if err != nil {
		return nil, err
	}
	rep.merge(extra)
	s.log.Info("configuration reloaded", zap.Strings("applied", rep.Applied), zap.Strings("need_restart", rep.Restart))
	return rep, nil
}

// Reload applies next's reloadable settings (auth, users, upstream
// passwords, the console's admin and stats users and users file, max
// clients, TLS certificate, setting sources; replicas when read routing
// supports it) and reports the others that differ from the running
// configuration: they need a restart. Nothing is applied when next is
// invalid.
func (s *Server) Reload(next Config) (*ReloadReport, error) {
	s.ops.reloadMu.Lock()
	defer s.ops.reloadMu.Unlock()
	return s.reload(next)
}

func (s *Server) reload(next Config) (*ReloadReport, error) {
	next, err := next.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("reload: %w", err)
	}
	old := s.live()
	nl := newLive(next)
	rep := &ReloadReport{}
	applied := func(name string, changed bool) {
		if changed {
			rep.Applied = append(rep.Applied, name)
		}
	}
	restart := func(name string, changed bool) {
		if changed {
			rep.Restart = append(rep.Restart, name)
		}
	}
	applied("auth", old.auth != nl.auth)
	applied("auth_file", !maps.Equal(old.users, nl.users))
	applied("upstream_passwords", !maps.Equal(old.upstreamPasswords, nl.upstreamPasswords))
	applied("admin_users", !slices.Equal(old.admins, nl.admins))
	applied("stats_users", !slices.Equal(old.stats, nl.stats))
	applied("console_auth_file", !maps.Equal(old.consoleUsers, nl.consoleUsers))
	applied("max_clients", old.maxClients != nl.maxClients)
	applied("max_console_clients", old.maxConsoleClients != nl.maxConsoleClients)
	ol, nw := old.poolLimits, nl.poolLimits
	applied("default_pool_size", ol.PoolSize != nw.PoolSize)
	applied("reserve_pool_size", ol.ReserveSize != nw.ReserveSize)
	applied("reserve_pool_timeout", ol.ReserveTimeout != nw.ReserveTimeout)
	applied("max_db_connections", ol.MaxDB != nw.MaxDB)
	applied("max_user_connections", ol.MaxUser != nw.MaxUser)
	applied("query_wait_timeout", ol.WaitTimeout != nw.WaitTimeout)
	applied("server_idle_timeout", ol.IdleTimeout != nw.IdleTimeout)
	applied("server_lifetime", ol.Lifetime != nw.Lifetime)
	applied("server_reuse", old.serverReuse != nl.serverReuse)
	applied("tls", old.tls != nil || nl.tls != nil)
	if !slices.Equal(old.replicas, nl.replicas) {
		s.ops.hookMu.Lock()
		rr := s.ops.replicaReload
		s.ops.hookMu.Unlock()
		if rr != nil {
			if err := rr(nl.replicas); err != nil {
				return nil, fmt.Errorf("reload: replicas: %w", err)
			}
			rep.Applied = append(rep.Applied, "replicas")
		} else {
			nl.replicas = old.replicas
			rep.Restart = append(rep.Restart, "replicas")
		}
	}
	cur := s.cfg
	restart("primary", cur.Primary != next.Primary)
	restart("max_message_size", cur.MaxMessageSize != next.MaxMessageSize)
	restart("shutdown_timeout", cur.ShutdownTimeout != next.ShutdownTimeout)
	restart("startup_timeout", cur.StartupTimeout != next.StartupTimeout)
	restart("max_startup_clients", cur.MaxStartupClients != next.MaxStartupClients)
	restart("client_memory", cur.ClientMemory != next.ClientMemory)
	restart("message_timeout", cur.MessageTimeout != next.MessageTimeout)
	restart("connect_timeout", cur.ConnectTimeout != next.ConnectTimeout)
	restart("buffer_size", cur.BufferSize != next.BufferSize)
	restart("health_interval", cur.HealthInterval != next.HealthInterval)
	s.ops.live.Store(nl)
	s.pools.Regrant() // clients waiting are judged by the new limits (round 25, BC-L1)
	return rep, nil
}

// ---------------------------------------------------------------------------
// The console

// console is one admin console session.
type console struct {
	user string
	role consoleRole
	log  *zap.Logger
	// As SHOW CLIENTS shows it.
	id         uint64
	addr, self net.Addr
	since      time.Time
	app, tls   string
	// cancel receives the session's cancel requests (psql's ^C): they
	// end a waiting PAUSE or WAIT_CLOSE.
	cancel      chan struct{}
	pid, secret uint32
	// conn and busy let Shutdown close an idle console at once but let
	// a console answering a command (a PAUSE that the shutdown ends with
	// 57P01) send its answer first.
	conn net.Conn
	busy atomic.Bool
}

// serveAdmin runs an admin console session: its own authentication
// (consoleLogin), then commands until the client leaves.
func (s *Server) serveAdmin(c net.Conn, st *startup, log *zap.Logger, slot *startupSlot) {
	user := st.params["user"]
	role, err := s.consoleLogin(c, user)
	if err != nil {
		s.refuse(c, s.startupError(slot, err), log, "admin console refused")
		return
	}
	s.startupEnd(slot)
	con := &console{user: user, role: role, log: log.Named("admin").With(zap.Stringer("role", role)), cancel: make(chan struct{}, 1),
		id: s.ops.nextID.Add(1), addr: c.RemoteAddr(), self: c.LocalAddr(), since: time.Now(), app: st.params["application_name"], tls: tlsInfo(c), conn: c}
	if err := s.addConsole(con); err != nil {
		s.ops.stats.ConsoleRefusals.Add(1)
		s.refuse(c, err, log, "admin console refused")
		return
	}
	defer s.dropConsole(con)
	s.ops.stats.AdminSessions.Add(1)
	con.log.Info("admin session open")
	var out []byte
	for _, p := range [][2]string{
		{"server_version", "16.0 (pgfence)"}, {"server_encoding", "UTF8"}, {"client_encoding", "UTF8"},
		{"DateStyle", "ISO, MDY"}, {"integer_datetimes", "on"}, {"standard_conforming_strings", "on"},
		{"TimeZone", "UTC"}, {"application_name", "pgfence"},
	} {
		out = encode(out, &pgproto3.ParameterStatus{Name: p[0], Value: p[1]})
	}
	var key [4]byte
	binary.BigEndian.PutUint32(key[:], con.secret)
	out = encode(out, &pgproto3.BackendKeyData{ProcessID: con.pid, SecretKey: key[:]})
	out = encode(out, &pgproto3.ReadyForQuery{TxStatus: 'I'})
	if _, err := c.Write(out); err != nil {
		c.Close()
		return
	}
	c.SetDeadline(time.Time{})
	err = s.adminLoop(c, con)
	c.Close()
	if err != nil {
		con.log.Debug("admin session closed", zap.Error(err))
	} else {
		con.log.Info("admin session closed")
	}
}

// addConsole counts con among its user's console sessions and gives it a
// cancel key of its own, or refuses it when its user already has
// max_console_clients sessions (issue 30, F-M1). The bound is each
// user's, so a user's own sessions, idle or busy, can keep out only that
// user: not another admin, and not a client (max_clients does not count
// consoles). With it the console's descriptors are at most
// max_console_clients times the console users, whatever one of them does.
func (s *Server) addConsole(con *console) error {
	limit := s.live().maxConsoleClients
	var b [8]byte
	s.ops.consolesMu.Lock()
	defer s.ops.consolesMu.Unlock()
	if s.ops.consoles == nil {
		s.ops.consoles, s.ops.consolesOf = map[uint32]*console{}, map[string]int{}
	}
	if limit > 0 && s.ops.consolesOf[con.user] >= limit {
		return &ProtocolError{Code: "53300",
			Msg:  fmt.Sprintf("pgfence: too many admin console sessions for user %q (max_console_clients is %d)", con.user, limit),
			Hint: "Close this user's idle console sessions (SHOW CLIENTS lists them, database pgfence); an admin can raise max_console_clients (SET max_console_clients, or the configuration file and RELOAD)."}
	}
	s.ops.consolesOf[con.user]++
	for {
		rand.Read(b[:])
		con.pid, con.secret = binary.BigEndian.Uint32(b[:4])&0x7fffffff, binary.BigEndian.Uint32(b[4:])
		if _, dup := s.ops.consoles[con.pid]; !dup && con.pid != 0 {
			break
		}
	}
	s.ops.consoles[con.pid] = con
	return nil
}

// dropConsole ends what addConsole counted.
func (s *Server) dropConsole(con *console) {
	s.ops.consolesMu.Lock()
	delete(s.ops.consoles, con.pid)
	if s.ops.consolesOf[con.user]--; s.ops.consolesOf[con.user] <= 0 {
		delete(s.ops.consolesOf, con.user)
	}
	s.ops.consolesMu.Unlock()
}

// cancelConsole delivers a cancel request meant for a console session;
// it reports false when the key is not a console's.
func (s *Server) cancelConsole(st *startup) bool {
	s.ops.consolesMu.Lock()
	con := s.ops.consoles[st.cancelPID]
	s.ops.consolesMu.Unlock()
	if con == nil {
		return false
	}
	var want [4]byte
	binary.BigEndian.PutUint32(want[:], con.secret)
	if subtle.ConstantTimeCompare(want[:], st.cancelSecret) != 1 {
		return false
	}
	select {
	case con.cancel <- struct{}{}:
	default:
	}
	return true
}

// consoleCount returns the number of open console sessions.
func (s *Server) consoleCount() int {
	s.ops.consolesMu.Lock()
	defer s.ops.consolesMu.Unlock()
	return len(s.ops.consoles)
}

func (s *Server) adminLoop(c net.Conn, con *console) error {
	be := pgproto3.NewBackend(c, c)
	be.SetMaxBodyLen(1 << 20)
	skipping := false // extended protocol: error sent, waiting for Sync
	for {
		msg, err := be.Receive()
		if err != nil {
			return err
		}
		var out []byte
		var after func()
		switch m := msg.(type) {
		case *pgproto3.Terminate:
			return nil
		case *pgproto3.Query:
			select {
			case <-con.cancel: // a cancel that came between commands
			default:
			}
			con.busy.Store(true)
			out, after = s.adminQuery(out, m.String, con)
			out = encode(out, &pgproto3.ReadyForQuery{TxStatus: 'I'})
		case *pgproto3.Sync:
			skipping = false
			out = encode(out, &pgproto3.ReadyForQuery{TxStatus: 'I'})
		case *pgproto3.Flush:
		case *pgproto3.Parse, *pgproto3.Bind, *pgproto3.Describe, *pgproto3.Execute, *pgproto3.Close:
			if !skipping {
				skipping = true
				out = encode(out, adminError("0A000", "the pgfence admin console speaks only the simple query protocol",
					"use psql, or a driver in simple-protocol mode (pgx: QueryExecModeSimpleProtocol)"))
			}
		case *pgproto3.FunctionCall:
			out = encode(out, adminError("0A000", "the pgfence admin console does not support function calls", ""))
			out = encode(out, &pgproto3.ReadyForQuery{TxStatus: 'I'})
		default:
			// CopyData and the like: nothing to answer.
		}
		if len(out) > 0 {
			_, err := c.Write(out)
			con.busy.Store(false)
			if err != nil {
				return err
			}
		}
		con.busy.Store(false)
		if after != nil {
			after()
		}
	}
}

// consoleBusy reports whether c is an admin console in the middle of a
// command.
func (s *Server) consoleBusy(c net.Conn) bool {
	s.ops.consolesMu.Lock()
	defer s.ops.consolesMu.Unlock()
	for _, con := range s.ops.consoles {
		if con.conn == c {
			return con.busy.Load()
		}
	}
	return false
}

func adminError(code, msg, hint string) *pgproto3.ErrorResponse {
	return &pgproto3.ErrorResponse{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: code, Message: msg, Hint: hint}
}

// adminTable is a command's answer: a result set typed as PgBouncer
// types its columns, or (cols nil) a command tag alone.
type adminTable struct {
	// types has a letter per column, as PgBouncer's tupdesc: s text, i
	// int4, q int8, N numeric, T a timestamp sent as text.
	types   string
	cols    []string
	rows    [][]any // per value: nil (NULL), string, int, int64, uint64 or time.Time (T)
	tag     string  // command tag; "SHOW" when empty
	notices []*pgproto3.NoticeResponse
}

// newTable starts a result set with PgBouncer's column types and names.
func newTable(types string, cols ...string) *adminTable {
	if len(types) != len(cols) {
		panic("admin table: " + types + " does not describe " + strings.Join(cols, ","))
	}
	return &adminTable{types: types, cols: cols}
}

// done is the answer of a command without rows.
func done(tag string) *adminTable { return &adminTable{tag: tag} }

func (t *adminTable) add(vals ...any) {
	if len(vals) != len(t.cols) {
		panic(fmt.Sprintf("admin table: %d values for %d columns", len(vals), len(t.cols)))
	}
	t.rows = append(t.rows, vals)
}

func (t *adminTable) notice(msg, detail string) {
	t.notices = append(t.notices, &pgproto3.NoticeResponse{Severity: "NOTICE", SeverityUnlocalized: "NOTICE", Code: "00000", Message: msg, Detail: detail})
}

// The OIDs and sizes of the column types.
var adminTypes = map[byte]struct {
	oid  uint32
	size int16
}{'s': {25, -1}, 'T': {25, -1}, 'i': {23, 4}, 'q': {20, 8}, 'N': {1700, -1}}

// pgTime formats a timestamp as PgBouncer's 'T' columns do.
func pgTime(t time.Time) string { return t.Local().Format("2006-01-02 15:04:05 MST") }

func adminValue(v any) []byte {
	switch v := v.(type) {
	case nil:
		return nil
	case string:
		return []byte(v)
	case int:
		return strconv.AppendInt(nil, int64(v), 10)
	case int64:
		return strconv.AppendInt(nil, v, 10)
	case uint64:
		return strconv.AppendUint(nil, v, 10)
	case time.Time:
		return []byte(pgTime(v))
	}
	panic(fmt.Sprintf("admin table: value of type %T", v))
}

func (t *adminTable) encode(out []byte) []byte {
	for _, n := range t.notices {
		out = encode(out, n)
	}
	if t.cols != nil {
		fields := make([]pgproto3.FieldDescription, len(t.cols))
		for i, c := range t.cols {
			ty := adminTypes[t.types[i]]
			fields[i] = pgproto3.FieldDescription{Name: []byte(c), DataTypeOID: ty.oid, DataTypeSize: ty.size, TypeModifier: -1}
		}
		out = encode(out, &pgproto3.RowDescription{Fields: fields})
		for _, r := range t.rows {
			vals := make([][]byte, len(r))
			for i, v := range r {
				vals[i] = adminValue(v)
			}
			out = encode(out, &pgproto3.DataRow{Values: vals})
		}
	}
	tag := t.tag
	if tag == "" {
		tag = "SHOW"
	}
	return encode(out, &pgproto3.CommandComplete{CommandTag: []byte(tag)})
}

// adminCommands are SHOW HELP's answer.
var adminCommands = [][2]string{
	{"SHOW HELP", "this list"},
	{"SHOW CLIENTS", "client connections, PgBouncer's columns, then job_key, epoch, token (admins only), step, tx_state, gated, replay, upstream"},
	{"SHOW SERVERS", "upstream connections, PgBouncer's columns, then upstream and tx_state"},
	{"SHOW POOLS", "per database and user: clients active and waiting (held by PAUSE), servers"},
	{"SHOW DATABASES", "databases in use, paused, disabled"},
	{"SHOW USERS", "users known and their connections"},
	{"SHOW STATS", "per database: totals and averages of transactions, queries, bytes, times (also STATS_TOTALS, STATS_AVERAGES, TOTALS)"},
	{"SHOW LISTS", "counts of databases, users, pools, clients, servers"},
	{"SHOW MEM", "buffers and Go heap"},
	{"SHOW VERSION", "pgfence's version"},
	{"SHOW STATE", "active, paused"},
	{"SHOW CONFIG", "every setting: value, default, changeable"},
	{"SHOW CONFIG_SOURCES", "SHOW CONFIG and where each value came from: flag, env, file or default"},
	{"SHOW SESSIONS", "open client sessions: job, token (admins only), transaction state, gated, upstream"},
	{"SHOW FENCES [database]", "fences and leases of the databases with sessions (or the one named); tokens for admins only"},
	{"SHOW FENCE_STATS", "gate outcomes by SQLSTATE, replays, conflicts, commits, reads by route, sessions, refusals"},
	{"SHOW UPSTREAMS", "primary and replicas: health and replay lag"},
	{"PAUSE [db]", "new transactions wait, running ones finish; returns once none is open (admin)"},
	{"RESUME [db]", "end PAUSE or KILL (admin)"},
	{"KILL [db]", "close every session of db (all databases) now and pause it (admin)"},
	{"KILL_CLIENT id", "close one session, by SHOW CLIENTS id (admin)"},
	{"DISABLE db / ENABLE db", "refuse / accept new clients of db (admin)"},
	{"RECONNECT [db]", "close the server connections once released: when their client leaves (admin)"},
	{"WAIT_CLOSE [db]", "wait until the connections RECONNECT marked are closed (admin)"},
	{"SET key = value", "change a reloadable setting until the next RELOAD (admin)"},
	{"RELOAD", "re-read the configuration file and environment, as SIGHUP (admin)"},
	{"SHUTDOWN [WAIT_FOR_SERVERS]", "close every session now / let transactions finish, as SIGTERM; then stop (admin)"},
}

// adminQuery answers one simple Query (statements separated by ;). after,
// when non-nil, is run once the answer is written (SHUTDOWN).
func (s *Server) adminQuery(out []byte, sql string, con *console) ([]byte, func()) {
	stmts := splitAdmin(sql)
	if len(stmts) == 0 {
		return encode(out, &pgproto3.EmptyQueryResponse{}), nil
	}
	var after func()
	for _, text := range stmts {
		t, then, err := s.adminCommand(con, text)
		if err != nil {
			return encode(out, err), after
		}
		if then != nil {
			after = then
		}
		out = t.encode(out)
	}
	return out, after
}

// adminOnly are the commands a stats user may not run.
var adminOnly = map[string]bool{
	"PAUSE": true, "RESUME": true, "KILL": true, "KILL_CLIENT": true, "DISABLE": true, "ENABLE": true, "RECONNECT": true,
	"WAIT_CLOSE": true, "SHUTDOWN": true, "RELOAD": true, "SUSPEND": true, "SET": true,
}

func (s *Server) adminCommand(con *console, text string) (*adminTable, func(), *pgproto3.ErrorResponse) {
	st, ok := parseAdmin(text)
	if !ok {
		return nil, nil, syntaxError(text)
	}
	if st.verb == "SET" && fakeParam(st.key) != "" {
		t := done("SET")
		t.notice("SET ignored", "")
		return t, nil, nil
	}
	if adminOnly[st.verb] && con.role != roleAdmin {
		return nil, nil, errAdminOnly(text)
	}
	if st.arg2 != "" && !(st.verb == "SHOW" && st.argWord == "FENCES") {
		return nil, nil, syntaxError(text)
	}
	var err *pgproto3.ErrorResponse
	switch st.verb {
	case "SHOW", "SELECT":
		if st.arg == "" {
			return nil, nil, syntaxError(text)
		}
		t, err := s.adminShow(con, st)
		return t, nil, err
	case "SET":
		t, err := s.adminSet(con, st)
		return t, nil, err
	case "RELOAD":
		if st.arg != "" {
			return nil, nil, syntaxError(text)
		}
		t, err := s.adminReload(con)
		return t, nil, err
	case "SHUTDOWN":
		then, err := s.cmdShutdown(con, st.argWord)
		if err != nil {
			return nil, nil, err
		}
		return done("SHUTDOWN"), then, nil
	case "SUSPEND":
		return nil, nil, adminError("0A000", "SUSPEND is not supported by pgfence: it serves PgBouncer's online restart, which pgfence does not have",
			"PAUSE drains transactions for a switchover")
	case "PAUSE":
		err = s.cmdPause(con, st.arg)
	case "RESUME":
		err = s.cmdResume(con, st.arg)
	case "KILL":
		err = s.cmdKill(con, st.arg)
	case "KILL_CLIENT":
		err = s.cmdKillClient(con, st.arg)
	case "DISABLE", "ENABLE":
		err = s.cmdDisable(con, st.arg, st.verb == "DISABLE")
	case "RECONNECT":
		err = s.cmdReconnect(con, st.arg)
	case "WAIT_CLOSE":
		err = s.cmdWaitClose(con, st.arg)
	default:
		return nil, nil, syntaxError(text)
	}
	if err != nil {
		return nil, nil, err
	}
	return done(st.verb), nil, nil
}

func syntaxError(text string) *pgproto3.ErrorResponse {
	return adminError("42601", fmt.Sprintf("invalid command '%s', use SHOW HELP;", text), "SHOW HELP lists the pgfence admin console's commands")
}

// adminReload is RELOAD: PgBouncer answers the command tag alone; pgfence
// adds a row per changed setting.
func (s *Server) adminReload(con *console) (*adminTable, *pgproto3.ErrorResponse) {
	rep, err := s.ReloadFromSource()
	if err != nil {
		con.log.Warn("reload failed", zap.Error(err))
		code := "F0000"
		if errors.Is(err, ErrNoReloadSource) {
			code = "55000"
		}
		return nil, adminError(code, err.Error(), "the running configuration is unchanged")
	}
	t := newTable("ss", "setting", "result")
	t.tag = "RELOAD"
	for _, a := range rep.Applied {
		t.add(a, "applied")
	}
	for _, r := range rep.Restart {
		t.add(r, "changed; needs a restart, the running value stays")
	}
	if len(t.rows) == 0 {
		t.notice("configuration reloaded: nothing changed", "")
	}
	return t, nil
}
