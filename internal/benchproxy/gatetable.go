package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgbench"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/seedbench"
)

// The gate table (issue 33): one fenced write transaction six ways, in
// alternation within each round, for each workload at one client on one
// job key and at eight clients on eight job keys, printed as markdown.
//
// Eight clients are eight pgbench processes of one client each, run in
// parallel and summed (TPS) and averaged (latency): each has its own job
// key and its generation in PGOPTIONS, as a worker connects, so the gated
// path is the one a worker takes. One pgbench with -c 8 could give each
// client its own key only by SET LOCAL fence.job_key/epoch/token chosen by
// :client_id inside the script, which is not how a worker presents its
// generation (the proxy would see a generation that changes every
// transaction). Every row runs the same way, so the rows compare.

// gateClients are the client counts of the gate table, one job key each.
var gateClients = []int{1, 8}

// A gateWorkload is one transaction shape of the gate table.
type gateWorkload struct {
	name   string // in the cell name, "gate <name> c=N", for -only
	mode   string // pgbench -M; "" for the COPY workload, timed with pgconn
	writes int    // statements that write per transaction (1 or 5)
	copy   bool   // one COPY of copyRows rows instead of the upserts
	desc   string
}

const copyRows = 1000

var gateWorkloads = []gateWorkload{
	{name: "simple", mode: "simple", writes: 1, desc: "pgbench -M simple: BEGIN; one conditional upsert; COMMIT"},
	{name: "extended", mode: "extended", writes: 1, desc: "pgbench -M extended: BEGIN; one conditional upsert; COMMIT (the step by set_config, a round trip of its own)"},
	{name: "prepared", mode: "prepared", writes: 1, desc: "pgbench -M prepared: as extended, each statement prepared once per session"},
	{name: "5writes", mode: "simple", writes: 5, desc: "pgbench -M simple: BEGIN; 5 conditional upserts into 2 tables (1 result row, 4 item rows); COMMIT"},
	{name: "copy", copy: true, desc: fmt.Sprintf("pgx (pgconn), simple protocol: BEGIN; COPY of %d rows (text format) into one table; COMMIT", copyRows)},
}

// gatePaths are the rows of the gate table, in the order they alternate.
var gatePaths = []struct {
	id, label string
}{
	{"direct", "unfenced, direct to PostgreSQL"},
	{"ungated", "unfenced, through pgfence (gate on, unprotected table)"},
	// Not one of the rows: the same transaction through the
	// same gate from a session without a generation. In a fenced
	// session every write is tentative (it may reach a protected table
	// where the gate cannot see) and the transaction ends with
	// fence.commit_if_written; here nothing is added.
	{"nogen", "unfenced, through pgfence, a session without a generation"},
	{"seed", "the seed's fence SQL by hand, direct"},
	{"seed-pgb", "the seed's fence SQL by hand, through PgBouncer (session mode)"},
	{"gated", "**gated by pgfence** (generation in PGOPTIONS, SET LOCAL fence.step)"},
	{"backstop", "the backstop alone (generation in PGOPTIONS, SET LOCAL fence.step, direct, no proxy)"},
	// Not one of the rows: for the breakdown of the gated row
	// (gated − fenced is the proxy's share; simple-protocol workloads
	// only, the script rides fence.gate in the BEGIN's query).
	{"fenced", "the protocol's SQL by hand (fence.gate with BEGIN, the writes, fence.commit with COMMIT), direct"},
}

// gateResult is one path's figures in one cell, averaged over rounds.
type gateResult struct {
	tps, lat     float64 // transactions per second (summed over clients), mean latency in ms
	txns         float64 // transactions processed
	pgCPU, pxCPU float64 // µs of CPU per transaction: PostgreSQL's processes, the relay's process
	hasPx        bool
}

// gateEnv is what the gate table runs against.
type gateEnv struct {
	ctx     context.Context
	admin   *pgx.Conn // superuser, straight to PostgreSQL
	db      string
	direct  int    // PostgreSQL's port
	gate    target // pgfence serve with the gate
	pgb     target // PgBouncer, session mode; port 0 when not installed
	dir     string // scripts
	leases  []fence.Lease
	pm      int // the postmaster's pid
	dur     time.Duration
	rounds  int
	bin     string // pgfence binary, for the memory figure; empty: in-process
	stmts   bool   // pg_stat_statements is loaded: read it around the last round's fenced paths
	stmtOut []string
	primary string // PostgreSQL DSN for a pgfence serve
	steps   atomic.Int64
}

// benchGateTable sets up the tables and leases, runs every selected cell
// and prints the table, the ratios, CPU and memory as markdown.
func benchGateTable(ctx context.Context, c *pgtest.Cluster, db string, gate, pgb target, bin string, only *regexp.Regexp, dur time.Duration, rounds int, stmts bool) error {
	type cell struct {
		w       gateWorkload
		clients int
		paths   map[string]bool
	}
	// A cell runs the paths for which -only matches its name or its name
	// and the path's ("gate simple c=8 gated").
	var cells []cell
	for _, w := range gateWorkloads {
		for _, n := range gateClients {
			name := fmt.Sprintf("gate %s c=%d", w.name, n)
			paths := map[string]bool{}
			for _, p := range gatePaths {
				if only.MatchString(name) || only.MatchString(name+" "+p.id) {
					paths[p.id] = true
				}
			}
			if len(paths) > 0 {
				cells = append(cells, cell{w, n, paths})
			}
		}
	}
	if len(cells) == 0 {
		return nil
	}
	admin, err := c.Primary.Connect(ctx, db)
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	e := &gateEnv{ctx: ctx, admin: admin, db: db, direct: c.Primary.Port, gate: gate, pgb: pgb,
		dur: dur, rounds: rounds, bin: bin, primary: c.Primary.DSN("postgres"), stmts: stmts}
	if err := e.setup(); err != nil {
		return fmt.Errorf("gate table setup: %w", err)
	}
	if e.dir, err = os.MkdirTemp("", "pgfence-bench-gate-"); err != nil {
		return err
	}
	defer os.RemoveAll(e.dir)

	results := make(map[string]map[string]gateResult) // cell → path → result
	var order []string
	for _, cl := range cells {
		name := fmt.Sprintf("gate %s c=%d", cl.w.name, cl.clients)
		order = append(order, name)
		res := map[string]gateResult{}
		for r := 0; r < rounds; r++ {
			for _, p := range gatePaths {
				if !cl.paths[p.id] || p.id == "seed-pgb" && pgb.port == 0 || p.id == "fenced" && cl.w.mode != "simple" {
					continue
				}
				watch := e.stmts && r == rounds-1 && p.id != "direct" && p.id != "seed-pgb"
				if watch {
					if _, err := admin.Exec(ctx, "SELECT pg_stat_statements_reset()"); err != nil {
						return err
					}
				}
				got, err := e.measure(cl.w, cl.clients, p.id)
				if err != nil {
					return fmt.Errorf("%s, %s: %w", name, p.id, err)
				}
				if watch {
					if err := e.readStatements(name, p.id, got.txns); err != nil {
						return err
					}
				}
				s := res[p.id]
				s.tps += got.tps / float64(rounds)
				s.lat += got.lat / float64(rounds)
				s.pgCPU += got.pgCPU / float64(rounds)
				s.pxCPU += got.pxCPU / float64(rounds)
				s.hasPx = got.hasPx
				res[p.id] = s
			}
		}
		results[name] = res
		fmt.Fprintf(os.Stderr, "benchproxy: %s done\n", name)
	}
	mem, memErr := e.sessionMemory()
	e.print(order, results, mem, memErr)
	for _, o := range e.stmtOut {
		fmt.Print(o)
	}
	return nil
}

// readStatements keeps the top of pg_stat_statements (track = all: the
// statements inside functions and triggers too, so a function's time
// includes its statements') after path p's run of txns transactions.
func (e *gateEnv) readStatements(cell, p string, txns float64) error {
	rows, err := e.admin.Query(e.ctx, `SELECT calls, total_exec_time, total_plan_time, toplevel, left(regexp_replace(query, '\s+', ' ', 'g'), 110)
FROM pg_stat_statements WHERE query NOT LIKE '%pg_stat_statements%' ORDER BY total_exec_time + total_plan_time DESC LIMIT 14`)
	if err != nil {
		return err
	}
	defer rows.Close()
	var b strings.Builder
	fmt.Fprintf(&b, "\npg_stat_statements, %s, %s (%.0f transactions; µs per transaction, nested statements included in their caller's time):\n\n", cell, p, txns)
	b.WriteString("| calls/tx | exec µs/tx | plan µs/tx | top level | statement |\n|---|---|---|---|---|\n")
	for rows.Next() {
		var calls int64
		var exec, plan float64
		var top bool
		var q string
		if err := rows.Scan(&calls, &exec, &plan, &top, &q); err != nil {
			return err
		}
		fmt.Fprintf(&b, "| %.2f | %.1f | %.1f | %v | `%s` |\n", float64(calls)/txns, exec*1000/txns, plan*1000/txns, top, strings.ReplaceAll(q, "|", "\\|"))
	}
	e.stmtOut = append(e.stmtOut, b.String())
	return rows.Err()
}

// setup creates the tables of every path and takes one lease per client.
func (e *gateEnv) setup() error {
	max := 0
	for _, n := range gateClients {
		max = maxInt(max, n)
	}
	var b strings.Builder
	b.WriteString(`
CREATE TABLE gt_results (job_key text PRIMARY KEY, payload text NOT NULL, token bigint NOT NULL);
CREATE TABLE gt_items (job_key text NOT NULL, n int NOT NULL, payload text NOT NULL, token bigint NOT NULL, PRIMARY KEY (job_key, n));
CREATE TABLE gt_copy (job_key text NOT NULL, n int NOT NULL, payload text NOT NULL);
CREATE TABLE gt_results_plain (LIKE gt_results INCLUDING ALL);
CREATE TABLE gt_items_plain (LIKE gt_items INCLUDING ALL);
CREATE TABLE gt_copy_plain (LIKE gt_copy INCLUDING ALL);
SELECT fence.protect('gt_results');
SELECT fence.protect('gt_items');
SELECT fence.protect('gt_copy');
CREATE TABLE report_items (job_key text NOT NULL, n int NOT NULL, payload text, applied_fencing_token bigint, PRIMARY KEY (job_key, n));
CREATE TABLE report_copy (job_key text NOT NULL, n int NOT NULL, payload text NOT NULL);
`)
	// The seed's fence rows, one per client (report_fences may exist:
	// the gated-write section creates the seed's schema).
	var exists bool
	if err := e.admin.QueryRow(e.ctx, "SELECT to_regclass('report_fences') IS NOT NULL").Scan(&exists); err != nil {
		return err
	}
	if !exists {
		b.WriteString(seedbench.Schema)
	}
	for k := 1; k <= max; k++ {
		fmt.Fprintf(&b, "INSERT INTO report_fences VALUES ('%s', %d);\n", seedKey(k), seedbench.Token)
	}
	if _, err := e.admin.Exec(e.ctx, b.String()); err != nil {
		return err
	}
	for k := 1; k <= max; k++ {
		l, err := fence.Acquire(e.ctx, e.admin, gateKey(k), "benchproxy", 24*time.Hour)
		if err != nil {
			return err
		}
		e.leases = append(e.leases, l)
	}
	var pid int
	if err := e.admin.QueryRow(e.ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		return err
	}
	e.pm = parentPid(pid)
	if e.pm <= 1 {
		return fmt.Errorf("cannot find the postmaster of backend %d", pid)
	}
	return nil
}

func maxInt(a, b int) int {
	if a > b {
		return a
	}
	return b
}

func gateKey(k int) string { return "gt-" + strconv.Itoa(k) }
func seedKey(k int) string { return "seed-job-" + strconv.Itoa(k) }

// gen is client k's generation as PGOPTIONS.
func (e *gateEnv) gen(k int) string {
	l := e.leases[k-1]
	return fmt.Sprintf("-c fence.job_key=%s -c fence.epoch=%d -c fence.token=%d", l.JobKey, l.Epoch, l.Token)
}

// route is where path p connects and whether it presents a generation.
func (e *gateEnv) route(p string) (port int, relay *target, gen bool) {
	switch p {
	case "direct", "seed":
		return e.direct, nil, false
	case "ungated", "gated":
		return e.gate.port, &e.gate, true
	case "nogen":
		return e.gate.port, &e.gate, false
	case "seed-pgb":
		return e.pgb.port, &e.pgb, false
	case "backstop", "fenced":
		return e.direct, nil, true
	}
	panic("unknown path " + p)
}

// stepPrefix tells the rows' receipts apart (the step's first letter in
// simple scripts, a range of numbers in extended ones).
var stepPrefix = map[string]int{"ungated": 1, "seed": 2, "seed-pgb": 3, "gated": 4, "backstop": 5, "fenced": 6}

// script is path p's pgbench script for client k in workload w.
func (e *gateEnv) script(w gateWorkload, p string, k int) string {
	l := e.leases[k-1]
	simple := w.mode == "simple"
	var b strings.Builder
	fenced := p == "ungated" || p == "gated" || p == "backstop" || p == "fenced"
	seed := p == "seed" || p == "seed-pgb"
	results, items := "gt_results_plain", "gt_items_plain"
	if p == "gated" || p == "backstop" || p == "fenced" {
		results, items = "gt_results", "gt_items"
	}
	if fenced || seed {
		// A new step per transaction: every commit writes its own
		// receipt. Steps are numbers here; each path has its own range.
		fmt.Fprintf(&b, "\\set s random(1, 1000000000000) + %d000000000000\n", stepPrefix[p])
	}
	switch {
	case p == "fenced":
		// What the proxy sends, typed by hand: the gate in the BEGIN's
		// query, the receipt step in the COMMIT's.
		fmt.Fprintf(&b, "BEGIN\\; SET LOCAL fence.step = ':s'\\; SELECT fence.gate('%s', %d, %d, ':s');\n", l.JobKey, l.Epoch, l.Token)
	case fenced && simple:
		// The step rides in the BEGIN's query (no round trip of its own).
		b.WriteString("BEGIN\\; SET LOCAL fence.step = ':s';\n")
	case fenced:
		// The extended protocol takes one statement per query: the
		// step by set_config with a bound parameter, as a driver sends
		// it (SET takes no parameters).
		b.WriteString("BEGIN;\nSELECT set_config('fence.step', :s, true);\n")
	default:
		b.WriteString("BEGIN;\n")
	}
	if seed {
		step := ":s"
		if simple {
			step = "':s'"
		}
		fmt.Fprintf(&b, "SELECT max_issued_token FROM report_fences WHERE job_key = '%s' AND max_issued_token = %d FOR UPDATE;\n", seedKey(k), seedbench.Token)
		fmt.Fprintf(&b, "INSERT INTO report_commit_receipts (job_key, fencing_token, step, payload_digest) VALUES ('%s', %d, %s, sha256('benchmark payload')) ON CONFLICT DO NOTHING;\n", seedKey(k), seedbench.Token, step)
		fmt.Fprintf(&b, "INSERT INTO report_results (job_key, payload, applied_fencing_token) VALUES ('%s', 'benchmark payload', %d) "+
			"ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, applied_fencing_token = excluded.applied_fencing_token "+
			"WHERE report_results.applied_fencing_token < excluded.applied_fencing_token;\n", seedKey(k), seedbench.Token)
		for n := 1; n < w.writes; n++ {
			fmt.Fprintf(&b, "INSERT INTO report_items (job_key, n, payload, applied_fencing_token) VALUES ('%s', %d, 'benchmark payload', %d) "+
				"ON CONFLICT (job_key, n) DO UPDATE SET payload = excluded.payload, applied_fencing_token = excluded.applied_fencing_token "+
				"WHERE report_items.applied_fencing_token < excluded.applied_fencing_token;\n", seedKey(k), n, seedbench.Token)
		}
	} else {
		fmt.Fprintf(&b, "INSERT INTO %[1]s (job_key, payload, token) VALUES ('%[2]s', 'benchmark payload', %[3]d) "+
			"ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token WHERE %[1]s.token < excluded.token;\n", results, l.JobKey, l.Token)
		for n := 1; n < w.writes; n++ {
			fmt.Fprintf(&b, "INSERT INTO %[1]s (job_key, n, payload, token) VALUES ('%[2]s', %[3]d, 'benchmark payload', %[4]d) "+
				"ON CONFLICT (job_key, n) DO UPDATE SET payload = excluded.payload, token = excluded.token WHERE %[1]s.token < excluded.token;\n", items, l.JobKey, n, l.Token)
		}
	}
	if p == "fenced" {
		fmt.Fprintf(&b, "SELECT fence.commit('%s', %d, %d, ':s', '\\x00'::bytea, 'v1')\\; ", l.JobKey, l.Epoch, l.Token)
	}
	b.WriteString("COMMIT;\n")
	return b.String()
}

// receipts counts fence receipts: a gated or backstop run must add some,
// an ungated one none.
func (e *gateEnv) receipts() (int64, error) {
	var n int64
	err := e.admin.QueryRow(e.ctx, "SELECT count(*) FROM fence.receipts WHERE job_key LIKE 'gt-%'").Scan(&n)
	return n, err
}

// measure runs path p of workload w with n clients for e.dur.
func (e *gateEnv) measure(w gateWorkload, n int, p string) (gateResult, error) {
	r0, err := e.receipts()
	if err != nil {
		return gateResult{}, err
	}
	var res gateResult
	if w.copy {
		res, err = e.measureCopy(n, p)
	} else {
		res, err = e.measurePgbench(w, n, p)
	}
	if err != nil {
		return res, err
	}
	r1, err := e.receipts()
	if err != nil {
		return res, err
	}
	switch {
	case (p == "gated" || p == "backstop" || p == "fenced") && r1 == r0:
		return res, errors.New("no receipt written: the fence did not act")
	case (p == "ungated" || p == "nogen") && r1 != r0:
		return res, errors.New("receipts written on an unprotected table")
	}
	if w.copy {
		// The COPY tables grow by 1,000 rows a transaction: empty them,
		// outside the measurement, in a fenced transaction of client 1's
		// generation (the backstop refuses TRUNCATE without one, even to
		// a superuser).
		l := e.leases[0]
		if _, err := e.admin.Exec(e.ctx, fmt.Sprintf("BEGIN; SET LOCAL fence.job_key = '%s'; SET LOCAL fence.epoch = %d; SET LOCAL fence.token = %d; SET LOCAL fence.step = 't%d'; "+
			"TRUNCATE gt_copy, gt_copy_plain, report_copy; COMMIT", l.JobKey, l.Epoch, l.Token, e.steps.Add(1))); err != nil {
			return res, fmt.Errorf("truncate the COPY tables: %w", err)
		}
	}
	return res, nil
}

// cpuMeter reads the CPU of PostgreSQL's processes and of the path's
// relay, before and after a run.
type cpuMeter struct {
	e         *gateEnv
	relay     *target
	pg0, px0  time.Duration
	children0 int
	txns      float64
}

func (e *gateEnv) startCPU(relay *target) *cpuMeter {
	m := &cpuMeter{e: e, relay: relay}
	m.children0 = len(childPids(e.pm))
	m.pg0 = clusterCPU(e.pm)
	if relay != nil && relay.cpu != nil {
		m.px0 = relay.cpu()
	}
	return m
}

// stop ends the measurement of txns transactions. After a pgbench run
// its backends exit on their own: stop waits (up to a second) until the
// postmaster has reaped them, so their CPU is in its children's times.
func (m *cpuMeter) stop(txns float64, waitReaped bool, res *gateResult) {
	if waitReaped {
		for deadline := time.Now().Add(time.Second); time.Now().Before(deadline) && len(childPids(m.e.pm)) > m.children0; {
			time.Sleep(10 * time.Millisecond)
		}
	}
	if txns <= 0 {
		return
	}
	res.pgCPU = float64((clusterCPU(m.e.pm) - m.pg0).Microseconds()) / txns
	if m.relay != nil && m.relay.cpu != nil {
		res.pxCPU = float64((m.relay.cpu() - m.px0).Microseconds()) / txns
		res.hasPx = true
	}
}

// measurePgbench runs n pgbench processes of one client each in
// parallel, client k with its own job key (and generation), and sums.
func (e *gateEnv) measurePgbench(w gateWorkload, n int, p string) (gateResult, error) {
	port, relay, gen := e.route(p)
	files := make([]string, n)
	for k := 1; k <= n; k++ {
		files[k-1] = filepath.Join(e.dir, fmt.Sprintf("%s-%s-%d.sql", w.name, p, k))
		if err := os.WriteFile(files[k-1], []byte(e.script(w, p, k)), 0o644); err != nil {
			return gateResult{}, err
		}
	}
	secs := strconv.Itoa(int(e.dur.Seconds()))
	out := make([]pgbench.Result, n)
	errs := make([]error, n)
	m := e.startCPU(relay)
	var wg sync.WaitGroup
	for k := 1; k <= n; k++ {
		wg.Add(1)
		go func(k int) {
			defer wg.Done()
			var env []string
			if gen {
				env = []string{"PGOPTIONS=" + e.gen(k)}
			}
			out[k-1], errs[k-1] = pgbench.Measure(env, port, e.db, "-n", "-M", w.mode, "-c", "1", "-j", "1", "-T", secs, "-f", files[k-1])
		}(k)
	}
	wg.Wait()
	idle := 0
	for k, err := range errs {
		// A client whose first transaction did not end within the run
		// (its session's start through a loaded proxy, say) counts as
		// zero; the table says so.
		if errors.Is(err, pgbench.ErrNoTransactions) {
			errs[k] = nil
			idle++
		}
	}
	if err := errors.Join(errs...); err != nil {
		return gateResult{}, err
	}
	if idle == n {
		return gateResult{}, fmt.Errorf("no client completed a transaction in %v", e.dur)
	}
	if idle > 0 {
		fmt.Fprintf(os.Stderr, "benchproxy: %s c=%d %s: %d client(s) completed no transaction\n", w.name, n, p, idle)
	}
	var res gateResult
	for _, o := range out {
		res.tps += o.TPS
		res.lat += o.Latency / float64(n-idle)
		res.txns += float64(o.Txns)
	}
	m.stop(res.txns, true, &res)
	return res, nil
}

// measureCopy times the COPY workload with n pgconn clients for e.dur
// (pgbench cannot send COPY data): BEGIN (with the step, for the fenced
// paths), for the seed its fence row and receipt, one COPY of copyRows
// rows in text format, COMMIT; a simple-protocol query each.
func (e *gateEnv) measureCopy(n int, p string) (gateResult, error) {
	port, relay, gen := e.route(p)
	ctx := e.ctx
	conns := make([]*pgconn.PgConn, n)
	defer func() {
		for _, c := range conns {
			if c != nil {
				c.Close(ctx)
			}
		}
	}()
	for k := 1; k <= n; k++ {
		cfg, err := pgconn.ParseConfig(fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=%s sslmode=disable", port, e.db))
		if err != nil {
			return gateResult{}, err
		}
		if gen {
			cfg.RuntimeParams["options"] = e.gen(k)
		}
		if conns[k-1], err = pgconn.ConnectConfig(ctx, cfg); err != nil {
			return gateResult{}, err
		}
	}
	table := "gt_copy_plain"
	switch p {
	case "gated", "backstop":
		table = "gt_copy"
	case "seed", "seed-pgb":
		table = "report_copy"
	}
	exec := func(c *pgconn.PgConn, sql string) error {
		_, err := c.Exec(ctx, sql).ReadAll()
		return err
	}
	counts := make([]int, n)
	lats := make([]time.Duration, n)
	errs := make([]error, n)
	m := e.startCPU(relay)
	t0 := time.Now()
	deadline := t0.Add(e.dur)
	var wg sync.WaitGroup
	for k := 1; k <= n; k++ {
		wg.Add(1)
		go func(k int) {
			defer wg.Done()
			c := conns[k-1]
			key := gateKey(k)
			if p == "seed" || p == "seed-pgb" {
				key = seedKey(k)
			}
			var data bytes.Buffer
			for i := 1; i <= copyRows; i++ {
				fmt.Fprintf(&data, "%s\t%d\tbenchmark payload\n", key, i)
			}
			copySQL := "COPY " + table + " (job_key, n, payload) FROM STDIN"
			for time.Now().Before(deadline) {
				s0 := time.Now()
				step := strconv.FormatInt(int64(stepPrefix[p])*1e12+e.steps.Add(1), 10)
				begin := "BEGIN"
				if gen {
					begin = "BEGIN; SET LOCAL fence.step = '" + step + "'"
				}
				err := exec(c, begin)
				if err == nil && (p == "seed" || p == "seed-pgb") {
					err = exec(c, fmt.Sprintf("SELECT max_issued_token FROM report_fences WHERE job_key = '%s' AND max_issued_token = %d FOR UPDATE", key, seedbench.Token))
					if err == nil {
						err = exec(c, fmt.Sprintf("INSERT INTO report_commit_receipts (job_key, fencing_token, step, payload_digest) VALUES ('%s', %d, '%s', sha256('benchmark payload')) ON CONFLICT DO NOTHING", key, seedbench.Token, step))
					}
				}
				if err == nil {
					_, err = c.CopyFrom(ctx, bytes.NewReader(data.Bytes()), copySQL)
				}
				if err == nil {
					err = exec(c, "COMMIT")
				}
				if err != nil {
					errs[k-1] = err
					return
				}
				lats[k-1] += time.Since(s0)
				counts[k-1]++
			}
		}(k)
	}
	wg.Wait()
	elapsed := time.Since(t0)
	if err := errors.Join(errs...); err != nil {
		return gateResult{}, err
	}
	var res gateResult
	total := 0
	var lat time.Duration
	for k := range counts {
		total += counts[k]
		lat += lats[k]
	}
	if total == 0 {
		return res, errors.New("no transaction completed")
	}
	res.tps = float64(total) / elapsed.Seconds()
	res.txns = float64(total)
	res.lat = float64(lat.Microseconds()) / 1000 / float64(total)
	m.stop(float64(total), false, &res)
	return res, nil
}

// sessionMemory is the RSS of a fresh `pgfence serve` (with the gate)
// with 1 and with 50 idle fenced sessions, each of which has committed
// one gated transaction. It needs the binary (-pgfence).
type memFigure struct{ one, fifty int64 } // KiB

func (e *gateEnv) sessionMemory() (memFigure, error) {
	if e.bin == "" {
		return memFigure{}, errors.New("needs -pgfence (the proxy runs in this process)")
	}
	port, pid, stop, err := startServe(e.bin, e.primary)
	if err != nil {
		return memFigure{}, err
	}
	defer stop()
	ctx := e.ctx
	var conns []*pgconn.PgConn
	defer func() {
		for _, c := range conns {
			c.Close(ctx)
		}
	}()
	open := func(total int) error {
		for len(conns) < total {
			cfg, err := pgconn.ParseConfig(fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=%s sslmode=disable", port, e.db))
			if err != nil {
				return err
			}
			cfg.RuntimeParams["options"] = e.gen(1)
			c, err := pgconn.ConnectConfig(ctx, cfg)
			if err != nil {
				return err
			}
			conns = append(conns, c)
			step := strconv.FormatInt(9e12+e.steps.Add(1), 10)
			if _, err := c.Exec(ctx, "BEGIN; SET LOCAL fence.step = '"+step+"'; "+
				"INSERT INTO gt_items (job_key, n, payload, token) VALUES ('gt-1', "+strconv.Itoa(100+len(conns))+", 'memory', 1) ON CONFLICT (job_key, n) DO UPDATE SET token = excluded.token; COMMIT").ReadAll(); err != nil {
				return fmt.Errorf("gated transaction of session %d: %w", len(conns), err)
			}
		}
		time.Sleep(500 * time.Millisecond) // let the sessions settle (GC)
		return nil
	}
	var m memFigure
	if err := open(1); err != nil {
		return m, err
	}
	m.one = procRSS(pid)
	if err := open(50); err != nil {
		return m, err
	}
	m.fifty = procRSS(pid)
	return m, nil
}

// print writes the gate table as markdown.
func (e *gateEnv) print(cells []string, results map[string]map[string]gateResult, mem memFigure, memErr error) {
	fmt.Printf("\n### Gated write transactions (issue 33)\n\n")
	fmt.Printf("%d round(s) of %v per path, paths alternating within each round; c=N is N clients on N job keys, one lease each (N pgbench processes of one client, summed); %d CPUs; PostgreSQL CPU is every process of the cluster (backends, background workers), the proxy's the relay process's.\n\n", e.rounds, e.dur, numCPU())
	wl := map[string]gateWorkload{}
	for _, w := range gateWorkloads {
		wl[w.name] = w
	}
	lastW := ""
	for _, cell := range cells {
		f := strings.Fields(cell) // "gate", workload, "c=N"
		w := wl[f[1]]
		if f[1] != lastW {
			if lastW != "" {
				fmt.Println()
			}
			fmt.Printf("**%s** — %s\n\n", w.name, w.desc)
			fmt.Println("| path | clients | tps | relative | mean latency ms | PostgreSQL CPU µs/tx | proxy CPU µs/tx |")
			fmt.Println("|---|---|---|---|---|---|---|")
			lastW = f[1]
		}
		res := results[cell]
		base := res["direct"].tps
		if base == 0 {
			base = math.NaN()
		}
		for _, p := range gatePaths {
			r, ok := res[p.id]
			if !ok {
				continue
			}
			px := "–"
			if r.hasPx {
				px = fmt.Sprintf("%.0f", r.pxCPU)
			}
			fmt.Printf("| %s | %s | %s | %.2f | %.3f | %.0f | %s |\n", p.label, strings.TrimPrefix(f[2], "c="), thousands(r.tps), r.tps/base, r.lat, r.pgCPU, px)
		}
	}
	fmt.Printf("\n**Ratios** (TPS; targets: gated / seed ≥ 1.0 direct and via PgBouncer, gated / unfenced through pgfence ≥ 0.6, reported against 0.75)\n\n")
	fmt.Println("| workload | clients | gated / seed direct | gated / seed via PgBouncer | gated / unfenced through pgfence | backstop alone / seed direct | gated / fenced by hand |")
	fmt.Println("|---|---|---|---|---|---|---|")
	ratio := func(a, b gateResult, target float64) string {
		if a.tps == 0 || b.tps == 0 {
			return "–"
		}
		v := a.tps / b.tps
		s := fmt.Sprintf("%.2f", v)
		if target > 0 && v < target {
			s += " ✗"
		}
		return s
	}
	for _, cell := range cells {
		f := strings.Fields(cell)
		res := results[cell]
		g := res["gated"]
		fmt.Printf("| %s | %s | %s | %s | %s | %s | %s |\n", f[1], strings.TrimPrefix(f[2], "c="),
			ratio(g, res["seed"], 1), ratio(g, res["seed-pgb"], 1), ratio(g, res["ungated"], 0.6), ratio(res["backstop"], res["seed"], 0), ratio(g, res["fenced"], 0))
	}
	fmt.Println()
	if memErr != nil {
		fmt.Printf("Proxy memory per gated session: not measured (%v).\n", memErr)
	} else {
		fmt.Printf("Proxy memory per gated session: RSS of a fresh `pgfence serve` %.1f MiB with 1 idle fenced session, %.1f MiB with 50 (each after one gated transaction): %.0f KiB per session.\n",
			float64(mem.one)/1024, float64(mem.fifty)/1024, float64(mem.fifty-mem.one)/49)
	}
}

// thousands formats a rate as an integer with commas.
func thousands(v float64) string {
	s := strconv.FormatInt(int64(v+0.5), 10)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// procStat is the fields of /proc/pid/stat after the command name
// (field 3, the state, first); nil when the process is gone.
func procStat(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 > len(s) {
		return nil
	}
	return strings.Fields(s[i+2:])
}

func parentPid(pid int) int {
	f := procStat(pid)
	if len(f) < 2 {
		return 0
	}
	p, _ := strconv.Atoi(f[1])
	return p
}

// childPids are the processes whose parent is pid.
func childPids(pid int) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, d := range ents {
		c, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if parentPid(c) == pid {
			out = append(out, c)
		}
	}
	sort.Ints(out)
	return out
}

// clusterCPU is the CPU time of the postmaster pm, of its live children
// and of the children it has reaped (its cutime and cstime): every
// backend, exited or not, and the background processes. Clock ticks of
// 10 ms.
func clusterCPU(pm int) time.Duration {
	ticks := func(f []string, from, to int) int64 {
		var t int64
		for i := from; i <= to && i < len(f); i++ {
			v, _ := strconv.ParseInt(f[i], 10, 64)
			t += v
		}
		return t
	}
	t := ticks(procStat(pm), 11, 14)
	for _, c := range childPids(pm) {
		t += ticks(procStat(c), 11, 12)
	}
	return time.Duration(t) * 10 * time.Millisecond
}

// procRSS is process pid's resident set in KiB.
func procRSS(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "VmRSS:") {
			f := strings.Fields(line)
			if len(f) >= 2 {
				v, _ := strconv.ParseInt(f[1], 10, 64)
				return v
			}
		}
	}
	return 0
}
