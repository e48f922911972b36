package proxy

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
)

// The proxy's own statements are the proxy's (issue 18 §2): a client can
// neither take the gate's prepared statements' names nor swap in a
// stand-in, so the gate never runs SQL of the client's choosing.
func init() { registerBypass("reserved", bypassReserved) }

// reservedEnv is a gate in front of a database with the protected table
// results, and a lease for job "r".
type reservedEnv struct {
	*fenceEnv
	lease fence.Lease
}

func newReservedEnv(t *testing.T) *reservedEnv {
	t.Helper()
	e := newFenceEnv(t)
	return &reservedEnv{fenceEnv: e, lease: e.acquire(t, "r", "w1", time.Minute)}
}

// snapshot is everything an attempt must not change: the results, the
// receipts and the fences.
func (e *reservedEnv) snapshot(t *testing.T) string {
	t.Helper()
	var s string
	err := e.direct(t).QueryRow(ctxT(t), `SELECT concat_ws(' | ',
		(SELECT string_agg(format('%s=%s@%s', job_key, payload, token), ',' ORDER BY job_key) FROM results),
		(SELECT string_agg(format('%s/%s/%s/%s %s', job_key, epoch, token, step, digest_version), ',' ORDER BY job_key, token, step) FROM fence.receipts),
		(SELECT string_agg(format('%s %s %s', job_key, epoch, max_issued_token), ',' ORDER BY job_key) FROM fence.fences))`).Scan(&s)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func (e *reservedEnv) unchanged(t *testing.T, before string) {
	t.Helper()
	if after := e.snapshot(t); after != before {
		t.Fatalf("the attempt changed the database:\nbefore %s\nafter  %s", before, after)
	}
}

// refused runs attempt on a fenced worker connection and wants it refused
// with FN013, nothing changed, and the session usable afterwards.
func (e *reservedEnv) refused(t *testing.T, mode pgx.QueryExecMode, attempt func(ctx context.Context, c *pgx.Conn) error) {
	t.Helper()
	c := e.mustConnect(t, client{lease: &e.lease, mode: mode})
	before := e.snapshot(t)
	wantCode(t, attempt(ctxT(t), c), fence.CodeReserved)
	e.unchanged(t, before)
	if _, err := c.Exec(ctxT(t), "ROLLBACK"); err != nil {
		t.Fatalf("session not usable after the refusal: %v", err)
	}
	var one int
	if err := c.QueryRow(ctxT(t), "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("session not usable after the refusal: %v", err)
	}
}

// rawRefused sends msgs and a Sync on a fenced worker's connection and
// wants one ErrorResponse FN013 before ReadyForQuery.
func (e *reservedEnv) rawRefused(t *testing.T, msgs ...pgproto3.FrontendMessage) {
	t.Helper()
	c := e.mustConnect(t, client{lease: &e.lease})
	before := e.snapshot(t)
	rawWantCodes(t, c.PgConn(), []string{fence.CodeReserved}, msgs...)
	e.unchanged(t, before)
}

// gatedCommit writes job r's result in an explicit transaction through
// c, runs between (the attempt) before COMMIT, and wants the commit to
// leave exactly one receipt of the proxy's own digest (v1): a stand-in
// for the receipt step would leave none, or the backstop's own.
func (e *reservedEnv) gatedCommit(t *testing.T, c *pgx.Conn, payload string, between ...string) {
	t.Helper()
	ctx := ctxT(t)
	tx := beginOK(t, c)
	defer tx.Rollback(ctx)
	execOK(t, tx, upsert, "r", payload, e.lease.Token)
	for _, q := range between {
		if _, err := tx.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit: %v", err)
	}
	e.wantResult(t, "r", payload, e.lease.Token)
}

func (e *reservedEnv) wantReceipt(t *testing.T, step string) {
	t.Helper()
	e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r' AND token = $1 AND step = $2 AND digest_version = 'v1'", e.lease.Token, step)
}

// standIn replaces the gate's receipt step (and gate step) by statements
// that do nothing, from inside a DO block, which the proxy cannot read.
const standIn = `DO $$ BEGIN
  EXECUTE 'DEALLOCATE ALL';
  EXECUTE 'PREPARE pgfence_commit(text, int8, int8, text, bytea, text) AS SELECT ''committed''::text';
  EXECUTE 'PREPARE pgfence_gate(text, int8, int8, text) AS SELECT ''ok''::text';
END $$`

func bypassReserved(t *testing.T) {
	// Extended: unnamed statements, which DEALLOCATE ALL (the stand-in's
	// and the cases') cannot take away from pgx's statement cache.
	simple, extended := pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeDescribeExec
	for _, c := range []struct {
		name string
		mode pgx.QueryExecMode
		sql  string
	}{
		{"sql_deallocate", simple, "DEALLOCATE pgfence_commit"},
		{"sql_deallocate_extended", extended, "DEALLOCATE pgfence_gate"},
		{"sql_prepare", simple, "PREPARE pgfence_commit(text, int8, int8, text, bytea, text) AS SELECT 'committed'::text"},
		{"sql_prepare_in_multi_statement_query", simple, "SELECT 1; PREPARE pgfence_gate AS SELECT 'ok'::text"},
		{"sql_execute", simple, "EXECUTE pgfence_gate('r', 1, 1, '')"},
		{"sql_explain_execute", simple, "EXPLAIN ANALYZE EXECUTE pgfence_commit('r', 1, 1, '', '\\x00', 'v1')"},
		{"sql_declare_cursor", simple, "BEGIN; DECLARE pgfence_p CURSOR FOR SELECT 1"},
		{"set_backstop_setting", simple, "SET pgfence.replay = '1'"},
		{"set_config_backstop_setting", extended, "SELECT set_config('pgfence.replay', '1', true)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			e.refused(t, c.mode, func(ctx context.Context, conn *pgx.Conn) error {
				_, err := conn.Exec(ctx, c.sql)
				return err
			})
		})
	}
	t.Run("protocol_parse", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		e.refused(t, extended, func(ctx context.Context, conn *pgx.Conn) error {
			_, err := conn.PgConn().Prepare(ctx, "pgfence_commit", "SELECT 'committed'::text", nil)
			return err
		})
	})
	t.Run("protocol_close_statement", func(t *testing.T) {
		t.Parallel()
		newReservedEnv(t).rawRefused(t, &pgproto3.Close{ObjectType: 'S', Name: "pgfence_gate"})
	})
	t.Run("protocol_describe_statement", func(t *testing.T) {
		t.Parallel()
		newReservedEnv(t).rawRefused(t, &pgproto3.Describe{ObjectType: 'S', Name: "pgfence_commit"})
	})
	t.Run("protocol_bind_statement", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		e.rawRefused(t, &pgproto3.Bind{PreparedStatement: "pgfence_commit",
			Parameters: [][]byte{[]byte("r"), []byte("1"), []byte(fmt.Sprint(e.lease.Token)), nil, []byte(`\x00`), []byte("v1")}},
			&pgproto3.Execute{})
	})
	t.Run("protocol_bind_portal", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		e.rawRefused(t, &pgproto3.Parse{Query: "SELECT 1"}, &pgproto3.Bind{DestinationPortal: "pgfence_p"})
	})
	t.Run("protocol_execute_portal", func(t *testing.T) {
		t.Parallel()
		newReservedEnv(t).rawRefused(t, &pgproto3.Execute{Portal: "pgfence_p"})
	})

	// The stand-in attack: the client replaces the gate's statements from
	// a DO block after they were prepared, then commits a gated write.
	// The proxy parses them again after anything opaque, so the receipt
	// is written.
	for _, m := range []struct {
		name string
		mode pgx.QueryExecMode
	}{{"simple", simple}, {"extended", extended}} {
		t.Run("do_block_stand_in_"+m.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			c := e.mustConnect(t, client{lease: &e.lease, mode: m.mode})
			// A first gated commit prepares the gate's statements.
			execOK(t, c, "SET fence.step = 'one'")
			e.gatedCommit(t, c, "first")
			e.wantReceipt(t, "one")
			execOK(t, c, "SET fence.step = 'two'")
			execOK(t, c, standIn)
			e.gatedCommit(t, c, "first", standIn)
			e.wantReceipt(t, "two")
		})
	}

	// After DEALLOCATE ALL, DISCARD ALL or DISCARD PLANS the gate's
	// statements are prepared again (or still there) before their next
	// use.
	for _, q := range []string{"DEALLOCATE ALL", "DISCARD ALL", "DISCARD PLANS"} {
		for _, m := range []struct {
			name string
			mode pgx.QueryExecMode
		}{{"simple", simple}, {"extended", extended}} {
			q, m := q, m
			t.Run(fmt.Sprintf("%s_%s", pgconnName(q), m.name), func(t *testing.T) {
				t.Parallel()
				e := newReservedEnv(t)
				c := e.mustConnect(t, client{lease: &e.lease, mode: m.mode, extra: []string{"-c fence.step=one"}})
				e.gatedCommit(t, c, "first")
				execOK(t, c, q)
				if q == "DISCARD ALL" {
					// DISCARD ALL resets the fence settings too (as
					// RESET ALL does): the startup options come back.
					var step string
					if err := c.QueryRow(ctxT(t), "SELECT current_setting('fence.step')").Scan(&step); err != nil || step != "one" {
						t.Fatalf("fence.step after DISCARD ALL: %q, %v", step, err)
					}
				}
				execOK(t, c, "SET fence.step = 'two'")
				e.gatedCommit(t, c, "first")
				e.wantReceipt(t, "two")
			})
		}
	}
}

// pgconnName turns a statement into a test name.
func pgconnName(q string) string {
	b := []byte(q)
	for i, c := range b {
		switch {
		case c == ' ':
			b[i] = '_'
		case c >= 'A' && c <= 'Z':
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b)
}
