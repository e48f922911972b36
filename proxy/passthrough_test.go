package proxy

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func TestSimpleQueryMultiStatement(t *testing.T) { bothRelays(t, testSimpleQueryMultiStatement) }

func testSimpleQueryMultiStatement(t *testing.T, relay Config) {
	c := relayedConn(t, relay)
	res, err := c.Exec(ctxT(t), "CREATE TABLE t(a int); INSERT INTO t VALUES (1),(2),(3); SELECT a FROM t ORDER BY a; SELECT 'x'").ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 4 {
		t.Fatalf("got %d results, want 4", len(res))
	}
	if got := res[1].CommandTag.String(); got != "INSERT 0 3" {
		t.Errorf("got tag %q, want INSERT 0 3", got)
	}
	if got := len(res[2].Rows); got != 3 || string(res[2].Rows[2][0]) != "3" {
		t.Errorf("got rows %q, want 1,2,3", res[2].Rows)
	}
	if string(res[3].Rows[0][0]) != "x" {
		t.Errorf("got %q, want x", res[3].Rows[0][0])
	}
	if c.TxStatus() != 'I' {
		t.Errorf("tx status %c, want I", c.TxStatus())
	}
}

// raw connects through dsn with pgconn and hands back the protocol
// frontend, for message-level tests.
func raw(t *testing.T, dsn string) (*pgproto3.Frontend, net.Conn) {
	t.Helper()
	c, err := pgconn.Connect(ctxT(t), dsn)
	if err != nil {
		t.Fatal(err)
	}
	hj := hijack(t, c)
	hj.Conn.SetDeadline(time.Now().Add(30 * time.Second))
	return hj.Frontend, hj.Conn
}

// expect receives messages until ReadyForQuery, returning their types
// in order (rows as 'D') and the messages.
func expectUntilReady(t *testing.T, fe *pgproto3.Frontend) (string, []pgproto3.BackendMessage) {
	t.Helper()
	var types []byte
	var msgs []pgproto3.BackendMessage
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatalf("receive: %v (after %q)", err, types)
		}
		types = append(types, backendType(m))
		msgs = append(msgs, copyMsg(m))
		if _, ok := m.(*pgproto3.ReadyForQuery); ok {
			return string(types), msgs
		}
	}
}

func backendType(m pgproto3.BackendMessage) byte {
	b, _ := m.Encode(nil)
	return b[0]
}

// copyMsg decodes a fresh copy (Receive's messages are reused).
func copyMsg(m pgproto3.BackendMessage) pgproto3.BackendMessage {
	b, _ := m.Encode(nil)
	switch m.(type) {
	case *pgproto3.DataRow:
		var d pgproto3.DataRow
		d.Decode(b[5:])
		return &d
	case *pgproto3.ErrorResponse:
		var e pgproto3.ErrorResponse
		e.Decode(b[5:])
		return &e
	case *pgproto3.CommandComplete:
		var c pgproto3.CommandComplete
		c.Decode(b[5:])
		return &c
	}
	return m
}

func TestPipelineWithErrorAndRecovery(t *testing.T) { bothRelays(t, testPipelineWithErrorAndRecovery) }

func testPipelineWithErrorAndRecovery(t *testing.T, relay Config) {
	c := relayedConn(t, relay)
	ctx := ctxT(t)
	mustExec(t, c, "CREATE TABLE t(a int PRIMARY KEY)")
	pl := c.StartPipeline(ctx)
	for i := 0; i < 100; i++ {
		pl.SendQueryParams("INSERT INTO t VALUES ($1)", [][]byte{[]byte(fmt.Sprint(i))}, nil, nil, nil)
	}
	pl.SendQueryParams("SELECT count(*) FROM t", nil, nil, nil, nil)
	if err := pl.Sync(); err != nil {
		t.Fatal(err)
	}
	// Second batch: an error in the middle; PostgreSQL skips the rest of
	// the batch and rolls it back.
	pl.SendQueryParams("INSERT INTO t VALUES (1000)", nil, nil, nil, nil)
	pl.SendQueryParams("INSERT INTO t VALUES (1)", nil, nil, nil, nil) // duplicate
	pl.SendQueryParams("INSERT INTO t VALUES (1001)", nil, nil, nil, nil)
	if err := pl.Sync(); err != nil {
		t.Fatal(err)
	}
	// Third batch: recovery.
	pl.SendQueryParams("SELECT count(*), max(a) FROM t", nil, nil, nil, nil)
	if err := pl.Sync(); err != nil {
		t.Fatal(err)
	}
	mustResults(t, pl, 100, "insert")
	res, _ := pl.GetResults()
	r := res.(*pgconn.ResultReader).Read()
	if r.Err != nil || string(r.Rows[0][0]) != "100" {
		t.Fatalf("count: got %q, %v; want 100", r.Rows, r.Err)
	}
	mustSync(t, pl)
	res, _ = pl.GetResults()
	if _, err := res.(*pgconn.ResultReader).Close(); err != nil {
		t.Fatalf("insert 1000: %v", err)
	}
	res, err := pl.GetResults()
	if err == nil {
		_, err = res.(*pgconn.ResultReader).Close()
	}
	if pgtest.SQLState(err) != "23505" {
		t.Fatalf("duplicate insert: got %v, want 23505", err)
	}
	mustSync(t, pl) // the third statement was skipped
	res, _ = pl.GetResults()
	r = res.(*pgconn.ResultReader).Read()
	if r.Err != nil || string(r.Rows[0][0]) != "100" || string(r.Rows[0][1]) != "99" {
		t.Fatalf("after recovery: got %q, %v; want [100 99]", r.Rows, r.Err)
	}
	mustSync(t, pl)
	if err := pl.Close(); err != nil {
		t.Fatal(err)
	}
}

// mustResults reads the next n results of pl, each a statement's (what,
// numbered from 0) that succeeded.
func mustResults(t *testing.T, pl *pgconn.Pipeline, n int, what string) {
	t.Helper()
	for i := range n {
		res, err := pl.GetResults()
		if err != nil {
			t.Fatal(err)
		}
		rr, ok := res.(*pgconn.ResultReader)
		if !ok {
			t.Fatalf("%s %d: got %T, want a statement's result", what, i, res)
		}
		if _, err := rr.Close(); err != nil {
			t.Fatalf("%s %d: %v", what, i, err)
		}
	}
}

func mustSync(t *testing.T, pl *pgconn.Pipeline) {
	t.Helper()
	res, err := pl.GetResults()
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := res.(*pgconn.PipelineSync); !ok {
		t.Fatalf("got %T, want PipelineSync", res)
	}
}

func TestExtendedProtocolStatementsPortalsSuspension(t *testing.T) {
	bothRelays(t, testExtendedProtocolStatementsPortalsSuspension)
}

func testExtendedProtocolStatementsPortalsSuspension(t *testing.T, relay Config) {
	p, db := relayed(t, relay, Config{})
	fe, _ := raw(t, p.dsn(db))
	// Named statement, named portal, Describe both, Execute with a row
	// limit (portal suspension), Flush in the middle, Close both.
	fe.Send(&pgproto3.Parse{Name: "s1", Query: "SELECT g FROM generate_series(1, $1::int) g"})
	fe.Send(&pgproto3.Describe{ObjectType: 'S', Name: "s1"})
	fe.Send(&pgproto3.Bind{DestinationPortal: "p1", PreparedStatement: "s1", Parameters: [][]byte{[]byte("5")}})
	fe.Send(&pgproto3.Describe{ObjectType: 'P', Name: "p1"})
	fe.Send(&pgproto3.Execute{Portal: "p1", MaxRows: 2})
	fe.Send(&pgproto3.Flush{})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	var got []byte
	for len(got) < 8 { // 1 t T 2 T D D s
		m, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, backendType(m))
	}
	if string(got) != "1tT2TDDs" {
		t.Fatalf("after Flush got %q, want 1tT2TDDs", got)
	}
	fe.Send(&pgproto3.Execute{Portal: "p1", MaxRows: 2})
	fe.Send(&pgproto3.Execute{Portal: "p1"})
	// Unnamed statement and portal in the same transaction.
	fe.Send(&pgproto3.Parse{Query: "SELECT 42"})
	fe.Send(&pgproto3.Bind{})
	fe.Send(&pgproto3.Execute{})
	fe.Send(&pgproto3.Close{ObjectType: 'P', Name: "p1"})
	fe.Send(&pgproto3.Close{ObjectType: 'S', Name: "s1"})
	fe.Send(&pgproto3.Sync{})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	types, msgs := expectUntilReady(t, fe)
	if types != "DDsDC12DC33Z" {
		t.Fatalf("got %q, want DDsDC12DC33Z", types)
	}
	if v := string(msgs[3].(*pgproto3.DataRow).Values[0]); v != "5" {
		t.Errorf("last row %q, want 5", v)
	}
	if v := string(msgs[7].(*pgproto3.DataRow).Values[0]); v != "42" {
		t.Errorf("unnamed row %q, want 42", v)
	}
	// The statement is gone.
	fe.Send(&pgproto3.Describe{ObjectType: 'S', Name: "s1"})
	fe.Send(&pgproto3.Sync{})
	fe.Flush()
	types, msgs = expectUntilReady(t, fe)
	if types != "EZ" || msgs[0].(*pgproto3.ErrorResponse).Code != "26000" {
		t.Fatalf("describe closed statement: got %q %v, want EZ 26000", types, msgs[0])
	}
}

func TestCopyBothWays(t *testing.T) { bothRelays(t, testCopyBothWays) }

func testCopyBothWays(t *testing.T, relay Config) {
	c := relayedConn(t, relay)
	ctx := ctxT(t)
	mustExec(t, c, "CREATE TABLE t(a int, b text)")
	var in strings.Builder
	for i := 0; i < 50000; i++ {
		fmt.Fprintf(&in, "%d\trow %d\n", i, i)
	}
	tag, err := c.CopyFrom(ctx, strings.NewReader(in.String()), "COPY t FROM STDIN")
	if err != nil {
		t.Fatal(err)
	}
	if tag.RowsAffected() != 50000 {
		t.Fatalf("copy in: %d rows, want 50000", tag.RowsAffected())
	}
	var out bytes.Buffer
	tag, err = c.CopyTo(ctx, &out, "COPY (SELECT * FROM t ORDER BY a) TO STDOUT")
	if err != nil {
		t.Fatal(err)
	}
	if out.String() != in.String() {
		t.Fatalf("copy out differs from copy in (%d vs %d bytes)", out.Len(), in.Len())
	}
	// A failing COPY FROM leaves the session usable.
	_, err = c.CopyFrom(ctx, strings.NewReader("not-an-int\tx\n"), "COPY t FROM STDIN")
	if pgtest.SQLState(err) != "22P02" {
		t.Fatalf("bad copy: got %v, want 22P02", err)
	}
	res, err := c.Exec(ctx, "SELECT count(*) FROM t").ReadAll()
	if err != nil || string(res[0].Rows[0][0]) != "50000" {
		t.Fatalf("after failed copy: %v %v", res, err)
	}
}

func TestCancelRequest(t *testing.T) { bothRelays(t, testCancelRequest) }

func testCancelRequest(t *testing.T, relay Config) {
	p, db := relayed(t, relay, Config{})
	c := connect(t, p.dsn(db))
	ctx := ctxT(t)
	errc := make(chan error, 1)
	go func() {
		_, err := c.Exec(context.Background(), "SELECT pg_sleep(60)").ReadAll()
		errc <- err
	}()
	admin, err := cluster.Primary.Connect(ctx, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	// Wait until the sleep is really running upstream.
	if err := pgtest.Poll(ctx, func() (bool, error) {
		var n int
		err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND query = 'SELECT pg_sleep(60)' AND state = 'active'", db).Scan(&n)
		return n == 1, err
	}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	// pgconn sends the cancel to the address it is connected to: the
	// proxy, with the proxy's BackendKeyData.
	if err := c.CancelRequest(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if pgtest.SQLState(err) != "57014" {
			t.Fatalf("got %v, want 57014 query_canceled", err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("cancel took %v", d)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("query not canceled")
	}
	// A wrong key cancels nothing (and is ignored quietly).
	wantValue(t, c, "SELECT 1", "1")
}

func TestListenNotifyNoticeParameterStatus(t *testing.T) {
	bothRelays(t, testListenNotifyNoticeParameterStatus)
}

func testListenNotifyNoticeParameterStatus(t *testing.T, relay Config) {
	p, db := relayed(t, relay, Config{})
	ctx := ctxT(t)
	cfg, err := pgconn.ParseConfig(p.dsn(db))
	if err != nil {
		t.Fatal(err)
	}
	notices := make(chan string, 10)
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { notices <- n.Message }
	notes := make(chan *pgconn.Notification, 10)
	cfg.OnNotification = func(_ *pgconn.PgConn, n *pgconn.Notification) { notes <- n }
	l, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close(ctx)
	mustExec(t, l, "LISTEN chan1")
	other := connect(t, p.dsn(db))
	mustExec(t, other, "NOTIFY chan1, 'hello'")
	// The notification arrives while l is idle: it must be flushed to the
	// client without any request from it.
	if err := l.WaitForNotification(ctx); err != nil {
		t.Fatal(err)
	}
	n := <-notes
	if n.Channel != "chan1" || n.Payload != "hello" {
		t.Fatalf("got %+v, want chan1/hello", n)
	}
	mustExec(t, l, "DO $$BEGIN RAISE NOTICE 'note %', 7; END$$")
	if got := <-notices; got != "note 7" {
		t.Fatalf("notice %q, want note 7", got)
	}
	mustExec(t, l, "SET application_name = 'via-pgfence'")
	if got := l.ParameterStatus("application_name"); got != "via-pgfence" {
		t.Fatalf("application_name %q, want via-pgfence", got)
	}
	// ParameterStatus from the upstream's startup is replayed.
	if got := l.ParameterStatus("server_version"); !strings.HasPrefix(got, "15") {
		t.Fatalf("server_version %q, want 15.x", got)
	}
}

func TestFunctionCall(t *testing.T) { bothRelays(t, testFunctionCall) }

func testFunctionCall(t *testing.T, relay Config) {
	p, db := relayed(t, relay, Config{})
	fe, _ := raw(t, p.dsn(db))
	fe.Send(&pgproto3.Query{String: "SELECT 'int4abs'::regproc::oid"})
	fe.Flush()
	_, msgs := expectUntilReady(t, fe)
	oid, err := strconv.Atoi(string(msgs[1].(*pgproto3.DataRow).Values[0]))
	if err != nil {
		t.Fatal(err)
	}
	arg := make([]byte, 4)
	binary.BigEndian.PutUint32(arg, uint32(0xffffffff)) // -1
	fe.Send(&pgproto3.FunctionCall{Function: uint32(oid), ArgFormatCodes: []uint16{1}, Arguments: [][]byte{arg}, ResultFormatCode: 1})
	fe.Flush()
	m, err := fe.Receive()
	if err != nil {
		t.Fatal(err)
	}
	fr, ok := m.(*pgproto3.FunctionCallResponse)
	if !ok || binary.BigEndian.Uint32(fr.Result) != 1 {
		t.Fatalf("got %#v, want FunctionCallResponse 1", m)
	}
	if m, _ := fe.Receive(); backendType(m) != 'Z' {
		t.Fatalf("got %T, want ReadyForQuery", m)
	}
}

func TestLargeRows(t *testing.T) { bothRelays(t, testLargeRows) }

func testLargeRows(t *testing.T, relay Config) {
	c := relayedConn(t, relay)
	ctx := ctxT(t)
	big := strings.Repeat("0123456789", 2_000_000) // 20 MB each way
	r := c.ExecParams(ctx, "SELECT repeat('ab', 10000000)", nil, nil, nil, nil).Read()
	if r.Err != nil || len(r.Rows[0][0]) != 20_000_000 {
		t.Fatalf("big row: %d bytes, %v", len(r.Rows[0][0]), r.Err)
	}
	r = c.ExecParams(ctx, "SELECT $1::text || 'x', length($1::text)", [][]byte{[]byte(big)}, nil, nil, nil).Read()
	if r.Err != nil || string(r.Rows[0][0]) != big+"x" || string(r.Rows[0][1]) != "20000000" {
		t.Fatalf("big param round trip failed: %v", r.Err)
	}
}
