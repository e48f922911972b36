package proxy

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() {
	registerBypass("consumerclaim", bypassConsumerClaim)
	registerBypass("consumerauth", bypassConsumerAuth)
}

// acceptAs runs fence.accept_event(consumer, job, epoch, token) as role by
// route and returns its answer ("t" or "f") or, when it fails, its
// SQLSTATE.
func (c *cast) acceptAs(t *testing.T, route, role, consumer, job string, epoch, token int64) string {
	t.Helper()
	sql := fmt.Sprintf("select fence.accept_event(%s, %s, %d, %d)", quoteLit(consumer), quoteLit(job), epoch, token)
	rs, err := c.connect(t, route, role, nil).Exec(ctxT(t), sql).ReadAll()
	if err != nil {
		if code := pgtest.SQLState(err); code != "" {
			return code
		}
		t.Fatalf("%s as %s (%s): %v", sql, role, route, err)
	}
	return string(rs[0].Rows[0][0])
}

// wantAccept fails t unless acceptAs answers want.
func (c *cast) wantAccept(t *testing.T, want, route, role, consumer, job string, epoch, token int64) {
	t.Helper()
	if got := c.acceptAs(t, route, role, consumer, job, epoch, token); got != want {
		t.Fatalf("accept_event(%q, %q, %d, %d) as %s (%s): %s, want %s", consumer, job, epoch, token, role, route, got, want)
	}
}

// claimedBy is the role fence.consumers says consumer belongs to ("" for
// none).
func (c *cast) claimedBy(t *testing.T, consumer string) string {
	t.Helper()
	var role string
	err := c.admin.QueryRow(ctxT(t), "select role from fence.consumers where consumer = $1", consumer).Scan(&role)
	if err != nil && err != pgx.ErrNoRows {
		t.Fatal(err)
	}
	return role
}

func quoteLit(s string) string { return "'" + s + "'" }

// bypassConsumerClaim: a consumer name is claimed only by an event its
// consumer accepted (issue 30, round 2, E-M3). Migration 015 claimed an
// unknown name for the caller before looking at the event, so a worker of
// any role denied another role's consumer with one event nobody ever
// issued (fence.accept_event('billing', 'job-never', 1, 1) answered false
// and made 'billing' its own; the real consumer then got 42501). A
// rejected event now changes nothing, whatever the reason it is rejected,
// by every route. Job authorization and consumer authorization are off
// here (the default): the first role to accept an event under a new name
// still gets it, which is the documented default (consumerauth covers
// the switch), and an administrator reassigns it.
func bypassConsumerClaim(t *testing.T) {
	c := newCast(t)
	w, w2, cur, stale, other := c.worker, c.worker2, c.current, c.stale, c.other
	done, err := fence.Acquire(ctxT(t), c.connectPgx(t, "direct", w, nil), "done", "d", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	c.as(t, w, fmt.Sprintf("select fence.retire('done', %d)", done.Token))
	type ev struct {
		job          string
		epoch, token int64
	}
	// Events worker2 (the squatter) sends under names nobody has used:
	// each is rejected, and must claim nothing.
	for _, tc := range []struct {
		name string
		e    ev
	}{
		{"job_never_acquired", ev{"job-never", 1, 1}},
		{"token_never_issued", ev{"job", cur.Epoch, cur.Token + 1000}},
		{"next_token_not_yet_issued", ev{"job", cur.Epoch, cur.Token + 1}},
		{"epoch_never_issued", ev{"job", cur.Epoch + 1000, cur.Token}},
		{"token_of_another_job", ev{"job", cur.Epoch, other.Token}},
		{"own_token_under_another_job", ev{"job", other.Epoch, other.Token}},
		{"retired_epoch", ev{"done", done.Epoch, done.Token}},
		{"max_epoch", ev{"job", math.MaxInt64, 1}},
		{"zero_token", ev{"job", cur.Epoch, 0}},
		{"negative_token", ev{"job", cur.Epoch, -1}},
	} {
		t.Run("rejected_claims_nothing_"+tc.name, func(t *testing.T) {
			name := "billing-" + tc.name
			c.tryRejected(t, attempt{role: w2, sql: fmt.Sprintf("begin; select fence.accept_event(%s, '%s', %d, %d); commit",
				quoteLit(name), tc.e.job, tc.e.epoch, tc.e.token)})
			// The name is still free: its real consumer takes it.
			c.wantAccept(t, "t", "direct", w, name, "job", cur.Epoch, cur.Token)
			if got := c.claimedBy(t, name); got != w {
				t.Fatalf("%s belongs to %q, want %q", name, got, w)
			}
		})
	}
	// The finding as the attacker wrote it, by each route.
	t.Run("squatter_rejected_then_owner", func(t *testing.T) {
		for _, route := range castRoutes {
			name := "billing-" + route
			c.wantAccept(t, "f", route, w2, name, "job-never", 1, 1)
			c.wantAccept(t, "t", route, w, name, "job", cur.Epoch, cur.Token)
			c.wantAccept(t, "f", route, w, name, "job", stale.Epoch, stale.Token)
			c.wantAccept(t, "42501", route, w2, name, "job2", other.Epoch, other.Token)
		}
	})
	// A rejected event in a transaction rolled back claims nothing either
	// (nor did it hold anything after).
	t.Run("rejected_in_a_rolled_back_transaction", func(t *testing.T) {
		for _, route := range castRoutes {
			name := "rollback-" + route
			c.tryRejected(t, attempt{role: w2, sql: fmt.Sprintf("begin; select fence.accept_event(%s, 'job', %d, %d); rollback",
				quoteLit(name), cur.Epoch, cur.Token+50)})
			if got := c.claimedBy(t, name); got != "" {
				t.Fatalf("%s belongs to %q after a rejected event, want nobody", name, got)
			}
		}
	})
	// Off (the default), first come holds: worker2 accepts an event of its
	// own job under a name worker will need, and keeps it (docs/security.md
	// says so, with the switch). An administrator gives it back.
	t.Run("first_come_holds_while_off_and_admin_reassigns", func(t *testing.T) {
		for _, route := range castRoutes {
			name := "squat-" + route
			c.wantAccept(t, "t", route, w2, name, "job2", other.Epoch, other.Token)
			if got := c.claimedBy(t, name); got != w2 {
				t.Fatalf("%s belongs to %q, want %q", name, got, w2)
			}
			c.try(t, attempt{role: w, sql: fmt.Sprintf("select fence.accept_event(%s, 'job', %d, %d)", quoteLit(name), cur.Epoch, cur.Token), code: "42501"})
			c.as(t, c.su, fmt.Sprintf("select fence.assign_consumer(%s, %s)", quoteLit(name), quoteLit(w)))
			c.wantAccept(t, "t", route, w, name, "job", cur.Epoch, cur.Token)
			c.wantAccept(t, "42501", route, w2, name, "job2", other.Epoch, other.Token)
		}
	})
	// What decides who may claim is out of a worker's reach.
	c.tryEach(t, castAttempts(w2, "42501", [][2]string{
		{"worker_switches_consumer_authorization", "select fence.set_consumer_authorization(false)"},
		{"worker_grants_itself_a_consumer", fmt.Sprintf("select fence.grant_consumer(%s, '%%')", quoteLit(w2))},
		{"worker_revokes_a_consumer_grant", fmt.Sprintf("select fence.revoke_consumer(%s, 'billing-%%')", quoteLit(w))},
		{"worker_assigns_a_consumer", fmt.Sprintf("select fence.assign_consumer('billing-direct', %s)", quoteLit(w2))},
		{"worker_writes_consumer_grants", fmt.Sprintf("insert into fence.consumer_grants (role, pattern) values (%s, '%%')", quoteLit(w2))},
		{"worker_reads_consumer_grants", "select * from fence.consumer_grants"},
		{"worker_writes_consumers", fmt.Sprintf("update fence.consumers set role = %s", quoteLit(w2))},
		{"worker_claims_by_insert", fmt.Sprintf("insert into fence.consumers (consumer, role) values ('fresh', %s)", quoteLit(w2))},
		{"worker_writes_settings", "insert into fence.settings (name, value) values ('consumer_authorization', 'off')"},
	}))
}

// bypassConsumerAuth: with consumer authorization on
// (fence.set_consumer_authorization(true)), a role that is not an
// administrator accepts events only under consumer names matching a LIKE
// pattern granted to it or to a role it belongs to
// (fence.grant_consumer); a claim whose role is no longer granted the name
// lapses, and the next granted role whose event is accepted takes it.
func bypassConsumerAuth(t *testing.T) {
	c := newCast(t)
	w, w2, cur, stale, other := c.worker, c.worker2, c.current, c.stale, c.other
	group := c.worker + "_consumers"
	id := func(s string) string { return pgx.Identifier{s}.Sanitize() }
	// Before the switch: worker2 squats "payroll" (first come, off).
	c.wantAccept(t, "t", "direct", w2, "payroll", "job2", other.Epoch, other.Token)
	c.exec(t, fmt.Sprintf(`create role %s nologin; grant %[1]s to %s;
select fence.set_consumer_authorization(true);
select fence.grant_consumer(%s, 'billing-%%');
select fence.grant_consumer(%s, 'payroll');
select fence.grant_consumer(%s, 'w2-%%');
select fence.grant_consumer(%s, 'billing-shared');`,
		id(group), id(w), quoteLit(group), quoteLit(w), quoteLit(w2), quoteLit(w2)))
	t.Cleanup(func() { c.admin.Exec(ctxT(t), "drop role if exists "+id(group)) })

	refused := func(name, role, consumer string, e [3]any) castCase {
		return castCase{name, attempt{role: role, code: "42501",
			sql: fmt.Sprintf("begin; select fence.accept_event(%s, '%s', %d, %d); commit", quoteLit(consumer), e[0], e[1], e[2])}}
	}
	own2 := [3]any{"job2", other.Epoch, other.Token}
	never := [3]any{"job-never", int64(1), int64(1)}
	c.tryEach(t, []castCase{
		// Not granted: refused whatever the event (so the answer tells
		// nothing about it), before anything is claimed or locked.
		refused("not_granted_own_event", w2, "billing-a", own2),
		refused("not_granted_never_issued", w2, "billing-a", never),
		refused("not_granted_pattern_is_like_not_prefix", w, "billingX", [3]any{"job", cur.Epoch, cur.Token}),
		refused("not_granted_lapsed_claimant", w2, "payroll", own2),
	})
	t.Run("granted_rejected_claims_nothing", func(t *testing.T) {
		c.tryRejected(t, attempt{role: w2, sql: "select fence.accept_event('w2-x', 'job-never', 1, 1)"})
	})
	t.Run("granted_through_a_group_claims", func(t *testing.T) {
		for _, route := range castRoutes {
			name := "billing-" + route
			c.wantAccept(t, "t", route, w, name, "job", cur.Epoch, cur.Token)
			c.wantAccept(t, "f", route, w, name, "job", stale.Epoch, stale.Token)
			if got := c.claimedBy(t, name); got != w {
				t.Fatalf("%s belongs to %q, want %q", name, got, w)
			}
		}
	})
	t.Run("granted_but_claimed_by_another_granted_role", func(t *testing.T) {
		c.wantAccept(t, "t", "direct", w, "billing-shared", "job", cur.Epoch, cur.Token)
		c.try(t, attempt{role: w2, code: "42501",
			sql: fmt.Sprintf("select fence.accept_event('billing-shared', 'job2', %d, %d)", other.Epoch, other.Token)})
	})
	// The squatter's claim from before the switch lapses: a rejected event
	// of the granted role does not take it, an accepted one does.
	t.Run("lapsed_claim_taken_by_an_accepted_event", func(t *testing.T) {
		c.wantAccept(t, "f", "proxy", w, "payroll", "job-never", 1, 1)
		if got := c.claimedBy(t, "payroll"); got != w2 {
			t.Fatalf("payroll belongs to %q after a rejected event, want %q still", got, w2)
		}
		c.wantAccept(t, "t", "proxy", w, "payroll", "job", cur.Epoch, cur.Token)
		if got := c.claimedBy(t, "payroll"); got != w {
			t.Fatalf("payroll belongs to %q, want %q", got, w)
		}
		c.wantAccept(t, "42501", "direct", w2, "payroll", "job2", other.Epoch, other.Token)
	})
	t.Run("revoked_grant_refuses_the_claimant", func(t *testing.T) {
		c.exec(t, fmt.Sprintf("select fence.revoke_consumer(%s, 'billing-%%')", quoteLit(group)))
		c.try(t, attempt{role: w, code: "42501",
			sql: fmt.Sprintf("select fence.accept_event('billing-direct', 'job', %d, %d)", cur.Epoch, cur.Token)})
		c.exec(t, fmt.Sprintf("select fence.grant_consumer(%s, 'billing-%%')", quoteLit(group)))
		c.wantAccept(t, "t", "direct", w, "billing-direct", "job", cur.Epoch, cur.Token)
	})
	t.Run("administrator_acts_and_reassigns", func(t *testing.T) {
		// A superuser needs no grant, and its claim does not lapse.
		c.wantAccept(t, "t", "direct", c.su, "billing-su", "job", cur.Epoch, cur.Token)
		c.wantAccept(t, "42501", "proxy", w, "billing-su", "job", cur.Epoch, cur.Token)
		c.wantAccept(t, "t", "proxy", c.su, "billing-direct", "job", cur.Epoch, cur.Token)
		// Reassigned to worker2, granted the name: it is worker2's.
		c.as(t, c.su, fmt.Sprintf("select fence.assign_consumer('billing-shared', %s)", quoteLit(w2)))
		c.wantAccept(t, "t", "proxy", w2, "billing-shared", "job2", other.Epoch, other.Token)
		c.wantAccept(t, "42501", "proxy", w, "billing-shared", "job", cur.Epoch, cur.Token)
	})
	t.Run("owner_still_advances", func(t *testing.T) {
		for _, route := range castRoutes {
			c.wantAccept(t, "t", route, w, "billing-proxy", "job", cur.Epoch, cur.Token)
			c.wantAccept(t, "f", route, w, "billing-proxy", "job", stale.Epoch, stale.Token)
		}
	})
	t.Run("switched_off_first_come_again", func(t *testing.T) {
		c.exec(t, "select fence.set_consumer_authorization(false)")
		c.wantAccept(t, "t", "direct", w2, "billing-late", "job2", other.Epoch, other.Token)
		c.wantAccept(t, "42501", "direct", w, "billing-late", "job", cur.Epoch, cur.Token)
	})
}
