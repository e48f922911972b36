package proxy

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("snapshot_import", bypassSnapshotImport) }

// bypassSnapshotImport (round 8, attacker P's H1): a read-only
// transaction judged against the replica's replay position imported, by
// SET TRANSACTION SNAPSHOT, a snapshot exported on the replica before the
// takeover, and read the previous generation, whatever the reader
// carried (B's generation, fence.min_lsn, nothing), by either protocol.
// A snapshot whose age the proxy does not know is judged as the oldest:
// FN007 for every reader that needs anything.
//
// The replica has replayed the takeover when the readers begin (their
// transactions begin on it, judged current); the exporter (straight on
// the replica, or through the proxy) holds A's snapshot open.
func bypassSnapshotImport(t *testing.T) {
	ctx := ctxT(t)
	var direct, proxied string
	var keep []*pgx.Conn
	var keepProxied *pgconn.PgConn
	sc := newReadsScene(t, false, readsSchema, nil, func(sc *readsScene) {
		c, err := cluster.Replica.Connect(ctx, sc.e.db)
		if err != nil {
			t.Fatal(err)
		}
		keep = append(keep, c)
		if _, err := c.Exec(ctx, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"); err != nil {
			t.Fatal(err)
		}
		var payload string
		if err := c.QueryRow(ctx, "SELECT pg_export_snapshot(), payload FROM results WHERE job_key = 'job'").Scan(&direct, &payload); err != nil || payload != "A" {
			t.Fatalf("export on the replica: %q %v", payload, err)
		}
		// Through the proxy: a read-only transaction on the replica.
		keepProxied = sc.e.reader(t, nil)
		if err := pgtest.Poll(ctx, func() (bool, error) {
			stmtExec(t, keepProxied, "BEGIN READ ONLY ISOLATION LEVEL REPEATABLE READ")
			vals, rep, err := where(t, keepProxied, "SELECT pg_export_snapshot(), payload, pg_is_in_recovery() FROM results WHERE job_key = 'job'")
			if err != nil || rep {
				if rep {
					proxied = vals[0]
				}
				return rep, err
			}
			_, err = keepProxied.Exec(ctx, "ROLLBACK").ReadAll()
			return false, err
		}); err != nil {
			t.Fatal(err)
		}
	})
	defer func() {
		for _, c := range keep {
			c.Close(context.Background())
		}
	}()
	resumeAndCatchUp(t)
	lsn := waitProxyReplay(t, sc.e.proxy).String()
	readers := map[string]func(t *testing.T) *pgconn.PgConn{
		"generation": sc.gen("pending"),
		"min_lsn": func(t *testing.T) *pgconn.PgConn {
			return sc.e.reader(t, nil, "-c fence.min_lsn="+lsn, "-c fence.read_policy=pending")
		},
		"nometa": func(t *testing.T) *pgconn.PgConn { return sc.e.reader(t, nil, "-c fence.read_policy=pending") },
	}
	begin := "BEGIN READ ONLY ISOLATION LEVEL REPEATABLE READ"
	for _, rn := range []string{"generation", "min_lsn", "nometa"} {
		for _, src := range []string{"replica", "proxy"} {
			id := direct
			if src == "proxy" {
				id = proxied
			}
			set := fmt.Sprintf("SET TRANSACTION SNAPSHOT '%s'", id)
			t.Run(rn+"_simple_"+src, func(t *testing.T) {
				c := readers[rn](t)
				defer c.Close(context.Background())
				stmtExec(t, c, begin)
				res, err := c.Exec(ctx, set+"; "+l4Read).ReadAll()
				if err == nil {
					res, err = c.Exec(ctx, l4Read).ReadAll()
				}
				snapCheck(t, res, err)
			})
			t.Run(rn+"_separate_"+src, func(t *testing.T) {
				c := readers[rn](t)
				defer c.Close(context.Background())
				stmtExec(t, c, begin)
				res, err := c.Exec(ctx, set).ReadAll()
				if err == nil {
					res, err = c.Exec(ctx, l4Read).ReadAll()
				}
				snapCheck(t, res, err)
			})
			t.Run(rn+"_extended_"+src, func(t *testing.T) {
				c := readers[rn](t)
				defer c.Close(context.Background())
				stmtExec(t, c, begin)
				ms := stmtBatch(t, c, &pgproto3.Parse{Query: set}, &pgproto3.Bind{}, &pgproto3.Execute{},
					&pgproto3.Parse{Query: l4Read}, &pgproto3.Bind{}, &pgproto3.Execute{})
				refused := false
				for _, m := range ms {
					switch m := m.(type) {
					case *pgproto3.DataRow:
						for _, v := range m.Values {
							if string(v) == "A" {
								t.Fatalf("the previous generation's result was served after the takeover: %q", m.Values)
							}
						}
					case *pgproto3.ErrorResponse:
						if m.Code != fence.CodePending {
							t.Fatalf("%s %s, want %s", m.Code, m.Message, fence.CodePending)
						}
						refused = true
					}
				}
				if !refused {
					t.Fatalf("not refused: %v", ms)
				}
			})
		}
	}
	keepProxied.Close(context.Background())
}

// snapCheck: no row of A; refused with FN007 (not another error: a
// transaction that went to the primary would fail there with 22023).
func snapCheck(t *testing.T, res []*pgconn.Result, err error) {
	t.Helper()
	for _, r := range res {
		for _, row := range r.Rows {
			for _, v := range row {
				if string(v) == "A" {
					t.Fatalf("the previous generation's result was served after the takeover: %q", row)
				}
			}
		}
	}
	if err == nil {
		t.Fatalf("not refused: %v", res)
	}
	wantCode(t, err, fence.CodePending)
	_ = strings.TrimSpace
}
