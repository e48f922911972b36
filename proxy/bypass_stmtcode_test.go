package proxy

import (
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("stmt_code", bypassStmtCode) }

// bypassStmtCode (round 5, attacker K's H2): code the proxy cannot see
// into (a DO block, a function) run on the replica connection replaced a
// named statement the proxy had copied there, and the next Bind of the
// name was judged as the copy (a harmless SET) while the replica ran the
// code's version, a read of the previous generation. After such code
// the proxy's knowledge of the statements on that connection is void:
// the next use closes and copies them again.
func bypassStmtCode(t *testing.T) {
	const set = "SET LOCAL statement_timeout = 0"
	cases := []struct{ name, code string }{
		{"do_block", "DO $$ BEGIN EXECUTE 'deallocate s1'; EXECUTE $q$prepare s1 as " + l4Read + "$q$; END $$"},
		{"function", "SELECT l4_swap()"},
		{"function_in_from", "SELECT * FROM l4_swap()"},
	}
	var readers []l4Reader
	newReadsScene(t, false, readsSchema, func(sc *readsScene) {
		execOK(t, sc.direct, "CREATE FUNCTION l4_swap() RETURNS int LANGUAGE plpgsql AS $f$ BEGIN EXECUTE 'deallocate s1'; EXECUTE $q$prepare s1 as "+l4Read+"$q$; RETURN 1; END $f$")
	}, func(sc *readsScene) {
		for _, k := range cases {
			c := sc.e.reader(t, nil, "-c fence.read_policy=pending", "-c fence.read_wait=50ms")
			stmtBatch(t, c, &pgproto3.Parse{Name: "s1", Query: set})
			// Set-up: a transaction refused FN007 (the takeover
			// watcher's marker not back within the wait, under load:
			// the fail-closed answer) is tried again.
			for attempt := 0; ; attempt++ {
				l4RoTx(t, c, k.name)
				// s1 is copied to the replica and run there.
				stmtBatch(t, c, &pgproto3.Bind{PreparedStatement: "s1"}, &pgproto3.Execute{})
				_, err := c.Exec(ctxT(t), k.code).ReadAll()
				if err == nil {
					break
				}
				if pgtest.SQLState(err) != fence.CodePending || attempt == 50 {
					t.Fatalf("%s: %v", k.code, err)
				}
				c.Exec(ctxT(t), "ROLLBACK").ReadAll()
			}
			readers = append(readers, l4Reader{k.name, c, []pgproto3.FrontendMessage{
				&pgproto3.Bind{PreparedStatement: "s1"}, &pgproto3.Describe{ObjectType: 'P'}, &pgproto3.Execute{}}})
		}
	})
	l4Check(t, readers)
}
