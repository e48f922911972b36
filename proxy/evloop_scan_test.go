//go:build linux

package proxy

import (
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/pgfence/pgfence/internal/wire"
)

// serverResponseBytes is what PostgreSQL answers pipelineBytes(n) with:
// pgbench -M extended's select-only transaction, repeated.
func serverResponseBytes(n int) []byte {
	var b []byte
	for range n {
		b, _ = (&pgproto3.ParseComplete{}).Encode(b)
		b, _ = (&pgproto3.BindComplete{}).Encode(b)
		b, _ = (&pgproto3.RowDescription{Fields: []pgproto3.FieldDescription{{Name: []byte("abalance"), DataTypeOID: 23, DataTypeSize: 4, TypeModifier: -1}}}).Encode(b)
		b, _ = (&pgproto3.DataRow{Values: [][]byte{[]byte("0")}}).Encode(b)
		b, _ = (&pgproto3.CommandComplete{CommandTag: []byte("SELECT 1")}).Encode(b)
		b, _ = (&pgproto3.ReadyForQuery{TxStatus: 'I'}).Encode(b)
	}
	return b
}

// benchmarkLoopScan feeds in to the event loop's pass-through framing
// check (relay.take) in reads of the pipe's size, as pump does, and
// empties the pipe after each as flush does once the destination took
// everything.
func benchmarkLoopScan(b *testing.B, in []byte, fromClient bool) {
	r := &relay{s: &Session{srv: &Server{}}}
	p := &pipe{fromClient: fromClient, buf: make([]byte, 32<<10), sc: wire.Scanner{From: "server"}}
	if fromClient {
		p.sc = wire.Scanner{From: "client", Client: true}
	}
	b.SetBytes(int64(len(in)))
	b.ReportAllocs()
	for b.Loop() {
		for off := 0; off < len(in); {
			n := copy(p.buf[p.end+p.heldBack:], in[off:])
			off += n
			if err := r.take(p, n); err != nil {
				b.Fatal(err)
			}
			if p.heldBack > 0 {
				copy(p.buf, p.buf[p.end:p.end+p.heldBack])
			}
			p.start, p.end = 0, 0
		}
	}
}

func BenchmarkLoopScanClient(b *testing.B) { benchmarkLoopScan(b, pipelineBytes(1000), true) }
func BenchmarkLoopScanServer(b *testing.B) { benchmarkLoopScan(b, serverResponseBytes(1000), false) }
