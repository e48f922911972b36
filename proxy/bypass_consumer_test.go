package proxy

import (
	"fmt"
	"math"
	"testing"

	"github.com/pgfence/pgfence/fence"
)

func init() { registerBypass("consumer", bypassConsumer) }

// bypassConsumer: fence.accept_event never lets an event whose epoch and
// token fence.acquire never issued for its key raise a consumer's
// watermark above the real generation and make it reject the real one
// (L6). It rejects such an event as it rejects an older one (false, the
// watermark unchanged): issue 30 changed the FN005 these cases expected,
// because that error told a role which tokens were issued.
func bypassConsumer(t *testing.T) {
	c := newCast(t)
	w, cur, stale, other := c.worker, c.current, c.stale, c.other
	// The consumer has accepted the current generation's event.
	c.as(t, w, fmt.Sprintf("select fence.accept_event('mailer', 'job', %d, %d)", cur.Epoch, cur.Token))
	accept := func(job string, epoch, token int64) string {
		return fmt.Sprintf("begin; select fence.accept_event('mailer', '%s', %d, %d); commit", job, epoch, token)
	}
	rejected := func(name, role, sql string) castCase { return castCase{name, attempt{role: role, sql: sql}} }
	for _, tc := range []castCase{
		rejected("token_never_issued", w, accept("job", cur.Epoch, cur.Token+1000)),
		rejected("next_token_not_yet_issued", w, accept("job", cur.Epoch, cur.Token+1)),
		rejected("epoch_never_issued", w, accept("job", cur.Epoch+1000, cur.Token)),
		rejected("max_epoch", w, accept("job", math.MaxInt64, 1)),
		rejected("max_token", w, accept("job", cur.Epoch, math.MaxInt64)),
		rejected("zero_token", w, accept("job", cur.Epoch, 0)),
		rejected("negative_token", w, accept("job", cur.Epoch, -1)),
		rejected("token_of_another_job", w, accept("job", cur.Epoch, other.Token)),
		rejected("epoch_of_another_job", w, accept("job", other.Epoch, other.Token)),
		rejected("job_never_acquired", w, accept("nobody", cur.Epoch, cur.Token)),
		rejected("forged_in_the_consumer_transaction", w,
			fmt.Sprintf("begin; insert into notes (note) values ('applied'); select fence.accept_event('mailer', 'job', %d, %d); commit", cur.Epoch, cur.Token+5)),
	} {
		t.Run(tc.name, func(t *testing.T) { c.tryRejected(t, tc.a) })
	}
	// Another role's event under this consumer: since migration 015 a
	// consumer is its role's, and another role is refused (42501) rather
	// than answered false; the watermark is unchanged either way.
	t.Run("forged_by_another_worker", func(t *testing.T) {
		c.try(t, attempt{role: c.worker2, sql: accept("job", cur.Epoch, cur.Token+7), code: "42501"})
	})
	t.Run("real_generations_still_decided", func(t *testing.T) {
		// The watermark is where the real events left it: the current
		// generation is accepted again, the stale one rejected.
		conn := c.connectPgx(t, "direct", w, nil)
		for _, ev := range []struct {
			l    fence.Lease
			want bool
		}{{cur, true}, {stale, false}} {
			var ok bool
			if err := conn.QueryRow(ctxT(t), "select fence.accept_event('mailer', 'job', $1, $2)", ev.l.Epoch, ev.l.Token).Scan(&ok); err != nil || ok != ev.want {
				t.Fatalf("accept_event(%d, %d): %v, %v; want %v", ev.l.Epoch, ev.l.Token, ok, err, ev.want)
			}
		}
	})
}

// tryRejected runs a (a query with one accept_event answer) by every
// route, asserting that the event was rejected (false) and, on the cast's
// own connection, that nothing changed.
func (c *cast) tryRejected(t *testing.T, a attempt) {
	t.Helper()
	for _, route := range castRoutes {
		t.Run(route, func(t *testing.T) {
			before := c.state(t)
			rs, err := c.connect(t, route, a.role, a.lease).Exec(ctxT(t), a.sql).ReadAll()
			if err != nil {
				t.Fatalf("%s as %s: %v, want false", a.sql, a.role, err)
			}
			got := ""
			for _, r := range rs {
				if len(r.Rows) == 1 {
					got = string(r.Rows[0][0])
				}
			}
			if got != "f" {
				t.Fatalf("%s as %s: %q, want false (rejected)", a.sql, a.role, got)
			}
			c.unchanged(t, before)
		})
	}
}
