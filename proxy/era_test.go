package proxy

import "testing"

// BenchmarkEraOK is what the era check costs a read that may go to a
// replica (era.go): the replica has shown the primary's era.
func BenchmarkEraOK(b *testing.B) {
	c := &catalog{db: "db"}
	e := primaryEra{era: 2, timeline: 2, began: "2026-01-01 00:00:00.000000", known: true}
	c.era.Store(&e)
	r := &replica{kick: make(chan struct{}, 1)}
	r.gen.Store(1)
	m := map[eraKey]uint64{{"db", e}: 1}
	r.erasOK.Store(&m)
	h := &fenceSession{cat: c}
	b.ReportAllocs()
	for b.Loop() {
		if !h.eraOK(r) {
			b.Fatal("not ok")
		}
	}
}

// TestEraOK: a replica serves a database's position-bound reads only with
// the primary's era shown on its current poller connection; a database
// without eras is not checked, an unknown era confirms none, and an
// unconfirmed era is asked for once.
func TestEraOK(t *testing.T) {
	c := &catalog{db: "db"}
	r := &replica{kick: make(chan struct{}, 1)}
	r.gen.Store(1)
	h := &fenceSession{cat: c}
	if !h.eraOK(r) {
		t.Fatal("a database without eras: want ok")
	}
	c.era.Store(&primaryEra{})
	if h.eraOK(r) {
		t.Fatal("an unknown era: want not ok")
	}
	e := primaryEra{era: 2, timeline: 2, began: "x", known: true}
	c.era.Store(&e)
	if h.eraOK(r) {
		t.Fatal("an era not shown: want not ok")
	}
	if _, ok := r.eraWant[eraKey{"db", e}]; !ok || len(r.kick) != 1 {
		t.Fatalf("an era not shown is asked for: want %v, kick %d", r.eraWant, len(r.kick))
	}
	m := map[eraKey]uint64{{"db", e}: 1}
	r.erasOK.Store(&m)
	if !h.eraOK(r) {
		t.Fatal("an era shown: want ok")
	}
	r.gen.Add(1) // the poller reconnected
	if h.eraOK(r) {
		t.Fatal("an era shown on an earlier poller connection: want not ok")
	}
	old := primaryEra{era: 1, timeline: 1, began: "y", known: true}
	m = map[eraKey]uint64{{"db", old}: 2}
	r.erasOK.Store(&m)
	if h.eraOK(r) {
		t.Fatal("an earlier era shown: want not ok")
	}
}
