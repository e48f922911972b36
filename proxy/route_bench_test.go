package proxy

import (
	"math"
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
	cat.tk.fresh.Store(math.MaxInt64) // a marker came back, and stays current throughout
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
				if _, p := h.require(res.Stmts, autoRead, anyReplay); !p {
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
	h.rt.replicaCode = 7                                 // reads on the replica ran code: nothing to do for the primary
	h.defaults, h.defaultsKnown = "search_path=sp", true // read with the session's first routed read (round 6)
	b.ReportAllocs()
	for b.Loop() {
		if ok, err := h.sessionKnown(nil, false); !ok || err != nil {
			b.Fatal("not known")
		}
	}
}

// defaultsConn is a gateConn with a replica connection that read defaults.
type defaultsConn struct {
	gateConn
	defaults string
}

func (c defaultsConn) replicaDefaults() (string, bool) { return c.defaults, true }

// BenchmarkReplicaAgrees is what round 6 adds to every read routed to the
// replica: the comparison of the replica connection's defaults with the
// primary session's, read once per session.
func BenchmarkReplicaAgrees(b *testing.B) {
	h := &fenceSession{}
	h.defaults, h.defaultsKnown = "search_path=sp, public statement_timeout=5s", true
	s := defaultsConn{defaults: "search_path=sp, public statement_timeout=5s"}
	b.ReportAllocs()
	for b.Loop() {
		if !h.replicaAgrees(s) {
			b.Fatal("differ")
		}
	}
}

// BenchmarkHeldKnown is what round 8 (attacker P's H2, H3) adds to a read
// routed to the replica: heldKnown's check of the session's held-cursor
// floor. The common paths send nothing (a nil gateConn: any round trip
// would panic): no floor, and a floor no takeover has passed since (an
// untracked database, where every relation read may run code, and a
// session that read on the replica before).
func BenchmarkHeldKnown(b *testing.B) {
	cat := &catalog{}
	cat.prot.Store(rewrite.NewProtected([]rewrite.RelName{{Schema: "public", Name: "pgbench_accounts"}}))
	cat.live.Store(true)
	cat.tk.update("job", takeover{token: 5, lsn: 100})
	cat.tk.raise(100)
	cat.tk.fresh.Store(math.MaxInt64) // a marker came back, and stays current throughout
	res, err := rewrite.Classify("SELECT abalance FROM pgbench_accounts WHERE aid = 1")
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name  string
		floor LSN
	}{{"no_floor", 0}, {"floor_current", 150}} {
		b.Run(c.name, func(b *testing.B) {
			st, err := session.New(map[string]string{}, nil)
			if err != nil {
				b.Fatal(err)
			}
			h := &fenceSession{cat: cat, st: st}
			h.rt.holdFloor = c.floor
			b.ReportAllocs()
			for b.Loop() {
				if err := h.heldKnown(nil, &replica{}, res.Stmts, autoRead, func(ok bool) error {
					if !ok {
						b.Fatal("not ok")
					}
					return nil
				}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
