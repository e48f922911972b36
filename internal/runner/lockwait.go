package runner

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
)

// An acquire locks the job's fence row. A transaction that holds that row
// (a gated write through the proxy, a worker's fence.gate, anyone's SELECT
// ... FOR UPDATE) makes the acquire wait until it ends: that is how a
// takeover is ordered after the old holder's last commit. A transaction
// left open (a worker stopped mid-transaction, an idle psql) makes it wait
// forever, so the acquire is watched from a second connection: after
// reportAfter the blocking sessions are logged, and after LockTimeout the
// acquire gives up naming them.

// ErrLockTimeout is returned when an acquire waited longer than
// Config.LockTimeout for the job's fence row.
var ErrLockTimeout = errors.New("gave up waiting for the job's fence row")

// reportAfter is how long an acquire may wait on the fence row before the
// blocking sessions are looked up and logged, and then how often they are
// looked up again.
const reportAfter = time.Second

// Blocker is a session holding a lock an acquire waits for, from
// pg_stat_activity.
type Blocker struct {
	PID         int
	User        string
	Database    string
	Application string
	Client      string // address, or "local" for a Unix socket
	State       string // "idle in transaction", "active", ...
	XactStart   time.Time
	Query       string // its last statement, when the role may see it
}

func (b Blocker) String() string {
	var s strings.Builder
	fmt.Fprintf(&s, "pid %d (user %s, database %s", b.PID, b.User, b.Database)
	if b.Application != "" {
		fmt.Fprintf(&s, ", application %q", b.Application)
	}
	fmt.Fprintf(&s, ", client %s, %s", b.Client, b.State)
	if !b.XactStart.IsZero() {
		fmt.Fprintf(&s, ", transaction open for %s", time.Since(b.XactStart).Round(time.Second))
	}
	if b.Query != "" {
		q := strings.Join(strings.Fields(b.Query), " ")
		if len(q) > 120 {
			q = q[:117] + "..."
		}
		fmt.Fprintf(&s, ", last query %q", q)
	}
	s.WriteString(")")
	return s.String()
}

func blockerList(bs []Blocker) string {
	parts := make([]string, len(bs))
	for i, b := range bs {
		parts[i] = b.String()
	}
	return strings.Join(parts, "; ")
}

func blockerPIDs(bs []Blocker) []int {
	pids := make([]int, len(bs))
	for i, b := range bs {
		pids[i] = b.PID
	}
	return pids
}

// blockers lists the sessions blocking backend pid.
func blockers(ctx context.Context, conn *pgx.Conn, pid uint32) ([]Blocker, error) {
	rows, err := conn.Query(ctx, `
select a.pid, coalesce(a.usename, ''), coalesce(a.datname, ''), coalesce(a.application_name, ''),
       coalesce(host(a.client_addr), 'local'), coalesce(a.state, ''), a.xact_start, coalesce(a.query, '')
  from pg_stat_activity a
 where a.pid = any (pg_blocking_pids($1))
 order by a.xact_start nulls last`, int32(pid))
	if err != nil {
		return nil, err
	}
	var out []Blocker
	for rows.Next() {
		var b Blocker
		var xact *time.Time
		if err := rows.Scan(&b.PID, &b.User, &b.Database, &b.Application, &b.Client, &b.State, &xact, &b.Query); err != nil {
			rows.Close()
			return nil, err
		}
		if xact != nil {
			b.XactStart = *xact
		}
		out = append(out, b)
	}
	return out, rows.Err()
}

// watchedAcquire runs fence.Acquire on db and, while it has not answered,
// looks from a second connection (opened with cfg) for sessions blocking
// it: it logs them once after reportAfter, and gives up with
// ErrLockTimeout, naming them, once lockTimeout (when positive) has passed.
// When ctx ends first, the error names the last blockers seen.
func watchedAcquire(ctx context.Context, db *pgx.Conn, cfg *pgx.ConnConfig, log *zap.Logger,
	jobKey, holder string, ttl, lockTimeout time.Duration) (fence.Lease, error) {
	type result struct {
		l   fence.Lease
		err error
	}
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan result, 1)
	pid := db.PgConn().PID()
	go func() {
		l, err := fence.Acquire(actx, db, jobKey, holder, ttl)
		done <- result{l, err}
	}()

	var watcher *pgx.Conn
	defer func() { closeConn(watcher) }()
	look := func() []Blocker {
		lctx, lc := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer lc()
		if watcher == nil || watcher.IsClosed() {
			c, err := pgx.ConnectConfig(lctx, cfg)
			if err != nil {
				log.Debug("cannot look for sessions blocking the acquire", zap.Error(err))
				return nil
			}
			watcher = c
		}
		bs, err := blockers(lctx, watcher, pid)
		if err != nil {
			log.Debug("cannot look for sessions blocking the acquire", zap.Error(err))
		}
		return bs
	}

	var last []Blocker
	reported := false
	tick := time.NewTicker(reportAfter)
	defer tick.Stop()
	var giveUp <-chan time.Time
	if lockTimeout > 0 {
		t := time.NewTimer(lockTimeout)
		defer t.Stop()
		giveUp = t.C
	}
	for {
		select {
		case r := <-done:
			if r.err != nil && ctx.Err() != nil && len(last) > 0 {
				return fence.Lease{}, fmt.Errorf("%w (job %q's fence row was locked by %s)", r.err, jobKey, blockerList(last))
			}
			return r.l, r.err
		case <-tick.C:
			if bs := look(); len(bs) > 0 {
				last = bs
				if !reported {
					reported = true
					log.Warn("waiting for the job's fence row: it is locked by an open transaction; the acquire goes on once that transaction ends",
						zap.Ints("blocking_pids", blockerPIDs(bs)), zap.String("blocked_by", blockerList(bs)))
				}
			}
		case <-giveUp:
			if bs := look(); len(bs) > 0 {
				last = bs
			}
			cancel()
			r := <-done
			if r.err == nil {
				return r.l, nil // it got through as we gave up
			}
			if len(last) == 0 {
				return fence.Lease{}, fmt.Errorf("%w: no answer from the database within %s: %w", ErrLockTimeout, lockTimeout, r.err)
			}
			return fence.Lease{}, fmt.Errorf("%w: job %q: still locked after %s by %s; end that transaction (or SELECT pg_terminate_backend(%d)) and try again",
				ErrLockTimeout, jobKey, lockTimeout, blockerList(last), last[0].PID)
		}
	}
}
