package proxy

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"
)

func init() { registerBypass("portals_kept", bypassPortalsKept) }

// bypassPortalsKept (issue 30, round 2, attacker F's M2): a client that
// binds named portals with large parameters and never closes them had
// every copy kept for the session's life, while PostgreSQL drops portals
// when their transaction ends. Now the proxy keeps only the portals that
// may still exist.
func bypassPortalsKept(t *testing.T) {
	e := newReservedEnv(t)
	conn := e.encConn(t, "UTF8")
	fe := conn.Frontend()
	param := make([]byte, 64<<10)
	for i := range param {
		param[i] = 'x'
	}
	const batches, per = 20, 20
	for b := 0; b < batches; b++ {
		fe.Send(&pgproto3.Parse{Query: "SELECT length($1::text)"})
		for i := 0; i < per; i++ {
			fe.Send(&pgproto3.Bind{DestinationPortal: fmt.Sprintf("p%d_%d", b, i), Parameters: [][]byte{param}})
		}
		fe.Send(&pgproto3.Sync{}) // the implicit transaction ends: its portals with it
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		for {
			m, err := fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			if e, ok := m.(*pgproto3.ErrorResponse); ok {
				t.Fatalf("batch %d: %s", b, e.Message)
			}
			if _, ok := m.(*pgproto3.ReadyForQuery); ok {
				break
			}
		}
	}
	var kept int64 = -1
	e.gate.idle.mu.Lock()
	for h := range e.gate.idle.sessions {
		if n := h.portalsKept.Load(); n > kept {
			kept = n
		}
	}
	e.gate.idle.mu.Unlock()
	if kept < 0 || kept > portalsPruned+per {
		t.Fatalf("%d client portals kept after %d transactions of %d named portals each, want at most %d", kept, batches, per, portalsPruned+per)
	}
}
