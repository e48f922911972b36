package rewrite

import (
	"strconv"
	"testing"
)

var benchQueries = []struct{ name, sql string }{
	{"upsert", "INSERT INTO results (job_key, token, payload) VALUES ($1, $2, $3) ON CONFLICT (job_key) DO UPDATE SET token = excluded.token, payload = excluded.payload WHERE results.token < excluded.token"},
	{"select", "SELECT abalance FROM pgbench_accounts WHERE aid = $1"},
	{"begin", "BEGIN"},
}

// BenchmarkClassifyUncached is the cost of a cache miss: parse, walk, no
// deparse.
func BenchmarkClassifyUncached(b *testing.B) {
	for _, q := range benchQueries {
		b.Run(q.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Classify(q.sql); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkCanonical is the deparse cost Canonical adds once per cached
// write statement.
func BenchmarkCanonical(b *testing.B) {
	b.ReportAllocs()
	sql := benchQueries[0].sql
	for b.Loop() {
		res, _ := Classify(sql)
		_ = res.Stmts[0].Canonical()
	}
}

// BenchmarkClassifyCached is the hot path: a cache hit.
func BenchmarkClassifyCached(b *testing.B) {
	for _, q := range benchQueries {
		b.Run(q.name, func(b *testing.B) {
			c := NewClassifier(nil)
			c.Classify(q.sql)
			b.ReportAllocs()
			for b.Loop() {
				c.Classify(q.sql)
			}
		})
	}
}

// BenchmarkClassifyCachedParallel measures the shared cache under
// concurrent sessions.
func BenchmarkClassifyCachedParallel(b *testing.B) {
	c := NewClassifier(nil)
	keys := make([]string, 64)
	for i := range keys {
		keys[i] = "SELECT * FROM t WHERE id = " + strconv.Itoa(i)
		c.Classify(keys[i])
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			c.Classify(keys[i%len(keys)])
			i++
		}
	})
}

// BenchmarkClassifyShape is a read whose literal changes every time (what
// pgbench -S and ORMs that inline values send): an exact-text miss served
// by the shape cache instead of a parse.
func BenchmarkClassifyShape(b *testing.B) {
	c := NewClassifier(nil)
	texts := make([]string, 4096)
	for i := range texts {
		texts[i] = "SELECT abalance FROM pgbench_accounts WHERE aid = " + strconv.Itoa(100000+i*7919)
	}
	c.Classify(texts[0])
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if _, err := c.Classify(texts[i%len(texts)]); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

// BenchmarkClassifyFenceStep: a worker's "BEGIN; SET LOCAL fence.step =
// '...'", a new text every transaction, through ClassifyShared (the
// gate's path): one parse per shape, then the value is put in.
func BenchmarkClassifyFenceStep(b *testing.B) {
	c := NewClassifier(nil)
	texts := make([]string, 4096)
	for i := range texts {
		texts[i] = "BEGIN; SET LOCAL fence.step = 'nightly-" + strconv.Itoa(100000+i*7919) + "'"
	}
	c.ClassifyShared(texts[0])
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if _, _, err := c.ClassifyShared(texts[i%len(texts)]); err != nil {
			b.Fatal(err)
		}
		i++
	}
}
