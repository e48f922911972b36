package proxy

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/zap/zaptest"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// TestFailoverReads (issue 31): across a failover WAL positions are not
// comparable, so a replica serves reads only once it has shown the
// primary's current era (fence.has_era, migration 021). A primary P with
// standbys A and B: A's WAL receiver is stopped, a takeover on P (lost in
// the failover) and a WAL segment switch reach B, P is killed and A
// promoted. B is diverged: it holds the lost takeover's write, can never
// follow A, and its replay position is past every position A reports.
// Through a proxy whose primary DSN lists P and A and whose replicas are
// B and C (a standby of A made after the failover, on a port named up
// front), a reader carrying the generation acquired on A never reads
// from B (nor does a reader without fence metadata), and sees the new
// generation's row; once C exists and has A's era it serves those reads.
func TestFailoverReads(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c, err := pgtest.Start(ctx, pgtest.Options{Replica: true})
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	nodeA := c.Replica
	nodeB, err := c.AddStandby(ctx, c.Primary, pgtest.Options{})
	if err != nil {
		t.Fatalf("standby B: %v", err)
	}
	db, err := c.CreateDatabase(ctx, "freads")
	if err != nil {
		t.Fatal(err)
	}
	old, err := c.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close(context.Background())
	if err := migrations.Apply(ctx, old); err != nil {
		t.Fatal(err)
	}
	if _, err := old.Exec(ctx, `
create role fw login; create role fw2 login; grant pgfence_worker to fw, fw2;
create table results (job_key text primary key, payload text not null, token bigint not null);
grant select, insert, update on results to fw, fw2;
select fence.protect('results');`); err != nil {
		t.Fatal(err)
	}
	// C's port, named before C exists: the proxy's replica list is fixed.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	portC := ln.Addr().(*net.TCPAddr).Port
	ln.Close()

	oldPort, newPort := c.Primary.Port, nodeA.Port
	dsn := fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%d,%d user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write", oldPort, newPort)
	gate, err := NewFence(FenceConfig{Primary: dsn}, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(gate.Close)
	p := startProxy(t, Config{Primary: dsn, Interceptor: gate,
		Replicas:    []string{nodeB.DSN("postgres"), fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", portC)},
		ReplicaPoll: 10 * time.Millisecond, ReplicaMaxLag: time.Minute})
	session := func(role string, l *fence.Lease) *pgconn.PgConn {
		t.Helper()
		cfg, err := pgconn.ParseConfig(fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", role, p.addr, db))
		if err != nil {
			t.Fatal(err)
		}
		if l != nil {
			cfg.RuntimeParams["options"] = pgoptions(*l)
		}
		return connectConfig(t, cfg)
	}
	acquire := func(role, job string) fence.Lease {
		t.Helper()
		cfg, err := pgx.ParseConfig(fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", role, p.addr, db))
		if err != nil {
			t.Fatal(err)
		}
		l, err := fence.Acquire(ctxT(t), connectPgx(t, cfg), job, role, time.Minute)
		if err != nil {
			t.Fatalf("acquire %s as %s through the proxy: %v", job, role, err)
		}
		return l
	}
	// Whether a replica answers a read (inet_server_port() is the
	// session's own: it goes to the primary), and what it sees of job j:
	// B alone has "lost", and B never has "new".
	const readSQL = "select pg_is_in_recovery()::text || ' ' || coalesce((select payload from results where job_key = 'j'), 'none')"
	read := func(conn *pgconn.PgConn) (replica bool, payload string) {
		t.Helper()
		v := lastValue(t, conn, readSQL)
		rec, payload, _ := strings.Cut(v, " ")
		return rec == "true", payload
	}
	// Sessions held to the end: the catalog watcher and the pollers live
	// while the database has sessions.
	session("fw", nil)

	first := acquire("fw", "j")
	mustExec(t, session("fw", &first), "set fence.step = 'first'; insert into results values ('j', 'first', 0)")
	if err := c.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	lsn, err := c.CurrentLSN(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ReplayedOn(ctx, nodeB, lsn); err != nil {
		t.Fatal(err)
	}
	// Before the failover B serves the holder's reads.
	firstReader := session("fw", &first)
	pollFind(t, "a read of the first generation on B", func() (bool, bool) {
		rep, payload := read(firstReader)
		return rep && payload == "first", rep && payload == "first"
	})

	// A stops receiving; P takes j over (a takeover the failover loses)
	// and writes, then switches WAL segments: B replays it all.
	if err := c.DetachReplica(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := old.Exec(ctx, "update fence.leases set expires_at = clock_timestamp() - interval '1 second' where job_key = 'j'"); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(c.Primary.DSN(db))
	if err != nil {
		t.Fatal(err)
	}
	cfg.User = "fw2"
	lostConn := connectPgx(t, cfg)
	lost, err := fence.Acquire(ctxT(t), lostConn, "j", "fw2", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lostConn.Exec(ctxT(t), fmt.Sprintf("set fence.job_key = 'j'; set fence.epoch = %d; set fence.token = %d; set fence.step = 'lost'", lost.Epoch, lost.Token)); err != nil {
		t.Fatal(err)
	}
	if _, err := lostConn.Exec(ctxT(t), "update results set payload = 'lost' where job_key = 'j'"); err != nil {
		t.Fatalf("the lost generation's write on P: %v", err)
	}
	if _, err := old.Exec(ctx, "select pg_switch_wal(); create table after_switch (); drop table after_switch"); err != nil {
		t.Fatal(err)
	}
	if lsn, err = c.CurrentLSN(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.ReplayedOn(ctx, nodeB, lsn); err != nil {
		t.Fatal(err)
	}
	if err := c.Failover(ctx); err != nil {
		t.Fatal(err)
	}

	// On A: a new generation through the proxy, and its write.
	l := acquire("fw", "j")
	mustExec(t, session("fw", &l), "set fence.step = 'new'; update results set payload = 'new' where job_key = 'j'")
	cat := catalogOf(t, gate, db)
	pollFind(t, "the new generation in the watcher's tracker", func() (bool, bool) {
		tk, ok := cat.tk.lookup("j")
		ok = ok && tk.token == l.Token
		return ok, ok
	})
	var replayB, insertA string
	if err := func() error {
		conn, err := nodeB.Connect(ctx, "postgres")
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		return conn.QueryRow(ctx, "select pg_last_wal_replay_lsn()::text").Scan(&replayB)
	}(); err != nil {
		t.Fatal(err)
	}
	if insertA, err = c.CurrentLSN(ctx); err != nil {
		t.Fatal(err)
	}
	b, _ := parseLSN(replayB)
	a, _ := parseLSN(insertA)
	if b <= a {
		t.Fatalf("B replayed up to %s, A is at %s: B must be past A for the test to mean anything", b, a)
	}
	t.Logf("diverged B replayed up to %s; the new primary A is at %s", b, a)

	notOnB := func(t *testing.T, conn *pgconn.PgConn, want string) {
		t.Helper()
		for i := 0; i < 20; i++ {
			rep, payload := read(conn)
			if payload != want {
				t.Fatalf("read #%d answered by a replica (%v) with %q, want %q: the diverged replica B served a reader of the new era",
					i, rep, payload, want)
			}
		}
	}
	t.Run("new_generation_not_on_diverged_replica", func(t *testing.T) {
		notOnB(t, session("fw", &l), "new")
	})
	t.Run("no_metadata_not_on_diverged_replica", func(t *testing.T) {
		notOnB(t, session("fw", nil), "new")
	})
	t.Run("wait_policy_not_on_diverged_replica", func(t *testing.T) {
		conn := session("fw", &l)
		mustExec(t, conn, "set fence.read_policy = 'wait'; set fence.read_wait = '200ms'")
		notOnB(t, conn, "new")
	})
	t.Run("follower_of_new_primary_in_rotation", func(t *testing.T) {
		nodeC, err := c.AddStandby(ctx, c.Primary, pgtest.Options{Port: portC})
		if err != nil {
			t.Fatalf("standby C of A: %v", err)
		}
		if err := c.ReplayedOn(ctx, nodeC, insertA); err != nil {
			t.Fatal(err)
		}
		reader := session("fw", &l)
		pollFind(t, "a read of the new generation on C", func() (bool, bool) {
			rep, payload := read(reader)
			if payload != "new" {
				t.Fatalf("answered by a replica (%v) with %q, want the new generation's row", rep, payload)
			}
			return rep, rep
		})
		// B stays out, whoever else serves.
		notOnB(t, reader, "new")
		for _, st := range p.srv.rs.status(ctxT(t)) {
			t.Logf("replica %s: healthy %v, %q", st.Addr, st.Healthy, st.Error)
		}
	})
}
