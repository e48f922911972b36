package rewrite

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/lru"
)

// inList is a distinct read of about size bytes: a one-table select with
// an IN list (its parse tree takes about 35 times its text on the heap).
func inList(i, size int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "SELECT * FROM t%d WHERE id IN (", i)
	for j := 0; b.Len() < size; j++ {
		fmt.Fprintf(&b, "%d,", j)
	}
	b.WriteString("0)")
	return b.String()
}

// insertValues is a distinct write of about size bytes, whose tree a
// cached entry keeps (Canonical).
func insertValues(i, size int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "INSERT INTO t%d VALUES ", i)
	for j := 0; b.Len() < size; j++ {
		fmt.Fprintf(&b, "(%d, 'abc', now()), ", j)
	}
	b.WriteString("(0, 'a', now())")
	return b.String()
}

// heapInUse is the live heap after a collection.
func heapInUse() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// TestClassifierCacheBytes: the caches are bounded by what their entries
// cost, not by their number: hundreds of distinct large statements leave a
// live heap within the bound (issue 30: 400 of 200 KB left 237 MB with a
// bound of 10,000 entries), the least recently used go first, and
// Canonical still deparses a cached write.
func TestClassifierCacheBytes(t *testing.T) {
	const bound = 1 << 20
	for _, tc := range []struct {
		name string
		gen  func(i, size int) string
		n    int
	}{{"reads", inList, 150}, {"writes", insertValues, 40}} {
		t.Run(tc.name, func(t *testing.T) {
			pool := lru.NewPool(bound)
			c := NewClassifier(pool)
			texts := make([]string, tc.n)
			for i := range texts {
				texts[i] = tc.gen(i, 10<<10)
			}
			before := heapInUse()
			for _, sql := range texts {
				if _, err := c.Classify(sql); err != nil {
					t.Fatal(err)
				}
			}
			grew := heapInUse() - before
			// The bound is an estimate: allow it a quarter more.
			if grew > bound*5/4 {
				t.Errorf("%d statements of 10 KB: the heap grew by %d bytes, want at most %d (the bound and a quarter)", tc.n, grew, bound*5/4)
			}
			if pool.Bytes() > bound || pool.Evictions() == 0 {
				t.Errorf("pool: %d bytes, %d evictions; want at most %d, and evictions", pool.Bytes(), pool.Evictions(), bound)
			}
			// The last is cached, the first evicted.
			last, _ := c.Classify(texts[len(texts)-1])
			if again, _ := c.Classify(texts[len(texts)-1]); again != last {
				t.Error("the most recent statement is not cached")
			}
			if c.cache.Len() == len(texts) {
				t.Error("every statement is cached")
			}
			if st := last.Stmts[0]; st.Writes() && !strings.HasPrefix(st.Canonical(), "INSERT INTO t39 VALUES (0, 'abc', now())") {
				t.Errorf("Canonical of a cached write: %.60q..., want the deparsed statement", st.Canonical())
			}
			runtime.KeepAlive(texts)
		})
	}
}

// A statement whose entry would cost more than the whole bound is
// classified, not cached, and evicts nothing.
func TestClassifierTooLargeToCache(t *testing.T) {
	pool := lru.NewPool(256 << 10)
	c := NewClassifier(pool)
	small := mustClassify(t, c, "SELECT 1 FROM t WHERE a = $1")
	// A read's entry costs about its text, a write's about 60 times.
	for _, sql := range []string{inList(0, 300<<10), insertValues(0, 10<<10)} {
		res, err := c.Classify(sql)
		if err != nil || len(res.Stmts) != 1 {
			t.Fatalf("Classify of a large statement: %v, %v", res, err)
		}
		if again, _ := c.Classify(sql); again == res {
			t.Errorf("a statement larger than the bound (%.30s...) is cached", sql)
		}
	}
	if again := mustClassify(t, c, "SELECT 1 FROM t WHERE a = $1"); again != small {
		t.Error("a statement too large to cache evicted the others")
	}
	if pool.Uncached() < 2 || pool.Evictions() != 0 {
		t.Errorf("Uncached %d, Evictions %d: want at least 2 and 0", pool.Uncached(), pool.Evictions())
	}
}
