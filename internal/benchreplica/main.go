// Command benchreplica measures read routing: autocommit `pgbench -S`
// through the gated proxy with one streaming replica configured, reads
// routed to the replica versus the same proxy with --read-replicas=false
// (every read on the primary), alternating in one run on one throwaway
// cluster (primary and replica on the same machine). It prints TPS, the
// ratio, and where the reads went (the router's counters), which shows the
// eligibility check adds no round trip: replica positions are cached.
// Optionally (-protected) pgbench_accounts is a protected table, so every
// read also checks the takeover positions. A measuring tool, not a test.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/pgfence/pgfence/internal/pgbench"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/proxy"

	"github.com/jackc/pgx/v5"
)

func main() {
	dur, scale, rounds := pgbench.Flags(2)
	protected := flag.Bool("protected", false, "protect pgbench_accounts (reads then check takeover positions)")
	flag.Parse()
	if err := run(*dur, *scale, *rounds, *protected); err != nil {
		fmt.Fprintln(os.Stderr, "benchreplica:", err)
		os.Exit(1)
	}
}

func run(dur time.Duration, scale, rounds int, protected bool) error {
	ctx := context.Background()
	c, err := pgtest.Start(ctx, pgtest.Options{Replica: true})
	if err != nil {
		return err
	}
	defer c.Close()
	const db = "bench"
	conn, err := c.Primary.Connect(ctx, "postgres")
	if err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+db); err != nil {
		return err
	}
	conn.Close(ctx)
	if out, err := pgbench.Run(nil, c.Primary.Port, db, "-i", "-q", "-s", strconv.Itoa(scale)); err != nil {
		return fmt.Errorf("pgbench -i: %w\n%s", err, out)
	}
	bc, err := c.Primary.Connect(ctx, db)
	if err != nil {
		return err
	}
	if err := migrations.Prepare(ctx, bc); err != nil {
		return err
	}
	if protected {
		if _, err := bc.Exec(ctx, "SELECT fence.protect('pgbench_accounts')", pgx.QueryExecModeSimpleProtocol); err != nil {
			return err
		}
	}
	bc.Close(ctx)
	if err := c.WaitReplicaCaughtUp(ctx); err != nil {
		return err
	}
	log := zap.NewNop()
	start := func(noReads bool) (int, *proxy.Server, func(), error) {
		gate, err := proxy.NewFence(proxy.FenceConfig{Primary: c.Primary.DSN("postgres")}, log)
		if err != nil {
			return 0, nil, nil, err
		}
		srv, err := proxy.New(proxy.Config{Primary: c.Primary.DSN("postgres"), Auth: proxy.AuthTrust, Replicas: []string{c.Replica.DSN("postgres")},
			NoReplicaReads: noReads, Interceptor: gate}, log)
		if err != nil {
			return 0, nil, nil, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, nil, nil, err
		}
		go srv.Serve(ctx, ln)
		stop := func() {
			sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			srv.Shutdown(sctx)
			gate.Close()
		}
		return ln.Addr().(*net.TCPAddr).Port, srv, stop, nil
	}
	repPort, repSrv, stop1, err := start(false)
	if err != nil {
		return err
	}
	defer stop1()
	priPort, _, stop2, err := start(true)
	if err != nil {
		return err
	}
	defer stop2()
	// Let the replica poller see the replica healthy.
	deadline := time.Now().Add(10 * time.Second)
	for {
		out, err := pgbench.Psql(repPort, db, "SELECT pg_is_in_recovery()")
		if err == nil && out == "t" {
			break
		}
		if time.Now().After(deadline) {
			return errors.New("reads never reached the replica")
		}
		time.Sleep(50 * time.Millisecond)
	}
	fmt.Printf("pgbench -S -s %d, %v per run, %d round(s), protected=%v; replica and primary on this machine\n\n", scale, dur, rounds, protected)
	fmt.Printf("%-22s %14s %14s %8s\n", "cell", "primary-only", "replica reads", "ratio")
	for _, clients := range []int{1, 8} {
		for _, mode := range []string{"simple"} {
			var pri, rep float64
			for range rounds {
				for _, tgt := range []struct {
					port int
					sum  *float64
				}{{priPort, &pri}, {repPort, &rep}} {
					r, err := pgbench.Measure(nil, tgt.port, db, "-S", "-n", "-M", mode, "-c", strconv.Itoa(clients), "-j", strconv.Itoa(min(clients, 2)), "-T", strconv.Itoa(int(dur.Seconds())))
					if err != nil {
						return err
					}
					*tgt.sum += r.TPS
				}
			}
			pri, rep = pri/float64(rounds), rep/float64(rounds)
			fmt.Printf("%-22s %14.0f %14.0f %8.2f\n", fmt.Sprintf("-S %s c=%d", mode, clients), pri, rep, rep/pri)
		}
	}
	st := repSrv.RouteStats()
	fmt.Printf("\nrouted to the replica: %d, eligible but sent to the primary: %d, fence-row checks: %d, waits: %d\n",
		st.Replica.Load(), st.Primary.Load(), st.FenceChecks.Load(), st.Waits.Load())
	return nil
}
