//go:build unix

package proxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// The tests of TLS sessions on the event loop (evloop_tls.go): a
// TLS client, with and without the write gate, with a plain and a TLS
// upstream. The session must be on the loop (its relay found there, with
// TLS where the mode has it), and carry everything through TLS, sizes
// larger than every buffer and TLS record included.

const tlsLoopMax = 2 << 20 // the tests' MaxMessageSize

// tlsMode is one of tlsLoopModes.
type tlsMode struct {
	gate        bool // the write gate intercepts
	upstreamTLS bool // the proxy connects to PostgreSQL with TLS
	bufferSize  int  // Config.BufferSize (0: the default)
}

// tlsLoopModes runs f in each mode.
func tlsLoopModes(t *testing.T, f func(t *testing.T, m tlsMode)) {
	for _, m := range []tlsMode{{}, {gate: true}, {upstreamTLS: true}, {gate: true, upstreamTLS: true}} {
		name := "event_loop"
		if m.gate {
			name = "gate_event_loop"
		}
		if m.upstreamTLS {
			name += "_tls_upstream"
		}
		t.Run(name, func(t *testing.T) { f(t, m) })
	}
}

// tlsLoopProxy is a proxy that offers TLS to clients, in mode m, and a
// fresh database.
func tlsLoopProxy(t *testing.T, m tlsMode) (*testProxy, string) {
	t.Helper()
	return tlsLoopProxyWith(t, m, Config{})
}

// tlsLoopProxyWith is tlsLoopProxy with cfg's other settings.
func tlsLoopProxyWith(t *testing.T, m tlsMode, cfg Config) (*testProxy, string) {
	t.Helper()
	cfg.TLS = &tls.Config{Certificates: []tls.Certificate{testCert(t)}}
	cfg.MaxMessageSize, cfg.BufferSize = tlsLoopMax, m.bufferSize
	if m.gate {
		cfg.Interceptor = newGate(t)
	}
	if m.upstreamTLS {
		primaryTLS(t) // auth_test.go
		cfg.Primary = fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=require", cluster.Primary.Addr())
	}
	return startProxy(t, cfg), cluster.NewDatabase(t)
}

func tlsDSN(p *testProxy, db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=require", p.addr.Port, db)
}

// tlsClient connects to db through p with TLS and returns the connection
// once its session is on the loop, in mode m.
func tlsClient(t *testing.T, p *testProxy, db string, m tlsMode) (*pgconn.PgConn, *relay) {
	t.Helper()
	c := connect(t, tlsDSN(p, db))
	if _, ok := c.Conn().(*tls.Conn); !ok {
		t.Fatalf("client connection is %T, want *tls.Conn", c.Conn())
	}
	return c, tlsOnLoop(t, p, m)
}

// tlsOnLoop waits for a TLS client's session of p on the loop, and checks
// it is in mode m.
func tlsOnLoop(t *testing.T, p *testProxy, m tlsMode) *relay {
	t.Helper()
	r := loopRelayWhere(t, p, "a TLS client's session", func(r *relay) bool { return r.client.tls != nil })
	if m.gate != (r.intercept != nil) || m.upstreamTLS != (r.server.tls != nil) {
		t.Fatalf("intercepted %v, TLS upstream %v; want %+v", r.intercept != nil, r.server.tls != nil, m)
	}
	return r
}

// TestLoopTLS: a TLS client's session on the loop carries the simple and
// extended protocols, a pipeline, COPY both ways and results of several
// MB, a message near MaxMessageSize and one over it (answered 54000 on
// the loop, where the session goes on); psql with sslmode=require too.
func TestLoopTLS(t *testing.T) { tlsLoopModes(t, testLoopTLS) }

func testLoopTLS(t *testing.T, m tlsMode) {
	p, db := tlsLoopProxy(t, m)
	c, _ := tlsClient(t, p, db, m)
	ctx := ctxT(t)

	wantValue(t, c, "SELECT 41 + 1", "42")
	wantValue(t, c, "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", map[bool]string{false: "f", true: "t"}[m.upstreamTLS])
	res := c.ExecParams(ctx, "SELECT $1::int + 1", [][]byte{[]byte("41")}, nil, nil, nil).Read()
	if res.Err != nil || len(res.Rows) != 1 || string(res.Rows[0][0]) != "42" {
		t.Fatalf("extended: got %q, %v; want 42", res.Rows, res.Err)
	}

	mustExec(t, c, "CREATE TABLE tls_copy(a int, b text)")
	pl := c.StartPipeline(ctx)
	for i := range 50 {
		pl.SendQueryParams("INSERT INTO tls_copy VALUES ($1, 'p')", [][]byte{[]byte(fmt.Sprint(-1 - i))}, nil, nil, nil)
	}
	pl.SendQueryParams("SELECT count(*) FROM tls_copy", nil, nil, nil, nil)
	if err := pl.Sync(); err != nil {
		t.Fatal(err)
	}
	mustResults(t, pl, 50, "pipelined insert")
	pres, _ := pl.GetResults()
	if r := pres.(*pgconn.ResultReader).Read(); r.Err != nil || string(r.Rows[0][0]) != "50" {
		t.Fatalf("pipelined count: got %q, %v; want 50", r.Rows, r.Err)
	}
	mustSync(t, pl)
	if err := pl.Close(); err != nil {
		t.Fatal(err)
	}
	mustExec(t, c, "DELETE FROM tls_copy")

	// COPY FROM STDIN and TO STDOUT of ~8 MB.
	var in bytes.Buffer
	for i := range 100000 {
		fmt.Fprintf(&in, "%d\t%s\n", i, strings.Repeat("c", 70))
	}
	tag, err := c.CopyFrom(ctx, bytes.NewReader(in.Bytes()), "COPY tls_copy FROM STDIN")
	if err != nil || tag.RowsAffected() != 100000 {
		t.Fatalf("COPY FROM STDIN: got %v, %v; want 100000 rows", tag, err)
	}
	var out bytes.Buffer
	if _, err := c.CopyTo(ctx, &out, "COPY (SELECT * FROM tls_copy ORDER BY a) TO STDOUT"); err != nil {
		t.Fatalf("COPY TO STDOUT: %v", err)
	}
	if !bytes.Equal(out.Bytes(), in.Bytes()) {
		t.Fatalf("COPY TO STDOUT: got %d bytes, want the %d copied in", out.Len(), in.Len())
	}

	// A result of 20 MB.
	all, err := c.Exec(ctx, bigResult).ReadAll()
	if err != nil || len(all) != 1 || len(all[0].Rows) != 20000 || len(all[0].Rows[19999][0]) != 1000 {
		t.Fatalf("big result: %v", err)
	}

	// A message near the limit, then one over it.
	near := tlsLoopMax - 100
	wantValue(t, c, "SELECT length('"+strings.Repeat("y", near)+"')", fmt.Sprint(near))
	if _, err := c.Exec(ctx, "SELECT length('"+strings.Repeat("z", tlsLoopMax)+"')").ReadAll(); pgtest.SQLState(err) != "54000" {
		t.Fatalf("message over the limit: got %v, want 54000", err)
	}
	wantValue(t, c, "SELECT count(*) FROM tls_copy", "100000")

	before := p.srv.ops.stats.SessionsLoop.Load()
	q := "SELECT 'psql-' || count(*) FROM tls_copy; COPY (SELECT repeat('z', 1000) FROM generate_series(1, 5000)) TO STDOUT"
	got, err := runPsql(t, p.addr.Port, "postgres", db, q, "PGSSLMODE=require")
	if err != nil || !strings.Contains(got, "psql-100000") || strings.Count(got, strings.Repeat("z", 1000)+"\n") != 5000 {
		t.Fatalf("psql over TLS: %v\n%.300s", err, got)
	}
	if n := p.srv.ops.stats.SessionsLoop.Load(); n != before+1 {
		t.Fatalf("psql's session: %d sessions on the loop, want %d", n, before+1)
	}
}

// TestLoopTLSSmallBuffer: with buffers smaller than a TLS record, a read
// of a record leaves the rest of it decrypted in the tls.Conn, for which
// no event comes: the loop reads it once it has room (pumpMore), both
// ways, including the last record of a result or of a COPY, after which
// nothing more comes.
func TestLoopTLSSmallBuffer(t *testing.T) {
	tlsLoopModes(t, func(t *testing.T, m tlsMode) {
		m.bufferSize = 4096
		p, db := tlsLoopProxy(t, m)
		c, _ := tlsClient(t, p, db, m)
		ctx := ctxT(t)
		wantValue(t, c, "SELECT length(repeat('x', 10000))", "10000")
		res, err := c.Exec(ctx, "SELECT repeat('x', 10000)").ReadAll()
		if err != nil || len(res[0].Rows[0][0]) != 10000 {
			t.Fatalf("a 10 kB value: %v", err)
		}
		mustExec(t, c, "CREATE TABLE tls_small(b text)")
		in := []byte(strings.Repeat(strings.Repeat("s", 999)+"\n", 1000))
		if tag, err := c.CopyFrom(ctx, bytes.NewReader(in), "COPY tls_small FROM STDIN"); err != nil || tag.RowsAffected() != 1000 {
			t.Fatalf("COPY FROM STDIN: got %v, %v; want 1000 rows", tag, err)
		}
		var out bytes.Buffer
		if _, err := c.CopyTo(ctx, &out, "COPY tls_small TO STDOUT"); err != nil || !bytes.Equal(out.Bytes(), in) {
			t.Fatalf("COPY TO STDOUT: got %d bytes (%v), want the %d copied in", out.Len(), err, len(in))
		}
	})
}

// TestLoopTLSPause: PAUSE holds a TLS client's next message on the loop;
// the client sends it with a larger one behind it in one TLS record,
// which the buffer (4 KiB) cannot take whole: after RESUME the loop reads
// the rest from the tls.Conn (no event comes for it) and both are
// answered.
func TestLoopTLSPause(t *testing.T) {
	tlsLoopModes(t, func(t *testing.T, m tlsMode) {
		m.bufferSize = 4096
		p, db := tlsLoopProxyWith(t, m, withConsole(Config{}))
		c, _ := tlsClient(t, p, db, m)
		adm := mustConsole(t, p, "admin")
		obs := mustConsole(t, p, "watcher")
		ctx := ctxT(t)
		if _, err := adm.Exec(ctx, "PAUSE"); err != nil {
			t.Fatalf("PAUSE: %v", err)
		}
		long := strings.Repeat("l", 6000)
		rawSend(t, c, "SELECT 10", "SELECT length('"+long+"')") // one Flush: one record
		waitClientState(t, obs, c, "waiting")
		if _, err := adm.Exec(ctx, "RESUME"); err != nil {
			t.Fatalf("RESUME: %v", err)
		}
		if got := rawAnswers(t, c, 2); got[0] != "10" || got[1] != "6000" {
			t.Fatalf("after RESUME: got %v, want 10, 6000", got)
		}
	})
}

// TestLoopTLSShutdown: an idle TLS client's session on the loop, ended by
// a graceful shutdown, reads 57P01 through TLS, then the end of the
// stream.
func TestLoopTLSShutdown(t *testing.T) { tlsLoopModes(t, testLoopTLSShutdown) }

func testLoopTLSShutdown(t *testing.T, m tlsMode) {
	p, db := tlsLoopProxy(t, m)
	cfg, err := pgconn.ParseConfig(tlsDSN(p, db))
	if err != nil {
		t.Fatal(err)
	}
	var rec *recordingConn
	cfg.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		rec = &recordingConn{Conn: c}
		return rec, err
	}
	c := connectConfig(t, cfg)
	tlsOnLoop(t, p, m)
	wantValue(t, c, "SELECT 1", "1")
	hj, err := c.Hijack()
	if err != nil {
		t.Fatal(err)
	}
	defer hj.Conn.Close()
	ctx := ctxT(t)
	done := make(chan error, 1)
	go func() { done <- p.srv.Shutdown(ctx) }()
	fe := pgproto3.NewFrontend(hj.Conn, hj.Conn)
	msg, err := fe.Receive()
	if e, ok := msg.(*pgproto3.ErrorResponse); err != nil || !ok || e.Code != "57P01" {
		t.Fatalf("got %T %+v (%v), want ErrorResponse 57P01", msg, msg, err)
	}
	// Read on the tls.Conn itself: pgproto3 reports any end as unexpected.
	if n, err := hj.Conn.Read(make([]byte, 16)); err != io.EOF {
		t.Fatalf("after 57P01: got %d bytes (%v), want the end of the stream", n, err)
	}
	if err := <-done; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	// The stream ended with close_notify: after the SSLRequest's answer
	// (one byte), TLS records, the last one a TLS 1.3 alert (2 bytes, its
	// content type and the 16 bytes of the AEAD tag), not the 57P01's.
	raw, last := rec.got.Bytes()[1:], 0
	for len(raw) >= 5 {
		n := int(raw[3])<<8 | int(raw[4])
		if len(raw) < 5+n {
			t.Fatalf("the stream ends in a record of %d bytes", n)
		}
		raw, last = raw[5+n:], n
	}
	if last != 2+1+16 || len(raw) != 0 {
		t.Fatalf("the last record has %d bytes (%d left), want a close_notify alert's 19", last, len(raw))
	}
}

// recordingConn keeps what it reads.
type recordingConn struct {
	net.Conn
	got bytes.Buffer
}

func (c *recordingConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.got.Write(b[:n])
	return n, err
}

// TestLoopTLSEarlyQuery: a client that sends its first query with its
// startup message, in one TLS record: the proxy's tls.Conn holds the
// query, decrypted, when the session comes onto the loop, and no event
// comes for it; the loop reads it at once (kick).
func TestLoopTLSEarlyQuery(t *testing.T) { tlsLoopModes(t, testLoopTLSEarlyQuery) }

func testLoopTLSEarlyQuery(t *testing.T, m tlsMode) {
	p, db := tlsLoopProxy(t, m)
	c := rawStart(t, p.addr.String())
	c.send(t, &pgproto3.SSLRequest{})
	b := make([]byte, 1)
	if _, err := io.ReadFull(c, b); err != nil || b[0] != 'S' {
		t.Fatalf("SSLRequest: got %q (%v), want S", b, err)
	}
	tc := tls.Client(c.Conn, &tls.Config{InsecureSkipVerify: true})
	if err := tc.HandshakeContext(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	rc := &rawConn{Conn: tc, fe: pgproto3.NewFrontend(tc, tc)}
	rc.send(t, &pgproto3.StartupMessage{ProtocolVersion: pgproto3.ProtocolVersionNumber,
		Parameters: map[string]string{"user": "postgres", "database": db}}, &pgproto3.Query{String: "SELECT 'early'"})
	if got, _ := rc.untilReady(t); got[len(got)-1] != "Z:I" {
		t.Fatalf("startup: got %q, want ReadyForQuery last", got)
	}
	if got, _ := rc.untilReady(t); strings.Join(got, " ") != "RowDescription DataRow CommandComplete Z:I" {
		t.Fatalf("the early query: got %q", got)
	}
	if n := p.srv.ops.stats.SessionsLoop.Load(); n != 1 {
		t.Fatalf("%d sessions on the loop, want 1", n)
	}
}

// TestLoopTLSBadClient: a TLS client that sends a record that does not
// decrypt, or closes in the middle of a record, ends its session on the
// loop: the session, its relay and its backend are gone.
func TestLoopTLSBadClient(t *testing.T) { tlsLoopModes(t, testLoopTLSBadClient) }

func testLoopTLSBadClient(t *testing.T, m tlsMode) {
	for _, tc := range []struct {
		name  string
		bytes []byte
	}{
		// An application_data record of 64 bytes that is not ciphertext.
		{"garbage", append([]byte{23, 3, 3, 0, 64}, bytes.Repeat([]byte{0x5a}, 64)...)},
		// A record header claiming 1000 bytes, 10 sent, then the close.
		{"mid_record", append([]byte{23, 3, 3, 3, 232}, bytes.Repeat([]byte{1}, 10)...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, db := tlsLoopProxy(t, m)
			c, _ := tlsClient(t, p, db, m)
			pid, err := strconvU32(lastValue(t, c, "SELECT pg_backend_pid()"))
			if err != nil {
				t.Fatal(err)
			}
			hj, err := c.Hijack()
			if err != nil {
				t.Fatal(err)
			}
			raw := hj.Conn.(*tls.Conn).NetConn()
			if _, err := raw.Write(tc.bytes); err != nil {
				t.Fatal(err)
			}
			if tc.name == "mid_record" {
				raw.Close()
			} else {
				defer raw.Close()
			}
			tlsSessionGone(t, p, pid)
		})
	}
}

// tlsSessionGone waits until p has no session, its loop no relay, and
// the backend of pid (through the proxy: its own pid) has ended.
func tlsSessionGone(t *testing.T, p *testProxy, pid uint32) {
	t.Helper()
	pollFind(t, "end of the session", func() (bool, bool) {
		p.srv.mu.Lock()
		defer p.srv.mu.Unlock()
		for _, s := range p.srv.conns {
			if s != nil {
				return false, false
			}
		}
		return true, true
	})
	pollFind(t, "empty event loop", func() (bool, bool) {
		l, err := p.srv.loop.get()
		if err != nil {
			t.Fatal(err)
		}
		l.mu.RLock()
		defer l.mu.RUnlock()
		return true, len(l.byFD) == 0
	})
	admin := cluster.Primary.MustConnect(t, "postgres")
	pollFind(t, "end of the backend", func() (bool, bool) {
		var n int
		if err := admin.QueryRow(context.Background(), "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", int32(pid)).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return true, n == 0
	})
}
