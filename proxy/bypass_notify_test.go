package proxy

import (
	"context"
	"fmt"
	"math"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("notify", bypassNotify) }

// bypassNotify: any login may NOTIFY pgfence_takeover, and a client's own
// connection answers the replica fence-row check. Neither may teach the
// proxy a takeover that did not happen, or make it miss one that did: a
// reader carrying the new generation is never served the previous one by
// a replica that has not replayed the takeover. Each case forges (as a
// login role that is no worker, directly and through the proxy) before the
// replica pauses, so that whatever the proxy recorded from the forgery is
// replayed; then the replica pauses and the real takeover happens. The
// readers of the new generation must get B's result from the primary (or
// FN007 with policy pending), never A's from the replica. A flood of
// forgeries must not grow the proxy's memory, nor keep it from hearing the
// real takeover.
func bypassNotify(t *testing.T) {
	e := newNotifyEnv(t)
	huge := int64(math.MaxInt64)
	payload := func(fields string) string { return "select pg_notify('pgfence_takeover', '" + fields + "')" }
	cases := []struct {
		name  string
		forge func(job string, a fence.Lease) string
		// flood: after the case, the proxy knows no more jobs than exist.
		flood bool
	}{
		// The attack: a token larger than any real one.
		{name: "huge_token", forge: func(job string, a fence.Lease) string {
			return payload(fmt.Sprintf(`{"job_key": "%s", "epoch": %d, "token": %d}`, job, a.Epoch, huge))
		}},
		// The tokens the real takeover may get (one global sequence: an
		// attacker can guess the next ones).
		{name: "guessed_next_tokens", forge: func(job string, a fence.Lease) string {
			return fmt.Sprintf("select pg_notify('pgfence_takeover', json_build_object('job_key', '%s', 'epoch', %d, 'token', %d + g)::text) from generate_series(1, 50) g",
				job, a.Epoch, a.Token)
		}},
		{name: "huge_token_retired", forge: func(job string, a fence.Lease) string {
			return payload(fmt.Sprintf(`{"job_key": "%s", "epoch": %d, "token": %d, "retired": true}`, job, a.Epoch, huge))
		}},
		{name: "huge_epoch_and_token", forge: func(job string, a fence.Lease) string {
			return payload(fmt.Sprintf(`{"job_key": "%s", "epoch": %d, "token": %d}`, job, huge, huge))
		}},
		{name: "token_as_string", forge: func(job string, a fence.Lease) string {
			return payload(fmt.Sprintf(`{"job_key": "%s", "epoch": %d, "token": "%d"}`, job, a.Epoch, huge))
		}},
		{name: "duplicate_keys", forge: func(job string, a fence.Lease) string {
			return payload(fmt.Sprintf(`{"job_key": "%s", "token": 1, "token": %d}`, job, huge))
		}},
		{name: "notify_statement", forge: func(job string, a fence.Lease) string {
			return fmt.Sprintf(`NOTIFY pgfence_takeover, '{"job_key": "%s", "epoch": %d, "token": %d}'`, job, a.Epoch, huge)
		}},
		{name: "from_a_do_block", forge: func(job string, a fence.Lease) string {
			return fmt.Sprintf(`do $$ begin perform pg_notify('pgfence_takeover', '{"job_key": "%s", "token": %d}'); end $$`, job, huge)
		}},
		// The forgery first, the real takeover's token only after it.
		{name: "forged_then_huge_for_another_job", forge: func(job string, a fence.Lease) string {
			return payload(fmt.Sprintf(`{"job_key": "%s", "token": %d}`, job, huge)) + "; " +
				payload(fmt.Sprintf(`{"job_key": "other-%s", "token": %d}`, job, huge))
		}},
		// A flood: jobs that do not exist, each with a huge token, and the
		// job itself among them.
		{name: "flood_of_forgeries", flood: true, forge: func(job string, a fence.Lease) string {
			return fmt.Sprintf("select pg_notify('pgfence_takeover', json_build_object('job_key', case when g %% 1000 = 0 then '%s' else 'ghost-' || g end, 'token', %d)::text) from generate_series(1, 20000) g",
				job, huge)
		}},
		{name: "flood_of_long_keys", flood: true, forge: func(job string, a fence.Lease) string {
			return fmt.Sprintf("select pg_notify('pgfence_takeover', json_build_object('job_key', repeat(chr(65 + g %% 26), 7000) || g, 'token', %d)::text) from generate_series(1, 2000) g; ", huge) +
				payload(fmt.Sprintf(`{"job_key": "%s", "token": %d}`, job, huge))
		}},
		{name: "malformed_payloads", flood: true, forge: func(job string, a fence.Lease) string {
			return strings.Join([]string{
				payload(`not json`), payload(`[1, 2, 3]`), payload(`{"job_key": 7}`), payload(`{"job_key": ""}`),
				payload(`{"job_key": null, "token": 1}`), payload(`{}`), payload(``),
				payload(fmt.Sprintf(`{"job_key": "%s", "token": %d}`, job, huge)),
			}, "; ")
		}},
	}
	for _, c := range cases {
		for _, route := range castRoutes {
			t.Run(c.name+"/"+route, func(t *testing.T) {
				job := e.nextJob()
				a := e.scenarioBefore(t, job)
				e.asForger(t, route, c.forge(job, a))
				b := e.scenarioAfter(t, job, a)
				e.readersSeeB(t, job, b)
				if c.flood {
					e.boundedMemory(t)
				}
			})
		}
	}

	t.Run("fence_row_check_answer_poisoned", func(t *testing.T) {
		// The replica fence-row check runs on the reader's own connection,
		// as its role, under its settings: its answer is the client's to
		// shape (here an operator || of its own, first on its search
		// path) and may decide that reader's own read, never another's.
		e.asForger(t, "direct", `create or replace function public.notify_cat(text, text) returns text
			language sql immutable as $$ select '999999999 0/1' $$;
			create operator public.|| (leftarg = text, rightarg = text, function = public.notify_cat)`)
		t.Cleanup(func() { execOK(t, e.direct(t), "drop operator if exists public.|| (text, text)") })
		job := e.nextJob()
		a := e.scenarioBefore(t, job)
		e.mark(t)
		if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		pauseReplay(t)
		b := e.takeover(t, job, "b", a)
		execOK(t, e.worker(t, &b), upsert, job, "B", b.Token)
		e.mark(t)
		e.forget(t, job)
		liar := e.reader(t, nil, opts(job, b.Token, "-c search_path=public,pg_catalog", "-c fence.read_policy=pending")...)
		_, _, _ = where(t, liar, e.readQuery(job)) // its own answer, whatever it is
		e.readersSeeB(t, job, b)
		resumeAndCatchUp(t)
	})

	t.Run("reader_hint_reads_the_fence_row", func(t *testing.T) {
		// A reader whose generation the proxy does not know makes the
		// watcher read that job's fence row on its own connection: the
		// token recorded is the fence's, never the reader's claim.
		job := e.nextJob()
		a := e.scenarioBefore(t, job)
		b := e.takeover(t, job, "b", a)
		e.mark(t)
		e.forget(t, job)
		future := e.reader(t, nil, opts(job, b.Token+1000, "-c fence.read_policy=primary")...)
		mustWhere(t, future, e.readQuery(job), false)
		cat := catalogOf(t, e.gate, e.db)
		if err := pgtest.Poll(ctxT(t), func() (bool, error) { _, ok := cat.tk.lookup(job); return ok, nil }); err != nil {
			t.Fatalf("the reader's unknown generation did not make the watcher read the fence row: %v", err)
		}
		if tk, _ := cat.tk.lookup(job); tk.token != b.Token {
			t.Fatalf("recorded token %d for %s, want the fence's %d (the reader claimed %d)", tk.token, job, b.Token, b.Token+1000)
		}
	})
}

// notifyEnv is the notify class's database: a routing proxy, and a login
// role that is no worker (forger) with CREATE on schema public.
type notifyEnv struct {
	*routeEnv
	forger string
	jobs   int
}

func newNotifyEnv(t *testing.T) *notifyEnv {
	e := &notifyEnv{routeEnv: newRouteEnvMode(t, true, fenceSchema)}
	prefix, _, _ := strings.Cut(e.db, "_")
	e.forger = prefix + "_forger"
	execOK(t, e.direct(t), fmt.Sprintf("create role %[1]s login; grant create on schema public to %[1]s", pgx.Identifier{e.forger}.Sanitize()))
	return e
}

func (e *notifyEnv) nextJob() string {
	e.jobs++
	return fmt.Sprintf("nj%d", e.jobs)
}

func (e *notifyEnv) readQuery(job string) string {
	return "SELECT payload, token, pg_is_in_recovery() FROM results WHERE job_key = '" + job + "'"
}

// asForger runs sql as the forger, straight to PostgreSQL or through the
// proxy.
func (e *notifyEnv) asForger(t *testing.T, route, sql string) {
	t.Helper()
	host := cluster.Primary.Addr()
	if route == "proxy" {
		host = e.proxy.addr.String()
	}
	c := connect(t, fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", url.PathEscape(e.forger), host, e.db))
	if _, err := c.Exec(ctxT(t), sql).ReadAll(); err != nil {
		t.Fatalf("%s as %s: %v", sql, e.forger, err)
	}
}

// mark makes a real takeover of a job of its own and waits until the
// proxy has recorded it: notifications arrive in order, so everything
// notified before it has been delivered to (and handled by) the watcher.
// After a flood the marker's own notification may find the set of keys
// to read full (it is then covered by position only): a reader's hint
// makes the watcher read the marker's row then, in a read after every
// notification received before it.
func (e *notifyEnv) mark(t *testing.T) {
	t.Helper()
	m := e.acquire(t, "marker", "m", time.Minute)
	cat := catalogOf(t, e.gate, e.db)
	polls := 0
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		if tk, ok := cat.tk.lookup("marker"); ok && tk.token >= m.Token {
			return true, nil
		}
		if polls++; polls > 20 {
			cat.tk.hint("marker")
		}
		return false, nil
	}); err != nil {
		t.Fatalf("the proxy never saw the marker's token %d: %v", m.Token, err)
	}
}

// forget makes the proxy forget what it knows of job (as a new proxy, or
// one the takeover's notification has not reached yet, would).
func (e *notifyEnv) forget(t *testing.T, job string) {
	t.Helper()
	cat := catalogOf(t, e.gate, e.db)
	cat.tk.mu.Lock()
	delete(cat.tk.jobs, job)
	cat.tk.mu.Unlock()
}

// scenarioBefore: A holds job and has written its result, which the
// replica has replayed.
func (e *notifyEnv) scenarioBefore(t *testing.T, job string) fence.Lease {
	t.Helper()
	a := e.acquire(t, job, "a", time.Minute)
	execOK(t, e.worker(t, &a), upsert, job, "A", a.Token)
	return a
}

// scenarioAfter: what the forgery made the proxy record is replayed; then
// replay pauses, B takes over job and writes its result, and the proxy
// has heard of it.
func (e *notifyEnv) scenarioAfter(t *testing.T, job string, a fence.Lease) fence.Lease {
	t.Helper()
	e.mark(t)
	if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	pauseReplay(t)
	b := e.takeover(t, job, "b", a)
	execOK(t, e.worker(t, &b), upsert, job, "B", b.Token)
	e.mark(t)
	return b
}

// readersSeeB: readers of B's generation (policies primary, wait and
// pending) and a reader without metadata never get A's result; the
// replica still has it (replay paused).
func (e *notifyEnv) readersSeeB(t *testing.T, job string, b fence.Lease) {
	t.Helper()
	q := e.readQuery(job)
	rconn, err := cluster.Replica.Connect(ctxT(t), e.db)
	if err != nil {
		t.Fatal(err)
	}
	defer rconn.Close(context.Background())
	var onReplica string
	if err := rconn.QueryRow(ctxT(t), "SELECT payload FROM results WHERE job_key = $1", job).Scan(&onReplica); err != nil || onReplica != "A" {
		t.Fatalf("replica shows %q (%v), want A's result (replay paused)", onReplica, err)
	}
	for _, r := range []struct {
		name string
		conn *pgconn.PgConn
	}{
		{"generation_primary", e.reader(t, nil, opts(job, b.Token)...)},
		{"generation_wait", e.reader(t, nil, opts(job, b.Token, "-c fence.read_policy=wait", "-c fence.read_wait=20ms")...)},
		{"no_metadata", e.reader(t, nil)},
	} {
		vals, onRep, err := where(t, r.conn, q)
		if err != nil {
			t.Fatalf("%s: %v", r.name, err)
		}
		if vals[0] != "B" || onRep {
			t.Fatalf("%s: read %v from replica=%v, want B's result from the primary", r.name, vals, onRep)
		}
	}
	pending := e.reader(t, nil, opts(job, b.Token, "-c fence.read_policy=pending")...)
	if rd := catalogOf(t, e.gate, e.db).reads.Load(); rd == nil || rd.all {
		// The database's operators run code (a forger's ||), and q has
		// an operator: it may change the session's state, so it runs on
		// the primary (round 12, attacker X's M1), never on the replica.
		if vals, onRep, err := where(t, pending, q); err != nil || vals[0] != "B" || onRep {
			t.Fatalf("pending: read %v (%v) from replica=%v, want B's result from the primary", vals, err, onRep)
		}
		return
	}
	_, _, err = where(t, pending, q)
	wantCode(t, err, fence.CodePending)
}

// boundedMemory: the proxy knows only jobs that exist (a few per case),
// and holds no backlog of notifications.
func (e *notifyEnv) boundedMemory(t *testing.T) {
	t.Helper()
	cat := catalogOf(t, e.gate, e.db)
	cat.tk.mu.RLock()
	n := len(cat.tk.jobs)
	cat.tk.mu.RUnlock()
	if limit := 2*e.jobs + 10; n > limit {
		t.Fatalf("the proxy records %d jobs after forged notifications; %d exist", n, e.jobs+1)
	}
}
