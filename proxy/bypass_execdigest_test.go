package proxy

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("execute_digest", bypassExecuteDigest) }

// bypassExecuteDigest (round 18, attacker AG's M1): the payload digest of
// an SQL-level EXECUTE was its canonical text, the prepared statement's
// name and arguments, and not what the statement does. A zombie (or any
// worker) that prepared the name anew as a different write and ran the
// same EXECUTE under a committed step was answered as the step's replay
// "with the same payload", its COMMIT answered COMMIT, and its write was
// silently dropped. Now an EXECUTE's digest item carries the prepared
// statement's canonical text (plan.DigestText): the different write is a
// conflict (FN003), the same one a replay. Through the proxy, which
// computes the digest; by each path that adds to it: the statement's
// completion (a transaction over several queries), the commit step's
// resolution (BEGIN, EXECUTE and COMMIT in one query, the PREPARE too),
// and an extended-protocol batch (EXECUTE sent by Parse/Bind/Execute in
// an implicit transaction).
func bypassExecuteDigest(t *testing.T) {
	c := newCast(t)
	w, cur := c.worker, &c.current
	first := "prepare w as insert into inh_c values (%d, 'job', 'first')"
	other := "prepare w as update res set v = 'other' where k = 1"
	shapes := []struct {
		name string
		run  func(t *testing.T, step, prepare string) error
	}{
		{"over_queries", func(t *testing.T, step, prepare string) error {
			conn := c.connect(t, "proxy", w, cur)
			for _, q := range []string{prepare, "set fence.step = '" + step + "'", "begin", "execute w", "commit"} {
				if err := castExec(ctxT(t), conn, q, ""); err != nil {
					return err
				}
			}
			return nil
		}},
		{"one_query", func(t *testing.T, step, prepare string) error {
			return castExec(ctxT(t), c.connect(t, "proxy", w, cur),
				fmt.Sprintf("set fence.step = '%s'; %s; begin; execute w; commit", step, prepare), "")
		}},
		{"extended_implicit", func(t *testing.T, step, prepare string) error {
			conn := c.connect(t, "proxy", w, cur)
			if err := castExec(ctxT(t), conn, fmt.Sprintf("set fence.step = '%s'; %s", step, prepare), ""); err != nil {
				return err
			}
			return conn.ExecParams(ctxT(t), "execute w", nil, nil, nil, nil).Read().Err
		}},
	}
	for i, sh := range shapes {
		t.Run(sh.name, func(t *testing.T) {
			step, k := "exec_"+sh.name, 40+i
			if err := sh.run(t, step, fmt.Sprintf(first, k)); err != nil {
				t.Fatalf("first commit: %v", err)
			}
			if n := c.count(t, "select count(*) from inh_c where k = $1 and v = 'first'", k); n != 1 {
				t.Fatalf("the first commit's row: %d, want 1", n)
			}
			t.Run("different_statement_conflicts", func(t *testing.T) {
				err := sh.run(t, step, other)
				if got := pgtest.SQLState(err); got != fence.CodeConflict {
					t.Fatalf("EXECUTE of a statement prepared as another write under committed step %q: %v (SQLSTATE %q), want %s",
						step, err, got, fence.CodeConflict)
				}
				if n := c.count(t, "select count(*) from res where k = 1 and v = 'other'"); n != 0 {
					t.Fatal("the different write was applied")
				}
			})
			t.Run("same_statement_replays", func(t *testing.T) {
				if err := sh.run(t, step, fmt.Sprintf(first, k)); err != nil {
					t.Fatalf("the retry with the same prepared statement: %v, want its replay (success)", err)
				}
				if n := c.count(t, "select count(*) from inh_c where k = $1", k); n != 1 {
					t.Fatalf("rows after the retry: %d, want 1", n)
				}
			})
		})
	}
	// Round 19, attacker AK's M1: the same query prepared with other
	// parameter types writes another value from the same EXECUTE: by SQL
	// PREPARE, and by a protocol-level Parse run by SQL EXECUTE.
	types := []struct {
		name    string
		prepare func(t *testing.T, conn *pgconn.PgConn, typ string) error
	}{
		{"sql_prepare", func(t *testing.T, conn *pgconn.PgConn, typ string) error {
			return castExec(ctxT(t), conn, "prepare w("+typ+") as insert into inh_c values (60, 'job', $1)", "")
		}},
		{"protocol_parse", func(t *testing.T, conn *pgconn.PgConn, typ string) error {
			oid := map[string]uint32{"int": 23, "text": 25}[typ]
			_, err := conn.Prepare(ctxT(t), "w", "insert into inh_c values (61, 'job', $1)", []uint32{oid})
			return err
		}},
	}
	for _, ty := range types {
		t.Run("param_types_"+ty.name, func(t *testing.T) {
			step := "exec_types_" + ty.name
			run := func(typ string) error {
				conn := c.connect(t, "proxy", w, cur)
				if err := ty.prepare(t, conn, typ); err != nil {
					return err
				}
				return castExec(ctxT(t), conn, "set fence.step = '"+step+"'; begin; execute w('007'); commit", "")
			}
			if err := run("int"); err != nil {
				t.Fatalf("first commit: %v", err)
			}
			err := run("text")
			if got := pgtest.SQLState(err); got != fence.CodeConflict {
				t.Fatalf("the same EXECUTE of the statement prepared with text for int: %v (SQLSTATE %q), want %s", err, got, fence.CodeConflict)
			}
			if err := run("int"); err != nil {
				t.Fatalf("the retry as first prepared: %v, want its replay (success)", err)
			}
		})
	}
}
