package proxy

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/internal/ownsql"
)

// pgfence's own console commands, which PgBouncer does not have: SHOW
// SESSIONS (the fence state of each session), SHOW FENCES (the fence and
// lease rows), SHOW FENCE_STATS (the gate's counters) and SHOW UPSTREAMS.

func txName(b byte) string {
	switch b {
	case 'T':
		return "in transaction"
	case 'E':
		return "failed"
	}
	return "idle"
}

// token shows a fencing token to admins only: to a stats user it is NULL.
func (con *console) token(v string) any {
	if con.role != roleAdmin || v == "" {
		return nil
	}
	return v
}

func (s *Server) showSessions(con *console) *adminTable {
	t := newTable("sssssssssssss", "client_addr", "user", "database", "job_key", "epoch", "token", "step",
		"tx_state", "gated", "replay", "upstream", "connected_at", "backend_pid")
	sess := s.sessions()
	sort.Slice(sess, func(i, j int) bool { return sess[i].info.connectedAt.Before(sess[j].info.connectedAt) })
	for _, ss := range sess {
		gi := sessionGate(ss)
		var epoch, token string
		if gi.hasGen {
			epoch, token = strconv.FormatInt(gi.gen.Epoch, 10), strconv.FormatInt(gi.gen.Token, 10)
		}
		t.add(ss.ClientAddr.String(), ss.User, ss.Database, gi.gen.JobKey, epoch, con.token(token), gi.gen.Step,
			txName(ss.TxStatus()), strconv.FormatBool(gi.gated), strconv.FormatBool(gi.replay), ss.Upstream(),
			ss.info.connectedAt.UTC().Format(time.RFC3339), strconv.FormatUint(uint64(ss.BackendPID), 10))
	}
	return t
}

// sessionGate returns the session's fence state (zero when its Handler
// is no GateReporter).
func sessionGate(ss *Session) gateInfo {
	r, ok := ss.h.(GateReporter)
	if !ok {
		return gateInfo{}
	}
	gs := r.GateState()
	return gateInfo{gen: gs.Gen, hasGen: gs.HasGen, gated: gs.Gated, replay: gs.Replay}
}

// fencesSQL reads the fences and leases of a database, once ownsql.Check
// has found them a superuser's plain tables.
var fencesSQL = own("console: SHOW FENCES", onControl, `SELECT f.job_key, f.epoch::pg_catalog.text, f.max_issued_token::pg_catalog.text,
 l.holder, l.token::pg_catalog.text,
 pg_catalog.to_char(l.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'),
 (l.expires_at OPERATOR(pg_catalog.>) pg_catalog.now())::pg_catalog.text, (f.retired_at IS NOT NULL)::pg_catalog.text
FROM fence.fences AS f LEFT JOIN fence.leases AS l ON l.job_key OPERATOR(pg_catalog.=) f.job_key
ORDER BY f.job_key`)

// consoleAppName names the console's control connections.
const consoleAppName = "pgfence console"

// errNoFence and errUntrustedFence: readFences found no schema fence, or
// one pgfence does not trust.
var (
	errNoFence        = errors.New("no fence schema")
	errUntrustedFence = errors.New("its schema fence is not pgfence's to trust, so it is not read")
)

// showFences reads fence.fences and fence.leases of db, or of every
// database with an open session, through control connections.
func (s *Server) showFences(con *console, db string) (*adminTable, *pgproto3.ErrorResponse) {
	t := newTable("sssssssss", "database", "job_key", "epoch", "max_issued_token", "lease_holder",
		"lease_token", "lease_expires", "lease_live", "retired")
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
			t.notice("no open sessions: name a database, SHOW FENCES dbname", "")
		}
	}
	for _, d := range dbs {
		rows, err := s.readFences(d)
		if err != nil {
			if errors.Is(err, errNoFence) && db == "" {
				continue // no fence schema in that database
			}
			if db != "" {
				return nil, adminError("58000", fmt.Sprintf("cannot read the fences of database %q: %v", d, err), "")
			}
			t.notice(fmt.Sprintf("database %q: %v", d, err), "")
			continue
		}
		for _, r := range rows {
			// job_key, epoch, max_issued_token, holder, lease_token, ...
			t.add(d, r[0], r[1], con.token(r[2]), r[3], con.token(r[4]), r[5], r[6], r[7])
		}
	}
	return t, nil
}

// readFences runs fencesSQL in db on a control connection (the primary
// DSN's credentials, pinned settings) after ownsql.Check, in one
// read-only snapshot, and returns the rows as text (NULL as "").
func (s *Server) readFences(db string) ([][]string, error) {
	timeout := s.primary.ConnectTimeout
	if timeout == 0 {
		timeout = s.cfg.ConnectTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout+10*time.Second)
	defer cancel()
	base := s.primary
	if base.ConnectTimeout == 0 {
		base = base.Copy()
		base.ConnectTimeout = s.cfg.ConnectTimeout
	}
	c, err := dialControl(ctx, base, db, consoleAppName, s.log, nil)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	defer c.Close(context.Background())
	if _, err := c.Exec(ctx, loadBeginSQL).ReadAll(); err != nil {
		return nil, err
	}
	trust, err := ownsql.Check(ctx, c, []ownsql.Rel{ownsql.Fences, ownsql.Leases})
	switch {
	case err != nil:
		return nil, err
	case !trust.Schema:
		return nil, errNoFence
	case !trust.Trusted():
		s.log.Warn("SHOW FENCES: this database's schema fence is not pgfence's to trust, so it is not read",
			zap.String("database", db), zap.String("why", trust.Problem))
		return nil, fmt.Errorf("%w: %s", errUntrustedFence, trust.Problem)
	}
	res, err := c.Exec(ctx, fencesSQL).ReadAll()
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

// showFenceStats is pgfence's own counters, one per row (SHOW STATS
// before the console took PgBouncer's columns).
func (s *Server) showFenceStats() *adminTable {
	t := newTable("ss", "stat", "value")
	n := func(name string, v int64) { t.add(name, strconv.FormatInt(v, 10)) }
	st := &s.ops.stats
	n("sessions_open", int64(len(s.sessions())))
	n("sessions_total", st.SessionsTotal.Load())
	n("sessions_event_loop_total", st.SessionsLoop.Load())
	n("client_parks_total", st.ClientParks.Load())
	n("admin_sessions_total", st.AdminSessions.Load())
	n("admin_sessions_refused_total", st.ConsoleRefusals.Load())
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
	n("accept_errors", st.AcceptErrors.Load())
	n("upstream_connect_errors", st.UpstreamErrors.Load())
	rs := s.RouteStats()
	if rs == nil {
		rs = &RouteStats{} // no replicas: nothing is routed
	}
	n("reads_primary", rs.Primary.Load())
	n("reads_replica", rs.Replica.Load())
	n("reads_pending", rs.Pending.Load())
	n("reads_waited", rs.Waits.Load())
	n("reads_retried", rs.Retries.Load())
	n("reads_stale", rs.Stale.Load())
	if fs := s.gateStats(); fs != nil {
		n("gate_passed", fs.Gated.Load())
		n("commits", fs.Committed.Load())
		n("replays", fs.Replayed.Load())
		n("conflicts", fs.Codes.Get("FN003"))
		n("refusals", fs.Refused.Load())
		fs.Codes.each(func(code string, v int64) { n("errors_"+strings.ReplaceAll(code, " ", "_"), v) })
		n("unfenced_writes", fs.Unfenced.Load())
		n("statements_classified", fs.Classified.Load())
		if fs.Cache != nil {
			n("cache_bytes", fs.Cache.Bytes())
			n("cache_entries", fs.Cache.Entries())
			n("cache_evictions", fs.Cache.Evictions())
			n("cache_uncached", fs.Cache.Uncached())
		}
		n("gate_step_count", int64(fs.GateLatency.Count()))
		t.add("gate_step_avg_ms", fmt.Sprintf("%.3f", float64(fs.GateLatency.Mean())/1e6))
		n("commit_step_count", int64(fs.CommitLatency.Count()))
		t.add("commit_step_avg_ms", fmt.Sprintf("%.3f", float64(fs.CommitLatency.Mean())/1e6))
	}
	return t
}

func (s *Server) showUpstreams() *adminTable {
	t := newTable("sssssss", "role", "addr", "healthy", "replay_lag", "replay_lag_bytes", "error", "checked_at")
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
