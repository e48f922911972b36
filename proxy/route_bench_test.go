package proxy

import (
	"testing"

	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/session"
)

// BenchmarkRequire is read routing's decision for one read (require): no
// round trip, only the catalog's cached sets and the takeover tracker.
func BenchmarkRequire(b *testing.B) {
	cat := &catalog{}
	cat.prot.Store(rewrite.NewProtected([]rewrite.RelName{{Schema: "public", Name: "pgbench_accounts"}}))
	cat.live.Store(true)
	cat.tk.update("job", takeover{token: 5, lsn: 100})
	cat.tk.raise(100)
	res, err := rewrite.Classify("SELECT abalance FROM pgbench_accounts WHERE aid = 1")
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		params map[string]string
	}{
		{"no_metadata", map[string]string{}},
		{"generation", map[string]string{"options": "-c fence.job_key=job -c fence.token=5"}},
	} {
		b.Run(c.name, func(b *testing.B) {
			st, err := session.New(c.params, nil)
			if err != nil {
				b.Fatal(err)
			}
			h := &fenceSession{cat: cat, st: st}
			b.ReportAllocs()
			for b.Loop() {
				if _, p, _ := h.require(res.Stmts, autoRead); !p {
					b.Fatal("not protected")
				}
			}
		})
	}
}

// BenchmarkSessionKnown is what round 5's fixes add to a read routed to
// the replica while nothing ran code on the primary (the common path):
// sessionKnown's check, no round trip.
func BenchmarkSessionKnown(b *testing.B) {
	h := &fenceSession{}
	h.rt.replicaCode = 7 // reads on the replica ran code: nothing to do for the primary
	b.ReportAllocs()
	for b.Loop() {
		if ok, err := h.sessionKnown(nil, false); !ok || err != nil {
			b.Fatal("not known")
		}
	}
}
