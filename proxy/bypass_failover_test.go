package proxy

import (
	"context"
	"fmt"
	"net/url"
	"slices"
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

func init() { registerBypass("failover", bypassFailover) }

// bypassFailover (issue 31): no generation outlives a PostgreSQL failover
// that lost a takeover. A (role fo_a) holds job j with token t1 and
// commits; the replica has it and is detached; B (fo_b) takes j over with
// t2 and commits, and more tokens are drawn (job lost), on the old
// primary only; the primary is killed and the replica promoted. On the
// new primary t1 is again j's fence token and the sequence is back below
// t2, so without the era defence (migration 019) the zombie A would
// commit and the next acquire would draw a number issued before. Every
// route by which A writes is refused with FN015 and changes nothing,
// directly and through a proxy in front of the new primary; so is B,
// whose takeover was lost, and the holder of a job nobody took over
// (fo_c, job k). A retry of A's commit that reached the replica is a
// replay; a retry of B's lost one is FN015. Renewals of void leases are
// FN015; a new holder acquires j at once, and every token and epoch drawn
// after the failover is above every one issued before it (L5).
//
// The class has a cluster of its own (a failover ends it): a primary, a
// streaming replica, and the proxy started on the promoted replica.
func bypassFailover(t *testing.T) {
	e := newFailoverCast(t)
	a, b, other := &e.a, &e.b, &e.other
	const fo = fence.CodeFailover
	zombie := func(name, sql string) castCase {
		return castCase{name, attempt{role: "fo_a", lease: a, sql: "set fence.step = '" + name + "'; " + sql, code: fo}}
	}
	t.Run("zombie", func(t *testing.T) {
		e.tryEach(t, []castCase{
			zombie("update", "update results set payload = 'zombie' where job_key = 'j'"),
			zombie("insert", "insert into results values ('z', 'zombie', 0)"),
			zombie("delete", "delete from results"),
			zombie("upsert", fmt.Sprintf("insert into results values ('j', 'zombie', %d) on conflict (job_key) do update set payload = excluded.payload", a.Token)),
			zombie("merge", "merge into results r using (select 'j' as k) s on r.job_key = s.k when matched then update set payload = 'zombie'"),
			zombie("writable_cte", "with w as (update results set payload = 'zombie' returning 1) select count(*) from w"),
			zombie("function", "select write_result('zombie')"),
			zombie("definer_function", "select write_result_definer('zombie')"),
			zombie("do_block", "do $$ begin update results set payload = 'zombie'; end $$"),
			zombie("trigger_on_other_table", "insert into notes (note) values ('zombie')"),
			zombie("jobkey_update", "update ledger set v = 'zombie' where job_key = 'j'"),
			zombie("jobkey_insert", "insert into ledger values (3, 'j', 'zombie')"),
			zombie("transaction", "begin; update results set payload = 'zombie'; commit"),
			zombie("savepoint", "begin; savepoint s; update results set payload = 'zombie'; release s; commit"),
			zombie("prepare_execute", "prepare zp(text) as update results set payload = $1 where job_key = 'j'; execute zp('zombie')"),
			{"copy", attempt{role: "fo_a", lease: a, sql: "copy results from stdin", copyIn: "z\tzombie\t0\n", code: fo}},
			{"jobkey_copy", attempt{role: "fo_a", lease: a, sql: "copy ledger from stdin", copyIn: "3\tj\tzombie\n", code: fo}},
			// The generation set by SET rather than in the startup packet.
			{"generation_by_set", attempt{role: "fo_a", code: fo, sql: fmt.Sprintf(
				"set fence.job_key = 'j'; set fence.epoch = %d; set fence.token = %d; set fence.step = 'by_set'; update results set payload = 'zombie'", a.Epoch, a.Token)}},
		})
		// A statement A prepared before the failover (TestBypass's
		// set-up ran it then, under step "prepared"), prepared again on
		// a new connection after it and run by the extended protocol.
		t.Run("prepared_statement", func(t *testing.T) {
			e.eachRoute(t, func(t *testing.T, route string) {
				conn := e.connect(t, route, "fo_a", a)
				ctx := ctxT(t)
				if _, err := conn.Exec(ctx, "set fence.step = 'prepared_again'").ReadAll(); err != nil {
					t.Fatal(err)
				}
				if _, err := conn.Prepare(ctx, "zp", failoverPrepared, nil); err != nil {
					t.Fatal(err)
				}
				err := conn.ExecPrepared(ctx, "zp", [][]byte{[]byte("zombie"), []byte("j")}, nil, nil).Read().Err
				if got := pgtest.SQLState(err); got != fo {
					t.Fatalf("prepared statement: %v (SQLSTATE %q), want %s", err, got, fo)
				}
			})
		})
	})
	t.Run("lost_takeover", func(t *testing.T) {
		e.tryEach(t, []castCase{
			{"update", attempt{role: "fo_b", lease: b, sql: "set fence.step = 'b_update'; update results set payload = 'b' where job_key = 'j'", code: fo}},
			{"do_block", attempt{role: "fo_b", lease: b, sql: "set fence.step = 'b_do'; do $$ begin delete from results; end $$", code: fo}},
			{"jobkey", attempt{role: "fo_b", lease: b, sql: "set fence.step = 'b_ledger'; update ledger set v = 'b' where job_key = 'j'", code: fo}},
			// B retries the commit it made after the detach: lost, so not
			// a replay and not a first commit either.
			{"retry_lost_commit", attempt{role: "fo_b", lease: b, sql: "set fence.step = 'b_before'; " + failoverWrite(*b, "b"), code: fo}},
		})
	})
	t.Run("other_job", func(t *testing.T) {
		e.tryEach(t, []castCase{
			{"upsert", attempt{role: "fo_c", lease: other, sql: "set fence.step = 'k_after'; " + failoverWrite(*other, "k after"), code: fo}},
			{"jobkey", attempt{role: "fo_c", lease: other, sql: "set fence.step = 'k_ledger'; update ledger set v = 'k' where job_key = 'k'", code: fo}},
			{"retry_lost_commit", attempt{role: "fo_c", lease: other, sql: "set fence.step = 'k_before'; " + failoverWrite(*other, "k before"), code: fo}},
		})
	})
	// A's commit from before the detach reached the new primary: its
	// retry is a replay (an FN00R error, or through the proxy, which ends
	// the transaction itself, success with the FN00R notice), and changes
	// nothing.
	t.Run("retry_surviving_commit", func(t *testing.T) {
		e.eachRoute(t, func(t *testing.T, route string) {
			before := e.state(t)
			var notices []string
			cfg := e.connConfig(t, route, "fo_a", a)
			cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { notices = append(notices, n.Code) }
			conn := connectConfig(t, cfg)
			err := castExec(ctxT(t), conn, "set fence.step = 'a_before'; "+failoverWrite(*a, "a"), "")
			if pgtest.SQLState(err) != fence.CodeReplay && !(err == nil && slices.Contains(notices, fence.CodeReplay)) {
				t.Fatalf("retry of A's surviving commit: %v (notices %v), want %s", err, notices, fence.CodeReplay)
			}
			e.unchanged(t, before)
		})
	})
	t.Run("renew", func(t *testing.T) {
		// B's renewal: the era is checked before the role (migration 022;
		// it was FN001 for the role the fence row names, A's): B learns
		// that its generation is void and the job free, and pgfence run
		// acquires again.
		for _, r := range []struct {
			name, role string
			l          *fence.Lease
			code       string
		}{{"zombie", "fo_a", a, fo}, {"lost_takeover", "fo_b", b, fo}, {"other_job", "fo_c", other, fo}} {
			t.Run(r.name, func(t *testing.T) {
				e.eachRoute(t, func(t *testing.T, route string) {
					before := e.state(t)
					_, err := fence.Renew(ctxT(t), e.connectPgx(t, route, r.role), r.l.JobKey, r.l.Token, time.Minute)
					if got := fence.Code(err); got != r.code {
						t.Fatalf("renew of a void lease: %v (code %q), want %s", err, got, r.code)
					}
					e.unchanged(t, before)
				})
			})
		}
	})
	// The void lease does not hold j: a new holder takes it at once
	// (A's lease has most of its minute left), and the numbers it and a
	// new job draw are above every one issued before the failover.
	var c, fresh fence.Lease
	t.Run("acquire", func(t *testing.T) {
		var err error
		if c, err = fence.Acquire(ctxT(t), e.connectPgx(t, "proxy", "fo_c"), "j", "c", time.Minute); err != nil {
			t.Fatalf("a new holder acquires j: %v", err)
		}
		if fresh, err = fence.Acquire(ctxT(t), e.connectPgx(t, "direct", "fo_b"), "fresh", "f", time.Minute); err != nil {
			t.Fatalf("acquire of a new job: %v", err)
		}
	})
	if c.Token == 0 || fresh.Token == 0 {
		t.Fatal("the acquires after the failover failed")
	}
	t.Run("no_reuse", func(t *testing.T) {
		for _, l := range []fence.Lease{c, fresh} {
			t.Run(l.JobKey, func(t *testing.T) {
				if l.Token <= e.oldTokenSeq {
					t.Errorf("token %d drawn after the failover is not above the sequence's %d before it", l.Token, e.oldTokenSeq)
				}
				for job, tok := range e.oldTokens {
					if l.Token <= tok {
						t.Errorf("token %d drawn after the failover is not above %d, issued before it to job %s", l.Token, tok, job)
					}
				}
			})
		}
		t.Run("epoch", func(t *testing.T) {
			if fresh.Epoch <= e.oldEpochSeq {
				t.Errorf("epoch %d drawn after the failover is not above %d, drawn before it", fresh.Epoch, e.oldEpochSeq)
			}
		})
	})
	// After the new takeover A and B are still void, not merely stale.
	t.Run("after_new_takeover", func(t *testing.T) {
		e.tryEach(t, []castCase{
			zombie("zombie_update", "update results set payload = 'zombie' where job_key = 'j'"),
			{"lost_takeover", attempt{role: "fo_b", lease: b, sql: "set fence.step = 'b_late'; update results set payload = 'b' where job_key = 'j'", code: fo}},
		})
	})
	// The control: the new generation writes by both routes.
	t.Run("new_generation_writes", func(t *testing.T) {
		for _, route := range castRoutes {
			conn := e.connect(t, route, "fo_c", &c)
			if err := castExec(ctxT(t), conn, "set fence.step = '"+route+"'; "+failoverWrite(c, "c "+route), ""); err != nil {
				t.Fatalf("%s: the new generation's write: %v", route, err)
			}
		}
	})
	// (round 9, Q-L1) Release and retire refuse a void generation, as
	// renew does: the zombie cannot end the job's lifecycle.
	t.Run("release_retire", func(t *testing.T) {
		e.tryEach(t, []castCase{
			{"release", attempt{role: "fo_c", sql: fmt.Sprintf("select fence.release('k', %d)", other.Token), code: fo}},
			{"retire", attempt{role: "fo_c", sql: fmt.Sprintf("select fence.retire('k', %d)", other.Token), code: fo}},
		})
	})
	// (round 9, Q-M1) The era's first transaction on a server (here: its
	// check dropped, as after a restart) holds the era's lock to its end:
	// it cannot be prepared, and a login without a fence role cannot
	// start it.
	t.Run("era_hostage", func(t *testing.T) {
		if _, err := e.admin.Exec(ctxT(t), "create role fo_view login; delete from fence.era_checks"); err != nil {
			t.Fatal(err)
		}
		// The proxy names a fence function a role may not run FN014.
		denied := map[string]string{"direct": "42501", "proxy": fence.CodeNotInstalled}
		for _, role := range []string{"fo_view", "fo_a"} {
			t.Run(role, func(t *testing.T) {
				e.eachRoute(t, func(t *testing.T, route string) {
					before := e.state(t)
					conn := e.connect(t, route, role, nil)
					err := castExec(ctxT(t), conn, "begin; select * from fence.current_era()", "")
					if role == "fo_view" {
						if got := pgtest.SQLState(err); got != denied[route] {
							t.Fatalf("a login without a fence role reads the era: %v, want %s", err, denied[route])
						}
						return
					}
					if err != nil {
						t.Fatalf("a worker reads the era: %v", err)
					}
					// PREPARE TRANSACTION is a query of its own through the
					// proxy, which refuses it after the settle's locks
					// (FN009) before PostgreSQL would (0A000).
					err = castExec(ctxT(t), conn, "prepare transaction 'fo_hostage'", "")
					want := map[string]string{"direct": "0A000", "proxy": fence.CodeUnsupported}[route]
					if got := pgtest.SQLState(err); got != want {
						t.Fatalf("PREPARE of the era's settling transaction: %v (SQLSTATE %q), want %s", err, got, want)
					}
					e.unchanged(t, before)
				})
			})
		}
	})
	// (round 9, Q-H2) An administrator's new era (the runbook's step after
	// restoring a copy as the primary) voids every generation, the one
	// issued after the failover included, on every route.
	t.Run("new_era", func(t *testing.T) {
		var era int
		if err := e.admin.QueryRow(ctxT(t), "select fence.new_era('restored from a backup (TestBypass)')").Scan(&era); err != nil {
			t.Fatal(err)
		}
		cw := func(name, sql string) castCase {
			return castCase{name, attempt{role: "fo_c", lease: &c, sql: "set fence.step = 'ne_" + name + "'; " + sql, code: fo}}
		}
		e.tryEach(t, []castCase{
			cw("update", "update results set payload = 'void' where job_key = 'j'"),
			cw("upsert", failoverWrite(c, "void")),
			cw("function", "select write_result('void')"),
			cw("definer_function", "select write_result_definer('void')"),
			cw("do_block", "do $$ begin update results set payload = 'void'; end $$"),
			cw("jobkey_update", "update ledger set v = 'void' where job_key = 'j'"),
			cw("transaction", "begin; update results set payload = 'void'; commit"),
			{"copy", attempt{role: "fo_c", lease: &c, sql: "copy results from stdin", copyIn: "z\tvoid\t0\n", code: fo}},
			{"renew", attempt{role: "fo_c", sql: fmt.Sprintf("select fence.renew('j', %d, '1 minute')", c.Token), code: fo}},
			{"release", attempt{role: "fo_c", sql: fmt.Sprintf("select fence.release('j', %d)", c.Token), code: fo}},
			{"retire", attempt{role: "fo_c", sql: fmt.Sprintf("select fence.retire('j', %d)", c.Token), code: fo}},
			{"worker_new_era", attempt{role: "fo_c", sql: "select fence.new_era('a worker')", code: "42501"}},
		})
		// The job is free at once, under a number far above.
		d, err := fence.Acquire(ctxT(t), e.connectPgx(t, "proxy", "fo_b"), "j", "d", time.Minute)
		if err != nil {
			t.Fatalf("acquire after the new era: %v", err)
		}
		if d.Token <= c.Token {
			t.Fatalf("token %d after the new era is not above %d", d.Token, c.Token)
		}
		for _, route := range castRoutes {
			if err := castExec(ctxT(t), e.connect(t, route, "fo_b", &d), "set fence.step = 'd_"+route+"'; "+failoverWrite(d, "d "+route), ""); err != nil {
				t.Fatalf("%s: the new era's generation writes: %v", route, err)
			}
		}
	})
}

// failoverCast is the failover class's set-up: its own cluster after the
// failover, the proxy in front of the new primary and the generations of
// before.
type failoverCast struct {
	c     *pgtest.Cluster
	db    string
	proxy *testProxy
	admin *pgx.Conn // superuser on the new primary

	a, b, other fence.Lease
	// What the old primary had issued when it died: token_seq's and
	// epoch_seq's last values and each job's latest token.
	oldTokenSeq, oldEpochSeq int64
	oldTokens                map[string]int64
}

const failoverSchema = `
create role fo_a login; create role fo_b login; create role fo_c login;
grant pgfence_worker to fo_a, fo_b, fo_c;
create table results (job_key text primary key, payload text not null, token bigint not null);
create table ledger (k int primary key, job_key text not null, v text not null);
create table notes (id serial primary key, note text not null);
insert into ledger values (1, 'j', 'seed'), (2, 'k', 'seed');
create function write_result(p text) returns void language plpgsql as $$
begin
  update results set payload = p where job_key = current_setting('fence.job_key');
end $$;
create function write_result_definer(p text) returns void language plpgsql security definer as $$
begin
  update results set payload = p where job_key = current_setting('fence.job_key');
end $$;
create function notes_write() returns trigger language plpgsql as $$
begin
  update results set payload = new.note where job_key = current_setting('fence.job_key');
  return new;
end $$;
create trigger notes_write after insert on notes for each row execute function notes_write();
grant select, insert, update, delete on results, ledger, notes to fo_a, fo_b, fo_c;
grant usage on sequence notes_id_seq to fo_a, fo_b, fo_c;
select fence.protect('results'), fence.protect('ledger', 'job_key');
`

// failoverPrepared is the statement A prepares before the failover and
// again after it.
const failoverPrepared = "update results set payload = $1 where job_key = $2"

// failoverWrite is g's upsert of its job's result.
func failoverWrite(g fence.Lease, payload string) string {
	return fmt.Sprintf("insert into results values ('%s', '%s', %d) on conflict (job_key) do update set payload = excluded.payload, token = excluded.token",
		g.JobKey, payload, g.Token)
}

func newFailoverCast(t *testing.T) *failoverCast {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := pgtest.Start(ctx, pgtest.Options{Replica: true, Settings: map[string]string{"max_prepared_transactions": "4"}})
	if err != nil {
		t.Fatalf("start cluster: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	db, err := c.CreateDatabase(ctx, "failover")
	if err != nil {
		t.Fatal(err)
	}
	e := &failoverCast{c: c, db: db}
	old, err := c.Primary.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close(context.Background())
	if err := migrations.Apply(ctx, old); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if _, err := old.Exec(ctx, failoverSchema); err != nil {
		t.Fatal(err)
	}
	// Before the detach: A holds j and commits (step a_before), and runs
	// the prepared statement; fo_c holds k and commits (step k_before).
	if e.a, err = fence.Acquire(ctx, e.connectPgx(t, "direct", "fo_a"), "j", "a", time.Minute); err != nil {
		t.Fatal(err)
	}
	if e.other, err = fence.Acquire(ctx, e.connectPgx(t, "direct", "fo_c"), "k", "k", time.Minute); err != nil {
		t.Fatal(err)
	}
	e.write(t, "fo_a", e.a, "a_before", failoverWrite(e.a, "a"))
	e.write(t, "fo_c", e.other, "k_before_detach", failoverWrite(e.other, "k"))
	pa := e.connect(t, "direct", "fo_a", &e.a)
	if _, err := pa.Exec(ctx, "set fence.step = 'prepared'").ReadAll(); err != nil {
		t.Fatal(err)
	}
	if _, err := pa.Prepare(ctx, "zp", failoverPrepared, nil); err != nil {
		t.Fatal(err)
	}
	if err := pa.ExecPrepared(ctx, "zp", [][]byte{[]byte("a prepared"), []byte("j")}, nil, nil).Read().Err; err != nil {
		t.Fatalf("A's prepared statement before the failover: %v", err)
	}
	if err := c.WaitReplicaCaughtUp(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.DetachReplica(ctx); err != nil {
		t.Fatal(err)
	}
	// Only the old primary has these: B's takeover of j and its commit,
	// fo_c's commit under k, and a job of its own.
	if _, err := old.Exec(ctx, "update fence.leases set expires_at = clock_timestamp() - interval '1 second' where job_key = 'j'"); err != nil {
		t.Fatal(err)
	}
	if e.b, err = fence.Acquire(ctx, e.connectPgx(t, "direct", "fo_b"), "j", "b", time.Minute); err != nil {
		t.Fatal(err)
	}
	e.write(t, "fo_b", e.b, "b_before", failoverWrite(e.b, "b"))
	e.write(t, "fo_c", e.other, "k_before", failoverWrite(e.other, "k before"))
	// PostgreSQL WAL-logs a sequence 32 values ahead: more than that many
	// numbers drawn after the detach are a tail the promoted replica's
	// sequences are below (without the era's jump, the next acquire would
	// draw one of them again).
	wb := e.connectPgx(t, "direct", "fo_b")
	for i := range 40 {
		if _, err := fence.Acquire(ctx, wb, fmt.Sprintf("lost%d", i), "l", time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	if err := old.QueryRow(ctx, "select (select last_value from fence.token_seq), (select last_value from fence.epoch_seq)").Scan(&e.oldTokenSeq, &e.oldEpochSeq); err != nil {
		t.Fatal(err)
	}
	rows, err := old.Query(ctx, "select job_key, max(token) from fence.issuance group by job_key")
	if err != nil {
		t.Fatal(err)
	}
	e.oldTokens = map[string]int64{}
	for rows.Next() {
		var job string
		var tok int64
		if err := rows.Scan(&job, &tok); err != nil {
			t.Fatal(err)
		}
		e.oldTokens[job] = tok
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if e.oldTokens["j"] != e.b.Token || len(e.oldTokens) != 42 {
		t.Fatalf("tokens issued on the old primary: %v, want j's %d, k's and 40 lost jobs'", e.oldTokens, e.b.Token)
	}
	if err := c.Failover(ctx); err != nil {
		t.Fatal(err)
	}
	if e.admin, err = c.Primary.Connect(ctx, db); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.admin.Close(context.Background()) })
	// The lost takeover is lost: j's fence token is A's again.
	var tok int64
	if err := e.admin.QueryRow(ctx, "select max_issued_token from fence.fences where job_key = 'j'").Scan(&tok); err != nil {
		t.Fatal(err)
	}
	if tok != e.a.Token {
		t.Fatalf("j's fence token on the new primary is %d, want A's %d (the takeover was not lost)", tok, e.a.Token)
	}
	// And the numbers drawn after the detach are a lost tail: the new
	// primary's sequences are below them (until the era moves them).
	var seqTok, seqEpoch int64
	if err := e.admin.QueryRow(ctx, "select (select last_value from fence.token_seq), (select last_value from fence.epoch_seq)").Scan(&seqTok, &seqEpoch); err != nil {
		t.Fatal(err)
	}
	if seqTok >= e.oldTokenSeq || seqEpoch >= e.oldEpochSeq {
		t.Fatalf("the new primary's token and epoch sequences are at %d and %d, want below the old primary's %d and %d", seqTok, seqEpoch, e.oldTokenSeq, e.oldEpochSeq)
	}
	dsn := c.Primary.DSN("postgres")
	gate, err := NewFence(FenceConfig{Primary: dsn}, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(gate.Close)
	e.proxy = startProxy(t, Config{Primary: dsn, Interceptor: gate})
	return e
}

// write runs sql under g as role, directly, with step: set-up writes that
// must succeed.
func (e *failoverCast) write(t *testing.T, role string, g fence.Lease, step, sql string) {
	t.Helper()
	if err := castExec(ctxT(t), e.connect(t, "direct", role, &g), "set fence.step = '"+step+"'; "+sql, ""); err != nil {
		t.Fatalf("%s as %s: %v", sql, role, err)
	}
}

// connConfig is a connection to the cluster's (current) primary
// ("direct") or through the class's proxy ("proxy") as role, carrying l's
// generation in the startup options when l is not nil.
func (e *failoverCast) connConfig(t *testing.T, route, role string, l *fence.Lease) *pgconn.Config {
	t.Helper()
	host := e.c.Primary.Addr()
	if route == "proxy" {
		host = e.proxy.addr.String()
	}
	cfg, err := pgconn.ParseConfig(fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", url.PathEscape(role), host, e.db))
	if err != nil {
		t.Fatal(err)
	}
	if l != nil {
		cfg.RuntimeParams["options"] = pgoptions(*l)
	}
	return cfg
}

func (e *failoverCast) connect(t *testing.T, route, role string, l *fence.Lease) *pgconn.PgConn {
	t.Helper()
	return connectConfig(t, e.connConfig(t, route, role, l))
}

func (e *failoverCast) connectPgx(t *testing.T, route, role string) *pgx.Conn {
	t.Helper()
	cfg, err := pgx.ParseConfig("")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Config = *e.connConfig(t, route, role, nil)
	return connectPgx(t, cfg)
}

// eachRoute runs f as a subtest per route.
func (e *failoverCast) eachRoute(t *testing.T, f func(t *testing.T, route string)) {
	for _, route := range castRoutes {
		t.Run(route, func(t *testing.T) { f(t, route) })
	}
}

func (e *failoverCast) tryEach(t *testing.T, cases []castCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e.eachRoute(t, func(t *testing.T, route string) {
				before := e.state(t)
				err := castExec(ctxT(t), e.connect(t, route, tc.a.role, tc.a.lease), tc.a.sql, tc.a.copyIn)
				if got := pgtest.SQLState(err); got != tc.a.code {
					t.Fatalf("%s as %s: got %v (SQLSTATE %q), want SQLSTATE %s", tc.a.sql, tc.a.role, err, got, tc.a.code)
				}
				e.unchanged(t, before)
			})
		})
	}
}

// state is what an attempt must not change: the rows of every table,
// the receipts, fences, leases and eras. (Not the sequences: the first
// transaction that settles the new era moves them forward, and setval is
// not undone by its rollback; moving forward is what L5 wants.)
func (e *failoverCast) state(t *testing.T) []string {
	t.Helper()
	rows, err := e.admin.Query(ctxT(t), `
select 'results ' || r::text from results r
union all select 'ledger ' || r::text from ledger r
union all select 'notes ' || r::text from notes r
union all select 'receipt ' || concat_ws(' ', job_key, epoch, token, step, encode(payload_digest, 'hex'), digest_version) from fence.receipts
union all select 'fence ' || f::text from fence.fences f
union all select 'lease ' || concat_ws(' ', job_key, holder, token, expires_at) from fence.leases
union all select 'issuance ' || i::text from fence.issuance i
union all select 'prepared ' || gid from pg_prepared_xacts`)
	if err != nil {
		t.Fatalf("state: %v", err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("state: %v", err)
	}
	slices.Sort(lines)
	return lines
}

func (e *failoverCast) unchanged(t *testing.T, before []string) {
	t.Helper()
	after := e.state(t)
	if !slices.Equal(before, after) {
		t.Fatalf("the attempt changed what it must not:\n  before: %s\n  after:  %s", strings.Join(before, "\n          "), strings.Join(after, "\n          "))
	}
}
