package proxy

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
)

func init() { registerBypass("tokens", bypassTokens) }

// bypassTokens: a role learns no token it was not given. Takeover
// notifications carry none; fence.accept_event answers an event that was
// never issued as it answers an older one; renew, release and retire
// answer a role that does not hold the current generation the same
// whatever token it presents, and no error names another's token. And
// lease squatting: no role that is not an administrator holds a lease
// longer than fence.settings' max_lease_ttl (1 day unless an
// administrator says otherwise), which it cannot change.
func bypassTokens(t *testing.T) {
	c := newCast(t)
	w, w2 := c.worker, c.worker2
	// A job of its own whose tokens are long numbers, so that an error
	// that shows one is told from one that shows a timestamp.
	c.exec(t, "select setval('fence.token_seq', 7364519283)")
	var stale, cur fence.Lease
	var err error
	if stale, err = fence.Acquire(ctxT(t), c.connectPgx(t, "direct", w, nil), "leak", "a", time.Minute); err != nil {
		t.Fatal(err)
	}
	c.exec(t, "update fence.leases set expires_at = clock_timestamp() - interval '1 second' where job_key = 'leak'")
	if cur, err = fence.Acquire(ctxT(t), c.connectPgx(t, "direct", w, nil), "leak", "b", time.Minute); err != nil {
		t.Fatal(err)
	}
	fn := func(format string, args ...any) string { return fmt.Sprintf(format, args...) }
	const badTTL = "22023"

	t.Run("notifications_carry_no_token", func(t *testing.T) {
		for _, route := range castRoutes {
			t.Run(route, func(t *testing.T) {
				ctx := ctxT(t)
				cfg := c.connConfig(t, route, w2, nil)
				notes := make(chan *pgconn.Notification, 16)
				cfg.OnNotification = func(_ *pgconn.PgConn, n *pgconn.Notification) { notes <- n }
				conn, err := pgconn.ConnectConfig(ctx, cfg)
				l := connected(t, conn, err, "listener")
				if _, err := l.Exec(ctx, "listen pgfence_takeover").ReadAll(); err != nil {
					t.Fatal(err)
				}
				job := "listened-" + route
				acq, err := fence.Acquire(ctx, c.connectPgx(t, route, w, nil), job, "h", time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				if err := fence.Retire(ctx, c.connectPgx(t, route, w, nil), job, fence.RetireOptions{Token: acq.Token}); err != nil {
					t.Fatal(err)
				}
				for _, what := range []string{"acquire", "retire"} {
					n := waitNotification(t, l, notes)
					if !strings.Contains(n, job) {
						t.Fatalf("%s: notification %q does not name the job", what, n)
					}
					if strings.Contains(n, "token") || strings.Contains(n, strconv.FormatInt(acq.Token, 10)) {
						t.Fatalf("%s: notification %q carries the token %d", what, n, acq.Token)
					}
				}
			})
		}
	})

	t.Run("accept_event_does_not_tell_issued", func(t *testing.T) {
		// The consumer has accepted the current generation; an older
		// issued token and one never issued get the same answer, and
		// neither moves the watermark. The prober is another role than
		// the job's (w2): since migration 015 a consumer is the role's
		// that first accepted under it, so the probe runs under a
		// consumer of w2's own (under w's it would get 42501 for every
		// event alike: TestBypass/rowlocks).
		c.as(t, w2, fn("select fence.accept_event('probe', 'leak', %d, %d)", cur.Epoch, cur.Token))
		for _, route := range castRoutes {
			for _, ev := range []struct {
				name         string
				epoch, token int64
			}{
				{"older_issued", stale.Epoch, stale.Token},
				{"never_issued_between", cur.Epoch, cur.Token - 1},
				{"never_issued_next", cur.Epoch, cur.Token + 1},
				{"never_issued_huge", cur.Epoch, 1 << 62},
				{"never_issued_epoch", cur.Epoch + 1000, cur.Token},
			} {
				t.Run(route+"/"+ev.name, func(t *testing.T) {
					if ev.name == "never_issued_between" && cur.Token-1 == stale.Token {
						ev.token = stale.Token - 1
					}
					before := c.state(t)
					got, err := acceptAnswer(ctxT(t), c.connect(t, route, w2, nil), ev.epoch, ev.token)
					if err != nil || got != "f" {
						t.Fatalf("accept_event(%d, %d) as another role: %q, %v; want false, as for any event older than the watermark", ev.epoch, ev.token, got, err)
					}
					c.unchanged(t, before)
				})
			}
		}
	})

	// The same answer to a role that is not the owner, whatever the token.
	for _, op := range []struct{ name, sql string }{
		{"renew", "select fence.renew('leak', %d, '1 minute')"},
		{"release", "select fence.release('leak', %d)"},
		{"retire", "select fence.retire('leak', %d)"},
	} {
		t.Run(op.name+"_answer_hides_the_current_token", func(t *testing.T) {
			for _, route := range castRoutes {
				var first *pgconn.PgError
				for _, tok := range []int64{cur.Token, stale.Token, cur.Token + 1, 55555555555} {
					before := c.state(t)
					err := castExec(ctxT(t), c.connect(t, route, w2, nil), fn(op.sql, tok), "")
					pg := pgError(err)
					if pg == nil {
						t.Fatalf("%s: %s with token %d as another role: %v, want a refusal", route, op.name, tok, err)
					}
					msg := strings.ReplaceAll(pg.Message, strconv.FormatInt(tok, 10), "T")
					if strings.Contains(msg+pg.Detail+pg.Hint, strconv.FormatInt(cur.Token, 10)) {
						t.Fatalf("%s: %s's refusal names the current token: %s", route, op.name, pg.Message)
					}
					if first == nil {
						first = &pgconn.PgError{Code: pg.Code, Message: msg}
					} else if pg.Code != first.Code || msg != first.Message {
						t.Fatalf("%s: %s answers token %d with %s %q, another token with %s %q: that tells the current token", route, op.name, tok, pg.Code, msg, first.Code, first.Message)
					}
					c.unchanged(t, before)
				}
			}
		})
	}

	t.Run("errors_name_no_token", func(t *testing.T) {
		for _, a := range []struct {
			name, role, sql string
		}{
			{"acquire_held", w2, "select fence.acquire('leak', 'x', '1 minute')"},
			{"acquire_same_holder_other_role", w2, "select fence.acquire('leak', 'b', '1 minute')"},
			{"renew_by_owner_with_stale_token", w, fn("select fence.renew('leak', %d, '1 minute')", stale.Token)},
			{"release_by_owner_with_stale_token", w, fn("select fence.release('leak', %d)", stale.Token)},
			{"retire_by_owner_with_stale_token", w, fn("select fence.retire('leak', %d)", stale.Token)},
			{"bypass_retire_live_lease", c.dba, "select fence.retire('leak')"},
		} {
			for _, route := range castRoutes {
				t.Run(a.name+"/"+route, func(t *testing.T) {
					before := c.state(t)
					pg := pgError(castExec(ctxT(t), c.connect(t, route, a.role, nil), a.sql, ""))
					if pg == nil {
						t.Fatalf("%s: want a refusal", a.sql)
					}
					if text := pg.Message + " " + pg.Detail + " " + pg.Hint; strings.Contains(text, strconv.FormatInt(cur.Token, 10)) {
						t.Fatalf("%s: the refusal names the current token %d: %s", a.sql, cur.Token, text)
					}
					c.unchanged(t, before)
				})
			}
		}
	})

	// Lease squatting: a TTL over the cap is refused, and only an
	// administrator moves the cap.
	c.tryEach(t, append(castAttempts(w2, badTTL, [][2]string{
		{"acquire_for_a_century", "select fence.acquire('squat', 'w2', '100 years')"},
		{"acquire_a_day_and_a_second", "select fence.acquire('squat', 'w2', '1 day 1 second')"},
		{"acquire_two_months", "select fence.acquire('squat', 'w2', '2 months')"},
		{"acquire_in_hours", "select fence.acquire('squat', 'w2', '1000000 hours')"},
		{"acquire_from_a_do_block", "do $$ begin perform fence.acquire('squat', 'w2', '100 years'); end $$"},
		{"acquire_with_a_forged_setting", "set fence.max_lease_ttl = '100 years'; select fence.acquire('squat', 'w2', '100 years')"},
	}), append(castAttempts(w, badTTL, [][2]string{
		{"renew_for_a_century", fn("select fence.renew('leak', %d, '100 years')", cur.Token)},
		{"renew_a_day_and_a_second", fn("select fence.renew('leak', %d, '86401 seconds')", cur.Token)},
	}), castAttempts(w2, "42501", [][2]string{
		{"raise_the_cap", "select fence.set_max_lease_ttl('100 years')"},
		{"drop_the_cap", "select fence.set_max_lease_ttl(null)"},
		{"update_the_setting", "update fence.settings set value = '100 years' where name = 'max_lease_ttl'"},
		{"delete_the_setting", "delete from fence.settings where name = 'max_lease_ttl'"},
		{"insert_the_setting", "insert into fence.settings values ('max_lease_ttl_x', '1')"},
	})...)...))
	c.tryEach(t, castAttempts(c.owner, "42501", [][2]string{{"owner_raises_the_cap", "select fence.set_max_lease_ttl('100 years')"}}))

	t.Run("cap_controls", func(t *testing.T) {
		ctx := ctxT(t)
		// A day is allowed; an administrator may exceed the cap, and
		// moves it.
		if _, err := fence.Acquire(ctx, c.connectPgx(t, "proxy", w2, nil), "day-long", "w2", 24*time.Hour); err != nil {
			t.Fatalf("a lease of exactly the cap: %v", err)
		}
		if _, err := fence.Acquire(ctx, c.connectPgx(t, "direct", c.su, nil), "admin-long", "su", 24*365*time.Hour); err != nil {
			t.Fatalf("an administrator's long lease: %v", err)
		}
		c.as(t, c.dba, "select fence.set_max_lease_ttl('1 hour')")
		_, err := fence.Acquire(ctx, c.connectPgx(t, "direct", w2, nil), "two-hours", "w2", 2*time.Hour)
		wantCode(t, err, badTTL)
		if pg := pgError(err); pg == nil || !strings.Contains(pg.Message, "01:00:00") || !strings.Contains(pg.Hint, "fence.set_max_lease_ttl") {
			t.Fatalf("the refusal does not say the cap and how to move it: %v", err)
		}
		c.as(t, c.dba, "select fence.set_max_lease_ttl(null)")
		if _, err := fence.Acquire(ctx, c.connectPgx(t, "direct", w2, nil), "two-hours", "w2", 2*time.Hour); err != nil {
			t.Fatalf("without a cap: %v", err)
		}
		c.try(t, attempt{role: c.dba, sql: "select fence.set_max_lease_ttl('-1 hour')", code: "22023"})
		c.as(t, c.dba, "select fence.set_max_lease_ttl('1 day')")
	})
}

// waitNotification waits on c for the next notification that arrives on
// notes (c's OnNotification) and returns its payload.
func waitNotification(t *testing.T, c *pgconn.PgConn, notes <-chan *pgconn.Notification) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctxT(t), 10*time.Second)
	defer cancel()
	for {
		select {
		case n := <-notes:
			return n.Payload
		default:
		}
		if err := c.WaitForNotification(ctx); err != nil {
			t.Fatalf("waiting for a notification: %v", err)
		}
	}
}

// acceptAnswer is fence.accept_event('probe', 'leak', epoch, token)'s
// answer ("t", "f") or error.
func acceptAnswer(ctx context.Context, conn *pgconn.PgConn, epoch, token int64) (string, error) {
	rs, err := conn.Exec(ctx, fmt.Sprintf("select fence.accept_event('probe', 'leak', %d, %d)", epoch, token)).ReadAll()
	if err != nil {
		return "", err
	}
	return string(rs[0].Rows[0][0]), nil
}

// pgError is err's *pgconn.PgError, or nil.
func pgError(err error) *pgconn.PgError {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg
	}
	return nil
}
