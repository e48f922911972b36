package proxy

import (
	"fmt"
	"testing"
	"time"

	"github.com/pgfence/pgfence/fence"
)

func init() { registerBypass("ownership", bypassOwnership) }

// bypassOwnership: a generation belongs to the role that acquired it.
// Another worker does not read its token, and even with the token (leaked,
// guessed) cannot renew, release or retire it (FN001, as for any token),
// gate, write under it or commit a bogus receipt for it (FN011). Nobody
// ends a live lease by accident.
func bypassOwnership(t *testing.T) {
	c := newCast(t)
	w2, cur := c.worker2, c.current
	const notOwner = fence.CodeNotOwner
	fn := func(format string, args ...any) string { return fmt.Sprintf(format, args...) }
	c.tryEach(t, []castCase{
		{"read_fences", attempt{role: w2, sql: "select max_issued_token from fence.fences", code: "42501"}},
		{"read_leases", attempt{role: w2, sql: "select token from fence.leases", code: "42501"}},
		{"read_issuance", attempt{role: w2, sql: "select token from fence.issuance", code: "42501"}},
		{"read_receipts", attempt{role: w2, sql: "select token from fence.receipts", code: "42501"}},
		{"read_token_sequence", attempt{role: w2, sql: "select last_value from fence.token_seq", code: "42501"}},
		// Renew, release and retire tell another role it does not hold the
		// lease (FN001) whatever token it presents: issue 30 changed the
		// FN011 these expected, which told the current token from others.
		{"renew_with_leaked_token", attempt{role: w2, sql: fn("select fence.renew('job', %d, '1 hour')", cur.Token), code: castStale}},
		{"release_with_leaked_token", attempt{role: w2, sql: fn("select fence.release('job', %d)", cur.Token), code: castStale}},
		{"retire_with_leaked_token", attempt{role: w2, sql: fn("select fence.retire('job', %d)", cur.Token), code: castStale}},
		{"retire_without_token", attempt{role: w2, sql: "select fence.retire('job')", code: notOwner}},
		{"retire_forced_without_token", attempt{role: w2, sql: "select fence.retire('job', null, true)", code: notOwner}},
		{"gate_with_leaked_token", attempt{role: w2, sql: fn("begin; select fence.gate('job', %d, %d, ''); commit", cur.Epoch, cur.Token), code: notOwner}},
		{"commit_bogus_receipt", attempt{role: w2, sql: fn("begin; select fence.commit('job', %d, %d, '', '\\xdead', 'v1'); commit", cur.Epoch, cur.Token), code: notOwner}},
		{"commit_if_written_bogus", attempt{role: w2, lease: &cur, sql: fn("begin; update res set v = 'zombie'; select fence.commit_if_written('job', %d, %d, '', '\\xdead', 'v1'); commit", cur.Epoch, cur.Token), code: notOwner}},
		{"write_with_leaked_token", attempt{role: w2, lease: &cur, sql: "update res set v = 'zombie'", code: notOwner}},
		{"opaque_write_with_leaked_token", attempt{role: w2, lease: &cur, sql: "do $$ begin delete from inh_c; end $$", code: notOwner}},
		{"copy_with_leaked_token", attempt{role: w2, lease: &cur, sql: "copy res from stdin", copyIn: "7\tjob\tzombie\n", code: notOwner}},
		// Taking over a live lease by naming its holder.
		{"acquire_as_same_holder", attempt{role: w2, sql: "select fence.acquire('job', 'b', '1 minute')", code: fence.CodeLeaseHeld}},
		// An administrator too needs force to end a running job's lease.
		{"bypass_retire_live_lease", attempt{role: c.dba, sql: "select fence.retire('job')", code: fence.CodeLeaseHeld}},
	})

	t.Run("replica_check_reveals_no_token", func(t *testing.T) {
		// has_generation answers only for the caller's own generations: for
		// another's token every guess is false, so it cannot be bisected.
		before := c.state(t)
		conn := c.connectPgx(t, "direct", w2, nil)
		for _, guess := range []int64{1, cur.Token - 1, cur.Token, cur.Token + 1, 1 << 40} {
			var ok bool
			if err := conn.QueryRow(ctxT(t), "select fence.has_generation('job', $1)", guess).Scan(&ok); err != nil || ok {
				t.Fatalf("has_generation('job', %d) for another role: %v, %v; want false", guess, ok, err)
			}
		}
		var own bool
		if err := c.connectPgx(t, "direct", c.worker, nil).QueryRow(ctxT(t), "select fence.has_generation('job', $1)", cur.Token).Scan(&own); err != nil || !own {
			t.Fatalf("has_generation for the holder's own token: %v, %v; want true", own, err)
		}
		var cols string
		if err := conn.QueryRow(ctxT(t), "select string_agg(attname, ',' order by attnum) from pg_attribute where attrelid = 'fence.jobs'::regclass and attnum > 0").Scan(&cols); err != nil {
			t.Fatal(err)
		}
		if cols != "job_key,epoch,retired_at,owner_role,lease_holder,lease_expires_at,lease_live" {
			t.Fatalf("fence.jobs columns: %s", cols)
		}
		c.unchanged(t, before)
	})
	t.Run("job_authorization", func(t *testing.T) {
		// Off by default; on, a role acquires only the keys its patterns match.
		c.as(t, c.dba, "select fence.set_job_authorization(true); select fence.grant_job('"+w2+"', 'report-%')")
		c.try(t, attempt{role: w2, sql: "select fence.acquire('job3', 'e', '1 minute')", code: notOwner})
		c.try(t, attempt{role: w2, sql: "select fence.grant_job('" + w2 + "', '%')", code: "42501"})
		c.try(t, attempt{role: w2, sql: "insert into fence.job_grants values ('" + w2 + "', '%')", code: "42501"})
		c.try(t, attempt{role: c.owner, sql: "select fence.set_job_authorization(false)", code: "42501"})
		if _, err := fence.Acquire(ctxT(t), c.connectPgx(t, "direct", w2, nil), "report-1", "e", time.Minute); err != nil {
			t.Fatalf("acquire of a granted key: %v", err)
		}
		c.as(t, c.dba, "select fence.set_job_authorization(false)")
	})
	t.Run("owner_keeps_working", func(t *testing.T) {
		// The control: the holder itself renews, writes, commits and
		// retires its own job with its token.
		for _, q := range []string{
			fn("select fence.renew('job', %d, '1 minute')", cur.Token),
			"set fence.step = 'own'; update res set v = 'own' where k = 1",
			fn("select fence.retire('job', %d)", cur.Token),
		} {
			if err := castExec(ctxT(t), c.connect(t, "direct", c.worker, &cur), q, ""); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		if n := c.count(t, "select count(*) from fence.fences where job_key = 'job' and retired_at is not null"); n != 1 {
			t.Fatal("the holder's retire did not retire the job")
		}
	})
}
