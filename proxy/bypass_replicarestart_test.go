package proxy

import (
	"testing"

	"github.com/pgfence/pgfence/fence"
)

// TestBypass/replica_restart (issue 30, round 9, attacker R's untried
// idea): the replica poller kept the highest replay position it had ever
// seen. A standby that crash-restarts (or is rebuilt) can open for hot
// standby behind where it was; the proxy still believed the old position
// and routed reads that need the newer one to it. Here the proxy is made
// to believe the paused replica is far ahead (what it would have kept
// from the standby's earlier life); the next poll must replace that with
// what the replica reports, and a read after B's takeover must not serve
// A's result from it.
//
// Only through the proxy: the poller is the proxy's.
func init() { registerBypass("replica_restart", testBypassReplicaRestart) }

func testBypassReplicaRestart(t *testing.T) {
	ctx := ctxT(t)
	sc := newReadsScene(t, false, readsSchema, nil, nil)
	r := sc.e.proxy.srv.rs.list[0]
	rconn, err := cluster.Replica.Connect(ctx, sc.e.db)
	if err != nil {
		t.Fatal(err)
	}
	defer rconn.Close(ctx)
	var text string
	if err := rconn.QueryRow(ctx, "SELECT pg_last_wal_replay_lsn()::text").Scan(&text); err != nil {
		t.Fatal(err)
	}
	real, err := parseLSN(text)
	if err != nil {
		t.Fatal(err)
	}
	// The position of an earlier life, past B's takeover.
	r.replay.Store(uint64(real + 1<<30))
	t.Run("poller_forgets", func(t *testing.T) {
		for range 2 { // a poll that began before the Store may answer first
			if _, err := r.refresh(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if got := LSN(r.replay.Load()); got > real {
			t.Fatalf("the proxy believes the replica replayed %s; it reports %s (replay paused)", got, real)
		}
	})
	t.Run("read_after_restart", func(t *testing.T) {
		readsCheck(t, sc.nometa("pending")(t), readsCase{sql: "SELECT payload FROM results WHERE job_key = 'job'", code: fence.CodePending})
	})
	t.Run("read_generation_after_restart", func(t *testing.T) {
		readsCheck(t, sc.gen("pending")(t), readsCase{sql: "SELECT payload FROM results WHERE job_key = 'job'", code: fence.CodePending})
	})
	sc.unchanged(t)
}
