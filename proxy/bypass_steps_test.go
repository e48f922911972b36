package proxy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// The gate's own steps cannot be replaced by client code (issue 30, HIGH
// 3, second bullet). Code the proxy cannot see into runs in many more
// places than DO blocks and visible function calls: a view's function, a
// trigger on the client's own table (INSERT or COPY), an operator, a
// domain's CHECK, a column's DEFAULT, a function named like a built-in.
// Any of them may DEALLOCATE the gate's prepared statements and PREPARE
// stand-ins under their names (a name the session's own code can always
// read in pg_prepared_statements), so the receipt step would write
// nothing. The gate parses each step right before it runs it, in the same
// message stream, so no client code runs between its Parse and its
// Execute.
func init() { registerBypass("steps", bypassSteps) }

// stepsSchema is the attacker's toolkit: swap() replaces every one of the
// gate's statements by a stand-in that does nothing, and every way to
// run it without a visible function call.
const stepsSchema = `
CREATE FUNCTION swap() RETURNS int LANGUAGE plpgsql AS $$
DECLARE n text;
BEGIN
  FOREACH n IN ARRAY ARRAY['pgfence_gate', 'pgfence_commit', 'pgfence_commit_if', 'pgfence_savepoint'] LOOP
    IF EXISTS (SELECT FROM pg_prepared_statements WHERE name = n) THEN
      EXECUTE format('DEALLOCATE %I', n);
    END IF;
  END LOOP;
  EXECUTE 'PREPARE pgfence_gate(text, int8, int8, text) AS SELECT ''ok''::text';
  EXECUTE 'PREPARE pgfence_commit(text, int8, int8, text, bytea, text) AS SELECT ''committed''::text';
  EXECUTE 'PREPARE pgfence_commit_if(text, int8, int8, text, bytea, text) AS SELECT ''none''::text';
  EXECUTE 'PREPARE pgfence_savepoint AS SELECT 1';
  RETURN 1;
END $$;
CREATE VIEW swapper AS SELECT swap() AS x;
CREATE FUNCTION swap_trg() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM swap(); RETURN NEW; END $$;
CREATE TABLE trig (note text);
CREATE TRIGGER trig_swap BEFORE INSERT ON trig FOR EACH ROW EXECUTE FUNCTION swap_trg();
CREATE FUNCTION swap_op(int, int) RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN swap(); END $$;
CREATE OPERATOR #@# (LEFTARG = int, RIGHTARG = int, FUNCTION = swap_op);
CREATE FUNCTION swap_check(int) RETURNS bool LANGUAGE plpgsql AS $$ BEGIN RETURN swap() = 1; END $$;
CREATE DOMAIN swapdom AS int CHECK (swap_check(VALUE));
CREATE TABLE defaults (x int DEFAULT swap());
CREATE FUNCTION public.lower(int) RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN swap(); END $$;
CREATE FUNCTION swap_idx(int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN RETURN swap(); END $$;
CREATE TABLE indexed (x int);
CREATE INDEX ON indexed (swap_idx(x));
`

func bypassSteps(t *testing.T) {
	vectors := []struct{ name, sql string }{
		{"view", "SELECT x FROM swapper"},
		{"trigger_on_insert", "INSERT INTO trig VALUES ('t')"},
		{"operator", "SELECT 1 #@# 1"},
		{"domain_check", "SELECT 1::swapdom"},
		{"column_default", "INSERT INTO defaults DEFAULT VALUES"},
		{"builtin_name", "SELECT lower(1)"},
		{"index_expression", "INSERT INTO indexed VALUES (1)"},
	}
	newEnv := func(t *testing.T) *reservedEnv {
		e := newReservedEnv(t)
		execOK(t, e.direct(t), stepsSchema)
		return e
	}
	// In the client's own transaction: the gated write, the vector (after
	// the gate's statements exist), COMMIT, which runs the receipt step.
	for _, v := range vectors {
		for _, m := range []struct {
			name string
			mode pgx.QueryExecMode
		}{{"simple", pgx.QueryExecModeSimpleProtocol}, {"extended", pgx.QueryExecModeDescribeExec}} {
			t.Run(v.name+"_in_transaction_"+m.name, func(t *testing.T) {
				t.Parallel()
				e := newEnv(t)
				c := e.mustConnect(t, client{lease: &e.lease, mode: m.mode})
				execOK(t, c, "SET fence.step = 'one'")
				e.gatedCommit(t, c, "first") // the gate's statements are prepared now
				e.wantReceipt(t, "one")
				execOK(t, c, "SET fence.step = 'two'")
				e.gatedCommit(t, c, "first", v.sql)
				e.wantReceipt(t, "two")
			})
		}
		// In one extended batch outside a transaction: the gate, the
		// write, the vector, and the receipt step before the Sync.
		t.Run(v.name+"_in_batch", func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			c := e.mustConnect(t, client{lease: &e.lease, mode: pgx.QueryExecModeDescribeExec})
			execOK(t, c, "SET fence.step = 'one'")
			e.gatedCommit(t, c, "first")
			execOK(t, c, "SET fence.step = 'two'")
			b := &pgx.Batch{}
			b.Queue(upsert, "r", "first", e.lease.Token) // a second write of the token: its receipt is the step's
			b.Queue(v.sql)
			if err := c.SendBatch(ctxT(t), b).Close(); err != nil {
				t.Fatalf("batch: %v", err)
			}
			e.wantReceipt(t, "two")
		})
	}
	// COPY into the client's own table fires its trigger.
	t.Run("trigger_on_copy", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		c := e.mustConnect(t, client{lease: &e.lease})
		execOK(t, c, "SET fence.step = 'one'")
		e.gatedCommit(t, c, "first")
		execOK(t, c, "SET fence.step = 'two'")
		tx := beginOK(t, c)
		defer tx.Rollback(ctxT(t))
		execOK(t, tx, upsert, "r", "first", e.lease.Token)
		if _, err := c.PgConn().CopyFrom(ctxT(t), strings.NewReader("c\n"), "COPY trig FROM STDIN"); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		e.wantReceipt(t, "two")
	})
	// The stand-ins are in place before the session's first gated write:
	// the gate's statements were never prepared by it.
	t.Run("stand_in_before_first_use", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		c := e.mustConnect(t, client{lease: &e.lease, mode: pgx.QueryExecModeDescribeExec})
		execOK(t, c, "SET fence.step = 'one'")
		execOK(t, c, "SELECT x FROM swapper")
		e.gatedCommit(t, c, "first")
		e.wantReceipt(t, "one")
	})
	// A retry whose gate and receipt steps have stand-ins in place is
	// still a replay: nothing is written twice and the client is told.
	t.Run("retry_with_stand_ins", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		var ns notices
		c := e.mustConnect(t, client{lease: &e.lease, mode: pgx.QueryExecModeDescribeExec, notices: &ns})
		execOK(t, c, "SET fence.step = 'one'")
		e.gatedCommit(t, c, "first")
		before := e.snapshot(t)
		tx := beginOK(t, c)
		defer tx.Rollback(ctxT(t))
		execOK(t, tx, "SELECT x FROM swapper")
		execOK(t, tx, upsert, "r", "first", e.lease.Token)
		if err := tx.Commit(ctxT(t)); err != nil {
			t.Fatalf("retry: %v, want the replay's success", err)
		}
		e.unchanged(t, before)
		if got := ns.take(); fmt.Sprint(got) != "[FN00R]" {
			t.Fatalf("notices %v, want one FN00R", got)
		}
	})
}
