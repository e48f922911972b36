//go:build linux

package proxy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// holdingReplica is a replica address in front of the test cluster's
// replica: it passes the proxy's replica poller through, so the replica
// is healthy and reads are routed, and holds every other connection (a
// session's dial) after its startup message, answering nothing, as a
// replica that accepts TCP but hangs does. held receives each connection
// it holds.
type holdingReplica struct {
	ln   net.Listener
	held chan net.Conn
}

func newHoldingReplica(t *testing.T) *holdingReplica {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := &holdingReplica{ln: ln, held: make(chan net.Conn, 16)}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go h.serve(t, c)
		}
	}()
	return h
}

// dsn is the address's DSN for Config.Replicas, with a connect timeout
// far beyond the test's: only the session's end can stop a held dial.
func (h *holdingReplica) dsn() string {
	return fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable&connect_timeout=3600", h.ln.Addr())
}

func (h *holdingReplica) serve(t *testing.T, c net.Conn) {
	startup, params, err := readStartup(c)
	if err != nil {
		c.Close()
		return
	}
	if params["application_name"] != pollerAppName {
		h.held <- c // the test closes it, or the proxy does
		return
	}
	up, err := net.Dial("tcp", cluster.Replica.Addr())
	if err != nil {
		c.Close()
		return
	}
	if _, err := up.Write(startup); err != nil {
		c.Close()
		up.Close()
		return
	}
	go func() { io.Copy(up, c); up.Close() }()
	io.Copy(c, up)
	c.Close()
}

// readStartup reads a startup message (sslmode=disable: no SSLRequest
// comes first) and returns its bytes and parameters.
func readStartup(c net.Conn) ([]byte, map[string]string, error) {
	var head [4]byte
	if _, err := io.ReadFull(c, head[:]); err != nil {
		return nil, nil, err
	}
	n := binary.BigEndian.Uint32(head[:])
	if n < 8 || n > 1<<16 {
		return nil, nil, errors.New("bad startup length")
	}
	msg := make([]byte, n)
	copy(msg, head[:])
	if _, err := io.ReadFull(c, msg[4:]); err != nil {
		return nil, nil, err
	}
	var sm pgproto3.StartupMessage
	if err := sm.Decode(msg[4:]); err != nil {
		return nil, nil, err
	}
	return msg, sm.Parameters, nil
}

// dialReplicaRunning reports whether a session's replica dial is still
// running on some goroutine.
func dialReplicaRunning() bool {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Contains(string(buf[:n]), "(*Session).useReplica.func") // its dial closure
		}
		buf = make([]byte, 2*len(buf))
	}
}

// TestReplicaDialEndsWithSession: a routed session whose replica accepts
// TCP but never answers is reset by its client while its replica dial
// (off the loop, detached) is held. The dial gives up with the session:
// its goroutine returns and the held connection is closed at once, not
// at ConnectTimeout (an hour here, so without the cancellation the held
// side sees nothing before the test's deadline).
func TestReplicaDialEndsWithSession(t *testing.T) {
	h := newHoldingReplica(t)
	e := newRouteEnvReplica(t, Config{}, h.dsn())
	ctx := ctxT(t)
	c := e.reader(t, nil)
	s := sessionOf(t, e.proxy, c)
	res := readAsync(t, c, "SELECT 1, pg_is_in_recovery()")

	var held net.Conn
	select {
	case held = <-h.held:
	case a := <-res:
		t.Fatalf("read answered (%v, %v) without dialing the replica", a.rs, a.err)
	case <-ctx.Done():
		t.Fatal("the session never dialed the replica")
	}
	defer held.Close()
	if !dialReplicaRunning() {
		t.Fatal("no replica dial running while its connection is held")
	}

	c.Conn().(*net.TCPConn).SetLinger(0)
	c.Conn().Close()
	<-res

	// The held side sees the proxy close the dialed connection.
	deadline, _ := ctx.Deadline()
	held.SetReadDeadline(deadline)
	var b [1]byte
	if _, err := held.Read(b[:]); !errors.Is(err, io.EOF) {
		t.Fatalf("held replica connection: read %v, want EOF (the dial closing it at the session's end)", err)
	}
	if err := pgtest.Poll(ctx, func() (bool, error) { return !dialReplicaRunning(), nil }); err != nil {
		t.Fatalf("the replica dial outlived its session: %v", err)
	}
	if err := pgtest.Poll(ctx, func() (bool, error) {
		for _, ss := range e.proxy.srv.sessions() {
			if ss == s {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Fatalf("the session outlived its client's reset: %v", err)
	}
}
