package proxy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
)

// Round 5 (attacker J): the answer to a replayed COMMIT. The proxy rolls
// a replayed transaction back; it answers the COMMIT as committed only
// when it can put the session back as the first attempt's COMMIT left
// it, and before the client's next request runs.
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
	// The settings a replayed transaction left are not all known to the
	// proxy: the COMMIT is answered as PostgreSQL answers a replay (FN00R,
	// an error: rolled back, settings as before it), never as committed
	// with settings the first attempt's COMMIT did not leave.
	for _, c := range []struct{ name, tx string }{
		// J-H2: a LOCAL set_config of a computed value, the COMMIT in a
		// later request: the resync took it for a session-level SET.
		{"local_computed_set_config", "SET fence.step = 'v' | SELECT set_config('fence.step', lower('W'), true)"},
		// J-H3: a computed value the restore would refuse (over 200
		// characters) was left out, silently.
		{"long_computed_step", "SELECT length(set_config('fence.step', repeat('a', 201), false))"},
		// Code the proxy cannot see into sets the step for the session.
		{"do_block", "DO $$ BEGIN PERFORM set_config('fence.step', 'x', false); END $$"},
		// J-M1: RESET to a default the proxy never saw.
		{"reset_unknown_default", "RESET search_path"},
	} {
		for _, proto := range []string{"simple", "extended"} {
			t.Run(c.name+"/"+proto, func(t *testing.T) {
				t.Parallel()
				e := newReservedEnv(t)
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
				if err := run(e.encConn(t, "UTF8")); err != nil {
					t.Fatalf("first attempt: %v", err)
				}
				retry := e.encConn(t, "UTF8")
				err := run(retry)
				wantCode(t, err, fence.CodeReplay)
				if st := retry.TxStatus(); st != 'I' {
					t.Fatalf("after the replay's error: transaction status %q, want idle", st)
				}
				e.wantCount(t, 1, "SELECT count(*) FROM results WHERE job_key = 'a'")
				mustExec(t, retry, "SELECT 1")
			})
		}
	}
}
