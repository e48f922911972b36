package proxy

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"
)

// libpq runs COPY … FROM STDIN with PQexecParams as Parse, Bind,
// Describe, Execute and Sync in one write, then, once the server has
// answered CopyInResponse, the data, CopyDone and another Sync
// (PQputCopyEnd adds it in the extended protocol). The server ignores a
// Sync or Flush that comes while it is in COPY FROM STDIN, so the first
// Sync ends nothing: the batch ends at the second. Before the gate knew
// it, it sent the wrapped batch's receipt step before the first Sync,
// into the COPY, and the server ended the session ("unexpected message
// type 0x42 during COPY from stdin").

// libpqCopy sends sql (a COPY … FROM STDIN) as PQexecParams does, and
// data in answer to CopyInResponse, ended by CopyDone (or CopyFail with
// fail) and a Sync; it returns the transcript up to the ReadyForQuery.
func libpqCopy(t *testing.T, tc *transcript, sql, data string) string {
	t.Helper()
	tc.copy = []byte(data)
	tc.syncCopy = true
	tc.fe.Send(&pgproto3.Parse{Query: sql})
	tc.fe.Send(&pgproto3.Bind{})
	tc.fe.Send(&pgproto3.Describe{ObjectType: 'P'})
	tc.fe.Send(&pgproto3.Execute{})
	tc.fe.Send(&pgproto3.Sync{})
	var b strings.Builder
	tc.read(t, &b, 1)
	return b.String()
}

// TestGateCopyLibpqOrder: a protected COPY FROM STDIN in libpq's order,
// outside a transaction, gets its receipt after the data (a replay and a
// conflict answer its retries); the session goes on with its queue of
// requests in step (a query after it is answered as itself).
func TestGateCopyLibpqOrder(t *testing.T) {
	e, opts := plEnv(t, "libpq", "-c fence.step=x")
	attempt := func(data string) string {
		tc := transcriptConn(t, "through pgfence", e.proxy.dsn(e.db), opts)
		got := libpqCopy(t, tc, "COPY pl (v) FROM STDIN", data)
		// The session is usable, and its answers are its own.
		if after := tc.run(t, &op{simple: []string{"SELECT count(*) FROM pl"}}); !strings.HasPrefix(after, "T [count]\nD [") || !strings.HasSuffix(after, "Z I\n") {
			t.Fatalf("the query after the COPY: %s", after)
		}
		return got
	}
	if got, want := attempt("a\n"), "1\n2\nn\nG\nC COPY 1\nZ I\n"; got != want {
		t.Fatalf("first attempt:\n%s\nwant:\n%s", got, want)
	}
	if n := e.count(t, "SELECT count(*) FROM fence.receipts WHERE job_key = 'libpq' AND digest_version = 'v1'"); n != 1 {
		t.Fatalf("%d receipts of the proxy's digest, want 1", n)
	}
	wantRetries(t, "libpq", attempt("a\n"), attempt("b\n"))
	if n := e.count(t, "SELECT count(*) FROM pl"); n != 1 {
		t.Fatalf("%d rows in pl, want the first attempt's 1", n)
	}
}

// TestGateCopyLibpqOrderCases: the same order in a transaction of the
// client's (the receipt goes before its COMMIT), into an unprotected
// table (nothing is added, and the session's queue stays in step), with
// CopyFail (nothing is written), and with a gate that refuses before the
// COPY starts (the Sync that follows is the batch's end after all).
func TestGateCopyLibpqOrderCases(t *testing.T) {
	e, opts := plEnv(t, "libpq2", "")
	execOK(t, e.direct(t), "CREATE TABLE up (v text)")
	t.Run("in_transaction", func(t *testing.T) {
		tc := transcriptConn(t, "through pgfence", e.proxy.dsn(e.db), opts+" -c fence.step=tx")
		if got := tc.run(t, &op{simple: []string{"BEGIN"}}); got != "C BEGIN\nZ T\n" {
			t.Fatalf("BEGIN: %s", got)
		}
		if got, want := libpqCopy(t, tc, "COPY pl (v) FROM STDIN", "t\n"), "1\n2\nn\nG\nC COPY 1\nZ T\n"; got != want {
			t.Fatalf("COPY:\n%s\nwant:\n%s", got, want)
		}
		if got := tc.run(t, &op{simple: []string{"COMMIT"}}); got != "C COMMIT\nZ I\n" {
			t.Fatalf("COMMIT: %s", got)
		}
		if n := e.count(t, "SELECT count(*) FROM fence.receipts WHERE job_key = 'libpq2' AND step = 'tx' AND digest_version = 'v1'"); n != 1 {
			t.Fatalf("%d receipts, want 1", n)
		}
	})
	t.Run("unprotected", func(t *testing.T) {
		tc := transcriptConn(t, "through pgfence", e.proxy.dsn(e.db), opts+" -c fence.step=up")
		for i := 0; i < 3; i++ {
			if got, want := libpqCopy(t, tc, "COPY up (v) FROM STDIN", "u\n"), "1\n2\nn\nG\nC COPY 1\nZ I\n"; got != want {
				t.Fatalf("COPY %d:\n%s\nwant:\n%s", i, got, want)
			}
		}
		// A gated write after them waits for the state to settle: with a
		// request the server never answers left in the queue, it would
		// wait for ever.
		if got := tc.run(t, &op{simple: []string{"SET fence.step = 'after'", "INSERT INTO pl VALUES ('w')"}}); got != "C SET\nC INSERT 0 1\nZ I\n" {
			t.Fatalf("a gated write after the COPYs: %s", got)
		}
		if n := e.count(t, "SELECT count(*) FROM up"); n != 3 {
			t.Fatalf("%d rows in up, want 3", n)
		}
	})
	t.Run("copy_fail", func(t *testing.T) {
		tc := transcriptConn(t, "through pgfence", e.proxy.dsn(e.db), opts+" -c fence.step=fail")
		tc.fe.Send(&pgproto3.Parse{Query: "COPY pl (v) FROM STDIN"})
		tc.fe.Send(&pgproto3.Bind{})
		tc.fe.Send(&pgproto3.Describe{ObjectType: 'P'})
		tc.fe.Send(&pgproto3.Execute{})
		tc.fe.Send(&pgproto3.Sync{})
		if err := tc.fe.Flush(); err != nil {
			t.Fatal(err)
		}
		for {
			m, err := tc.fe.Receive()
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := m.(*pgproto3.CopyInResponse); ok {
				break
			}
		}
		tc.fe.Send(&pgproto3.CopyData{Data: []byte("f\n")})
		tc.fe.Send(&pgproto3.CopyFail{Message: "client gave up"})
		tc.fe.Send(&pgproto3.Sync{})
		var b strings.Builder
		tc.read(t, &b, 1)
		if got := b.String(); !strings.Contains(got, "E ERROR ERROR 57014") || !strings.HasSuffix(got, "Z I\n") {
			t.Fatalf("CopyFail: %s", got)
		}
		if n := e.count(t, "SELECT count(*) FROM fence.receipts WHERE job_key = 'libpq2' AND step = 'fail'"); n != 0 {
			t.Fatalf("%d receipts after CopyFail, want none", n)
		}
		if got := tc.run(t, &op{simple: []string{"SELECT 1"}}); got != "T [?column?]\nD [1]\nC SELECT 1\nZ I\n" {
			t.Fatalf("after CopyFail: %s", got)
		}
	})
	t.Run("refused_before_copy", func(t *testing.T) {
		// No generation: the gate refuses the COPY (FN008) before it
		// starts, so the server never enters COPY and the Sync ends the
		// batch; the client sends no data.
		tc := transcriptConn(t, "through pgfence", e.proxy.dsn(e.db), "-c fence.step=none")
		got := libpqCopy(t, tc, "COPY pl (v) FROM STDIN", "n\n")
		if !strings.Contains(got, "E ERROR ERROR FN008") || strings.Contains(got, "G\n") || !strings.HasSuffix(got, "Z I\n") {
			t.Fatalf("refused COPY: %s", got)
		}
		if after := tc.run(t, &op{simple: []string{"SELECT 1"}}); after != "T [?column?]\nD [1]\nC SELECT 1\nZ I\n" {
			t.Fatalf("after the refusal: %s", after)
		}
	})
}
