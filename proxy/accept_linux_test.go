package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"golang.org/x/sys/unix"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/testbin"
)

// logRecorder is a log writer for a `pgfence serve` process (one JSON line
// per Write, testbin.Serve) that tests can wait on.
type logRecorder struct {
	mu      sync.Mutex
	lines   []map[string]any
	changed chan struct{} // closed and replaced at every line
}

func newLogRecorder() *logRecorder { return &logRecorder{changed: make(chan struct{})} }

func (l *logRecorder) Write(b []byte) (int, error) {
	var m map[string]any
	if json.Unmarshal(bytes.TrimSpace(b), &m) != nil {
		m = map[string]any{"msg": string(b)}
	}
	l.mu.Lock()
	l.lines = append(l.lines, m)
	close(l.changed)
	l.changed = make(chan struct{})
	l.mu.Unlock()
	return len(b), nil
}

// with returns the lines whose message starts with msg.
func (l *logRecorder) with(msg string) []map[string]any {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, m := range l.lines {
		if s, _ := m["msg"].(string); strings.HasPrefix(s, msg) {
			out = append(out, m)
		}
	}
	return out
}

// wait waits until n lines start with msg and returns them.
func (l *logRecorder) wait(t *testing.T, msg string, n int) []map[string]any {
	t.Helper()
	ctx := ctxT(t)
	for {
		l.mu.Lock()
		ch := l.changed
		l.mu.Unlock()
		if got := l.with(msg); len(got) >= n {
			return got
		}
		select {
		case <-ch:
		case <-ctx.Done():
			t.Fatalf("the log has %d lines %q, want %d", len(l.with(msg)), msg, n)
		}
	}
}

// openFDs returns the numbers of pid's open file descriptors, in order.
func procFDs(t *testing.T, pid int) []int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	var fds []int
	for _, e := range ents {
		if n, err := strconv.Atoi(e.Name()); err == nil {
			fds = append(fds, n)
		}
	}
	sort.Ints(fds)
	return fds
}

// allowFDs sets pid's soft limit on descriptors so that exactly n more can
// be opened than it has open now: a new descriptor takes the lowest free
// number, which must be below the limit, so the limit is one more than the
// n-th free number (the lowest free number for none).
func allowFDs(t *testing.T, pid, n int) (limit int) {
	t.Helper()
	open := procFDs(t, pid)
	used := make(map[int]bool, len(open))
	for _, fd := range open {
		used[fd] = true
	}
	free := 0
	for ; ; limit++ {
		if used[limit] {
			continue
		}
		if free == n {
			break
		}
		free++
	}
	var old unix.Rlimit
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, nil, &old); err != nil {
		t.Fatal(err)
	}
	lim := unix.Rlimit{Cur: uint64(limit), Max: old.Max}
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, &lim, nil); err != nil {
		t.Fatalf("prlimit %d nofile %d: %v", pid, limit, err)
	}
	return limit
}

// freeBelow returns how many descriptors pid may open under limit.
func freeBelow(t *testing.T, pid, limit int) int {
	t.Helper()
	n := limit
	for _, fd := range procFDs(t, pid) {
		if fd < limit {
			n--
		}
	}
	return n
}

// TestServeOutOfDescriptors runs `pgfence serve` (with the write gate)
// under a real descriptor limit (prlimit on the process): when accept
// fails with EMFILE the server keeps serving the sessions it has, new
// clients wait in the backlog, the episode is logged once, and they are
// served once descriptors free up; a session that gets its client socket
// but not its upstream connection, or not the event loop's duplicates, is
// refused with 53000 and nothing else notices. Before the fix, the
// first EMFILE from accept ended Serve and with it every session.
func TestServeOutOfDescriptors(t *testing.T) {
	logs := newLogRecorder()
	cmd, addr := testbin.Serve(t, logs, "--listen", "127.0.0.1:0", "--primary", cluster.Primary.DSN("postgres"), "--auth", "trust")
	pid := cmd.Process.Pid
	t.Cleanup(func() {
		if t.Failed() {
			logs.mu.Lock()
			defer logs.mu.Unlock()
			for _, l := range logs.lines {
				t.Log(l)
			}
		}
	})
	db := cluster.NewDatabase(t)
	dsn := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable&connect_timeout=60", addr.Port, db)
	alive := func(what string) {
		t.Helper()
		if err := syscall.Kill(pid, 0); err != nil {
			t.Fatalf("%s: pgfence serve has exited: %v", what, err)
		}
	}
	// a is open throughout: it has its descriptors, and the gate has
	// read the database's catalog (a control connection).
	a := connect(t, dsn)
	wantValue(t, a, "SELECT 1", "1")
	type result struct {
		c   *pgconn.PgConn
		err error
	}
	pending := func() <-chan result {
		ch := make(chan result, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			c, err := pgconn.Connect(ctx, dsn)
			if err == nil {
				t.Cleanup(func() { c.Close(context.Background()) })
			}
			ch <- result{c, err}
		}()
		return ch
	}
	// refused checks that a client got 53000 with msg: at connect, or,
	// when the proxy had told it the session was ready before the loop
	// refused it, as the answer to its first query.
	refused := func(r result, msg string) {
		t.Helper()
		err := r.err
		if err == nil {
			_, err = r.c.Exec(ctxT(t), "SELECT 1").ReadAll()
		}
		if got := pgtest.SQLState(err); got != "53000" || !strings.Contains(err.Error(), msg) {
			t.Fatalf("got %v (SQLSTATE %q), want 53000 %s", err, got, msg)
		}
	}

	// No descriptor to spare: accept fails (EMFILE), b waits in the
	// backlog, a goes on; with descriptors b is served.
	allowFDs(t, pid, 0)
	b := pending()
	logs.wait(t, "accept failing", 1)
	alive("accept failing")
	wantValue(t, a, "SELECT 2", "2")
	allowFDs(t, pid, 5)
	r := <-b
	if r.err != nil {
		t.Fatalf("a client that waited while accept failed: %v", r.err)
	}
	wantValue(t, r.c, "SELECT 3", "3")
	logs.wait(t, "accepting again", 1)

	// One descriptor: the client is accepted, its upstream dial fails.
	allowFDs(t, pid, 1)
	refused(<-pending(), "cannot open a connection to PostgreSQL")
	// Two: the upstream connection opens, the event loop's duplicates
	// cannot be had.
	allowFDs(t, pid, 2)
	refused(<-pending(), "cannot relay this session")
	alive("refusals")
	wantValue(t, a, "SELECT 4", "4")

	// Five, what a session with the gate needs while it opens (its
	// client's and upstream's sockets and the loop's 3 duplicates, the
	// first 2 closed once it runs): c opens, and holds 3. The next client
	// is refused; when c leaves, its descriptors serve the one after.
	limit := allowFDs(t, pid, 5)
	c := connect(t, dsn)
	wantValue(t, c, "SELECT 5", "5")
	refused(<-pending(), "cannot relay this session")
	c.Close(ctxT(t))
	pollFind(t, "the descriptors of the session that ended", func() (int, bool) {
		n := freeBelow(t, pid, limit)
		return n, n == 5
	})
	wantValue(t, connect(t, dsn), "SELECT 6", "6")

	// The limit back: every client is served.
	allowFDs(t, pid, 200)
	for i := range 5 {
		wantValue(t, connect(t, dsn), fmt.Sprintf("SELECT %d", 10+i), strconv.Itoa(10+i))
	}
	alive("the end")
	// accept(2) takes a descriptor before it looks at the backlog, so
	// it fails whenever none is free, client or not: every phase above
	// with none to spare had an episode, logged once in 10 s (the test
	// takes less).
	starts, ends := logs.with("accept failing"), logs.with("accepting again")
	if len(starts) < 1 || len(starts) > 2 || len(ends) > len(starts) {
		t.Errorf("%d log lines \"accept failing\" and %d \"accepting again\", want 1 or 2, and no more ends", len(starts), len(ends))
	}
	for _, e := range ends {
		if n, _ := e["failed_accepts"].(float64); n < 1 {
			t.Errorf("accepting again: failed_accepts %v, want at least 1", e["failed_accepts"])
		}
	}
	if errs := logs.with("panic"); len(errs) > 0 {
		t.Errorf("panics: %v", errs)
	}
}
