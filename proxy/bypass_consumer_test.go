package proxy

import (
	"fmt"
	"math"
	"testing"

	"github.com/pgfence/pgfence/fence"
)

func init() { registerBypass("consumer", bypassConsumer) }

// bypassConsumer: fence.accept_event refuses, with FN005, an event whose
// epoch and token fence.acquire never issued for its key, so a forged or
// corrupted event cannot raise a consumer's watermark above the real
// generation and make it reject the real one (L6).
func bypassConsumer(t *testing.T) {
	c := newCast(t)
	w, cur, stale, other := c.worker, c.current, c.stale, c.other
	// The consumer has accepted the current generation's event.
	c.as(t, w, fmt.Sprintf("select fence.accept_event('mailer', 'job', %d, %d)", cur.Epoch, cur.Token))
	accept := func(job string, epoch, token int64) string {
		return fmt.Sprintf("begin; select fence.accept_event('mailer', '%s', %d, %d); commit", job, epoch, token)
	}
	const unknown = fence.CodeUnknownJob
	c.tryEach(t, []castCase{
		{"token_never_issued", attempt{role: w, sql: accept("job", cur.Epoch, cur.Token+1000), code: unknown}},
		{"next_token_not_yet_issued", attempt{role: w, sql: accept("job", cur.Epoch, cur.Token+1), code: unknown}},
		{"epoch_never_issued", attempt{role: w, sql: accept("job", cur.Epoch+1000, cur.Token), code: unknown}},
		{"max_epoch", attempt{role: w, sql: accept("job", math.MaxInt64, 1), code: unknown}},
		{"max_token", attempt{role: w, sql: accept("job", cur.Epoch, math.MaxInt64), code: unknown}},
		{"zero_token", attempt{role: w, sql: accept("job", cur.Epoch, 0), code: unknown}},
		{"negative_token", attempt{role: w, sql: accept("job", cur.Epoch, -1), code: unknown}},
		{"token_of_another_job", attempt{role: w, sql: accept("job", cur.Epoch, other.Token), code: unknown}},
		{"epoch_of_another_job", attempt{role: w, sql: accept("job", other.Epoch, other.Token), code: unknown}},
		{"job_never_acquired", attempt{role: w, sql: accept("nobody", cur.Epoch, cur.Token), code: unknown}},
		{"forged_by_another_worker", attempt{role: c.worker2, sql: accept("job", cur.Epoch, cur.Token+7), code: unknown}},
		{"forged_in_the_consumer_transaction", attempt{role: w, code: unknown,
			sql: fmt.Sprintf("begin; insert into notes (note) values ('applied'); select fence.accept_event('mailer', 'job', %d, %d); commit", cur.Epoch, cur.Token+5)}},
	})
	t.Run("real_generations_still_decided", func(t *testing.T) {
		// The watermark is where the real events left it: the current
		// generation is accepted again, the stale one rejected (false, not
		// an error: it was issued).
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
