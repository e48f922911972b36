package proxy

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func init() { registerBypass("relation_code", bypassRelationCode) }

// relCodeSchema: plain tables (readable by anyone, reading no protected
// table) whose reads run the database's code while they are planned: an
// index expression, a partial index's predicate, an extended statistics
// expression (the planner folds each, calling the immutable function), and
// an inheritance child's CHECK constraint (constraint exclusion folds it
// when the parent is read). The function reads the protected table and
// tells what it saw in a NOTICE.
const relCodeSchema = `
CREATE FUNCTION leak(int) RETURNS int LANGUAGE plpgsql IMMUTABLE
  AS $$ DECLARE p text; BEGIN SELECT payload INTO p FROM results WHERE job_key = 'job'; RAISE NOTICE 'leak: %', p; RETURN $1; END $$;
CREATE TABLE ix_t (id int); INSERT INTO ix_t VALUES (1); CREATE INDEX ix_t_leak ON ix_t ((leak(1) + id));
CREATE TABLE pi_t (id int); INSERT INTO pi_t VALUES (1); CREATE INDEX pi_t_leak ON pi_t (id) WHERE leak(2) > 0;
CREATE TABLE st_t (id int); INSERT INTO st_t VALUES (1); CREATE STATISTICS st_t_leak ON (leak(3) + id), id FROM st_t;
CREATE TABLE ck_parent (id int); CREATE TABLE ck_child (CHECK (leak(4) > 0)) INHERITS (ck_parent); INSERT INTO ck_child VALUES (1);
CREATE VIEW ix_v AS SELECT id FROM ix_t;
`

// bypassRelationCode (round 8, attacker P's H6): in a tracked database a
// read of a plain table that reads no protected table was eventual, and a
// lagging replica ran the function of the table's index expression (or
// partial index predicate, statistics expression, a child's CHECK) while
// planning it: the function read the previous generation there and told
// it to the reader (a NOTICE), whatever generation the reader carried. A
// relation whose objects (its indexes, statistics, constraints, defaults,
// policies, rules: pg_depend, not a list of kinds) depend on the
// database's code runs that code on every read: it is exposed, as a view
// calling a user function is.
func bypassRelationCode(t *testing.T) {
	sc := newReadsScene(t, true, readsSchema+relCodeSchema, nil, nil)
	type reader struct {
		name string
		opts []string
	}
	readers := []reader{
		{"nometa", []string{"-c fence.read_policy=primary"}},
		{"generation", opts("job", sc.b.Token, "-c fence.read_policy=primary")},
		{"pending", []string{"-c fence.read_policy=pending"}},
	}
	for _, r := range readers {
		for _, q := range []string{
			"SELECT count(*), pg_is_in_recovery() FROM ix_t",
			"SELECT count(*), pg_is_in_recovery() FROM pi_t WHERE id = 1",
			"SELECT count(*), pg_is_in_recovery() FROM st_t WHERE id = 1",
			"SELECT count(*), pg_is_in_recovery() FROM ck_parent WHERE id = 1",
			"SELECT count(*), pg_is_in_recovery() FROM ix_v",
		} {
			t.Run(r.name+"/"+q, func(t *testing.T) {
				var mu sync.Mutex
				var notices []string
				cfg, err := pgconn.ParseConfig(sc.e.proxy.dsn(sc.e.db))
				if err != nil {
					t.Fatal(err)
				}
				cfg.RuntimeParams["options"] = strings.Join(r.opts, " ")
				cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
					mu.Lock()
					notices = append(notices, n.Message)
					mu.Unlock()
				}
				c := connectConfig(t, cfg)
				defer c.Close(context.Background())
				vals, rep, err := where(t, c, q)
				mu.Lock()
				defer mu.Unlock()
				for _, n := range notices {
					if strings.Contains(n, "leak: A") {
						t.Fatalf("the table's code read the previous generation on the replica (%v, replica=%v): %s", vals, rep, n)
					}
				}
				if err != nil {
					wantCode(t, err, "FN007")
					return
				}
				if rep {
					t.Fatalf("answered by the lagging replica: %v %v", vals, notices)
				}
				if fmt.Sprint(notices) == "[]" {
					t.Logf("no notice (the planner did not fold the code): %v", vals)
				}
			})
		}
	}
}
