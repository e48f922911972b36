package proxy

import (
	"testing"
	"time"
)

// TestOptionalInterfacesNotType: the console, the metrics and read
// routing find what they need of an interceptor through the optional
// interfaces (optional.go), not its type: an interceptor of another type
// that implements them (here one that wraps the gate) gets read routing
// and the gate's counters too.
func TestOptionalInterfacesNotType(t *testing.T) {
	type wrapped struct{ *Fence }
	db := cluster.NewDatabaseWith(t, ddlTriggerSQL+fenceSchema)
	if err := cluster.WaitReplicaCaughtUp(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	gate := newGate(t)
	p := startProxy(t, Config{Interceptor: wrapped{gate}, Replicas: []string{cluster.Replica.DSN("postgres")},
		ReplicaPoll: 10 * time.Millisecond, ReplicaMaxLag: time.Minute})
	if p.srv.rs == nil {
		t.Fatal("read routing is off for an interceptor that is a ReadRouter but not a *Fence")
	}
	connect(t, p.dsn(db))
	waitHealthy(t, p)
	waitCatalogReplayed(t, p, gate, db)
	e := &routeEnv{&fenceEnv{db: db, proxy: p, gate: gate}}
	r := e.reader(t, nil)
	mustWhere(t, r, "SELECT count(*), pg_is_in_recovery() FROM audit", true)
	mustExec(t, r, "INSERT INTO audit (note) VALUES ('w')")
	if fs := p.srv.gateStats(); fs != &gate.Stats {
		t.Fatalf("gate counters: got %p, want the gate's %p", fs, &gate.Stats)
	}
	if n := gate.Stats.Classified.Load(); n == 0 {
		t.Fatal("the wrapped gate classified nothing")
	}
}
