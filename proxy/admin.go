package proxy

import (
	"context"
	"crypto/rand"
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

	reloadMu sync.Mutex // one reload at a time

	hookMu        sync.Mutex
	replicaStatus func(context.Context) []UpstreamStatus
	replicaReload func(replicas []string) error
}

// liveConfig is the part of Config a reload may replace. It is swapped
// whole; readers load it once per use.
type liveConfig struct {
	auth              AuthMethod
	users             map[string]string
	upstreamPasswords map[string]string
	admins            []string // sorted
	maxClients        int
	tls               *tls.Config
	replicas          []string
	extra             []Setting
}

func newLive(c Config) *liveConfig {
	admins := slices.Clone(c.AdminUsers)
	sort.Strings(admins)
	return &liveConfig{
		auth:              c.Auth,
		users:             c.Users,
		upstreamPasswords: c.UpstreamPasswords,
		admins:            slices.Compact(admins),
		maxClients:        c.MaxClients,
		tls:               c.TLS,
		replicas:          c.Replicas,
		extra:             c.ExtraSettings,
	}
}

// initOps prepares the operations state from the validated config.
func (s *Server) initOps() {
	s.ops.live.Store(newLive(s.cfg))
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

// fence returns the write gate, when it is the interceptor.
func (s *Server) fence() *Fence {
	f, _ := s.cfg.Interceptor.(*Fence)
	return f
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

// gateInfo is a session's fence state as SHOW SESSIONS shows it.
type gateInfo struct {
	jobKey        string
	epoch, token  int64
	step          string
	hasGen        bool
	gated, replay bool
}

// gateReporter is implemented by Handlers that know a fence state.
type gateReporter interface{ gateInfo() gateInfo }

func (h *fenceSession) gateInfo() gateInfo {
	h.mu.Lock()
	defer h.mu.Unlock()
	var gi gateInfo
	gi.jobKey, gi.epoch, gi.token, gi.step, gi.hasGen = h.st.Generation()
	g := h.st.Gate()
	gi.gated, gi.replay = g.Gated, g.Replay
	if g.Gated && !gi.hasGen {
		gi.jobKey, gi.epoch, gi.token, gi.step, gi.hasGen = g.Gen.JobKey, g.Gen.Epoch, g.Gen.Token, g.Gen.Step, true
	}
	return gi
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
// passwords, admin users, max clients, TLS certificate; replicas when read
// routing supports it) and reports the others that differ from the running
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
	applied("max_clients", old.maxClients != nl.maxClients)
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
	restart("connect_timeout", cur.ConnectTimeout != next.ConnectTimeout)
	restart("buffer_size", cur.BufferSize != next.BufferSize)
	restart("health_interval", cur.HealthInterval != next.HealthInterval)
	s.ops.live.Store(nl)
	return rep, nil
}

// ---------------------------------------------------------------------------
// The console

// serveAdmin runs an admin console session for an authenticated user.
func (s *Server) serveAdmin(c net.Conn, user string, log *zap.Logger) {
	if !slices.Contains(s.live().admins, user) {
		s.refuse(c, &ProtocolError{Code: "42501", Msg: fmt.Sprintf("permission denied: user %q is not a pgfence admin (see admin_users)", user)}, log, "admin console refused")
		return
	}
	s.ops.stats.AdminSessions.Add(1)
	log = log.Named("admin")
	log.Info("admin session open")
	var out []byte
	for _, p := range [][2]string{
		{"server_version", "16.0 (pgfence)"}, {"server_encoding", "UTF8"}, {"client_encoding", "UTF8"},
		{"DateStyle", "ISO, MDY"}, {"integer_datetimes", "on"}, {"standard_conforming_strings", "on"},
		{"TimeZone", "UTC"}, {"application_name", "pgfence"},
	} {
		out = encode(out, &pgproto3.ParameterStatus{Name: p[0], Value: p[1]})
	}
	// A key no cancel request will match: the console runs nothing to cancel.
	var key [8]byte
	rand.Read(key[:])
	out = encode(out, &pgproto3.BackendKeyData{ProcessID: binary.BigEndian.Uint32(key[:4]) & 0x7fffffff, SecretKey: key[4:]})
	out = encode(out, &pgproto3.ReadyForQuery{TxStatus: 'I'})
	if _, err := c.Write(out); err != nil {
		c.Close()
		return
	}
	c.SetDeadline(time.Time{})
	err := s.adminLoop(c, log)
	c.Close()
	if err != nil {
		log.Debug("admin session closed", zap.Error(err))
	} else {
		log.Info("admin session closed")
	}
}

func (s *Server) adminLoop(c net.Conn, log *zap.Logger) error {
	be := pgproto3.NewBackend(c, c)
	be.SetMaxBodyLen(1 << 20)
	skipping := false // extended protocol: error sent, waiting for Sync
	for {
		msg, err := be.Receive()
		if err != nil {
			return err
		}
		var out []byte
		switch m := msg.(type) {
		case *pgproto3.Terminate:
			return nil
		case *pgproto3.Query:
			out = s.adminQuery(out, m.String, log)
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
			if _, err := c.Write(out); err != nil {
				return err
			}
		}
	}
}

func adminError(code, msg, hint string) *pgproto3.ErrorResponse {
	return &pgproto3.ErrorResponse{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: code, Message: msg, Hint: hint}
}

// adminTable is a result: every column text.
type adminTable struct {
	cols    []string
	rows    [][]string
	tag     string // command tag; "SHOW" when empty
	notices []string
}

func (t *adminTable) add(vals ...string) { t.rows = append(t.rows, vals) }

func (t *adminTable) encode(out []byte) []byte {
	for _, n := range t.notices {
		out = encode(out, &pgproto3.NoticeResponse{Severity: "NOTICE", SeverityUnlocalized: "NOTICE", Code: "00000", Message: n})
	}
	fields := make([]pgproto3.FieldDescription, len(t.cols))
	for i, c := range t.cols {
		fields[i] = pgproto3.FieldDescription{Name: []byte(c), DataTypeOID: 25, DataTypeSize: -1, TypeModifier: -1}
	}
	out = encode(out, &pgproto3.RowDescription{Fields: fields})
	for _, r := range t.rows {
		vals := make([][]byte, len(r))
		for i, v := range r {
			vals[i] = []byte(v)
		}
		out = encode(out, &pgproto3.DataRow{Values: vals})
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
	{"SHOW SESSIONS", "open client sessions: job, token, transaction state, gated, upstream"},
	{"SHOW FENCES [database]", "fences and leases of the databases with sessions (or the one named)"},
	{"SHOW STATS", "gate outcomes by SQLSTATE, replays, conflicts, commits, reads by route, sessions, refusals"},
	{"SHOW UPSTREAMS", "primary and replicas: health and replay lag"},
	{"SHOW CONFIG", "effective settings (no secrets) and whether RELOAD can change them"},
	{"RELOAD", "re-read the configuration file and environment (as SIGHUP)"},
}

// adminQuery answers one simple Query (statements separated by ;).
func (s *Server) adminQuery(out []byte, sql string, log *zap.Logger) []byte {
	var stmts []string
	for _, part := range strings.Split(sql, ";") {
		if part = strings.TrimSpace(part); part != "" {
			stmts = append(stmts, part)
		}
	}
	if len(stmts) == 0 {
		return encode(out, &pgproto3.EmptyQueryResponse{})
	}
	for _, st := range stmts {
		t, err := s.adminCommand(st, log)
		if err != nil {
			return encode(out, err)
		}
		out = t.encode(out)
	}
	return out
}

func (s *Server) adminCommand(stmt string, log *zap.Logger) (*adminTable, *pgproto3.ErrorResponse) {
	words := strings.Fields(stmt)
	verb := strings.ToUpper(words[0])
	var what string
	if len(words) > 1 {
		what = strings.ToUpper(words[1])
	}
	unknown := adminError("42601", fmt.Sprintf("unknown pgfence admin command %q: SHOW HELP lists the commands", stmt), "")
	switch {
	case verb == "SHOW" && len(words) == 2 && what == "HELP":
		t := &adminTable{cols: []string{"command", "description"}}
		for _, c := range adminCommands {
			t.add(c[0], c[1])
		}
		return t, nil
	case verb == "SHOW" && len(words) == 2 && what == "SESSIONS":
		return s.showSessions(), nil
	case verb == "SHOW" && (len(words) == 2 || len(words) == 3) && what == "FENCES":
		var db string
		if len(words) == 3 {
			db = strings.Trim(words[2], `"'`)
		}
		return s.showFences(db)
	case verb == "SHOW" && len(words) == 2 && what == "STATS":
		return s.showStats(), nil
	case verb == "SHOW" && len(words) == 2 && what == "UPSTREAMS":
		return s.showUpstreams(), nil
	case verb == "SHOW" && len(words) == 2 && what == "CONFIG":
		return s.showConfig(), nil
	case verb == "RELOAD" && len(words) == 1:
		rep, err := s.ReloadFromSource()
		if err != nil {
			log.Warn("reload failed", zap.Error(err))
			code := "F0000"
			if errors.Is(err, ErrNoReloadSource) {
				code = "55000"
			}
			return nil, adminError(code, err.Error(), "the running configuration is unchanged")
		}
		t := &adminTable{cols: []string{"setting", "result"}, tag: "RELOAD"}
		for _, a := range rep.Applied {
			t.add(a, "applied")
		}
		for _, r := range rep.Restart {
			t.add(r, "changed; needs a restart, the running value stays")
		}
		if len(t.rows) == 0 {
			t.notices = append(t.notices, "configuration reloaded: nothing changed")
		}
		return t, nil
	}
	return nil, unknown
}

func txName(b byte) string {
	switch b {
	case 'T':
		return "in transaction"
	case 'E':
		return "failed"
	}
	return "idle"
}

func (s *Server) showSessions() *adminTable {
	t := &adminTable{cols: []string{"client_addr", "user", "database", "job_key", "epoch", "token", "step",
		"tx_state", "gated", "replay", "upstream", "connected_at", "backend_pid"}}
	sess := s.sessions()
	sort.Slice(sess, func(i, j int) bool { return sess[i].info.connectedAt.Before(sess[j].info.connectedAt) })
	for _, ss := range sess {
		var gi gateInfo
		if r, ok := ss.h.(gateReporter); ok {
			gi = r.gateInfo()
		}
		var epoch, token string
		if gi.hasGen {
			epoch, token = strconv.FormatInt(gi.epoch, 10), strconv.FormatInt(gi.token, 10)
		}
		t.add(ss.ClientAddr.String(), ss.User, ss.Database, gi.jobKey, epoch, token, gi.step,
			txName(ss.TxStatus()), strconv.FormatBool(gi.gated), strconv.FormatBool(gi.replay), ss.Upstream(),
			ss.info.connectedAt.UTC().Format(time.RFC3339), strconv.FormatUint(uint64(ss.BackendPID), 10))
	}
	return t
}

const fencesSQL = `SELECT f.job_key, f.epoch::text, f.max_issued_token::text, l.holder, l.token::text,
 to_char(l.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'),
 (l.expires_at > now())::text, (f.retired_at IS NOT NULL)::text
FROM fence.fences f LEFT JOIN fence.leases l USING (job_key) ORDER BY f.job_key`

// showFences reads fence.fences and fence.leases of db, or of every
// database with an open session, through control connections.
func (s *Server) showFences(db string) (*adminTable, *pgproto3.ErrorResponse) {
	t := &adminTable{cols: []string{"database", "job_key", "epoch", "max_issued_token", "lease_holder",
		"lease_token", "lease_expires", "lease_live", "retired"}}
	dbs := []string{db}
	if db == "" {
		seen := map[string]bool{}
		dbs = dbs[:0]
		for _, ss := range s.sessions() {
			if !seen[ss.Database] {
				seen[ss.Database] = true
				dbs = append(dbs, ss.Database)
			}
		}
		sort.Strings(dbs)
		if len(dbs) == 0 {
			t.notices = append(t.notices, "no open sessions: name a database, SHOW FENCES dbname")
		}
	}
	for _, d := range dbs {
		rows, err := s.controlQuery(d, fencesSQL)
		if err != nil {
			var pg *pgconn.PgError
			if errors.As(err, &pg) && pg.Code == "3F000" && db == "" {
				continue // no fence schema in that database
			}
			if db != "" {
				return nil, adminError("58000", fmt.Sprintf("cannot read the fences of database %q: %v", d, err), "")
			}
			t.notices = append(t.notices, fmt.Sprintf("database %q: %v", d, err))
			continue
		}
		for _, r := range rows {
			t.add(append([]string{d}, r...)...)
		}
	}
	return t, nil
}

// controlQuery runs sql on db with the primary DSN's credentials and
// returns the rows as text (NULL as "").
func (s *Server) controlQuery(db, sql string) ([][]string, error) {
	pc := s.primary.Copy()
	pc.Database = db
	if pc.ConnectTimeout == 0 {
		pc.ConnectTimeout = s.cfg.ConnectTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), pc.ConnectTimeout+10*time.Second)
	defer cancel()
	c, err := pgconn.ConnectConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	defer c.Close(context.Background())
	res, err := c.Exec(ctx, sql).ReadAll()
	if err != nil {
		return nil, err
	}
	var out [][]string
	for _, r := range res {
		for _, row := range r.Rows {
			vals := make([]string, len(row))
			for i, v := range row {
				vals[i] = string(v)
			}
			out = append(out, vals)
		}
	}
	return out, nil
}

func (s *Server) showStats() *adminTable {
	t := &adminTable{cols: []string{"stat", "value"}}
	n := func(name string, v int64) { t.add(name, strconv.FormatInt(v, 10)) }
	st := &s.ops.stats
	n("sessions_open", int64(len(s.sessions())))
	n("sessions_total", st.SessionsTotal.Load())
	n("sessions_event_loop_total", st.SessionsLoop.Load())
	n("client_handoffs_total", st.ClientHandoffs.Load())
	n("admin_sessions_total", st.AdminSessions.Load())
	refused := st.Refused()
	var total int64
	codes := slices.Sorted(maps.Keys(refused))
	for _, c := range codes {
		total += refused[c]
	}
	n("clients_refused", total)
	for _, c := range codes {
		n("clients_refused_"+c, refused[c])
	}
	n("upstream_connect_errors", st.UpstreamErrors.Load())
	n("reads_primary", st.ReadsPrimary.Load())
	n("reads_replica", st.ReadsReplica.Load())
	if f := s.fence(); f != nil {
		fs := &f.Stats
		n("gate_passed", fs.Gated.Load())
		n("commits", fs.Committed.Load())
		n("replays", fs.Replayed.Load())
		n("conflicts", fs.Codes.Get("FN003"))
		n("refusals", fs.Refused.Load())
		fs.Codes.each(func(code string, v int64) { n("errors_"+strings.ReplaceAll(code, " ", "_"), v) })
		n("unfenced_writes", fs.Unfenced.Load())
		n("statements_classified", fs.Classified.Load())
		n("gate_step_count", int64(fs.GateLatency.Count()))
		t.add("gate_step_avg_ms", fmt.Sprintf("%.3f", float64(fs.GateLatency.Mean())/1e6))
		n("commit_step_count", int64(fs.CommitLatency.Count()))
		t.add("commit_step_avg_ms", fmt.Sprintf("%.3f", float64(fs.CommitLatency.Mean())/1e6))
	}
	return t
}

func (s *Server) showUpstreams() *adminTable {
	t := &adminTable{cols: []string{"role", "addr", "healthy", "replay_lag", "replay_lag_bytes", "error", "checked_at"}}
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.ConnectTimeout)
	defer cancel()
	ups := []UpstreamStatus{s.checkPrimary(ctx)}
	if f := s.replicaStatusFunc(); f != nil {
		ups = append(ups, f(ctx)...)
	} else {
		for _, r := range s.replicas {
			ups = append(ups, s.ping(ctx, "replica", r))
		}
	}
	for _, u := range ups {
		var lag, lagBytes string
		if u.LagKnown {
			lag, lagBytes = u.ReplayLag.String(), strconv.FormatInt(u.LagBytes, 10)
		}
		t.add(u.Role, u.Addr, strconv.FormatBool(u.Healthy), lag, lagBytes, u.Error, u.Checked.UTC().Format(time.RFC3339))
	}
	return t
}

// redactDSN shows where a DSN points, without its password.
func redactDSN(dsn string) string {
	pc, err := pgconn.ParseConfig(dsn)
	if err != nil {
		return "(unparsable)"
	}
	return fmt.Sprintf("host=%s port=%d user=%s dbname=%s", pc.Host, pc.Port, pc.User, pc.Database)
}

func (s *Server) showConfig() *adminTable {
	t := &adminTable{cols: []string{"key", "value", "reloadable"}}
	l := s.live()
	c := s.cfg
	yes, no := "yes", "no"
	var reps []string
	for _, r := range l.replicas {
		reps = append(reps, redactDSN(r))
	}
	s.ops.hookMu.Lock()
	replicasReload := s.ops.replicaReload != nil
	s.ops.hookMu.Unlock()
	t.add("primary", redactDSN(c.Primary), no)
	t.add("replicas", strings.Join(reps, ", "), map[bool]string{true: yes, false: no}[replicasReload])
	t.add("auth", string(l.auth), yes)
	t.add("auth_file", fmt.Sprintf("%d users", len(l.users)), yes)
	t.add("upstream_passwords", fmt.Sprintf("%d users", len(l.upstreamPasswords)), yes)
	t.add("admin_users", strings.Join(l.admins, ","), yes)
	t.add("max_clients", strconv.Itoa(l.maxClients), yes)
	t.add("tls", strconv.FormatBool(l.tls != nil), yes)
	t.add("max_message_size", strconv.Itoa(c.MaxMessageSize), no)
	t.add("shutdown_timeout", c.ShutdownTimeout.String(), no)
	t.add("startup_timeout", c.StartupTimeout.String(), no)
	t.add("connect_timeout", c.ConnectTimeout.String(), no)
	t.add("buffer_size", strconv.Itoa(c.BufferSize), no)
	t.add("health_interval", c.HealthInterval.String(), no)
	t.add("gate", strconv.FormatBool(s.fence() != nil), no)
	for _, e := range l.extra {
		t.add(e.Key, e.Value, map[bool]string{true: yes, false: no}[e.Reloadable])
	}
	return t
}
