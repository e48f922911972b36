package proxy

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
)

// TestBypass/replstate: what crosses the end of a read-only transaction
// served by the session's replica connection, and the session state of
// its two backends (issue 30, attacker C: H4, M2, H5).
//
//   - H4: a query that ends the transaction on the replica carried the
//     statements after the COMMIT there unjudged, so a session chained
//     read-only transactions on a lagging replica across takeovers
//     ("COMMIT; BEGIN READ ONLY; SELECT ..."), or read in autocommit
//     after one ("COMMIT; SELECT ...").
//   - M2: a session-state change (SET fence.step, ...) run on the replica
//     connection only, while the proxy took it as the session's: a false
//     receipt, and a later real commit answered "already committed".
//   - H5: the replica backend read text under another
//     standard_conforming_strings than the one the proxy classified it
//     with (the primary's, changed by a DO block), so a protected read the
//     proxy took for a literal ran on the lagging replica.
//
// Each attack runs right after a takeover the proxy has seen, with replay
// paused before it: the previous generation's payload must never come
// back.
func init() {
	registerBypass("replstate", testBypassReplState)
}

// replScene is one round: the previous generation's result replayed on
// the replica, a reader prepared (prep), replay paused, a takeover the
// proxy has seen and its result on the primary.
type replScene struct {
	e    *routeEnv
	cur  fence.Lease
	prev string // the previous generation's payload: must never be read
}

// round prepares reader with prep while the replica has the current
// generation, then pauses replay and takes over. It returns the payload
// that must not be read.
func (sc *replScene) round(t *testing.T, prep func()) string {
	t.Helper()
	ctx := ctxT(t)
	resumeAndCatchUp(t)
	prep()
	pauseReplay(t)
	prev := sc.prev
	next := sc.e.takeover(t, "job", "h", sc.cur)
	w := sc.e.worker(t, &next)
	payload := fmt.Sprintf("gen%d", next.Token)
	if _, err := w.Exec(ctx, upsert, "job", payload, next.Token); err != nil {
		t.Fatalf("the new generation's commit: %v", err)
	}
	w.Close(ctx)
	sc.e.waitTakeover(t, sc.e.gate, "job", next.Token)
	sc.cur, sc.prev = next, payload
	return prev
}

// values is every value of every row of every result of sql.
func values(t *testing.T, c *pgconn.PgConn, sql string) ([]string, error) {
	t.Helper()
	rs, err := c.Exec(ctxT(t), sql).ReadAll()
	var out []string
	for _, r := range rs {
		for _, row := range r.Rows {
			for _, v := range row {
				out = append(out, string(v))
			}
		}
	}
	return out, err
}

// notStale fails if vals holds the previous generation's payload.
func notStale(t *testing.T, what string, vals []string, prev string) {
	t.Helper()
	for _, v := range vals {
		if v == prev {
			t.Errorf("%s: served the previous generation's %q: %v", what, prev, vals)
		}
	}
}

// stillUsable checks that c answers a plain query with its own answer
// (one ReadyForQuery per query: nothing of the last one is left behind).
func stillUsable(t *testing.T, c *pgconn.PgConn) {
	t.Helper()
	vals, err := values(t, c, "SELECT 'usable'")
	if err != nil || len(vals) != 1 || vals[0] != "usable" {
		t.Fatalf("session out of step after the attempt: %v %v", vals, err)
	}
}

func testBypassReplState(t *testing.T) {
	e := newRouteEnv(t)
	ctx := ctxT(t)
	a := e.acquire(t, "job", "a", time.Minute)
	w := e.worker(t, &a)
	if _, err := w.Exec(ctx, upsert, "job", "gen-a", a.Token); err != nil {
		t.Fatal(err)
	}
	w.Close(ctx)
	sc := &replScene{e: e, cur: a, prev: "gen-a"}

	// H4: the statements after the end of a transaction on the replica.
	chained := []struct{ name, sql string }{
		{"commit_begin_read_only", "COMMIT; BEGIN READ ONLY; " + readPayload},
		{"commit_autocommit", "COMMIT; " + readPayload},
		{"end_autocommit", "END; " + readPayload},
		{"rollback_autocommit", "ROLLBACK; " + readPayload},
		{"abort_begin_read_only", "ABORT; START TRANSACTION READ ONLY; " + readPayload + "; COMMIT"},
		{"read_commit_read", "SELECT 1; COMMIT; " + readPayload},
		{"commit_two_reads", "COMMIT; SELECT 2; " + readPayload},
		{"commit_lowercase_comment", "commit /* ; */ ; -- x\n begin read only; " + readPayload},
		{"commit_then_begin_isolation", "COMMIT; BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; " + readPayload},
	}
	for _, c := range chained {
		t.Run("H4_"+c.name, func(t *testing.T) {
			r := e.reader(t, nil)
			prev := sc.round(t, func() { routeReadOnlyOnReplica(t, r) })
			vals, err := values(t, r, c.sql)
			if err != nil {
				t.Fatalf("%s: %v", c.sql, err)
			}
			notStale(t, c.sql, vals, prev)
			mustExec(t, r, "ROLLBACK") // a transaction the attempt left open, if any
			stillUsable(t, r)
		})
	}

	// H4, the error semantics the split keeps: a statement that fails
	// before the COMMIT skips the rest of the query, as PostgreSQL does;
	// the transaction stays open (failed) on the replica.
	t.Run("H4_error_before_commit_skips_rest", func(t *testing.T) {
		r := e.reader(t, nil)
		prev := sc.round(t, func() { routeReadOnlyOnReplica(t, r) })
		// The failing statement reads nothing and applies no operator
		// (1/0 would: after the takeover, in a database with operators of
		// its own, the transaction's read-set judgement refuses it, FN007):
		// a SET LOCAL with a bad value fails on the server.
		vals, err := values(t, r, "SET LOCAL statement_timeout = 'bogus'; COMMIT; "+readPayload)
		if err == nil || !strings.Contains(err.Error(), "22023") {
			t.Fatalf("want 22023, got %v %v", vals, err)
		}
		notStale(t, "after the failed SET LOCAL", vals, prev)
		if st := r.TxStatus(); st != 'E' {
			t.Fatalf("transaction status %c, want E (failed, still open)", st)
		}
		mustExec(t, r, "ROLLBACK")
		stillUsable(t, r)
	})

	// H4, extended protocol: a batch that commits the replica's
	// transaction and reads on before its Sync.
	t.Run("H4_extended_commit_then_read", func(t *testing.T) {
		r := e.reader(t, nil)
		prev := sc.round(t, func() { routeReadOnlyOnReplica(t, r) })
		fe := r.Frontend()
		fe.Send(&pgproto3.Parse{Query: "COMMIT"})
		fe.Send(&pgproto3.Bind{})
		fe.Send(&pgproto3.Execute{})
		fe.Send(&pgproto3.Parse{Query: readPayload})
		fe.Send(&pgproto3.Bind{})
		fe.Send(&pgproto3.Execute{})
		fe.Send(&pgproto3.Sync{})
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		for {
			m, err := fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			if d, ok := m.(*pgproto3.DataRow); ok {
				for _, v := range d.Values {
					if string(v) == prev {
						t.Errorf("served the previous generation's %q", prev)
					}
				}
			}
			if _, ok := m.(*pgproto3.ReadyForQuery); ok {
				break
			}
		}
		mustExec(t, r, "ROLLBACK")
		stillUsable(t, r)
	})

	// M2: session state changed on the replica connection only.
	// The attempt may be refused (0A000) or split (the SET runs on the
	// primary); either way the proxy's step is the primary's: the
	// transaction that follows leaves exactly one receipt, of the step
	// the primary has.
	for _, attempt := range []string{"COMMIT; SET fence.step = 'zz'", "COMMIT; SELECT set_config('fence.step', 'zz', false)",
		"SET fence.step = 'zz'; COMMIT", "ROLLBACK; SET fence.step = 'zz'"} {
		t.Run("M2_receipts_"+strings.ReplaceAll(strings.Fields(attempt)[0]+"_"+strings.Fields(attempt)[1], ";", ""), func(t *testing.T) {
			resumeAndCatchUp(t)
			sc.cur = e.takeover(t, "job", "m2", sc.cur) // a generation that has written nothing yet
			e.waitTakeover(t, e.gate, "job", sc.cur.Token)
			resumeAndCatchUp(t) // the replica has the generation r carries
			r := e.reader(t, nil, pgoptions(sc.cur))
			routeReadOnlyOnReplica(t, r)
			if _, err := values(t, r, attempt); err != nil && !strings.Contains(err.Error(), "0A000") {
				t.Fatalf("%s: %v", attempt, err)
			}
			mustExec(t, r, "ROLLBACK")
			step := lastValue(t, r, "BEGIN; SELECT coalesce(current_setting('fence.step', true), '') || '|' || pg_is_in_recovery()::text")
			mustExec(t, r, "COMMIT")
			mustExec(t, r, fmt.Sprintf("BEGIN; INSERT INTO results VALUES ('job', 'm2', %d) ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload; COMMIT", sc.cur.Token))
			if n := e.count(t, "SELECT count(*) FROM fence.receipts WHERE job_key = 'job' AND token = $1", sc.cur.Token); n != 1 {
				t.Errorf("%d receipts for one transaction, want 1", n)
			}
			want, _, _ := strings.Cut(step, "|")
			if n := e.count(t, "SELECT count(*) FROM fence.receipts WHERE job_key = 'job' AND token = $1 AND step = $2", sc.cur.Token, want); n != 1 {
				t.Errorf("no receipt of the primary's step %q (%s)", want, step)
			}
		})
	}
	states := []struct{ name, sql string }{
		{"set_fence_step", "SET fence.step = 'zz'"},
		{"set_session_fence_step", "SET SESSION fence.step TO 'zz'"},
		{"set_config_step", "SELECT set_config('fence.step', 'zz', false)"},
		{"set_search_path", "SET search_path = other, public"},
		{"reset_all", "RESET ALL"},
		{"reset_name", "RESET application_name"},
		{"set_scs_local", "SET LOCAL standard_conforming_strings = off"},
		{"set_encoding_local", "SELECT set_config('client_encoding', 'LATIN1', true)"},
		{"set_names", "SET NAMES 'LATIN1'"},
		{"set_session_characteristics", "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE"},
		{"prepare", "PREPARE pr AS SELECT 1"},
		{"deallocate_all", "DEALLOCATE ALL"},
		{"discard_plans", "DISCARD PLANS"},
		{"set_role", "SET ROLE postgres"},
		{"set_read_policy", "SET fence.read_policy = 'primary'"},
	}
	for _, c := range states {
		t.Run("M2_in_tx_"+c.name, func(t *testing.T) {
			r := e.reader(t, nil)
			resumeAndCatchUp(t)
			routeReadOnlyOnReplica(t, r)
			_, err := values(t, r, c.sql)
			if err == nil || !strings.Contains(err.Error(), "0A000") {
				t.Errorf("%s in a read-only transaction on the replica: %v, want 0A000", c.sql, err)
			}
			mustExec(t, r, "ROLLBACK")
			stillUsable(t, r)
		})
	}
	// Controls: what leaves no session state runs on.
	for _, sql := range []string{"SET LOCAL statement_timeout = '5s'", "SET TRANSACTION READ ONLY",
		"SELECT set_config('application_name', 'x', true)", "SAVEPOINT s1; RELEASE s1"} {
		t.Run("M2_control_"+strings.Fields(sql)[0]+"_"+strings.Fields(sql)[1], func(t *testing.T) {
			r := e.reader(t, nil)
			resumeAndCatchUp(t)
			routeReadOnlyOnReplica(t, r)
			mustExec(t, r, sql)
			if got := lastValue(t, r, "SELECT pg_is_in_recovery()"); got != "t" {
				t.Errorf("the transaction left the replica: %s", got)
			}
			mustExec(t, r, "COMMIT")
		})
	}

	// H5: text read under other lexing rules on the replica.
	lexing := []struct{ name, change, sql string }{
		{"scs_do", "DO $$ BEGIN PERFORM set_config('standard_conforming_strings', 'off', false); END $$",
			"SELECT 'a\\', (SELECT payload FROM results WHERE job_key = $$job$$) AS p, pg_is_in_recovery() -- '\n"},
		{"scs_function", "CREATE OR REPLACE FUNCTION public.scs_off() RETURNS text LANGUAGE sql AS $$ SELECT set_config('standard_conforming_strings', 'off', false) $$; SELECT public.scs_off()",
			"SELECT 'a\\', (SELECT payload FROM results WHERE job_key = $$job$$) AS p, pg_is_in_recovery() -- '\n"},
		{"scs_in_tx", "DO $$ BEGIN PERFORM set_config('standard_conforming_strings', 'off', false); END $$",
			"BEGIN READ ONLY; SELECT 'a\\', (SELECT payload FROM results WHERE job_key = $$job$$) AS p, pg_is_in_recovery() -- '\n; COMMIT"},
		{"search_path_do", "DO $$ BEGIN PERFORM set_config('search_path', 'other, public', false); END $$",
			"SELECT payload, pg_is_in_recovery() FROM results WHERE job_key = 'job'"},
	}
	for _, c := range lexing {
		t.Run("H5_"+c.name, func(t *testing.T) {
			r := e.reader(t, nil)
			prev := sc.round(t, func() {
				mustExec(t, r, "CREATE SCHEMA IF NOT EXISTS other")
				waitReplicaRead(t, r, "SELECT 1, pg_is_in_recovery()") // the replica connection is open
				mustExec(t, r, c.change)                               // on the primary
			})
			vals, err := values(t, r, c.sql)
			if err != nil {
				t.Fatalf("%s: %v", c.sql, err)
			}
			notStale(t, c.sql, vals, prev)
			stillUsable(t, r)
		})
	}
}

const readPayload = "SELECT payload, token, pg_is_in_recovery() FROM results WHERE job_key = 'job'"
