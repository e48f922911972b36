package proxy

import (
	"errors"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
)

// TestPipelineBackpressure: a client that pipelines requests and reads no
// answers is stopped being read, as PostgreSQL stops reading a client that
// does not read (it blocks on send), so the proxy's memory stays bounded
// (issue 30, B-M3: Close('S', 'x') written nonstop took the proxy from 82
// to 600 MB and rising). Through the write gate: the client's writes stall
// after a bounded number of bytes (the sockets' buffers and the proxy's
// fixed ones), and the heap does not grow with what it tries to send;
// the same without the gate.
func TestPipelineBackpressure(t *testing.T) {
	t.Run("gate", func(t *testing.T) { testPipelineBackpressure(t, Config{Interceptor: newGate(t)}) })
	t.Run("pass_through", func(t *testing.T) { testPipelineBackpressure(t, Config{}) })
}

func testPipelineBackpressure(t *testing.T, cfg Config) {
	p := startProxy(t, cfg)
	db := cluster.NewDatabase(t)
	r := rawConnect(t, p.dsn(db))
	var close1 []byte
	for range 1024 {
		close1, _ = (&pgproto3.Close{ObjectType: 'S', Name: "x"}).Encode(close1)
	}
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	const tries = 64 << 20
	sent := 0
	for sent < tries {
		r.SetWriteDeadline(time.Now().Add(3 * time.Second))
		n, err := r.Write(close1)
		sent += n
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			break // stalled: the proxy stopped reading
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	runtime.GC()
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	t.Logf("sent %d bytes before the writes stalled; heap %d -> %d", sent, before.HeapAlloc, after.HeapAlloc)
	if sent >= tries {
		t.Fatalf("the proxy took all %d bytes of requests whose answers nobody read", sent)
	}
	if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > 32<<20 {
		t.Fatalf("the heap grew by %d bytes for requests whose answers nobody read", grew)
	}
}
