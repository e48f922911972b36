package proxy

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"strconv"
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

// TestPipelineBackpressureReader: the bound of TestPipelineBackpressure
// never stalls a client that reads its answers while it writes (as pgx's
// pgconn does for a large batch: TestConnExecBatchHuge of pgx's own suite
// hung through the first version of the bound, which stopped reading the
// client with its last requests still in the proxy's buffer for the
// server, where PostgreSQL could not answer them). The whole batch is
// written in one go, its single Sync at the end, while another goroutine
// reads; each answer must come within readStall of the one before.
func TestPipelineBackpressureReader(t *testing.T) {
	closes := func(n int) []byte {
		var b []byte
		for range n {
			b, _ = (&pgproto3.Close{ObjectType: 'S', Name: "x"}).Encode(b)
		}
		return b
	}
	// pgconn's Batch.ExecParams: Parse, Bind, Describe, Execute.
	execs := func(n int) []byte {
		var b []byte
		for i := range n {
			b, _ = (&pgproto3.Parse{Query: "select $1::text"}).Encode(b)
			b, _ = (&pgproto3.Bind{Parameters: [][]byte{[]byte(strconv.Itoa(i))}}).Encode(b)
			b, _ = (&pgproto3.Describe{ObjectType: 'P'}).Encode(b)
			b, _ = (&pgproto3.Execute{}).Encode(b)
		}
		return b
	}
	for _, mode := range []struct {
		name string
		cfg  func() Config
	}{
		{"gate", func() Config { return Config{Interceptor: newGate(t)} }},
		{"pass_through", func() Config { return Config{} }},
	} {
		t.Run(mode.name, func(t *testing.T) {
			p := startProxy(t, mode.cfg())
			db := cluster.NewDatabase(t)
			for _, c := range []struct {
				name    string
				batch   []byte
				answers int // before the ReadyForQuery
			}{
				{"close", closes(200_000), 200_000},
				{"exec_params", execs(30_000), 30_000 * 5}, // ParseComplete, BindComplete, RowDescription, DataRow, CommandComplete
			} {
				t.Run(c.name, func(t *testing.T) {
					r := rawConnect(t, p.dsn(db))
					batch, _ := (&pgproto3.Sync{}).Encode(c.batch)
					got := make(chan error, 1)
					go func() { got <- readAnswers(r, c.answers) }()
					r.SetWriteDeadline(time.Now().Add(2 * time.Minute))
					if _, err := r.Write(batch); err != nil {
						t.Fatalf("writing the batch of %d bytes: %v (reading: %v)", len(batch), err, <-got)
					}
					if err := <-got; err != nil {
						t.Fatal(err)
					}
				})
			}
		})
	}
}

// readStall is how long readAnswers waits for the next answer.
const readStall = 30 * time.Second

// readAnswers reads answers up to the ReadyForQuery that ends the batch,
// and checks that there were want of them before it, none an error.
func readAnswers(r *rawConn, want int) error {
	br := bufio.NewReaderSize(r, 64<<10)
	var hdr [5]byte
	n := 0
	for {
		r.SetReadDeadline(time.Now().Add(readStall))
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			return fmt.Errorf("stalled or failed after %d of %d answers: %w", n, want, err)
		}
		body := make([]byte, int(binary.BigEndian.Uint32(hdr[1:]))-4)
		if _, err := io.ReadFull(br, body); err != nil {
			return fmt.Errorf("stalled or failed in answer %d of %d: %w", n, want, err)
		}
		switch hdr[0] {
		case 'Z':
			if n != want {
				return fmt.Errorf("got %d answers before ReadyForQuery, want %d", n, want)
			}
			return nil
		case 'E':
			return fmt.Errorf("answer %d: an error: %q", n, body)
		case 'N', 'S', 'A':
		default:
			n++
		}
	}
}
