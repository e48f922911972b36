package proxy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
)

// Rounds 5 and 6 (attackers J and L): what a retry's session holds after
// a replayed COMMIT. The proxy rolls the replayed transaction back and
// answers it as committed; what the transaction left for fence.step is
// not known to it (a SET it saw, but also a computed or converted value,
// code it cannot see into: a DO block, a trigger, a column default, a
// view), so it sets fence.step to replayStep, under which the backstop
// refuses every write until the client sets a step, as its first attempt
// did. No client request runs between a gated COMMIT and its answer.
func init() { registerBypass("replay_round5", bypassReplayRound5) }

func bypassReplayRound5(t *testing.T) {
	// J-H1: a batch pipelined after the COMMIT's batch (sent before its
	// answer) ran before the settings were set again, under the step from
	// before the transaction, and its write was applied twice.
	t.Run("pipelined_after_commit", func(t *testing.T) {
		t.Parallel()
		e := newReservedEnv(t)
		ins := fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('a', 'A', %d)", e.lease.Token)
		run := func(conn *pgconn.PgConn) {
			p := conn.StartPipeline(ctxT(t))
			for _, sql := range []string{"BEGIN", "SET fence.step = 's1'", ins, "SET fence.step = 's2'", "COMMIT"} {
				p.SendQueryParams(sql, nil, nil, nil, nil)
			}
			p.SendPipelineSync()
			p.SendQueryParams("UPDATE results SET payload = payload || '+' WHERE job_key = 'a'", nil, nil, nil, nil)
			p.SendPipelineSync()
			if err := p.Flush(); err != nil {
				t.Fatal(err)
			}
			for syncs := 0; syncs < 2; {
				r, err := p.GetResults()
				if err != nil {
					t.Logf("pipeline: %v", err)
					continue
				}
				switch r := r.(type) {
				case *pgconn.ResultReader:
					if _, err := r.Close(); err != nil {
						t.Logf("pipeline: %v", err)
					}
				case *pgconn.PipelineSync:
					syncs++
				case nil:
					t.Fatal("pipeline ended before its second Sync")
				}
			}
			if err := p.Close(); err != nil {
				t.Logf("pipeline close: %v", err)
			}
		}
		run(e.encConn(t, "UTF8"))
		e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
		run(e.encConn(t, "UTF8"))
		e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
	})
	// What the replayed transaction left for fence.step, the proxy did not
	// know: the retry's next write (a visible UPDATE, or one a trigger
	// makes, which only the backstop sees) ran under the step the proxy
	// put back and was applied twice. Now it is refused (FN008) and applied
	// once.
	objects := `
create table tn (note text);
create function tnf() returns trigger language plpgsql as $$ begin update results set payload = payload || '+' where job_key = 'a'; return new; end $$;
create trigger tnt after insert on tn for each row execute function tnf();
create table td (x text default set_config('fence.step', 'd', false), y int);
create table tr (x int);
create function trf() returns trigger language plpgsql as $$ begin perform set_config('fence.step', 'v', false); return new; end $$;
create trigger trt before insert on tr for each row execute function trf();
create view vstep as select set_config('fence.step', 'w', false) as s;`
	for _, c := range []struct{ name, tx string }{
		// J-H2: a LOCAL set_config of a computed value, the COMMIT in a
		// later request: the read-back took it for a session-level SET.
		{"local_computed_set_config", "SET fence.step = 'v' | SELECT set_config('fence.step', lower('W'), true)"},
		// J-H3: a computed value the restore would refuse (over 200
		// characters) was left out, silently.
		{"long_computed_step", "SELECT length(set_config('fence.step', repeat('a', 201), false))"},
		// Code the proxy cannot see into sets the step for the session.
		{"do_block", "DO $$ BEGIN PERFORM set_config('fence.step', 'x', false); END $$"},
		// J-M1: RESET to a default the proxy never saw.
		{"reset_unknown_default", "SET fence.step = 's2' | RESET search_path"},
		// L-H1: code behind other syntax: a column default, a BEFORE
		// trigger, a view.
		{"column_default", "SET fence.step = 's2' | INSERT INTO td (y) VALUES (1)"},
		{"before_trigger", "SET fence.step = 's2' | INSERT INTO tr VALUES (1)"},
		{"view", "SET fence.step = 's2' | SELECT * FROM vstep"},
	} {
		for _, proto := range []string{"simple", "extended"} {
			for _, next := range []struct{ name, sql string }{
				{"visible_next", "UPDATE results SET payload = payload || '+' WHERE job_key = 'a'"},
				{"trigger_next", "INSERT INTO tn VALUES ('b')"},
			} {
				if proto == "extended" && next.name == "trigger_next" {
					continue // the backstop's refusal does not depend on the protocol of the transaction before
				}
				t.Run(c.name+"/"+proto+"/"+next.name, func(t *testing.T) {
					t.Parallel()
					e := newReservedEnv(t)
					mustExec(t, e.direct(t).PgConn(), objects)
					stmts := []string{"BEGIN", "SET fence.step = 's1'",
						fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('a', 'A', %d)", e.lease.Token)}
					stmts = append(stmts, strings.Split(c.tx, " | ")...)
					run := func(conn *pgconn.PgConn) error {
						mustExec(t, conn, "SET search_path = public, pg_temp")
						if proto == "simple" {
							mustExec(t, conn, strings.Join(stmts, "; "))
							_, err := conn.Exec(ctxT(t), "COMMIT").ReadAll()
							return err
						}
						b := &pgconn.Batch{}
						for _, sql := range append(stmts, "COMMIT") {
							b.ExecParams(sql, nil, nil, nil, nil)
						}
						_, err := conn.ExecBatch(ctxT(t), b).ReadAll()
						return err
					}
					first := e.encConn(t, "UTF8")
					if err := run(first); err != nil {
						t.Fatalf("first attempt: %v", err)
					}
					switch c.name {
					case "column_default", "before_trigger", "view":
						// Round 8 (O-H1): code the proxy cannot see set
						// the step for the session, so the next write's
						// gate or commit (the step the proxy believes)
						// and its backstop (the server's) went under two
						// steps: two receipts for one transaction. The
						// database refuses that now (FN009); the client
						// sets its step with SET.
						_, err := first.Exec(ctxT(t), next.sql).ReadAll()
						wantCode(t, err, fence.CodeUnsupported)
						mustExec(t, first, "SET fence.step = 'next'; "+next.sql)
					default:
						mustExec(t, first, next.sql)
					}
					e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
					retry := e.encConn(t, "UTF8")
					if err := run(retry); err != nil {
						t.Fatalf("retry: %v, want the replay's success", err)
					}
					if v := lastValue(t, retry, "SHOW fence.step"); v != replayStep {
						t.Fatalf("after the replayed COMMIT fence.step is %q, want %q", v, replayStep)
					}
					_, err := retry.Exec(ctxT(t), next.sql).ReadAll()
					wantCode(t, err, fence.CodeFencingRequired)
					e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
					if c.name == "do_block" {
						// Round 8 (O-H2): a DO block may have set the
						// generation too, so a replay of it clears the
						// generation: a step alone is not enough.
						_, err := retry.Exec(ctxT(t), "SET fence.step = 'later'; "+next.sql).ReadAll()
						wantCode(t, err, fence.CodeFencingRequired)
						mustExec(t, retry, fmt.Sprintf("SET fence.job_key = %s; SET fence.epoch = %d; SET fence.token = %d", e.lease.JobKey, e.lease.Epoch, e.lease.Token))
					}
					mustExec(t, retry, "SET fence.step = 'later'; "+next.sql) // a step of its own: written
					e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A++'")
				})
			}
		}
	}
	// Round 7 (attacker N): every replay leaves fence.step unknown,
	// whatever answered it: a replayed COMMIT AND CHAIN (answered with an
	// error), and an implicit transaction of a batch ended by a Query in
	// the batch (the database's replay guard answers it) left the step
	// from before the transaction, and the next write was applied twice.
	for _, c := range []struct {
		name string
		run  func(t *testing.T, e *reservedEnv, conn *pgconn.PgConn)
	}{
		{"chain", func(t *testing.T, e *reservedEnv, conn *pgconn.PgConn) {
			conn.Exec(ctxT(t), fmt.Sprintf("BEGIN; SET fence.step = 's1'; INSERT INTO results (job_key, payload, token) VALUES ('a', 'A', %d); SET fence.step = 's2'; COMMIT AND CHAIN", e.lease.Token)).ReadAll()
			if conn.TxStatus() != 'I' {
				mustExec(t, conn, "COMMIT")
			}
		}},
		{"query_in_batch", func(t *testing.T, e *reservedEnv, conn *pgconn.PgConn) {
			fe := conn.Frontend()
			for _, sql := range []string{"SELECT set_config('fence.step', 's1', false)",
				fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('a', 'A', %d)", e.lease.Token),
				"SELECT set_config('fence.step', 's2', false)"} {
				fe.Send(&pgproto3.Parse{Query: sql})
				fe.Send(&pgproto3.Bind{})
				fe.Send(&pgproto3.Execute{})
			}
			fe.Send(&pgproto3.Query{String: "SELECT 1"})
			fe.Send(&pgproto3.Sync{})
			if err := fe.Flush(); err != nil {
				t.Fatal(err)
			}
			t.Logf("batch: %v", rawAnswers(t, conn, 2))
		}},
	} {
		t.Run("replay_step/"+c.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			next := "UPDATE results SET payload = payload || '+' WHERE job_key = 'a'"
			first := e.encConn(t, "UTF8")
			c.run(t, e, first)
			mustExec(t, first, next)
			e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
			retry := e.encConn(t, "UTF8")
			c.run(t, e, retry)
			if v := lastValue(t, retry, "SHOW fence.step"); v != replayStep {
				t.Fatalf("after the replay fence.step is %q, want %q", v, replayStep)
			}
			_, err := retry.Exec(ctxT(t), next).ReadAll()
			wantCode(t, err, fence.CodeFencingRequired)
			e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a' AND payload = 'A+'")
		})
	}
	// L-H2: a typed parameter the server converts before set_config sees
	// it (bpchar drops trailing spaces, name truncates, "char" keeps one
	// byte): the proxy recorded the raw text, so its receipt of the next
	// write and the backstop's went under two steps (two receipts for one
	// transaction), and a replay put the raw one back.
	for _, c := range []struct {
		name string
		oid  uint32
		raw  string
	}{{"bpchar", 1042, "b2   "}, {"name", 19, strings.Repeat("n", 70)}, {"char", 18, "xyz"}} {
		t.Run("typed_parameter/"+c.name, func(t *testing.T) {
			t.Parallel()
			e := newReservedEnv(t)
			conn := e.encConn(t, "UTF8")
			if _, err := conn.ExecParams(ctxT(t), "SELECT set_config('fence.step', $1, false)", [][]byte{[]byte(c.raw)}, []uint32{c.oid}, nil, nil).Close(); err != nil {
				t.Fatal(err)
			}
			mustExec(t, conn, fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('t', 'T', %d)", e.lease.Token))
			server := lastValue(t, conn, "SHOW fence.step")
			e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r'")
			e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r' AND step = $1", server)
		})
	}
}
