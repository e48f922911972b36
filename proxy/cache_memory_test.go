package proxy

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
)

// liveHeap is the test process's live heap after a collection.
func liveHeap() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// TestGateCachesBoundedByBytes (issue 30): the write gate's classifier and
// plan caches are bounded by the bytes their entries cost, within
// memory_budget (an eighth of it by default), not by a number of entries:
// one session's hundreds of distinct large statements leave, once it has
// ended, a heap within the bound (it left 237 MB for 400 of 200 KB with a
// bound of 10,000 entries), the evictions are counted, and a client
// message that needs the memory the caches hold makes them give way.
// Not parallel: it measures the process's heap.
func TestGateCachesBoundedByBytes(t *testing.T) {
	const budget = 64 << 20 // caches: 8 MiB
	// ClientMemory: the whole budget, so that one session's message can
	// need what the caches hold.
	p := startProxy(t, withConsole(Config{MemoryBudget: budget, ClientMemory: budget, Interceptor: newGate(t)}))
	db := cluster.NewDatabase(t)
	c := connect(t, p.dsn(db))
	mustExec(t, c, "SELECT 1")
	before := liveHeap()

	// 300 distinct reads of 20 KB: their parse trees take 700 KB each.
	for i := range 300 {
		var b strings.Builder
		fmt.Fprintf(&b, "SELECT c%d.oid FROM pg_class c%d WHERE c%d.oid IN (", i, i, i)
		for j := 0; b.Len() < 20<<10; j++ {
			fmt.Fprintf(&b, "%d,", j)
		}
		b.WriteString("0)")
		mustExec(t, c, b.String())
	}
	c.Close(ctxT(t))
	grew := liveHeap() - before
	if limit := int64(budget/8 + 8<<20); grew > limit {
		t.Errorf("after a session of 300 distinct 20 KB statements the heap grew by %d bytes, want at most %d (the caches' 8 MiB and 8 MiB for the rest)", grew, limit)
	}
	adm, err := consoleConnect(t, p, "admin", consolePassword("admin"))
	if err != nil {
		t.Fatal(err)
	}
	st := stats(t, adm)
	if st["cache_bytes"] == 0 || st["cache_bytes"] > budget/8 || st["cache_evictions"] == 0 {
		t.Errorf("SHOW FENCE_STATS: cache_bytes %d, cache_evictions %d; want some bytes, at most %d, and evictions", st["cache_bytes"], st["cache_evictions"], budget/8)
	}

	// A message that fits the budget only without some of what the caches
	// hold: they give way (7.25 MiB held costs 58 of the 64 MiB, the
	// caches hold about 8).
	c = connect(t, p.dsn(db))
	q := "SELECT length('" + strings.Repeat("x", 7<<20+256<<10) + "')"
	res, err := c.Exec(ctxT(t), q).ReadAll()
	if err != nil || string(res[0].Rows[0][0]) != fmt.Sprint(7<<20+256<<10) {
		t.Fatalf("a message that fits the budget without the caches: %v", err)
	}
	if got, most := stats(t, adm)["cache_bytes"], budget-heldCost(len(q)+1); got > most {
		t.Errorf("cache_bytes %d after the large message (was %d), want at most %d: the caches give way", got, st["cache_bytes"], most)
	}
}
