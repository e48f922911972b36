package main

import (
	"fmt"
	"regexp"
	"strconv"
	"time"

	"github.com/pgfence/pgfence/internal/pgbench"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/proxy"
)

// benchConnect is the connect table (issue 32, session mode): pgbench -C
// -S, a new connection for each select-only transaction, at 1 and 8
// clients, against PostgreSQL direct (a fork per connection), pgfence with
// the write gate as it runs by default (a new backend per client),
// pgfence with server_reuse (the backend a client left, reset, for the
// next one) and PgBouncer in session mode with its default
// server_lifetime (the same, warm). Cells "connect select-only c=N".
func benchConnect(c *pgtest.Cluster, db string, gated target, gate proxy.Interceptor,
	start func(proxy.Config) (int, func() time.Duration, error), only *regexp.Regexp, dur time.Duration, rounds int) error {
	var clients []int
	for _, n := range []int{1, 8} {
		if only.MatchString(fmt.Sprintf("connect select-only c=%d", n)) {
			clients = append(clients, n)
		}
	}
	if len(clients) == 0 || gate == nil {
		return nil
	}
	targets := []target{{"direct", c.Primary.Port, nil}, gated}
	port, cpu, err := start(proxy.Config{Interceptor: gate, ServerReuse: true})
	if err != nil {
		return err
	}
	targets = append(targets, target{"pgfence+reuse", port, cpu})
	if port, pid, stop, err := startPgBouncer(c.Primary.Port, true); err != nil {
		fmt.Printf("connect table: PgBouncer (warm) column skipped: %v\n", err)
	} else {
		defer stop()
		targets = append(targets, target{"pgbouncer-warm", port, procCPU(pid)})
	}
	fmt.Printf("\nA new connection per transaction (pgbench -C -S), %v per run, %d round(s); targets alternate within each cell\n\n", dur, rounds)
	hdr := fmt.Sprintf("%-22s %7s", "workload", "clients")
	for _, t := range targets {
		hdr += fmt.Sprintf(" %16s", t.name+" tps")
	}
	for _, t := range targets[1:] {
		hdr += fmt.Sprintf(" %20s", t.name+"/direct")
	}
	fmt.Println(hdr)
	for _, n := range clients {
		sum := make([]float64, len(targets))
		for r := 0; r < rounds; r++ {
			for i, t := range targets {
				m, err := pgbench.Measure(nil, t.port, db, "-n", "-C", "-S", "-T", strconv.Itoa(int(dur.Seconds())),
					"-c", strconv.Itoa(n), "-j", strconv.Itoa(min(n, 2)))
				if err != nil {
					return fmt.Errorf("connect %s c=%d: %w", t.name, n, err)
				}
				sum[i] += m.TPS / float64(rounds)
			}
		}
		row := fmt.Sprintf("%-22s %7d", "connect select-only", n)
		for _, s := range sum {
			row += fmt.Sprintf(" %16.0f", s)
		}
		for _, s := range sum[1:] {
			row += fmt.Sprintf(" %20.3f", s/sum[0])
		}
		fmt.Println(row)
	}
	return nil
}
