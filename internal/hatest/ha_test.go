package hatest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/testbin"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testbin.Remove()
	os.Exit(code)
}

// env is a Patroni cluster with a migrated database app, a protected table
// and two `pgfence serve` instances whose primary lists both nodes.
type env struct {
	t       *testing.T
	c       *haCluster
	proxies [2]int // listen ports
	metrics [2]int // metrics ports
	logs    [2]string
	// issued is every token issued before the failover.
	issued []int64
	steps  int
}

func skipUnlessHA(t *testing.T) {
	if os.Getenv("PGFENCE_HA") == "" {
		t.Skip("needs Patroni and etcd: run make test-ha (PGFENCE_HA=1)")
	}
}

func newEnv(t *testing.T, base int, syncMode bool) *env {
	pgf := testbin.Pgfence(t) // built first: building takes a while on a busy machine
	c := startHA(t, base, syncMode)
	e := &env{t: t, c: c}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	leader := c.nodes[0].pgPort
	admin, err := pgx.Connect(ctx, dsn(leader, "postgres", "postgres"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "create database app"); err != nil {
		t.Fatal(err)
	}
	admin.Close(ctx)
	if out, err := exec.Command(pgf, "migrate", "--database", dsn(leader, "postgres", "app")).CombinedOutput(); err != nil {
		t.Fatalf("pgfence migrate: %v\n%s", err, out)
	}
	app, err := pgx.Connect(ctx, dsn(leader, "postgres", "app"))
	if err != nil {
		t.Fatal(err)
	}
	defer app.Close(ctx)
	if _, err := app.Exec(ctx, `
create role wa login; create role wb login;
grant pgfence_worker to wa, wb;
create table results (job_key text primary key, payload text not null, token bigint not null);
grant select, insert, update on results to wa, wb;
select fence.protect('results');`); err != nil {
		t.Fatal(err)
	}
	if syncMode {
		if _, err := app.Exec(ctx, "select fence.set_failover_mode('sync')"); err != nil {
			t.Fatal(err)
		}
	}
	for i := range e.proxies {
		e.proxies[i] = c.port(8 + i)
		e.metrics[i] = c.port(10 + i)
		e.logs[i] = filepath.Join(c.root, fmt.Sprintf("pgfence%d.log", i+1))
		f, err := os.Create(e.logs[i])
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		testbin.Serve(t, f, "--listen", fmt.Sprintf("127.0.0.1:%d", e.proxies[i]),
			"--primary", e.primaryDSN("postgres", "app"),
			"--auth", "trust", "--metrics-listen", fmt.Sprintf("127.0.0.1:%d", e.metrics[i]),
			"--log-format", "json")
	}
	return e
}

// primaryDSN lists both nodes: libpq and pgx pick the one that accepts
// writes, as pgfence serve does upstream.
func (e *env) primaryDSN(user, db string) string {
	return fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%d,%d user=%s dbname=%s target_session_attrs=read-write sslmode=disable connect_timeout=5",
		e.c.nodes[0].pgPort, e.c.nodes[1].pgPort, user, db)
}

// route is where a worker's connection goes: through proxy 1 or 2, or
// straight to PostgreSQL (the backstop).
type route int

const (
	proxy1 route = iota
	proxy2
	direct
)

func (r route) String() string { return [...]string{"proxy 1", "proxy 2", "direct"}[r] }

func (e *env) dsnVia(r route, user string) string {
	if r == direct {
		return e.primaryDSN(user, "app")
	}
	return dsn(e.proxies[r], user, "app")
}

// connect connects as user by route r, with generation g (and step) in
// its settings when g is not nil, as pgfence run's PGOPTIONS does.
func (e *env) connect(r route, user string, g *fence.Lease, step string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(e.dsnVia(r, user))
	if err != nil {
		e.t.Fatal(err)
	}
	if g != nil {
		cfg.RuntimeParams["options"] = fmt.Sprintf("-c fence.job_key=%s -c fence.epoch=%d -c fence.token=%d -c fence.step=%s", g.JobKey, g.Epoch, g.Token, step)
	}
	return pgx.ConnectConfig(ctxT(e.t), cfg)
}

func (e *env) acquire(r route, user, job string) fence.Lease {
	e.t.Helper()
	conn, err := e.connect(r, user, nil, "")
	if err != nil {
		e.t.Fatalf("connect %s as %s: %v", r, user, err)
	}
	defer conn.Close(context.Background())
	l, err := fence.Acquire(ctxT(e.t), conn, job, user, time.Minute)
	if err != nil {
		e.t.Fatalf("acquire %s as %s via %s: %v", job, user, r, err)
	}
	e.issued = append(e.issued, l.Token)
	return l
}

// writeStep upserts g's job's result by route r under step.
func (e *env) writeStep(r route, user string, g fence.Lease, step, payload string) error {
	conn, err := e.connect(r, user, &g, step)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctxT(e.t),
		"insert into results values ($1, $2, $3) on conflict (job_key) do update set payload = excluded.payload, token = excluded.token",
		g.JobKey, payload, g.Token)
	return err
}

// write is writeStep with a step of its own.
func (e *env) write(r route, user string, g fence.Lease, payload string) error {
	e.steps++
	return e.writeStep(r, user, g, fmt.Sprintf("s%d", e.steps), payload)
}

func (e *env) mustWrite(r route, user string, g fence.Lease, payload string) {
	e.t.Helper()
	if err := e.write(r, user, g, payload); err != nil {
		e.t.Fatalf("%s writes %q via %s under token %d: %v", user, payload, r, g.Token, err)
	}
}

func (e *env) wantCode(what string, err error, code string) {
	e.t.Helper()
	if fence.Code(err) != code && pgtest.SQLState(err) != code {
		e.t.Fatalf("%s: %v, want %s", what, err, code)
	}
}

// admin runs sql on the current primary as postgres.
func (e *env) admin(sql string, dst ...any) {
	e.t.Helper()
	conn, err := pgx.Connect(ctxT(e.t), e.primaryDSN("postgres", "app"))
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if len(dst) == 0 {
		_, err = conn.Exec(ctxT(e.t), sql)
	} else {
		err = conn.QueryRow(ctxT(e.t), sql).Scan(dst...)
	}
	if err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
}

func (e *env) payload(job string) string {
	var p string
	e.admin(fmt.Sprintf("select payload from results where job_key = '%s'", job), &p)
	return p
}

// expire makes job's lease expired without waiting for it (the takeover
// then needs no sleep).
func (e *env) expire(job string) {
	e.admin(fmt.Sprintf("update fence.leases set expires_at = clock_timestamp() - interval '1 second' where job_key = '%s'", job))
}

// workers acquire jobs w0..w3, each through one proxy, and write through
// both.
func (e *env) workers() []fence.Lease {
	var ws []fence.Lease
	for i := 0; i < 4; i++ {
		w := e.acquire(route(i%2), "wa", fmt.Sprintf("w%d", i))
		e.mustWrite(proxy1, "wa", w, "w before 1")
		e.mustWrite(proxy2, "wa", w, "w before 2")
		ws = append(ws, w)
	}
	return ws
}

// failover kills the leader (node0) and waits, by asking Patroni's REST API,
// until node1 leads, then until the primary DSN reaches a writable server.
func (e *env) failover() {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e.t.Logf("before the failover:\n%s", e.c.patronictl(e.c.nodes[1]))
	// A session open through each proxy across the failover.
	var open []*pgx.Conn
	for _, r := range []route{proxy1, proxy2} {
		conn, err := e.connect(r, "wa", nil, "")
		if err != nil {
			e.t.Fatal(err)
		}
		defer conn.Close(context.Background())
		open = append(open, conn)
	}
	e.c.killNode(e.c.nodes[0])
	e.c.poll(ctx, "Patroni promotes node1 (GET /primary on node1 is 200)", func() bool { return e.c.api(e.c.nodes[1], "/primary") == 200 })
	e.c.poll(ctx, "node1 accepts writes", func() bool {
		var ro string
		err := e.c.query(ctx, e.c.nodes[1].pgPort, "app", "show transaction_read_only", &ro)
		return err == nil && ro == "off"
	})
	e.t.Logf("after the failover:\n%s", e.c.patronictl(e.c.nodes[1]))
	// Sessions on the old primary end with an error; they do not hang
	// and are not silently moved to the new primary.
	for i, conn := range open {
		qctx, qcancel := context.WithTimeout(ctx, 20*time.Second)
		_, err := conn.Exec(qctx, "select 1")
		timedOut := qctx.Err() != nil
		qcancel()
		if err == nil || timedOut {
			e.t.Fatalf("a session opened through proxy %d before the failover: %v, want an error at once", i+1, err)
		}
		e.t.Logf("a session opened through proxy %d before the failover: %v", i+1, err)
	}
	var era, tl int
	var lossless bool
	var reason string
	e.admin("select era, timeline, lossless, coalesce(reason, '') from fence.current_era()", &era, &tl, &lossless, &reason)
	e.t.Logf("fence.current_era(): era %d, timeline %d, lossless %v, reason %q", era, tl, lossless, reason)
}

// followed waits until each proxy's health check (every 5 s) reports the
// new primary up: pgfence_upstream_up names the node that answered.
func (e *env) followed() {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sample := fmt.Sprintf(`pgfence_upstream_up{addr="127.0.0.1:%d",role="primary"}`, e.c.nodes[1].pgPort)
	for i := range e.metrics {
		e.c.poll(ctx, fmt.Sprintf("proxy %d reports %s 1", i+1, sample), func() bool { return e.metric(i, sample) == 1 })
	}
}

// leaseCLI acquires job by `pgfence lease acquire` through route r.
func (e *env) leaseCLI(r route, user, job string) fence.Lease {
	e.t.Helper()
	out, err := exec.Command(testbin.Pgfence(e.t), "lease", "acquire", "--database", e.dsnVia(r, user),
		"--job", job, "--holder", user, "--ttl", "1m", "--json").Output()
	if err != nil {
		e.t.Fatalf("pgfence lease acquire %s via %s: %v %s", job, r, err, stderrOf(err))
	}
	var l struct {
		JobKey string `json:"job_key"`
		Epoch  int64  `json:"epoch"`
		Token  int64  `json:"token"`
	}
	if err := json.Unmarshal(out, &l); err != nil || l.Token == 0 {
		e.t.Fatalf("pgfence lease acquire printed %q: %v", out, err)
	}
	return fence.Lease{JobKey: l.JobKey, Epoch: l.Epoch, Token: l.Token, Holder: user}
}

// run runs a worker under `pgfence run` through route r: psql writes
// the job's result with the token pgfence run put in PGOPTIONS.
func (e *env) run(r route, job, payload string) error {
	script := fmt.Sprintf(`exec psql "$APP_URL" -X -q -v ON_ERROR_STOP=1 -c "insert into results values ('%s', '%s', current_setting('fence.token')::bigint) on conflict (job_key) do update set payload = excluded.payload, token = excluded.token"`, job, payload)
	cmd := exec.Command(testbin.Pgfence(e.t), "run", "--database", e.dsnVia(r, "wb"), "--job", job, "--holder", "wb", "--ttl", "30s", "--", "sh", "-c", script)
	cmd.Env = append(os.Environ(), "APP_URL="+e.dsnVia(r, "wb"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("pgfence run: %v\n%s", err, out)
	}
	return nil
}

func stderrOf(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}

// metric is the value of the Prometheus sample named name (with its
// labels, as printed) on proxy i's /metrics; 0 when absent.
func (e *env) metric(i int, name string) float64 {
	e.t.Helper()
	cl := http.Client{Timeout: 5 * time.Second}
	resp, err := cl.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", e.metrics[i]))
	if err != nil {
		e.t.Fatalf("metrics of proxy %d: %v", i+1, err)
	}
	out, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 {
		e.t.Fatalf("metrics of proxy %d: %s %v", i+1, resp.Status, err)
	}
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` ([0-9.e+]+)$`)
	m := re.FindSubmatch(out)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseFloat(string(m[1]), 64)
	return v
}

// audit runs pgfence audit over the history on the current primary and
// returns its report; the test fails when it finds violations.
func (e *env) audit() {
	e.t.Helper()
	out, err := exec.Command(testbin.Pgfence(e.t), "audit", "--database", e.primaryDSN("postgres", "app"),
		"--result", "results:job_key:token").CombinedOutput()
	e.t.Logf("pgfence audit:\n%s", out)
	if err != nil {
		e.t.Fatalf("pgfence audit: %v", err)
	}
}

// proxyLog logs the lines of each proxy's log from the failover on, for
// the runbook and for a failure's reader.
func (e *env) proxyLog() {
	for i, p := range e.logs {
		b, _ := os.ReadFile(p)
		lines := strings.Split(string(b), "\n")
		if len(lines) > 30 {
			lines = lines[len(lines)-30:]
		}
		e.t.Logf("pgfence %d log (last lines):\n%s", i+1, strings.Join(lines, "\n"))
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestPatroniAsync: asynchronous replication. B's takeover of J through
// proxy 1 commits on the leader while the replica cannot receive it (the
// replication link is cut: the WAL is not on the replica's disk, so no
// replay at promotion can bring it back); the nemesis kills the leader and
// Patroni promotes the replica. The takeover is lost. Then every generation
// issued before the failover is refused with FN015 — the zombie A, B whose
// takeover was lost, the other workers — through both proxies and
// directly; a new acquire draws a token above every token issued before;
// workers re-acquire and go on (also under pgfence run); pgfence audit is
// clean.
func TestPatroniAsync(t *testing.T) {
	skipUnlessHA(t)
	e := newEnv(t, 61000, false)
	ctx := ctxT(t)
	a := e.acquire(proxy1, "wa", "j")
	e.mustWrite(proxy1, "wa", a, "a")
	if err := e.run(proxy2, "cron", "cron before"); err != nil {
		t.Fatal(err)
	}
	ws := e.workers()

	// Everything so far is on the replica; from here on nothing reaches it.
	leader, replica := e.c.nodes[0], e.c.nodes[1]
	e.c.poll(ctx, "the replica has received everything", func() bool {
		var ok bool
		err := e.c.query(ctx, leader.pgPort, "postgres",
			"select count(*) = 1 from pg_stat_replication where state = 'streaming' and flush_lsn = pg_current_wal_lsn()", &ok)
		return err == nil && ok
	})
	leader.link.Cut()
	e.c.poll(ctx, "the replication link is down (no walsender on the leader, no streaming receiver on the replica)", func() bool {
		var ok bool
		err := e.c.query(ctx, leader.pgPort, "postgres", "select count(*) = 0 from pg_stat_replication", &ok)
		if err != nil || !ok {
			return false
		}
		err = e.c.query(ctx, replica.pgPort, "postgres", "select count(*) = 0 from pg_stat_wal_receiver where status = 'streaming'", &ok)
		return err == nil && ok
	})
	var received string
	if err := e.c.query(ctx, replica.pgPort, "postgres", "select pg_last_wal_receive_lsn()::text", &received); err != nil {
		t.Fatal(err)
	}

	// The takeover and B's write, through proxy 1, reach only the leader.
	e.expire("j")
	b := e.acquire(proxy1, "wb", "j")
	e.mustWrite(proxy1, "wb", b, "b")
	e.wantCode("zombie A writes after the takeover, before the failover", e.write(proxy2, "wa", a, "zombie before"), fence.CodeStale)
	var beyond bool
	if err := e.c.query(ctx, leader.pgPort, "postgres",
		fmt.Sprintf("select pg_current_wal_lsn() > '%s'::pg_lsn", received), &beyond); err != nil || !beyond {
		t.Fatalf("the takeover is not beyond what the replica received (%s): %v %v", received, beyond, err)
	}
	var stillReceived string
	if err := e.c.query(ctx, replica.pgPort, "postgres", "select pg_last_wal_receive_lsn()::text", &stillReceived); err != nil || stillReceived != received {
		t.Fatalf("the replica received more after the cut: %s, then %s (%v)", received, stillReceived, err)
	}
	maxBefore := int64(0)
	for _, tok := range e.issued {
		maxBefore = max(maxBefore, tok)
	}

	e.failover()

	if got := e.payload("j"); got != "a" {
		t.Fatalf("after the failover J's result is %q, want A's (B's write was lost with the takeover)", got)
	}
	for _, r := range []route{proxy1, proxy2, direct} {
		e.wantCode("zombie A writes via "+r.String(), e.write(r, "wa", a, "zombie"), fence.CodeFailover)
		e.wantCode("B, whose takeover was lost, writes via "+r.String(), e.write(r, "wb", b, "b again"), fence.CodeFailover)
		for _, w := range ws {
			e.wantCode("worker "+w.JobKey+" writes via "+r.String(), e.write(r, "wa", w, "w after"), fence.CodeFailover)
		}
	}
	// B retries its commit: the new primary has no receipt of it: FN015,
	// not a first commit. A's retry of its surviving commit is a replay.
	e.wantCode("B retries its lost commit directly", e.writeStep(direct, "wb", b, "s2", "b"), fence.CodeFailover)
	e.wantCode("A retries its surviving commit directly", e.writeStep(direct, "wa", a, "s1", "a"), fence.CodeReplay)
	if got := e.payload("j"); got != "a" {
		t.Fatalf("after the refused writes J's result is %q, want A's", got)
	}

	// A new acquire: above every token issued before the failover, on
	// either proxy; the void leases do not hold their jobs.
	c := e.leaseCLI(proxy2, "wb", "j")
	if c.Token <= maxBefore {
		t.Fatalf("token %d issued after the failover is not above %d, the largest issued before", c.Token, maxBefore)
	}
	e.mustWrite(proxy1, "wb", c, "c")
	e.mustWrite(proxy2, "wb", c, "c 2")
	for i, w := range ws {
		n := e.acquire(route(i%2), "wb", w.JobKey)
		if n.Token <= maxBefore {
			t.Fatalf("worker %s's new token %d is not above %d", w.JobKey, n.Token, maxBefore)
		}
		e.mustWrite(route((i+1)%2), "wb", n, "w after")
	}
	if err := e.run(proxy1, "cron", "cron after"); err != nil {
		t.Fatalf("a worker under pgfence run after the failover: %v", err)
	}
	var era int
	var lossless bool
	e.admin("select era, lossless from fence.current_era()", &era, &lossless)
	if era < 2 || lossless {
		t.Fatalf("current era %d (lossless %v), want a new, lossy era", era, lossless)
	}
	for i := range e.proxies {
		if n := e.metric(i, `pgfence_gate_errors_total{code="FN015"}`); n == 0 {
			t.Errorf("proxy %d counted no FN015 in pgfence_gate_errors_total", i+1)
		}
	}
	e.followed()
	e.audit()
	e.proxyLog()
}

// TestPatroniSync: Patroni's synchronous_mode and fence failover_mode
// sync. B's takeover through proxy 1 is acknowledged only once the
// synchronous standby has it; the nemesis kills the leader; Patroni
// promotes the standby. B and the other workers keep their leases and
// write on through both proxies; the zombie A is refused with FN001, as
// before the failover; no lease is void; pgfence audit is clean.
func TestPatroniSync(t *testing.T) {
	skipUnlessHA(t)
	e := newEnv(t, 61030, true)
	a := e.acquire(proxy1, "wa", "j")
	e.mustWrite(proxy1, "wa", a, "a")
	ws := e.workers()
	e.expire("j")
	b := e.acquire(proxy1, "wb", "j") // its commit waits for the standby
	e.mustWrite(proxy2, "wb", b, "b")
	e.wantCode("zombie A writes after the takeover, before the failover", e.write(proxy2, "wa", a, "zombie before"), fence.CodeStale)

	e.failover()

	if got := e.payload("j"); got != "b" {
		t.Fatalf("after the failover J's result is %q, want B's", got)
	}
	for _, r := range []route{proxy1, proxy2, direct} {
		e.wantCode("zombie A writes via "+r.String(), e.write(r, "wa", a, "zombie"), fence.CodeStale)
		e.mustWrite(r, "wb", b, "b after via "+r.String())
		for _, w := range ws {
			e.mustWrite(r, "wa", w, "w after via "+r.String())
		}
	}
	var lossless bool
	e.admin("select lossless from fence.current_era()", &lossless)
	if !lossless {
		t.Fatal("the era after a failover in sync mode is not lossless")
	}
	// The new primary has no synchronous standby (the old leader is dead):
	// Patroni (synchronous_mode_strict: false) turns synchronous replication
	// off, and an acquire fails closed (55000) rather than hand out a
	// takeover a second failover could lose. Renewals go on.
	var ssn string
	e.admin("show synchronous_standby_names", &ssn)
	t.Logf("synchronous_standby_names on the new primary: %q", ssn)
	conn, err := e.connect(proxy2, "wb", nil, "")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := fence.Renew(ctxT(t), conn, "j", b.Token, time.Minute); err != nil {
		t.Fatalf("B renews its lease after the failover: %v", err)
	}
	if ssn == "" {
		_, err := fence.Acquire(ctxT(t), conn, "new", "wb", time.Minute)
		e.wantCode("acquire in sync mode without a synchronous standby", err, "55000")
	}
	e.followed()
	e.audit()
	e.proxyLog()
}
