// Command benchproxy measures pgfence's pass-through proxy against direct
// connections (and PgBouncer in session mode, when installed; pgfence with
// its write gate intercepting every message, as `pgfence serve` runs, with
// no table protected; and a floor relay that does nothing but relay) with
// pgbench, alternating the targets in one run on one throwaway cluster, and
// prints TPS, the ratio to direct, the latency added and each relay's CPU
// per transaction. With -pgfence (as `make bench` runs it) the pgfence
// columns are `pgfence serve` processes, like the other relays; without,
// they run in this process (for -cpuprofile). It is a measuring tool, not
// a test: it fails only when it cannot run.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgbench"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/seedbench"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/proxy"
)

func main() {
	dur, scale, rounds := pgbench.Flags(1)
	only := flag.String("only", "", "run only the cells whose \"workload c=N\" matches this regexp (\"gated-write c=1\" the gated-write section; the gate table's cells are \"gate <workload> c=N\", and a path of one \"gate <workload> c=N <path>\")")
	pollColumn := flag.Bool("poll-column", true, "with -gated-write, also time the gated write through the gate with its loop on poll(2) (off for a pgfence binary older than --poller)")
	poller := flag.String("poller", "", "what every pgfence column's event loop waits in: epoll or poll (proxy.Config.Poller; empty: the platform's default)")
	gated := flag.Bool("gate", true, "add a column for pgfence with the write gate (as pgfence serve runs; no table protected, so it measures the interception cost alone)")
	gatedWrite := flag.Bool("gated-write", true, "with -gate, also time a gated write transaction with pgbench against the same transaction direct, the seed's hand-written fence SQL and the protocol's SQL by hand")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the proxies (this process) to this file; needs -pgfence empty")
	statements := flag.Bool("statements", false, "load pg_stat_statements (track = all) and print, for each gate table cell, the statements of its last round's fenced paths (it costs throughput: a run for the breakdown, not for the table)")
	bin := flag.String("pgfence", "", "run the pgfence columns as `pgfence serve` processes of this binary, as users run it (empty: in this process)")
	flag.Parse()
	if *cpuprofile != "" && *bin != "" {
		fmt.Fprintln(os.Stderr, "benchproxy: -cpuprofile profiles in-process proxies: leave -pgfence empty")
		os.Exit(2)
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "benchproxy: -cpuprofile:", err)
			os.Exit(2)
		}
		defer pprof.StopCPUProfile()
	}
	onlyRe, err := regexp.Compile(*only)
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchproxy: -only:", err)
		os.Exit(2)
	}
	if err := run(*dur, *scale, *rounds, onlyRe, *poller, *gated, *gated && *gatedWrite, *pollColumn, *bin, *statements); err != nil {
		fmt.Fprintln(os.Stderr, "benchproxy:", err)
		pprof.StopCPUProfile()
		os.Exit(1)
	}
}

type target struct {
	name string
	port int
	cpu  func() time.Duration // CPU time used so far by the process serving it; nil for direct
}

type result struct{ tps, lat, cpuPerTxn float64 }

// selfCPU is this process's CPU time (the in-process proxies; the harness
// itself idles while pgbench runs).
func selfCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// procCPU is the CPU time of process pid, from /proc (clock ticks of 10 ms).
func procCPU(pid int) func() time.Duration {
	return func() time.Duration {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return 0
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
		if len(f) < 13 {
			return 0
		}
		u, _ := strconv.ParseInt(f[11], 10, 64)
		k, _ := strconv.ParseInt(f[12], 10, 64)
		return time.Duration(u+k) * 10 * time.Millisecond
	}
}

func run(dur time.Duration, scale, rounds int, only *regexp.Regexp, poller string, gated, gatedWrite, pollColumn bool, bin string, statements bool) error {
	ctx := context.Background()
	var opts pgtest.Options
	if statements {
		opts.Settings = map[string]string{"shared_preload_libraries": "'pg_stat_statements'", "pg_stat_statements.track": "all"}
	}
	c, err := pgtest.Start(ctx, opts)
	if err != nil {
		return err
	}
	defer c.Close()
	var stops []func()
	var gw func(relays map[string]int) error // the gated write, run after the table
	var gateI proxy.Interceptor              // the write gate, when gated
	db := "bench"
	if _, err := pgbench.Psql(c.Primary.Port, "postgres", "CREATE DATABASE bench"); err != nil {
		return err
	}
	if statements {
		if _, err := pgbench.Psql(c.Primary.Port, db, "CREATE EXTENSION pg_stat_statements"); err != nil {
			return err
		}
	}
	if out, err := pgbench.Run(nil, c.Primary.Port, db, "-i", "-q", "-s", strconv.Itoa(scale)); err != nil {
		return fmt.Errorf("pgbench -i: %w\n%s", err, out)
	}

	// start runs a pgfence proxy: in this process (its CPU is this
	// process's), or with -pgfence as a `pgfence serve` process of its own,
	// the way PgBouncer and the floor relay run.
	start := func(cfg proxy.Config) (int, func() time.Duration, error) {
		cfg.Primary = c.Primary.DSN("postgres")
		cfg.Auth = proxy.AuthTrust // the throwaway cluster's roles have no passwords
		if cfg.Poller == "" {
			cfg.Poller = poller
		}
		if bin != "" {
			args := []string{}
			if cfg.Interceptor == nil {
				args = append(args, "--no-gate")
			}
			if cfg.Poller != "" {
				args = append(args, "--poller", cfg.Poller)
			}
			if cfg.ServerReuse {
				args = append(args, "--server-reuse")
			}
			port, pid, stop, err := startServe(bin, cfg.Primary, args...)
			if err != nil {
				return 0, nil, err
			}
			stops = append(stops, stop)
			return port, procCPU(pid), nil
		}
		srv, err := proxy.New(cfg, zap.NewNop())
		if err != nil {
			return 0, nil, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, nil, err
		}
		go srv.Serve(ctx, ln)
		stops = append(stops, func() { srv.Shutdown(ctx) })
		return ln.Addr().(*net.TCPAddr).Port, selfCPU, nil
	}
	defer func() {
		for _, f := range stops {
			f()
		}
	}()
	port, cpu, err := start(proxy.Config{})
	if err != nil {
		return err
	}
	targets := []target{{"direct", c.Primary.Port, nil}, {"pgfence", port, cpu}}
	if gated {
		conn, err := c.Primary.Connect(ctx, db)
		if err != nil {
			return err
		}
		err = migrations.Apply(ctx, conn)
		conn.Close(ctx)
		if err != nil {
			return err
		}
		gate, err := proxy.NewFence(proxy.FenceConfig{Primary: c.Primary.DSN("postgres")}, zap.NewNop())
		if err != nil {
			return err
		}
		gateI = gate
		port, cpu, err := start(proxy.Config{Interceptor: gate})
		stops = append(stops, gate.Close)
		if err != nil {
			return err
		}
		targets = append(targets, target{"pgfence+gate", port, cpu})
		if gatedWrite {
			gport := 0
			if pollColumn && (poller == "" || poller == "epoll") {
				// The gate with its loop waiting in poll(2), for
				// comparison.
				if gport, _, err = start(proxy.Config{Interceptor: gate, Poller: "poll"}); err != nil {
					return err
				}
			}
			gw = func(relays map[string]int) error {
				return benchGatedWrite(ctx, c, db, port, gport, relays, dur, rounds)
			}
		}
	}
	if port, pid, stop, err := startPgBouncer(c.Primary.Port, false); err != nil {
		fmt.Fprintf(os.Stderr, "benchproxy: PgBouncer column skipped: %v\n", err)
	} else {
		defer stop()
		targets = append(targets, target{"pgbouncer", port, procCPU(pid)})
	}

	if port, pid, stop, err := startFloorRelay(c.Primary.Port); err != nil {
		fmt.Fprintf(os.Stderr, "benchproxy: floor relay column skipped: %v\n", err)
	} else {
		defer stop()
		targets = append(targets, target{"floor", port, procCPU(pid)})
	}

	type cell struct {
		name    string
		args    []string
		clients int
	}
	var cells []cell
	for _, w := range []struct {
		name string
		args []string
	}{
		{"select-only simple", []string{"-S"}},
		{"select-only extended", []string{"-S", "-M", "extended"}},
		{"tpcb-like simple", nil},
	} {
		for _, n := range []int{1, 8} {
			if !only.MatchString(fmt.Sprintf("%s c=%d", w.name, n)) {
				continue
			}
			cells = append(cells, cell{w.name, w.args, n})
		}
	}
	if len(cells) > 0 {
		fmt.Printf("pgbench -s %d, %v per run, %d round(s), %d CPUs; targets alternate within each cell\n\n", scale, dur, rounds, numCPU())
	}
	hdr := fmt.Sprintf("%-22s %7s", "workload", "clients")
	for _, t := range targets {
		hdr += fmt.Sprintf(" %14s", t.name+" tps")
	}
	for _, t := range targets[1:] {
		hdr += fmt.Sprintf(" %17s %17s %19s", t.name+"/direct", t.name+" +lat ms", t.name+" cpu µs/tx")
	}
	if len(cells) > 0 {
		fmt.Println(hdr)
	}
	for _, cl := range cells {
		sum := make([]result, len(targets))
		for r := 0; r < rounds; r++ {
			for i, t := range targets {
				args := append([]string{"-n", "-T", strconv.Itoa(int(dur.Seconds())), "-c", strconv.Itoa(cl.clients), "-j", strconv.Itoa(min(cl.clients, 2))}, cl.args...)
				var cpu0 time.Duration
				if t.cpu != nil {
					cpu0 = t.cpu()
				}
				m, err := pgbench.Measure(nil, t.port, db, args...)
				if err != nil {
					return fmt.Errorf("%s %s c=%d: %w", t.name, cl.name, cl.clients, err)
				}
				res := result{tps: m.TPS, lat: m.Latency}
				if t.cpu != nil && res.tps > 0 {
					res.cpuPerTxn = float64((t.cpu() - cpu0).Microseconds()) / (res.tps * dur.Seconds())
				}
				sum[i].cpuPerTxn += res.cpuPerTxn / float64(rounds)
				sum[i].tps += res.tps / float64(rounds)
				sum[i].lat += res.lat / float64(rounds)
			}
		}
		row := fmt.Sprintf("%-22s %7d", cl.name, cl.clients)
		for _, s := range sum {
			row += fmt.Sprintf(" %14.0f", s.tps)
		}
		for _, s := range sum[1:] {
			row += fmt.Sprintf(" %17.3f %17.3f %19.1f", s.tps/sum[0].tps, s.lat-sum[0].lat, s.cpuPerTxn)
		}
		fmt.Println(row)
	}
	byName := map[string]target{}
	relays := map[string]int{}
	for _, t := range targets {
		byName[t.name] = t
		relays[t.name] = t.port
	}
	if gw != nil && only.MatchString("gated-write c=1") {
		if err := gw(relays); err != nil {
			return err
		}
	}
	if gated {
		// A new connection for each transaction (issue 32): cells
		// "connect <workload> c=N".
		if err := benchConnect(c, db, byName["pgfence+gate"], gateI, start, only, dur, rounds); err != nil {
			return err
		}
		// The gate table (issue 33): cells "gate <workload> c=N".
		return benchGateTable(ctx, c, db, byName["pgfence+gate"], byName["pgbouncer"], bin, only, dur, rounds, statements)
	}
	return nil
}

// startPgBouncer runs PgBouncer in session mode in front of the primary,
// as an unprivileged user when we are root (it refuses to run as root).
//
// server_lifetime = 0: each client gets a fresh server connection, closed
// after it, as pgfence and a direct connection give each pgbench run. By
// default PgBouncer would hand every run after the first the backends of
// the one before, already warm (their catalog caches built, the shared
// buffers they read mapped), which the README's Performance section shows
// is worth a good part of its lead. The columns compare the relays, not
// how warm their backends are.
//
// warm: server_lifetime is PgBouncer's default, and a client gets the
// backend the one before left (the connect table, which compares that
// with pgfence's server_reuse).
func startPgBouncer(pgPort int, warm bool) (int, int, func(), error) {
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		for _, p := range []string{"/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"} {
			if _, err := os.Stat(p); err == nil {
				bin = p
			}
		}
		if bin == "" {
			return 0, 0, nil, errors.New("pgbouncer not installed (apt-get install -y pgbouncer)")
		}
	}
	dir, err := os.MkdirTemp("", "pgfence-bench-pgbouncer-")
	if err != nil {
		return 0, 0, nil, err
	}
	port, err := freePort()
	if err != nil {
		return 0, 0, nil, err
	}
	ini := fmt.Sprintf(`[databases]
* = host=127.0.0.1 port=%d
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = session
server_lifetime = %d
max_client_conn = 200
default_pool_size = 50
logfile = %s
`, pgPort, port, filepath.Join(dir, "users.txt"), map[bool]int{false: 0, true: 3600}[warm], filepath.Join(dir, "pgbouncer.log"))
	os.WriteFile(filepath.Join(dir, "users.txt"), []byte(`"postgres" ""`+"\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "pgbouncer.ini"), []byte(ini), 0o644)
	cmd := exec.Command(bin, filepath.Join(dir, "pgbouncer.ini"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return 0, 0, nil, fmt.Errorf("pgbouncer refuses root and there is no postgres user: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		os.Chown(dir, uid, gid)
	}
	if err := cmd.Start(); err != nil {
		return 0, 0, nil, err
	}
	stop := func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
		os.RemoveAll(dir)
	}
	if err := waitReady(port, 10*time.Second); err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "pgbouncer.log"))
		stop()
		return 0, 0, nil, fmt.Errorf("pgbouncer did not come up: %v\n%s", err, strings.TrimSpace(string(log)))
	}
	return port, cmd.Process.Pid, stop, nil
}

func numCPU() int {
	out, err := exec.Command("nproc").Output()
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(out)))
	return n
}

// benchGatedWrite times one write transaction of a worker that knows only
// its generation (PGOPTIONS), with pgbench (libpq, simple protocol, one
// client), four ways in alternation:
//
//   - direct: BEGIN; the conditional upsert into an unprotected table;
//     COMMIT — three round trips straight to PostgreSQL.
//   - gated: the same three round trips through pgfence with the write
//     gate, into a protected table; the step rides in the BEGIN's query
//     (SET LOCAL fence.step), so every commit writes its own receipt.
//   - fenced SQL: what the proxy sends, typed by hand straight to
//     PostgreSQL in the same three round trips: the protocol's own
//     server-side cost. gated/fenced is the proxy's share.
//   - seed: the seed's hand-written fence SQL, straight to PostgreSQL:
//     BEGIN, the fence row FOR UPDATE, the receipt, the upsert, COMMIT.
//
// Latency ratios are printed (the targets: gated/direct ≤ 1.5,
// gated/seed ≤ 1).
func benchGatedWrite(ctx context.Context, c *pgtest.Cluster, db string, gatePort, pollPort int, relays map[string]int, dur time.Duration, rounds int) error {
	conn, err := c.Primary.Connect(ctx, db)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `
CREATE TABLE gw_results (job_key text PRIMARY KEY, payload text NOT NULL, token bigint NOT NULL);
CREATE TABLE gw_plain (job_key text PRIMARY KEY, payload text NOT NULL, token bigint NOT NULL);
SELECT fence.protect('gw_results');
`+seedbench.Schema); err != nil {
		return err
	}
	l, err := fence.Acquire(ctx, conn, "bench-job", "benchproxy", time.Hour)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "pgfence-bench-gw-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	upsert := func(table string, token int64) string {
		return fmt.Sprintf("INSERT INTO %[1]s (job_key, payload, token) VALUES ('bench-job', 'benchmark payload', %[2]d) "+
			"ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token WHERE %[1]s.token < excluded.token;\n", table, token)
	}
	step := "\\set s random(1, 1000000000000)\n"
	// protocol is the protocol's SQL typed by hand, for step tag (a
	// prefix and the random :s): the gate in the BEGIN's query, the
	// upsert, the receipt with COMMIT, three round trips. With setGen the
	// generation rides in the BEGIN's query as SET LOCALs (for a relay
	// that passes no startup options); with twoTrips the upsert rides
	// there too.
	protocol := func(tag string, setGen, twoTrips bool) string {
		set, sep := "", ";\n"
		if setGen {
			set = fmt.Sprintf("SET LOCAL fence.job_key = 'bench-job'\\; SET LOCAL fence.epoch = %d\\; SET LOCAL fence.token = %d\\; ", l.Epoch, l.Token)
		}
		if twoTrips {
			sep = "\\; "
		}
		return step + fmt.Sprintf("BEGIN\\; %sSET LOCAL fence.step = '%s'\\; SELECT fence.gate('bench-job', %d, %d, '%s')%s", set, tag, l.Epoch, l.Token, tag, sep) +
			upsert("gw_results", l.Token) +
			fmt.Sprintf("SELECT fence.commit('bench-job', %d, %d, '%s', '\\x00'::bytea, 'v1')\\; COMMIT;\n", l.Epoch, l.Token, tag)
	}
	scripts := map[string]string{
		"direct": "BEGIN;\n" + upsert("gw_plain", l.Token) + "COMMIT;\n",
		"gated":  step + "BEGIN\\; SET LOCAL fence.step = 'g:s';\n" + upsert("gw_results", l.Token) + "COMMIT;\n",
		"fenced": protocol("f:s", false, false),
		"seed": step + "BEGIN;\n" +
			fmt.Sprintf("SELECT max_issued_token FROM report_fences WHERE job_key = '%s' AND max_issued_token = %d FOR UPDATE;\n", seedbench.JobKey, seedbench.Token) +
			fmt.Sprintf("INSERT INTO report_commit_receipts (job_key, fencing_token, step, payload_digest) VALUES ('%s', %d, ':s', sha256('benchmark payload')) ON CONFLICT DO NOTHING;\n", seedbench.JobKey, seedbench.Token) +
			fmt.Sprintf("INSERT INTO report_results (job_key, payload, applied_fencing_token) VALUES ('%s', 'benchmark payload', %d) "+
				"ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, applied_fencing_token = excluded.applied_fencing_token "+
				"WHERE report_results.applied_fencing_token < excluded.applied_fencing_token;\n", seedbench.JobKey, seedbench.Token) +
			"COMMIT;\n",
	}
	gen := fmt.Sprintf("PGOPTIONS=-c fence.job_key=bench-job -c fence.epoch=%d -c fence.token=%d", l.Epoch, l.Token)
	// A row: a pgbench script, the port it runs against and its
	// environment (the generation in PGOPTIONS, for rows through the gate).
	type row struct {
		name string
		port int
		env  []string
	}
	order := []row{
		{"direct", c.Primary.Port, nil},
		{"gated", gatePort, []string{gen}},
		{"fenced", c.Primary.Port, []string{gen}},
		{"seed", c.Primary.Port, nil},
	}
	add := func(r row, script string) {
		order = append(order, r)
		scripts[r.name] = script
	}
	// The protocol's SQL by hand through a pass-through relay (PgBouncer
	// passes no startup options: the generation rides in the BEGIN's
	// query as SET LOCALs), against the same script direct.
	for _, name := range []string{"direct", "pgfence", "pgbouncer", "floor"} {
		if port, ok := relays[name]; ok {
			add(row{"local via " + name, port, nil}, protocol(name[:3]+":s", true, false))
		}
	}
	// The protocol's SQL in two round trips through pass-through
	// pgfence, the generation in PGOPTIONS as the fenced row has it
	// (pass-through forwards startup options). A lockstep client sends
	// three messages, so no gate can use fewer round trips through a
	// relay (answering BEGIN itself would still cost the client's hop to
	// the proxy): this bounds what any such change could reach against
	// the seed.
	if port, ok := relays["pgfence"]; ok {
		add(row{"two trips via pgfence", port, []string{gen}}, protocol("T:s", false, true))
	}
	// The unfenced transaction through the pass-through relay and the
	// floor relay: what a proxy hop costs, against which the gate's rows
	// compare.
	for _, name := range []string{"pgfence", "floor"} {
		if port, ok := relays[name]; ok {
			add(row{"direct via " + name, port, nil}, scripts["direct"])
		}
	}
	add(row{"ungated", gatePort, []string{gen}}, step+"BEGIN\\; SET LOCAL fence.step = 'u:s';\n"+upsert("gw_plain", l.Token)+"COMMIT;\n")
	if pollPort != 0 {
		add(row{"poll", pollPort, []string{gen}}, strings.ReplaceAll(scripts["gated"], "'g:s'", "'r:s'"))
	}
	lat := map[string]float64{}
	for r := 0; r < rounds; r++ {
		for _, o := range order {
			f := filepath.Join(dir, o.name+".sql")
			if err := os.WriteFile(f, []byte(scripts[o.name]), 0o644); err != nil {
				return err
			}
			m, err := pgbench.Measure(o.env, o.port, db, "-n", "-M", "simple", "-c", "1", "-T", strconv.Itoa(int(dur.Seconds())), "-f", f)
			if err != nil {
				return fmt.Errorf("gated write, %s: %w", o.name, err)
			}
			lat[o.name] += m.Latency / float64(rounds)
		}
	}
	var receipts int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM fence.receipts WHERE job_key = 'bench-job' AND step LIKE 'g%'").Scan(&receipts); err != nil {
		return err
	}
	if receipts == 0 {
		return errors.New("gated write: the gated runs left no receipt; the gate did not act")
	}
	fmt.Printf("\ngated write transaction, pgbench -c 1 -M simple (mean latency, ms): direct %.3f, gated %.3f, fenced SQL by hand %.3f, seed %.3f\n",
		lat["direct"], lat["gated"], lat["fenced"], lat["seed"])
	fmt.Printf("gated/direct %.2f (target ≤ 1.5), gated/seed %.2f (target ≤ 1), gated/fenced %.2f (the proxy's share), fenced/direct %.2f (the protocol's SQL)\n",
		lat["gated"]/lat["direct"], lat["gated"]/lat["seed"], lat["gated"]/lat["fenced"], lat["fenced"]/lat["direct"])
	for _, name := range []string{"pgfence", "pgbouncer", "floor"} {
		if v, ok := lat["local via "+name]; ok {
			fmt.Printf("the protocol's SQL by hand through %s (pass-through): %.3f ms, %.2f of the same direct (%.3f ms)\n", name, v, v/lat["local via direct"], lat["local via direct"])
		}
	}
	if v, ok := lat["two trips via pgfence"]; ok {
		fmt.Printf("the protocol's SQL by hand in two round trips through pgfence pass-through (the least a gate could do through a relay): %.3f ms, %.2f of the seed\n", v, v/lat["seed"])
	}
	if v, ok := lat["direct via pgfence"]; ok {
		fmt.Printf("the unfenced transaction through pgfence pass-through: %.3f ms, %.2f of direct\n", v, v/lat["direct"])
	}
	if v, ok := lat["direct via floor"]; ok {
		fmt.Printf("the unfenced transaction through the floor relay (one read and one write per message, no parsing): %.3f ms, %.2f of direct\n", v, v/lat["direct"])
	}
	fmt.Printf("the same transaction on an unprotected table through the gate (classified, not gated): %.3f ms, %.2f of direct\n", lat["ungated"], lat["ungated"]/lat["direct"])
	if g := lat["poll"]; g > 0 {
		fmt.Printf("the gate with its loop on poll(2): %.3f ms, %.2f of direct, %.2f of fenced\n", g, g/lat["direct"], g/lat["fenced"])
	}
	return nil
}
