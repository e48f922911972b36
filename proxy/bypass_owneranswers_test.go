package proxy

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() {
	registerBypass("replay_lock", bypassReplayLock)
	registerBypass("owner_answers", bypassOwnerAnswers)
}

// answerCast is a cast with more generations of worker's: job "rl"
// acquired twice (old, receipted and stale; cur, current), job "rt"
// retired, job "pr" whose old generation's receipts gc pruned; and a
// receipted step "done" of the cast's current generation of "job".
type answerCast struct {
	*cast
	rlOld, rlCur, rt, prOld fence.Lease
}

func newAnswerCast(t *testing.T) *answerCast {
	t.Helper()
	c := &answerCast{cast: newCast(t)}
	ctx := ctxT(t)
	w := c.connectPgx(t, "direct", c.worker, nil)
	acquire := func(job string) fence.Lease {
		l, err := fence.Acquire(ctx, w, job, "h", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	commit := func(l fence.Lease, step string) {
		if _, err := fence.RunTx(ctx, w, l.Generation(step), []byte("p"), func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "update res set v = 'answers' where k = 1")
			return err
		}); err != nil {
			t.Fatalf("commit %s: %v", l.Generation(step), err)
		}
	}
	expire := func(job string) {
		c.exec(t, "update fence.leases set expires_at = clock_timestamp() - interval '1 second' where job_key = $1", job)
	}
	commit(c.current, "done")
	c.rlOld = acquire("rl")
	commit(c.rlOld, "")
	expire("rl")
	c.rlCur = acquire("rl")
	c.rt = acquire("rt")
	if err := fence.Retire(ctx, w, "rt", fence.RetireOptions{Token: c.rt.Token}); err != nil {
		t.Fatal(err)
	}
	c.prOld = acquire("pr")
	commit(c.prOld, "")
	expire("pr")
	acquire("pr")
	c.exec(t, "update fence.receipts set committed_at = committed_at - interval '1 hour' where job_key = 'pr'; select fence.gc('1 minute')")
	return c
}

// bypassReplayLock (issue 30): a transaction locks a job's fence row only
// for a current generation of its own role. fence.gate, fence.commit and
// the backstop decide a replay from the receipt without a lock, and any
// other role's attempt — at a receipted, current, stale or never-issued
// generation — is refused (FN011) without one, so nobody pins another
// role's job by leaving such a transaction open.
func bypassReplayLock(t *testing.T) {
	c := newAnswerCast(t)
	w, w2, cur := c.worker, c.worker2, c.current
	gate := func(job string, e, tk int64, step string) string {
		return fmt.Sprintf("begin; select fence.gate('%s', %d, %d, '%s')", job, e, tk, step)
	}
	commit := func(job string, e, tk int64, step string) string {
		return fmt.Sprintf("begin; select fence.commit('%s', %d, %d, '%s', '\\x70', 'v1')", job, e, tk, step)
	}
	ciw := func(job string, e, tk int64, step string) string {
		return fmt.Sprintf("begin; select fence.commit_if_written('%s', %d, %d, '%s', '\\x70', 'v1')", job, e, tk, step)
	}
	const notOwner = fence.CodeNotOwner
	rlOld, rlCur := c.rlOld, c.rlCur
	cases := []struct {
		name, role, job, sql, code string
		lease                      *fence.Lease
	}{
		{"other_role_gate_receipted_current", w2, "job", gate("job", cur.Epoch, cur.Token, "done"), notOwner, nil},
		{"other_role_gate_receipted_stale", w2, "rl", gate("rl", rlOld.Epoch, rlOld.Token, ""), notOwner, nil},
		{"other_role_gate_current", w2, "job", gate("job", cur.Epoch, cur.Token, "fresh"), notOwner, nil},
		{"other_role_gate_stale", w2, "job", gate("job", c.stale.Epoch, c.stale.Token, ""), notOwner, nil},
		{"other_role_gate_never_issued_token", w2, "job", gate("job", cur.Epoch, cur.Token+1000, ""), notOwner, nil},
		{"other_role_gate_never_issued_epoch", w2, "job", gate("job", cur.Epoch+1000, cur.Token, ""), notOwner, nil},
		{"other_role_commit_receipted", w2, "job", commit("job", cur.Epoch, cur.Token, "done"), notOwner, nil},
		{"other_role_commit_current", w2, "job", commit("job", cur.Epoch, cur.Token, "fresh"), notOwner, nil},
		{"other_role_commit_receipted_stale", w2, "rl", commit("rl", rlOld.Epoch, rlOld.Token, ""), notOwner, nil},
		{"other_role_commit_if_written", w2, "job", ciw("job", cur.Epoch, cur.Token, "done"), "", nil},
		{"other_role_write_receipted", w2, "job", "begin; set local fence.step = 'done'; update res set v = 'pinned' where k = 1", notOwner, &cur},
		{"other_role_write_current", w2, "job", "begin; set local fence.step = 'fresh'; update res set v = 'pinned' where k = 1", notOwner, &cur},
		{"other_role_write_receipted_stale", w2, "rl", "begin; update res set v = 'pinned' where k = 1", notOwner, &rlOld},
		{"owner_gate_receipted_stale", w, "rl", gate("rl", rlOld.Epoch, rlOld.Token, ""), "", nil},
		{"owner_gate_receipted_current", w, "job", gate("job", cur.Epoch, cur.Token, "done"), "", nil},
		{"owner_gate_stale", w, "rl", gate("rl", rlOld.Epoch, rlOld.Token, "fresh"), fence.CodeStale, nil},
		{"owner_gate_never_issued", w, "job", gate("job", cur.Epoch, cur.Token+1000, ""), notOwner, nil},
		{"owner_commit_receipted_stale", w, "rl", commit("rl", rlOld.Epoch, rlOld.Token, ""), fence.CodeConflict, nil},
		{"owner_write_receipted_stale", w, "rl", "begin; update res set v = 'replayed' where k = 1", "", &rlOld},
		{"owner_write_receipted_current", w, "job", "begin; set local fence.step = 'done'; update res set v = 'replayed' where k = 1", "", &cur},
		{"owner_write_stale", w, "rl", "begin; set local fence.step = 'fresh'; update res set v = 'zombie' where k = 1", fence.CodeStale, &rlOld},
		{"owner_gate_retired", w, "rt", gate("rt", c.rt.Epoch, c.rt.Token, ""), fence.CodeRetired, nil},
	}
	_ = rlCur
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, r := range castRoutes {
				if r == "proxy" && tc.lease == nil {
					continue // the proxy adds nothing to a call of the protocol
				}
				t.Run(r, func(t *testing.T) {
					before := c.state(t)
					conn := c.connect(t, r, tc.role, tc.lease)
					err := castExec(ctxT(t), conn, tc.sql, "")
					if got := pgtest.SQLState(err); got != tc.code {
						t.Fatalf("%s as %s: got %v (SQLSTATE %q), want %q", tc.sql, tc.role, err, got, tc.code)
					}
					// The transaction is still open (aborted or not): the
					// job's fence row must be free for a takeover now.
					c.fenceRowFree(t, tc.job)
					castExec(ctxT(t), conn, "rollback", "")
					c.unchanged(t, before)
				})
			}
		})
	}
}

// fenceRowFree fails t unless job's fence row can be locked at once.
func (c *cast) fenceRowFree(t *testing.T, job string) {
	t.Helper()
	q := fmt.Sprintf("begin; select 1 from fence.fences where job_key = '%s' for update nowait; rollback", job)
	if err := castExec(ctxT(t), c.connect(t, "direct", c.su, nil), q, ""); err != nil {
		t.Fatalf("the fence row of %q is locked: %v", job, err)
	}
}

// bypassOwnerAnswers (issue 30): what a role is told about a generation
// depends only on the role's own generations and on what fence.jobs shows
// anyone. Another role's generation — current, stale, receipted, retired —
// and a generation never issued get the same FN011, whose message names
// neither the current token nor the owner; a job nobody ever acquired is
// FN005 for everyone. The owner keeps its precise answers: FN001 stale,
// FN004 retired, FN006 pruned, a replay for a receipted generation.
func bypassOwnerAnswers(t *testing.T) {
	c := newAnswerCast(t)
	w, w2, cur := c.worker, c.worker2, c.current
	type ask struct {
		job          string
		epoch, token int64
		step         string
	}
	asks := map[string]ask{
		"current":            {"job", cur.Epoch, cur.Token, "fresh"},
		"current_receipted":  {"job", cur.Epoch, cur.Token, "done"},
		"stale":              {"job", c.stale.Epoch, c.stale.Token, "fresh"},
		"stale_receipted":    {"rl", c.rlOld.Epoch, c.rlOld.Token, ""},
		"retired":            {"rt", c.rt.Epoch, c.rt.Token, ""},
		"pruned":             {"pr", c.prOld.Epoch, c.prOld.Token, ""},
		"never_issued_token": {"job", cur.Epoch, cur.Token + 1000, ""},
		"never_issued_epoch": {"job", cur.Epoch + 1000, cur.Token, ""},
		"another_jobs_token": {"rl", c.rlCur.Epoch, cur.Token, ""},
	}
	forms := map[string]func(a ask) string{
		"gate": func(a ask) string {
			return fmt.Sprintf("begin; select fence.gate('%s', %d, %d, '%s'); rollback", a.job, a.epoch, a.token, a.step)
		},
		"commit": func(a ask) string {
			return fmt.Sprintf("begin; select fence.commit('%s', %d, %d, '%s', '\\x70', 'v1'); rollback", a.job, a.epoch, a.token, a.step)
		},
		"write": func(a ask) string {
			return fmt.Sprintf("begin; set local fence.job_key = '%s'; set local fence.epoch = %d; set local fence.token = %d; set local fence.step = '%s'; update res set v = 'asked' where k = 1; rollback",
				a.job, a.epoch, a.token, a.step)
		},
	}
	owner := map[string]string{
		"current": "", "current_receipted": "replay", "stale": fence.CodeStale, "stale_receipted": "replay",
		"retired": fence.CodeRetired, "pruned": fence.CodeExpired,
		"never_issued_token": fence.CodeNotOwner, "never_issued_epoch": fence.CodeNotOwner, "another_jobs_token": fence.CodeNotOwner,
	}
	answer := func(t *testing.T, role, sql string) (code, msg string) {
		t.Helper()
		conn := c.connect(t, "direct", role, nil)
		err := castExec(ctxT(t), conn, sql, "")
		if err == nil {
			return "", ""
		}
		var pe *pgconn.PgError
		if !errors.As(err, &pe) {
			t.Fatalf("%s: %v", sql, err)
		}
		return pe.Code, pe.Message
	}
	for form, sql := range forms {
		t.Run(form, func(t *testing.T) {
			for name, a := range asks {
				t.Run("other_role_"+name, func(t *testing.T) {
					before := c.state(t)
					code, msg := answer(t, w2, sql(a))
					if code != fence.CodeNotOwner {
						t.Fatalf("another role asking about a %s generation: %s %q, want %s", name, code, msg, fence.CodeNotOwner)
					}
					// The same words whatever the generation: only the
					// presented key, epoch and token differ.
					if want := fmt.Sprintf("job %q: epoch %d token %d is not a generation of role %q", a.job, a.epoch, a.token, w2); msg != want {
						t.Fatalf("the answer %q, want %q", msg, want)
					}
					c.unchanged(t, before)
				})
				t.Run("owner_"+name, func(t *testing.T) {
					code, msg := answer(t, w, sql(a))
					want := owner[name]
					if want == "replay" {
						switch form {
						case "gate", "write":
							want = ""
						case "commit":
							want = fence.CodeConflict // another payload than the first commit's
						}
					}
					if code != want {
						t.Fatalf("the owner asking about its %s generation: %s %q, want %q", name, code, msg, want)
					}
				})
			}
			t.Run("unknown_job", func(t *testing.T) {
				for _, role := range []string{w, w2} {
					if code, msg := answer(t, role, sql(ask{"nobody-acquired-this", 1, 1, ""})); code != fence.CodeUnknownJob {
						t.Fatalf("%s: %s %q, want %s", role, code, msg, fence.CodeUnknownJob)
					}
				}
			})
		})
	}
}
