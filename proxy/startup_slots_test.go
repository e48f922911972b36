package proxy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestStartupSlots: connections that never authenticate cannot keep
// authenticated clients or the admin console out (issue 30, B-M4). The
// attacker's form: many sockets send a startup packet and stall in SCRAM;
// before, each counted against max_clients for startup_timeout, and a
// real login and the console got 53300. Now they count against
// max_startup_clients only, where the one that has waited longest makes
// room for a newcomer (53300 naming max_startup_clients), max_clients
// counts authenticated sessions, and the console counts against neither.
func TestStartupSlots(t *testing.T) {
	const maxClients, maxStartup, stalled = 2, 4, 20
	ae := newAuthEnv(t, withConsole(Config{MaxClients: maxClients, MaxStartupClients: maxStartup}))
	evicted0 := ae.p.srv.ops.stats.StartupEvictions.Load()
	var stalls []*rawConn
	for range stalled {
		stalls = append(stalls, ae.scramStart(t, "auth_alice")) // and stop
	}
	if got := ae.p.srv.startupCount(); got != maxStartup {
		t.Fatalf("connections in startup: got %d, want %d", got, maxStartup)
	}
	if got := ae.p.srv.ops.stats.StartupEvictions.Load() - evicted0; got != stalled-maxStartup {
		t.Fatalf("evicted: got %d, want %d", got, stalled-maxStartup)
	}
	// The oldest were told why.
	code, msg := stalls[0].closedWithMessage(t)
	if code != "53300" || !strings.Contains(msg, "max_startup_clients") {
		t.Fatalf("an evicted connection: got %q %q, want 53300 naming max_startup_clients", code, msg)
	}
	// Real logins get in, up to max_clients, while the stalls go on.
	for i := range maxClients {
		if err := ae.try(t, "auth_alice", "alice-pw"); err != nil {
			t.Fatalf("login %d beside %d stalled connections: %v", i, stalled, err)
		}
	}
	// The console too, with max_clients sessions open.
	dsn := fmt.Sprintf("postgres://auth_alice:alice-pw@127.0.0.1:%d/%s?sslmode=disable", ae.p.addr.Port, ae.db)
	for range maxClients {
		connect(t, dsn)
	}
	if err := ae.try(t, "auth_alice", "alice-pw"); pgtest.SQLState(err) != "53300" {
		t.Fatalf("a login over max_clients: got %v, want 53300", err)
	}
	con, err := consoleConnect(t, ae.p, "admin", consolePassword("admin"))
	if err != nil {
		t.Fatalf("the console with max_clients sessions and %d stalled connections: %v", maxStartup, err)
	}
	if _, err := con.Exec(ctxT(t), "SHOW CONFIG"); err != nil {
		t.Fatal(err)
	}
}
