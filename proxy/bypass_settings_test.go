package proxy

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
)

func init() { registerBypass("session_settings", bypassSessionSettings) }

// bypassSessionSettings (attack round 14, attacker Z): pgfence's functions
// answer the same whatever the caller's session sets. A worker may set
// TimeZone, DateStyle, IntervalStyle, extra_float_digits,
// standard_conforming_strings and the like for itself (SET, startup
// options, ALTER ROLE … SET); none of them lengthens a lease past
// max_lease_ttl (Z-H1: a month against days, a day across the end of a
// made-up daylight saving time), changes how a fence setting or a timeline
// history line is read (Z-M1, Z-L1), or hides a change of what a
// protected table's rows read from the DDL guard. And a replay whose
// first commit's digest is of another kind says that the payloads were
// not compared (Z-L2), in the database and through the proxy.
func bypassSessionSettings(t *testing.T) {
	c := newCast(t)
	w, w2 := c.worker, c.worker2
	const badTTL = "22023"
	fn := fmt.Sprintf

	// Intervals that compare as at most a day (a month is 30 days, a day
	// 24 hours) but that now() + ttl made years: refused, by acquire and
	// renew, by both routes.
	c.tryEach(t, append(castAttempts(w2, badTTL, [][2]string{
		{"acquire_months_less_days", "select fence.acquire('ss-squat', 'w2', interval '120000 mons -3599999 days')"},
		{"acquire_century_less_days", "select fence.acquire('ss-squat', 'w2', interval '1200 mons -35999 days')"},
		{"acquire_year_less_days", "select fence.acquire('ss-squat', 'w2', interval '1 year -359 days')"},
		{"acquire_negative_seconds", "select fence.acquire('ss-squat', 'w2', interval '-1 year +361 days')"},
	}), castAttempts(w, badTTL, [][2]string{
		{"renew_months_less_days", fn("select fence.renew('job', %d, interval '120000 mons -3599999 days')", c.current.Token)},
		{"renew_century_less_days", fn("select fence.renew('job', %d, interval '1200 mons -35999 days')", c.current.Token)},
	})...))
	// An administrator's gc and cap: seconds that are not positive are
	// refused even when the interval compares as positive (gc's cutoff
	// was in the future: every closed generation's receipts pruned).
	c.tryEach(t, castAttempts(c.dba, badTTL, [][2]string{
		{"gc_negative_seconds", "select fence.gc(interval '-1 year +361 days')"},
		{"cap_negative_seconds", "select fence.set_max_lease_ttl(interval '-1 year +361 days')"},
	}))

	// The lease a worker gets is the seconds checked: a month less 29
	// days is a day (it was two), and a day is 24 hours under a TimeZone
	// whose daylight saving time (23 hours ahead) ends within the day (it
	// was 47 hours).
	dst := dstZone(time.Now())
	for _, route := range castRoutes {
		t.Run("ttl_is_its_seconds/"+route, func(t *testing.T) {
			ctx := ctxT(t)
			conn := c.connect(t, route, w2, nil)
			job := "ss-ttl-" + route
			rs, err := conn.Exec(ctx, fn("select token from fence.acquire('%s', 'w2', interval '1 mon -29 days')", job)).ReadAll()
			if err != nil {
				t.Fatalf("acquire for a month less 29 days: %v", err)
			}
			c.leaseAtMostADay(t, job, "acquire, a month less 29 days")
			if _, err := conn.Exec(ctx, fn("select fence.renew('%s', %s, interval '1 mon -29 days')", job, rs[0].Rows[0][0])).ReadAll(); err != nil {
				t.Fatalf("renew for a month less 29 days: %v", err)
			}
			c.leaseAtMostADay(t, job, "renew, a month less 29 days")
		})
		t.Run("ttl_ignores_timezone/"+route, func(t *testing.T) {
			ctx := ctxT(t)
			conn := c.connect(t, route, w2, nil)
			job := "ss-tz-" + route
			rs, err := conn.Exec(ctx, fn("select token from fence.acquire('%s', 'w2', interval '1 hour')", job)).ReadAll()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := conn.Exec(ctx, fn("set timezone = '%s'; select fence.renew('%s', %s, interval '1 day')", dst, job, rs[0].Rows[0][0])).ReadAll(); err != nil {
				t.Fatalf("renew for a day under %s: %v", dst, err)
			}
			c.leaseAtMostADay(t, job, "renew, a day under "+dst)
			if _, err := conn.Exec(ctx, fn("select fence.acquire('%s-2', 'w2', interval '1 day')", job)).ReadAll(); err != nil {
				t.Fatalf("acquire for a day under %s: %v", dst, err)
			}
			c.leaseAtMostADay(t, job+"-2", "acquire, a day under "+dst)
		})
	}

	// standard_conforming_strings off: the token check still reads
	// 's2s' as no number (FN008, not 22P02) and ' 5 ' as 5. Directly only:
	// the proxy refuses a bad fence.token at SET time.
	scsOff := func(token string) string {
		return fn("set standard_conforming_strings = off; set fence.job_key = 'job'; set fence.epoch = %d; set fence.token = '%s'; set fence.step = 'scs'; ",
			c.current.Epoch, token)
	}
	c.tryEach(t, []castCase{
		{"scs_off_token_s2s", attempt{role: w, sql: scsOff("s2s") + "insert into res values (7, 'job', 'scs')", code: castNoMeta, direct: true}},
		{"scs_off_token_s2s_keyed", attempt{role: w, sql: scsOff("s2s") + "insert into app.ledger values (7, 'job', 'scs')", code: castNoMeta, direct: true}},
	})
	t.Run("scs_off_token_with_spaces_writes", func(t *testing.T) {
		conn := c.connect(t, "direct", w, nil)
		if _, err := conn.Exec(ctxT(t), scsOff(fn(" %d ", c.current.Token))+"insert into app.ledger values (8, 'job', 'scs')").ReadAll(); err != nil {
			t.Fatalf("the current generation's write with standard_conforming_strings off: %v", err)
		}
	})

	// The era's evidence of a lossless promotion reads the timeline
	// history the same with standard_conforming_strings off (a worker
	// that settled the era after a synchronous standby's promotion made
	// it lossy: every generation void). On the replica (the function
	// needs primary_conninfo), with a history file of a timeline the
	// replica never looks for.
	t.Run("era_evidence_scs_off", func(t *testing.T) {
		ctx := ctxT(t)
		lsn, err := cluster.CurrentLSN(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := cluster.ReplayedOn(ctx, cluster.Replica, lsn); err != nil {
			t.Fatal(err)
		}
		const history = "pg_wal/00000063.history" // timeline 99
		if err := cluster.Replica.WriteFile(history, []byte("98\t0/3586600\tno recovery target specified\n")); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cluster.Replica.RemoveFile(history) })
		for _, scs := range []string{"on", "off"} {
			// A session of its own for each: PL/pgSQL reads a function's
			// literals once per session, at its first call.
			cfg, err := pgx.ParseConfig(cluster.Replica.DSN(c.db))
			if err != nil {
				t.Fatal(err)
			}
			cfg.RuntimeParams["options"] = "-c standard_conforming_strings=" + scs
			rconn := connectPgx(t, cfg)
			var why *string
			if err := rconn.QueryRow(ctx, "select fence.era_lossless_evidence(98, 99)").Scan(&why); err != nil {
				t.Fatal(err)
			}
			if why != nil {
				t.Errorf("standard_conforming_strings %s: a promotion's history reads as %q, want lossless (null)", scs, *why)
			}
		}
	})

	// The DDL guard's record of a policy: a table owner changes the
	// policy a DBA made into one that prints the same under its own
	// settings. A protected table of the owner's for each, whose rows are
	// read through the policy (row-level security the DBA enabled).
	for _, p := range []struct{ table, settings, using string }{
		{"ss_date", "set datestyle = 'SQL, MDY'", "v <> ('2026-01-02'::date)::text"},
		{"ss_float", "set extra_float_digits = 1", "k::float8 <> '0.1'::float8"},
	} {
		c.as(t, c.dba, fn(`%[2]s;
create table app.%[1]s (k int, v text);
alter table app.%[1]s owner to %[3]s;
select fence.protect('app.%[1]s');
alter table app.%[1]s enable row level security;
create policy %[1]s on app.%[1]s using (%[4]s)`, p.table, p.settings, pgx.Identifier{c.owner}.Sanitize(), p.using))
	}
	c.tryEach(t, []castCase{
		{"policy_same_text_other_datestyle", attempt{role: c.owner, code: castLocked,
			sql: "set datestyle = 'SQL, DMY'; alter policy ss_date on app.ss_date using (v <> ('2026-02-01'::date)::text)"}},
		{"policy_same_text_fewer_float_digits", attempt{role: c.owner, code: castLocked,
			sql: "set extra_float_digits = -15; alter policy ss_float on app.ss_float using (k::float8 <> '0.12'::float8)"}},
	})

	// Z-L2: the first commit of step "zl2" is the backstop's (a direct
	// write: digest backstop-v1); a commit of the same step with the
	// proxy's digest version is a replay that says the payloads were not
	// compared, in the database and in the proxy's NOTICE.
	t.Run("replay_across_digest_kinds", func(t *testing.T) {
		ctx := ctxT(t)
		first := c.connect(t, "direct", w, &c.current)
		if _, err := first.Exec(ctx, "set fence.step = 'zl2'; insert into res values (9, 'job', 'first')").ReadAll(); err != nil {
			t.Fatal(err)
		}
		db := c.connect(t, "direct", w, nil)
		_, err := db.Exec(ctx, fn("select fence.commit('job', %d, %d, 'zl2', decode('00', 'hex'), 'v1')", c.current.Epoch, c.current.Token)).ReadAll()
		pg := pgError(err)
		if pg == nil || pg.Code != fence.CodeReplay || strings.Contains(pg.Message, "same payload") ||
			!strings.Contains(pg.Message, "could not be compared") || !strings.Contains(pg.Hint, "only if this is a retry") {
			t.Fatalf("fence.commit of another digest kind: %v (hint %q), want FN00R saying the payloads could not be compared", err, hintOf(pg))
		}
		cfg := c.connConfig(t, "proxy", w, &c.current)
		cfg.RuntimeParams["options"] += " -c fence.step=zl2"
		var notices []*pgconn.Notice
		cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { notices = append(notices, n) }
		conn, err := pgconn.ConnectConfig(ctx, cfg)
		conn = connected(t, conn, err, "proxy")
		if _, err := conn.Exec(ctx, "update res set v = 'TOTALLY DIFFERENT' where k = 999").ReadAll(); err != nil {
			t.Fatalf("the retry through the proxy: %v", err)
		}
		var replay *pgconn.Notice
		for _, n := range notices {
			if n.Code == fence.CodeReplay {
				replay = n
			}
		}
		if replay == nil || strings.Contains(replay.Message, "same payload") || !strings.Contains(replay.Message, "could not be compared") ||
			!strings.Contains(replay.Hint, "only if this is a retry") {
			t.Fatalf("the proxy's replay notice %+v, want one saying the payloads could not be compared", replay)
		}
		if n := c.count(t, "select count(*) from res where v = 'TOTALLY DIFFERENT'"); n != 0 {
			t.Fatalf("%d rows of the retry, want 0", n)
		}
	})
}

// leaseAtMostADay fails t unless job's lease ends within a day (the cap)
// and more than 23 hours from now.
func (c *cast) leaseAtMostADay(t *testing.T, job, what string) {
	t.Helper()
	var secs float64
	if err := c.admin.QueryRow(ctxT(t), "select extract(epoch from expires_at - clock_timestamp())::float8 from fence.leases where job_key = $1", job).Scan(&secs); err != nil {
		t.Fatal(err)
	}
	if secs > 86400 || secs < 23*3600 {
		t.Errorf("%s: the lease ends in %.0f s, want at most a day (86400 s)", what, secs)
	}
}

// dstZone is a POSIX TimeZone whose daylight saving time, 23 hours ahead
// of its standard time (UTC), is in effect at now and ends within the
// next 12 hours of its wall clock: under it now() + interval '1 day' is
// 47 hours. Days are zero-based days of the year ("n"); a rule that
// starts in one year and ends in the next is read as PostgreSQL reads a
// southern hemisphere's.
func dstZone(now time.Time) string {
	now = now.UTC()
	start := now.Add(-24 * time.Hour)                                      // standard time is UTC
	end := now.Add(23 * time.Hour).Add(12 * time.Hour).Truncate(time.Hour) // daylight saving wall time
	return fmt.Sprintf("STD0DST-23,%d/%d,%d/%d", start.YearDay()-1, start.Hour(), end.YearDay()-1, end.Hour())
}

func hintOf(pg *pgconn.PgError) string {
	if pg == nil {
		return ""
	}
	return pg.Hint
}
