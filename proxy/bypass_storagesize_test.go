package proxy

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func init() { registerBypass("storage_size", bypassStorageSize) }

// bypassStorageSize (round 8, attacker P's M1): pg_total_relation_size
// and pg_relation_size of a protected table name it only in a string: a
// read-only built-in whose answer is the size of the node's files, which
// grow with the protected rows. A lagging replica answered it to a reader
// carrying the new generation with the previous generation's size. These
// built-ins report the node's storage, as the statistics views do: they
// are session-local (rewrite/funcs.go), never read on a replica.
func bypassStorageSize(t *testing.T) {
	sc := newReadsScene(t, false, readsSchema, nil, nil)
	readers := []struct {
		name string
		c    func(t *testing.T) *pgconn.PgConn
	}{
		{"generation", sc.gen("primary")},
		{"nometa", func(t *testing.T) *pgconn.PgConn { return sc.e.reader(t, nil) }},
	}
	for _, r := range readers {
		for _, q := range []string{
			"SELECT pg_total_relation_size('results'), pg_is_in_recovery()",
			"SELECT pg_relation_size('results'), pg_is_in_recovery()",
			"SELECT pg_relation_size('public.results', 'main'), pg_is_in_recovery()",
			"SELECT pg_catalog.pg_total_relation_size('results'), pg_is_in_recovery()",
		} {
			t.Run(r.name+"/"+q, func(t *testing.T) {
				c := r.c(t)
				defer c.Close(context.Background())
				vals, rep, err := where(t, c, q)
				if err != nil {
					t.Fatal(err)
				}
				if rep {
					t.Fatalf("answered by the lagging replica: %v", vals)
				}
			})
		}
	}
}
