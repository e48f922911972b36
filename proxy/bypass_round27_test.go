package proxy

import (
	"fmt"
	"testing"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() {
	registerBypass("stale_gate", bypassStaleGate)
	registerBypass("syncrep_forged", bypassSyncRepForged)
}

// bypassStaleGate (round 27, attacker BH, H2): a fenced autocommit write
// sent as a simple Query that failed after its gate left the gate's state
// behind (the session state tracked no transaction to end), and the
// worker's next transaction, even an empty one, ran the receipt step and
// wrote a receipt for the step with no write: the step's real write was
// then refused as already committed. The implicit transaction's end at
// ReadyForQuery 'I' clears it.
func bypassStaleGate(t *testing.T) {
	c := newCast(t)
	for _, route := range castRoutes {
		t.Run(route, func(t *testing.T) {
			step := "stale-" + route
			conn := c.connect(t, route, c.worker, &c.current)
			if _, err := conn.Exec(ctxT(t), "set fence.step = '"+step+"'").ReadAll(); err != nil {
				t.Fatal(err)
			}
			_, err := conn.Exec(ctxT(t), "update app.ledger set v = 'x' where k = 1 and 1 / 0 = 1").ReadAll()
			if got := pgtest.SQLState(err); got != "22012" {
				t.Fatalf("the failing write: %v (SQLSTATE %q), want 22012", err, got)
			}
			if _, err := conn.Exec(ctxT(t), "begin; select 1; commit").ReadAll(); err != nil {
				t.Fatalf("an empty transaction after it: %v", err)
			}
			if n := c.count(t, "select count(*) from fence.receipts where step = $1", step); n != 0 {
				t.Fatalf("%d receipts for step %s, which wrote nothing", n, step)
			}
			if _, err := conn.Exec(ctxT(t), "update app.ledger set v = '"+step+"' where k = 1").ReadAll(); err != nil {
				t.Fatalf("the step's write, retried: %v", err)
			}
			if n := c.count(t, "select count(*) from app.ledger where k = 1 and v = $1", step); n != 1 {
				t.Fatalf("the retried write was not applied (%d rows)", n)
			}
		})
	}
}

// bypassSyncRepForged (round 27, attacker BH, H1): the proxy recognised
// PostgreSQL's WARNING about a cancelled wait for the synchronous
// standby by its English text, which any code can RAISE: the table
// owner's column default made the proxy answer a worker's INSERT, in a
// transaction still open, with FN016 ("committed on the primary; retry
// the step"), and the retry ran in that transaction: the step applied
// twice. PostgreSQL's own warning names its routine (SyncRepWaitForLSN),
// which PL/pgSQL's cannot.
func bypassSyncRepForged(t *testing.T) {
	c := newCast(t)
	c.as(t, c.owner, `create function public.sr_warn() returns text language plpgsql security definer set search_path = pg_catalog as $$
begin
  raise warning 'canceling wait for synchronous replication due to user request'
    using detail = 'The transaction has already committed locally, but might not have been replicated to the standby.';
  return 'dflt';
end $$;
alter table app.ledger alter column v set default public.sr_warn()`)
	for i, route := range castRoutes {
		t.Run(route, func(t *testing.T) {
			k := 9300 + i
			conn := c.connect(t, route, c.worker, &c.current)
			for _, q := range []string{
				"set fence.step = 'sr-" + route + "'",
				"begin",
				fmt.Sprintf("insert into app.ledger (k, job_key) values (%d, 'job')", k),
				"commit",
			} {
				_, err := conn.Exec(ctxT(t), q).ReadAll()
				if got := pgtest.SQLState(err); got == fence.CodeUnconfirmed {
					t.Fatalf("%s: the owner's warning answered as %s: %v", q, fence.CodeUnconfirmed, err)
				} else if err != nil {
					t.Fatalf("%s: %v", q, err)
				}
			}
			if n := c.count(t, "select count(*) from app.ledger where k = $1", k); n != 1 {
				t.Fatalf("%d rows committed, want 1", n)
			}
		})
	}
}
