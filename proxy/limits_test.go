package proxy

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestOversizeMessage: a message over max_message_size gets 54000 naming
// the limit and the setting that raises it, in its place among the
// responses, with PostgreSQL's semantics for a statement that fails there
// (issue 19 §5); the session goes on. This replaces the old behaviour
// (08P01 and the connection closed) for the types that carry statements
// and data; a Sync that long is still a protocol violation.
func TestOversizeMessage(t *testing.T) { bothRelays(t, testOversizeMessage) }

func testOversizeMessage(t *testing.T, relay Config) {
	const limit = 4096
	p, db := relayed(t, relay, Config{MaxMessageSize: limit})
	big := "'" + strings.Repeat("x", 5000) + "'"
	setup := connect(t, p.dsn(db))
	mustExec(t, setup, "CREATE TABLE t (a int, b text)")
	other := connect(t, p.dsn(db))

	t.Run("query", func(t *testing.T) {
		r := rawConnect(t, p.dsn(db))
		r.send(t, &pgproto3.Query{String: "INSERT INTO t VALUES (1, " + big + ")"})
		got, errs := r.untilReady(t)
		want(t, "oversized query", got, "E:54000", "Z:I")
		if e := errs[0]; !strings.Contains(e.Message, "4096") || !strings.Contains(e.Message, "max_message_size") || !strings.Contains(e.Hint, "--max-message-size") {
			t.Fatalf("error does not name the limit and its setting: %q (hint %q)", e.Message, e.Hint)
		}
		r.send(t, &pgproto3.Query{String: "SELECT 1"})
		got, _ = r.untilReady(t)
		want(t, "next query", got, "RowDescription", "DataRow", "CommandComplete", "Z:I")
		// In a transaction the statement fails it, as in PostgreSQL.
		r.send(t, &pgproto3.Query{String: "BEGIN"}, &pgproto3.Query{String: "INSERT INTO t VALUES (2, 'small')"},
			&pgproto3.Query{String: "SELECT " + big}, &pgproto3.Query{String: "SELECT 1"}, &pgproto3.Query{String: "COMMIT"})
		var all []string
		for range 5 {
			got, _ = r.untilReady(t)
			all = append(all, got...)
		}
		want(t, "oversized query in a transaction", all, "CommandComplete", "Z:T", "CommandComplete", "Z:T",
			"E:54000", "Z:E", "E:25P02", "Z:E", "CommandComplete", "Z:I")
		wantRows(t, db, "t", 0)
	})

	t.Run("extended", func(t *testing.T) {
		r := rawConnect(t, p.dsn(db))
		// A batch: a good INSERT, a Bind over the limit, another INSERT.
		// PostgreSQL fails the batch at the Bind and skips to the Sync;
		// its implicit transaction rolls back.
		r.send(t,
			&pgproto3.Parse{Query: "INSERT INTO t VALUES ($1, 'x')"}, &pgproto3.Bind{Parameters: [][]byte{[]byte("3")}}, &pgproto3.Execute{},
			&pgproto3.Parse{Name: "s", Query: "INSERT INTO t VALUES (4, $1)"},
			&pgproto3.Bind{PreparedStatement: "s", Parameters: [][]byte{bytes.Repeat([]byte("y"), 5000)}}, &pgproto3.Execute{},
			&pgproto3.Bind{PreparedStatement: "s", Parameters: [][]byte{[]byte("z")}}, &pgproto3.Execute{},
			&pgproto3.Sync{})
		got, errs := r.untilReady(t)
		want(t, "batch with an oversized Bind", got, "ParseComplete", "BindComplete", "CommandComplete", "ParseComplete", "E:54000", "Z:I")
		if !strings.Contains(errs[0].Message, "Bind message") {
			t.Fatalf("error %q does not say which message", errs[0].Message)
		}
		wantRows(t, db, "t", 0)
		// A Parse over the limit; the session goes on after the Sync.
		r.send(t, &pgproto3.Parse{Name: "q", Query: "SELECT " + big}, &pgproto3.Describe{ObjectType: 'S', Name: "q"}, &pgproto3.Sync{},
			&pgproto3.Parse{Query: "SELECT 42"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{})
		got, _ = r.untilReady(t)
		want(t, "oversized Parse", got, "E:54000", "Z:I")
		got, _ = r.untilReady(t)
		want(t, "the next batch", got, "ParseComplete", "BindComplete", "DataRow", "CommandComplete", "Z:I")
	})

	t.Run("copy", func(t *testing.T) {
		r := rawConnect(t, p.dsn(db))
		r.copyIn(t, "COPY t FROM STDIN")
		row := []byte("5\tsmall\n")
		r.send(t, &pgproto3.CopyData{Data: row}, &pgproto3.CopyData{Data: bytes.Repeat(row, 1000)}, &pgproto3.CopyData{Data: row}, &pgproto3.CopyDone{})
		got, errs := r.untilReady(t)
		want(t, "oversized CopyData", got, "E:54000", "Z:I")
		if !strings.Contains(errs[0].Message, "COPY") {
			t.Fatalf("error %q does not say COPY", errs[0].Message)
		}
		wantRows(t, db, "t", 0)
		r.send(t, &pgproto3.Query{String: "SELECT 1"})
		got, _ = r.untilReady(t)
		want(t, "after the COPY", got, "RowDescription", "DataRow", "CommandComplete", "Z:I")
	})

	t.Run("behind_a_big_result", func(t *testing.T) {
		// Sent while a 20 MB result is coming: on the event loop the
		// session moves to goroutines in the middle of that result (of
		// one of its messages, most likely), which must arrive whole and
		// in order.
		r := rawConnect(t, p.dsn(db))
		r.send(t, &pgproto3.Query{String: "SELECT repeat('x', 1000) FROM generate_series(1, 20000)"})
		r.SetReadDeadline(time.Now().Add(30 * time.Second))
		for range 10 { // the result is streaming
			if _, err := r.fe.Receive(); err != nil {
				t.Fatal(err)
			}
		}
		r.send(t, &pgproto3.Query{String: "SELECT " + big}, &pgproto3.Query{String: "SELECT 'after'"})
		got, _ := r.untilReady(t)
		if len(got) != 20003-10 || got[len(got)-2] != "CommandComplete" || got[len(got)-1] != "Z:I" {
			t.Fatalf("the rest of the big result: %d messages, ... %v", len(got), got[max(0, len(got)-3):])
		}
		got, _ = r.untilReady(t)
		want(t, "the oversized query behind it", got, "E:54000", "Z:I")
		got, _ = r.untilReady(t)
		want(t, "the query after", got, "RowDescription", "DataRow", "CommandComplete", "Z:I")
	})

	t.Run("sync", func(t *testing.T) {
		// No Sync is that long: a protocol violation, as before.
		r := rawConnect(t, p.dsn(db))
		r.Write(append([]byte{'S', 0, 0, 0x20, 0x04}, make([]byte, 8192)...))
		if code := r.closedWith(t); code != "08P01" {
			t.Fatalf("oversized Sync: got %q, want 08P01 and the connection closed", code)
		}
	})

	if _, err := other.Exec(ctxT(t), "SELECT 1").ReadAll(); err != nil {
		t.Fatalf("other session affected: %v", err)
	}
}

// TestOversizeMessageNames: the substitute for an oversized message refers
// to names no client can know, so a statement a client prepared under a
// guessable name never runs in its place.
func TestOversizeMessageNames(t *testing.T) {
	a, b := startProxy(t, Config{MaxMessageSize: 4096}), startProxy(t, Config{MaxMessageSize: 4096})
	if a.srv.oversizedTag == b.srv.oversizedTag || !strings.HasPrefix(a.srv.oversizedTag, oversizedPrefix) || len(a.srv.oversizedTag) != len(oversizedPrefix)+16 {
		t.Fatalf("substitute tags %q and %q: want a random one per proxy", a.srv.oversizedTag, b.srv.oversizedTag)
	}
	db := cluster.NewDatabase(t)
	r := rawConnect(t, a.dsn(db))
	r.send(t, &pgproto3.Query{String: `PREPARE "` + oversizedPrefix + `Q_5000" AS SELECT 'ran'`})
	r.untilReady(t)
	r.send(t, &pgproto3.Query{String: "SELECT '" + strings.Repeat("x", 4994) + "'"})
	got, _ := r.untilReady(t)
	want(t, "oversized query next to a guessable prepared statement", got, "E:54000", "Z:I")
}

// TestCopyStreamed: COPY data is streamed in pieces, never held whole,
// through the write gate too: a single 3 MiB CopyData passes with a memory
// budget far smaller than it, and nothing is taken from the budget.
func TestCopyStreamed(t *testing.T) {
	bothRelays(t, func(t *testing.T, relay Config) {
		p := startProxy(t, withRelay(relay, Config{MemoryBudget: 256 << 10}))
		db := cluster.NewDatabase(t)
		r := rawConnect(t, p.dsn(db))
		r.send(t, &pgproto3.Query{String: "CREATE TABLE t (a int, b text)"})
		r.untilReady(t)
		r.copyIn(t, "COPY t FROM STDIN")
		var data []byte
		for i := range 30000 {
			data = fmt.Appendf(data, "%d\t%s\n", i, strings.Repeat("v", 90))
		}
		r.send(t, &pgproto3.CopyData{Data: data}, &pgproto3.CopyDone{})
		got, _ := r.untilReady(t)
		want(t, "3 MiB in one CopyData", got, "CommandComplete", "Z:I")
		wantRows(t, db, "t", 30000)
		if peak := p.srv.mem.peak.Load(); peak != 0 {
			t.Fatalf("the COPY took %d bytes of the memory budget, want none", peak)
		}
	})
}

// TestHeldMessageBudget: a message held whole for the gate takes its cost
// from the budget while it is held and gives it back; one that does not
// fit is refused before it is read.
func TestHeldMessageBudget(t *testing.T) {
	const budget = 4 << 20
	p := startProxy(t, Config{MemoryBudget: budget, ClientMemory: budget, Interceptor: newGate(t)})
	// small's query costs 3.2 MiB of the 4: it fits, alone.
	db := cluster.NewDatabase(t)
	c := connect(t, p.dsn(db))
	ctx := ctxT(t)
	small := strings.Repeat("x", 400<<10)
	res, err := c.Exec(ctx, "SELECT length('"+small+"')").ReadAll()
	if err != nil || string(res[0].Rows[0][0]) != fmt.Sprint(len(small)) {
		t.Fatalf("a query that fits: %v %v", res, err)
	}
	if peak, used := p.srv.mem.peak.Load(), p.srv.mem.used.Load(); peak != heldCost(len(small)+len("SELECT length('')")+1) || used != 0 {
		t.Fatalf("budget: peak %d, in use %d; want the query's cost, then 0", peak, used)
	}
	_, err = c.Exec(ctx, "SELECT length('"+strings.Repeat("x", 1<<20)+"')").ReadAll()
	if pgtest.SQLState(err) != "53200" || !strings.Contains(err.Error(), "memory_budget") {
		t.Fatalf("a query over the budget: got %v, want 53200 naming memory_budget", err)
	}
	select {
	case <-c.CleanupDone():
	case <-time.After(10 * time.Second):
		t.Fatal("the session refused for the budget was not closed")
	}
	if used := p.srv.mem.used.Load(); used != 0 {
		t.Fatalf("%d bytes of the budget still taken after the refusal", used)
	}
	if _, err := connect(t, p.dsn(db)).Exec(ctx, "SELECT 1").ReadAll(); err != nil {
		t.Fatalf("a new session after the refusal: %v", err)
	}
}

// procMemory reads a process's resident set (VmRSS) and its peak (VmHWM)
// from /proc, in bytes.
func procMemory(t *testing.T, pid int) (rss, peak int64) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		n, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "VmRSS:":
			rss = n << 10
		case "VmHWM:":
			peak = n << 10
		}
	}
	return rss, peak
}

// socketQueues returns the send and receive queues (bytes) of the TCP
// socket from local to remote port on 127.0.0.1, as /proc/net/tcp shows
// them, and whether it is there.
func socketQueues(t *testing.T, local, remote int) (tx, rx int64, ok bool) {
	t.Helper()
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("0100007F:%04X 0100007F:%04X", local, remote)
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 || f[1]+" "+f[2] != want {
			continue
		}
		q := strings.Split(f[4], ":")
		tx, _ = strconv.ParseInt(q[0], 16, 64)
		rx, _ = strconv.ParseInt(q[1], 16, 64)
		return tx, rx, true
	}
	return 0, 0, false
}

// TestMemoryBudgetRSS: many clients sending big queries at once through a
// real `pgfence serve` (with the write gate, which holds each whole): the
// process's peak resident set stays within the memory budget above what
// it was before them. All the clients send their query but its last byte,
// so that every message is in flight at once (observed: the proxy has read
// all that was sent, /proc/net/tcp); exactly as many as the budget holds
// are held, the others are refused with 53200 once sent; then all finish.
// A session running small queries throughout is unaffected. (Before the
// budget, four clients sending 48 MiB queries took the proxy from 33 to
// 293 MiB; without it, this test's clients take it over 300 MiB.)
func TestMemoryBudgetRSS(t *testing.T) {
	const (
		budget  = 96 << 20
		clients = 16
		size    = 4 << 20
		slack   = 16 << 20 // the sessions' own buffers, the runtime
	)
	p := startFenceServe(t, "--memory-budget", "96MiB", "--max-message-size", "8MiB")
	db := cluster.NewDatabase(t)
	dsn := fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", p.Addr, db)
	ctx := ctxT(t)
	steady := connect(t, dsn)
	mustExec(t, steady, "SELECT 1")
	msg, _ := (&pgproto3.Query{String: "SELECT length('" + strings.Repeat("x", size) + "')"}).Encode(nil)
	held := int(budget / heldCost(len(msg)-headerLen))
	conns := make([]*rawConn, clients)
	for i := range conns {
		conns[i] = rawConnect(t, dsn)
	}
	base, _ := procMemory(t, p.cmd.Process.Pid)

	var wg sync.WaitGroup
	for _, r := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.Write(msg[:len(msg)-1])
		}()
	}
	wg.Wait()
	pport := p.Addr.(*net.TCPAddr).Port
	for i, r := range conns {
		cport := r.LocalAddr().(*net.TCPAddr).Port
		err := pgtest.Poll(ctx, func() (bool, error) {
			ctx, _, ok1 := socketQueues(t, cport, pport)
			_, prx, ok2 := socketQueues(t, pport, cport)
			return ok1 && ok2 && ctx == 0 && prx == 0, nil
		})
		if err != nil {
			t.Fatalf("client %d: the proxy has not read what it sent: %v", i, err)
		}
	}
	if _, err := steady.Exec(ctx, "SELECT 1").ReadAll(); err != nil {
		t.Fatalf("the steady session while the budget is full: %v", err)
	}
	for _, r := range conns {
		r.Write(msg[len(msg)-1:])
	}
	ok, refused := 0, 0
	for i, r := range conns {
		r.SetReadDeadline(time.Now().Add(30 * time.Second))
		var got []string
		for {
			m, err := r.fe.Receive()
			if err != nil {
				got = append(got, "closed")
				break
			}
			if e, isErr := m.(*pgproto3.ErrorResponse); isErr {
				got = append(got, "E:"+e.Code)
			}
			if _, rfq := m.(*pgproto3.ReadyForQuery); rfq {
				got = append(got, "Z")
				break
			}
		}
		switch strings.Join(got, " ") {
		case "Z":
			ok++
		case "E:53200 closed":
			refused++
		default:
			t.Fatalf("client %d: got %v, want its answer or 53200", i, got)
		}
	}
	if _, err := steady.Exec(ctx, "SELECT 1").ReadAll(); err != nil {
		t.Fatalf("the steady session: %v", err)
	}
	_, peak := procMemory(t, p.cmd.Process.Pid)
	t.Logf("resident before %d MiB, peak %d MiB; %d of %d clients held and answered, %d refused with 53200", base>>20, peak>>20, ok, clients, refused)
	if ok != held || refused != clients-held {
		t.Fatalf("%d answered and %d refused, want the %d the budget holds answered and the others refused", ok, refused, held)
	}
	if peak-base > budget+slack {
		t.Fatalf("peak resident set %d MiB over %d MiB before: more than the %d MiB budget (+%d MiB slack)", (peak-base)>>20, base>>20, budget>>20, slack>>20)
	}
}
