//go:build unix

package proxy

import (
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/pgfence/pgfence/internal/wire"
)

// pgbenchExchange is pgbench -M extended's select-only transaction,
// repeated n times: the client's stream (Parse, Bind, Describe, Execute,
// Sync) and PostgreSQL's answer to it.
func pgbenchExchange(n int) (client, server []byte) {
	row := &pgproto3.RowDescription{Fields: []pgproto3.FieldDescription{{Name: []byte("abalance"), DataTypeOID: 23, DataTypeSize: 4, TypeModifier: -1}}}
	for range n {
		for _, m := range []pgproto3.FrontendMessage{
			&pgproto3.Parse{Query: "SELECT abalance FROM pgbench_accounts WHERE aid = $1"},
			&pgproto3.Bind{Parameters: [][]byte{[]byte("12345")}},
			&pgproto3.Describe{ObjectType: 'P'}, &pgproto3.Execute{}, &pgproto3.Sync{},
		} {
			client, _ = m.Encode(client)
		}
		for _, m := range []pgproto3.BackendMessage{
			&pgproto3.ParseComplete{}, &pgproto3.BindComplete{}, row,
			&pgproto3.DataRow{Values: [][]byte{[]byte("0")}},
			&pgproto3.CommandComplete{CommandTag: []byte("SELECT 1")}, &pgproto3.ReadyForQuery{TxStatus: 'I'},
		} {
			server, _ = m.Encode(server)
		}
	}
	return client, server
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

func BenchmarkLoopScanClient(b *testing.B) {
	client, _ := pgbenchExchange(1000)
	benchmarkLoopScan(b, client, true)
}

func BenchmarkLoopScanServer(b *testing.B) {
	_, server := pgbenchExchange(1000)
	benchmarkLoopScan(b, server, false)
}
