package proxy

import (
	"context"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("prepare", bypassPrepare) }

// bypassPrepare (issue 30): PREPARE TRANSACTION after a fenced write is
// refused however it is written, so no prepared transaction keeps a fence
// row locked after its client has gone. The database's refusal is
// PostgreSQL's own (0A000, "operated on temporary objects": the first
// fenced write opened a temporary relation of the session, which nothing a
// client does undoes); through the proxy, its parser refuses first
// (FN009) wherever it can see the statement. The test cluster has
// max_prepared_transactions > 0, so these refusals are the fence's.
func bypassPrepare(t *testing.T) {
	c := newCast(t)
	w, cur := c.worker, &c.current
	c.as(t, c.owner, `
create function public.owner_write(val text) returns void language sql set search_path = public
  as $$ update res set v = val where k = 1 $$;
create procedure public.p_prepare() language plpgsql as $$ begin execute 'prepare transaction ''pgfence_bypass_p'''; end $$;
create function public.noisy() returns int language plpgsql as $$ begin raise exception 'the view ran' using errcode = 'P0099'; end $$;
`)
	const (
		refused = "0A000"               // PostgreSQL: the transaction touched a temporary relation
		parsed  = fence.CodeUnsupported // the proxy's parser
	)
	write := "begin; update res set v = 'prepared' where k = 1; "
	cases := []struct {
		name          string
		sql           string
		direct, proxy string // "": that route is not tried
	}{
		{"plain", write + "prepare transaction 'pgfence_bypass_p'", refused, parsed},
		{"comment_ended_by_cr", write + "prepare -- PostgreSQL's lexer ends this comment here:\r transaction 'pgfence_bypass_p'", refused, parsed},
		{"nested_block_comment", write + "prepare /* a /* nested */ comment */ transaction 'pgfence_bypass_p'", refused, parsed},
		{"comment_without_blanks", write + "PREPARE/**/TRANSACTION 'pgfence_bypass_p'", refused, parsed},
		{"mixed_case", write + "PrEpArE\ttRaNsAcTiOn 'pgfence_bypass_p'", refused, parsed},
		{"after_opaque_write", "begin; select owner_write('prepared'); prepare transaction 'pgfence_bypass_p'", refused, parsed},
		{"after_do_write", "begin; do $$ begin update res set v = 'do' where k = 1; end $$; prepare transaction 'pgfence_bypass_p'", refused, parsed},
		{"after_copy", "", "", ""}, // below: COPY, then PREPARE
		// Under the write's step (the session's, set below): a commit under
		// another step than the write's is refused (FN009, one step per
		// transaction) before PREPARE is reached.
		{"after_receipt", "begin; update res set v = 'receipted' where k = 1; select fence.commit('job', " + itoa(cur.Epoch) + ", " + itoa(cur.Token) + ", 'prepare after_receipt direct', '\\x01', 'v1'); prepare transaction 'pgfence_bypass_p'", refused, ""},
		{"after_gate_only", "begin; select fence.gate('job', " + itoa(cur.Epoch) + ", " + itoa(cur.Token) + ", 'prepare after_gate_only'); prepare transaction 'pgfence_bypass_p'", refused, ""},
		{"write_released_savepoint", "begin; savepoint s; update res set v = 'sp' where k = 1; release s; prepare transaction 'pgfence_bypass_p'", refused, parsed},
		{"write_rolled_back_savepoint", "begin; savepoint s; update res set v = 'sp' where k = 1; rollback to s; prepare transaction 'pgfence_bypass_p'", refused, parsed},
		{"discard_temp_after_write", write + "discard temp; prepare transaction 'pgfence_bypass_p'", refused, parsed},
		{"client_temp_table_of_that_name", "create temp table pgfence_no_prepare (a int); " + write + "prepare transaction 'pgfence_bypass_p'", refused, parsed},
		{"client_temp_view_of_that_name", "create temp view pgfence_no_prepare as select noisy() as n; " + write + "prepare transaction 'pgfence_bypass_p'", refused, parsed},
		{"execute_in_do_block", write + "do $$ begin execute 'prepare transaction ''pgfence_bypass_p'''; end $$", refused, refused},
		{"procedure", write + "call p_prepare()", refused, refused},
		// Round 5, K-M1: the lease functions lock the job's fence row
		// without a fenced write; prepared, the lock outlived the session
		// and the next holder's takeover waited for an administrator.
		{"after_renew", "begin; select fence.renew('job', " + itoa(cur.Token) + ", '1 minute'); prepare transaction 'pgfence_bypass_p'", refused, parsed},
		{"after_release", "begin; select fence.release('job', " + itoa(cur.Token) + "); prepare transaction 'pgfence_bypass_p'", refused, parsed},
		{"after_retire", "begin; select fence.retire('job', " + itoa(cur.Token) + "); prepare transaction 'pgfence_bypass_p'", refused, parsed},
		{"after_acquire", "begin; select fence.acquire('job-prepared', 'h', '1 minute'); prepare transaction 'pgfence_bypass_p'", refused, parsed},
	}
	for _, tc := range cases {
		if tc.sql == "" {
			continue
		}
		t.Run(tc.name, func(t *testing.T) {
			for _, r := range castRoutes {
				code := tc.direct
				if r == "proxy" {
					code = tc.proxy
				}
				if code == "" {
					continue
				}
				t.Run(r, func(t *testing.T) {
					conn := c.connect(t, r, w, cur)
					c.prepareRefused(t, conn, "set fence.step = 'prepare "+tc.name+" "+r+"'; "+tc.sql, code, nil)
				})
			}
		})
	}
	for _, r := range castRoutes {
		t.Run("after_copy/"+r, func(t *testing.T) {
			conn := c.connect(t, r, w, cur)
			c.prepareRefused(t, conn, "set fence.step = 'prepare copy "+r+"'; begin", "", nil)
			if err := castExec(ctxT(t), conn, "copy res from stdin", "70\tjob\tcopied\n"); err != nil {
				t.Fatal(err)
			}
			want := refused
			if r == "proxy" {
				want = parsed
			}
			c.prepareRefused(t, conn, "prepare transaction 'pgfence_bypass_p'", want, nil)
		})
		t.Run("extended_protocol/"+r, func(t *testing.T) {
			conn := c.connect(t, r, w, cur)
			want := refused
			if r == "proxy" {
				want = parsed
			}
			c.prepareRefused(t, conn, "set fence.step = 'prepare extended "+r+"'", "", nil)
			c.prepareRefused(t, conn, "", want, func(ctx context.Context) error {
				b := &pgconn.Batch{}
				b.ExecParams("begin", nil, nil, nil, nil)
				b.ExecParams("update res set v = 'extended' where k = 1", nil, nil, nil, nil)
				b.ExecParams("prepare transaction 'pgfence_bypass_p'", nil, nil, nil, nil)
				_, err := conn.ExecBatch(ctx, b).ReadAll()
				return err
			})
		})
	}
	// K-M1 through the proxy by a session without fence metadata, the
	// PREPARE a query of its own: the proxy's probe refuses it (the
	// transaction now opened the temporary relation that makes PostgreSQL
	// refuse it too).
	for _, q := range []string{
		"begin; select fence.renew('job', " + itoa(cur.Token) + ", '1 minute')",
		"begin; select fence.release('job', " + itoa(cur.Token) + ")",
	} {
		t.Run("lease_function_unfenced_session", func(t *testing.T) {
			conn := c.connect(t, "proxy", w, nil)
			c.prepareRefused(t, conn, q, "", nil)
			c.prepareRefused(t, conn, "prepare transaction 'pgfence_bypass_p'", parsed, nil)
		})
	}
	// The control: without a fenced write the same session prepares (the
	// cluster allows it), and without a write nothing is refused.
	t.Run("unfenced_prepare_works", func(t *testing.T) {
		conn := c.connect(t, "direct", w, nil)
		if err := castExec(ctxT(t), conn, "begin; insert into notes (note) values ('2pc'); prepare transaction 'pgfence_bypass_ok'", ""); err != nil {
			t.Fatalf("prepare without a fenced write: %v", err)
		}
		c.exec(t, "rollback prepared 'pgfence_bypass_ok'")
	})
}

// prepareRefused runs sql (or do, when not nil) on conn and wants code;
// with a code it also wants nothing changed, no prepared transaction and
// the job's fence row free once the attempt's transaction has ended.
func (c *cast) prepareRefused(t *testing.T, conn *pgconn.PgConn, sql, code string, do func(context.Context) error) {
	t.Helper()
	before := c.state(t)
	var err error
	if do != nil {
		err = do(ctxT(t))
	} else {
		err = castExec(ctxT(t), conn, sql, "")
	}
	if got := pgtest.SQLState(err); got != code {
		t.Fatalf("%s: got %v (SQLSTATE %q), want SQLSTATE %q", sql, err, got, code)
	}
	if code == "" {
		return
	}
	castExec(ctxT(t), conn, "rollback", "")
	c.unchanged(t, before)
	if err := castExec(ctxT(t), c.connect(t, "direct", c.su, nil), "begin; select 1 from fence.fences where job_key = 'job' for update nowait; rollback", ""); err != nil {
		t.Fatalf("the fence row is locked after the refused PREPARE: %v", err)
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
