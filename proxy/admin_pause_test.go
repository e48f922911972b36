package proxy

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// sessionOf returns the proxy's session of client c (through p).
func sessionOf(t *testing.T, p *testProxy, c *pgconn.PgConn) *Session {
	t.Helper()
	addr := c.Conn().LocalAddr().String()
	return pollFind(t, "session for client "+addr, func() (*Session, bool) {
		for _, ss := range p.srv.sessions() {
			if ss.ClientAddr.String() == addr {
				return ss, true
			}
		}
		return nil, false
	})
}

// rawSend sends Query messages for sqls on c at once, without waiting
// for answers (read them with rawAnswers).
func rawSend(t *testing.T, c *pgconn.PgConn, sqls ...string) {
	t.Helper()
	for _, sql := range sqls {
		c.Frontend().Send(&pgproto3.Query{String: sql})
	}
	if err := c.Frontend().Flush(); err != nil {
		t.Fatal(err)
	}
}

// rawAnswers reads c's answers up to the n-th ReadyForQuery (after
// rawSend) or a FATAL error and returns, per query, its first value or
// its SQLSTATE.
func rawAnswers(t *testing.T, c *pgconn.PgConn, n int) []string {
	t.Helper()
	c.Conn().SetReadDeadline(time.Now().Add(30 * time.Second))
	defer c.Conn().SetReadDeadline(time.Time{})
	var out []string
	cur := ""
	for len(out) < n {
		m, err := c.Frontend().Receive()
		if err != nil {
			t.Fatalf("after %v: %v", out, err)
		}
		switch m := m.(type) {
		case *pgproto3.DataRow:
			if cur == "" && len(m.Values) > 0 {
				cur = string(m.Values[0])
			}
		case *pgproto3.ErrorResponse:
			cur = m.Code
			if m.Severity == "FATAL" { // no ReadyForQuery follows
				return append(out, cur)
			}
		case *pgproto3.ReadyForQuery:
			out = append(out, cur)
			cur = ""
		}
	}
	return out
}

// connectAsync connects to dsn in the background and reports how that
// went, closing the connection.
func connectAsync(ctx context.Context, dsn string) <-chan error {
	done := make(chan error, 1)
	go func() {
		c, err := pgconn.Connect(ctx, dsn)
		if err == nil {
			c.Close(ctx)
		}
		done <- err
	}()
	return done
}

// mustConsole connects to p's console as user with its password.
func mustConsole(t *testing.T, p *testProxy, user string) *pgx.Conn {
	t.Helper()
	c, err := consoleConnect(t, p, user, consolePassword(user))
	if err != nil {
		t.Fatalf("console as %s: %v", user, err)
	}
	return c
}

// clientState returns the state column of SHOW CLIENTS for client c.
func clientState(t *testing.T, adm *pgx.Conn, c *pgconn.PgConn) string {
	t.Helper()
	addr := c.Conn().LocalAddr().String()
	for _, r := range table(t, adm, "SHOW CLIENTS") {
		if r["addr"]+":"+r["port"] == addr {
			return r["state"]
		}
	}
	return ""
}

// waitClientState polls SHOW CLIENTS until client c is in state.
func waitClientState(t *testing.T, adm *pgx.Conn, c *pgconn.PgConn, state string) {
	t.Helper()
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return clientState(t, adm, c) == state, nil }); err != nil {
		t.Fatalf("client %s never %s (now %q): %v", c.Conn().LocalAddr(), state, clientState(t, adm, c), err)
	}
}

// poolWaiting returns SHOW POOLS' cl_waiting of db.
func poolWaiting(t *testing.T, adm *pgx.Conn, db string) int {
	t.Helper()
	for _, r := range table(t, adm, "SHOW POOLS") {
		if r["database"] == db {
			return mustAtoi(t, r["cl_waiting"])
		}
	}
	return 0
}

// waitPoolWaiting polls SHOW POOLS until n clients wait in db's pool.
func waitPoolWaiting(t *testing.T, adm *pgx.Conn, db string, n int) {
	t.Helper()
	if err := pgtest.Poll(ctxT(t), func() (bool, error) { return poolWaiting(t, adm, db) == n, nil }); err != nil {
		t.Fatalf("SHOW POOLS cl_waiting of %s: %d, want %d: %v", db, poolWaiting(t, adm, db), n, err)
	}
}

func execAsync(ctx context.Context, c *pgconn.PgConn, sql string) <-chan []*pgconn.Result {
	ch := make(chan []*pgconn.Result, 1)
	go func() {
		res, err := c.Exec(ctx, sql).ReadAll()
		if err != nil {
			res = append(res, &pgconn.Result{Err: err})
		}
		ch <- res
	}()
	return ch
}

// stillWaiting fails the test when ch already has a value.
func stillWaiting[T any](t *testing.T, ch <-chan T, what string) {
	t.Helper()
	select {
	case v := <-ch:
		t.Fatalf("%s did not wait: %v", what, v)
	default:
	}
}

func resultErr(res []*pgconn.Result) error {
	for _, r := range res {
		if r.Err != nil {
			return r.Err
		}
	}
	return nil
}

// TestConsolePause is PAUSE for a primary switchover, on every relay
// path: PAUSE waits for the open transaction, which goes on and commits;
// a session's next transaction waits (and the relay does not read its
// client meanwhile: no event for its socket on the loop); new clients wait
// before the proxy connects upstream; RESUME lets everything go on, in
// order, nothing lost.
func TestConsolePause(t *testing.T) {
	bothRelays(t, func(t *testing.T, relay Config) {
		p := startProxy(t, withRelay(relay, withConsole(Config{})))
		db := cluster.NewDatabase(t)
		ctx := ctxT(t)
		a, b := connect(t, p.dsn(db)), connect(t, p.dsn(db))
		mustExec(t, a, "CREATE TABLE t (v int)")
		mustExec(t, a, "BEGIN; INSERT INTO t VALUES (1)")
		adm := mustConsole(t, p, "admin")
		obs := mustConsole(t, p, "watcher")

		paused := make(chan error, 1)
		go func() { _, err := adm.Exec(ctx, "PAUSE"); paused <- err }()
		if err := pgtest.Poll(ctx, func() (bool, error) { return p.srv.ops.ctl.paused(db), nil }); err != nil {
			t.Fatal(err)
		}
		// b is idle: its next transaction waits.
		rawSend(t, b, "INSERT INTO t VALUES (10) RETURNING v")
		waitClientState(t, obs, b, "waiting")
		stillWaiting(t, paused, "PAUSE with a transaction open")
		// The relay does not read the held client, even with more bytes
		// waiting in its socket: no event meanwhile.
		rawSend(t, b, "SELECT 'after'")
		sb := sessionOf(t, p, b)
		ev := clientEvents(sb)
		for range 20 {
			table(t, obs, "SHOW STATE")
			mustExec(t, a, "SELECT 1")
		}
		if d := clientEvents(sb) - ev; d != 0 {
			t.Errorf("%d events for the held client's socket while it waited, want 0", d)
		}

		// a's transaction goes on and commits; then PAUSE returns.
		mustExec(t, a, "INSERT INTO t VALUES (2)")
		mustExec(t, a, "COMMIT")
		if err := <-paused; err != nil {
			t.Fatalf("PAUSE: %v", err)
		}
		if !p.srv.drained(db) {
			t.Fatal("PAUSE returned with a transaction open")
		}
		// Now a's next transaction waits too, and a new client.
		aDone := execAsync(ctx, a, "SELECT count(*) FROM t")
		waitClientState(t, obs, a, "waiting")
		cDone := make(chan error, 1)
		var c *pgconn.PgConn
		go func() {
			var err error
			c, err = pgconn.Connect(ctx, p.dsn(db))
			cDone <- err
		}()
		waitPoolWaiting(t, obs, db, 3) // a, b and the new client
		// Nothing of b's reached PostgreSQL.
		direct := connect(t, cluster.Primary.DSN(db))
		wantValue(t, direct, "SELECT count(*) FROM t WHERE v = 10", "0")
		state := map[string]string{}
		for _, r := range table(t, obs, "SHOW STATE") {
			state[r["key"]] = r["value"]
		}
		if state["paused"] != "yes" {
			t.Errorf("SHOW STATE while paused: %v", state)
		}
		// A stats user cannot RESUME.
		_, err := obs.Exec(ctx, "RESUME")
		wantCode(t, err, "42501")

		if _, err := adm.Exec(ctx, "RESUME"); err != nil {
			t.Fatalf("RESUME: %v", err)
		}
		if got := rawAnswers(t, b, 2); got[0] != "10" || got[1] != "after" {
			t.Fatalf("b's queries after RESUME: %v, want 10, after", got)
		}
		if res := <-aDone; resultErr(res) != nil || string(res[0].Rows[0][0]) != "2" {
			// a's count ran after RESUME, before or after b's insert.
			if resultErr(res) != nil || string(res[0].Rows[0][0]) != "3" {
				t.Fatalf("a's count after RESUME: %v %v", res[0].Rows, resultErr(res))
			}
		}
		if err := <-cDone; err != nil {
			t.Fatalf("new client after RESUME: %v", err)
		}
		defer c.Close(ctx)
		mustExec(t, c, "SELECT 1")
		mustExec(t, b, "SELECT 1") // b goes on as usual
		for _, r := range table(t, obs, "SHOW STATS") {
			if r["database"] == db && mustAtoi(t, r["total_wait_time"]) == 0 {
				t.Errorf("SHOW STATS: total_wait_time 0 after clients waited for RESUME: %v", r)
			}
		}
		_, err = adm.Exec(ctx, "RESUME")
		wantCode(t, err, "55000") // not paused any more
	})
}

// TestConsolePauseDatabase: PAUSE db holds that database only; RESUME db
// ends it; PAUSE without a database while one is paused, RESUME of a
// database not paused, and PAUSE of the console's own are errors.
func TestConsolePauseDatabase(t *testing.T) {
	p := startProxy(t, withConsole(Config{Interceptor: newGate(t)}))
	db1, db2 := cluster.NewDatabase(t), cluster.NewDatabase(t)
	ctx := ctxT(t)
	c1, c2 := connect(t, p.dsn(db1)), connect(t, p.dsn(db2))
	adm := mustConsole(t, p, "admin")
	execOK(t, adm, "PAUSE "+db1)
	held := execAsync(ctx, c1, "SELECT 1")
	waitClientState(t, adm, c1, "waiting")
	mustExec(t, c2, "SELECT 1") // db2 is not paused
	dbs := map[string]string{}
	for _, r := range table(t, adm, "SHOW DATABASES") {
		dbs[r["name"]] = r["paused"]
	}
	if dbs[db1] != "1" || dbs[db2] != "0" {
		t.Errorf("SHOW DATABASES paused: %v", dbs)
	}
	for stmt, code := range map[string]string{"RESUME " + db2: "55000", "RESUME": "55000", "PAUSE " + AdminDatabase: "55000"} {
		_, err := adm.Exec(ctx, stmt)
		wantCode(t, err, code)
	}
	stillWaiting(t, held, "the paused database's query")
	execOK(t, adm, "RESUME "+db1)
	if err := resultErr(<-held); err != nil {
		t.Fatal(err)
	}
}

// TestConsolePauseCancel: ^C on a PAUSE that waits (a cancel request
// with the console's key) gives it up with 57014 and resumes, as
// PgBouncer does; the open transaction is not touched.
func TestConsolePauseCancel(t *testing.T) {
	p := startProxy(t, withConsole(Config{}))
	db := cluster.NewDatabase(t)
	ctx := ctxT(t)
	a, b := connect(t, p.dsn(db)), connect(t, p.dsn(db))
	mustExec(t, a, "BEGIN")
	adm := mustConsole(t, p, "admin")
	paused := make(chan error, 1)
	go func() { _, err := adm.Exec(ctx, "PAUSE"); paused <- err }()
	if err := pgtest.Poll(ctx, func() (bool, error) { return p.srv.ops.ctl.paused(db), nil }); err != nil {
		t.Fatal(err)
	}
	held := execAsync(ctx, b, "SELECT 1")
	obs := mustConsole(t, p, "watcher")
	waitClientState(t, obs, b, "waiting")
	if err := adm.PgConn().CancelRequest(ctx); err != nil {
		t.Fatal(err)
	}
	err := <-paused
	wantCode(t, err, "57014")
	if err := resultErr(<-held); err != nil {
		t.Fatalf("held query after the canceled PAUSE: %v", err)
	}
	mustExec(t, a, "COMMIT") // the transaction was left alone
	if p.srv.ops.ctl.paused(db) {
		t.Error("still paused after the canceled PAUSE")
	}
}

// TestConsoleKill: KILL db ends the database's sessions at once (57P01;
// an open transaction rolls back) and pauses it: a new client waits for
// RESUME db; other databases are untouched. KILL_CLIENT ends one.
func TestConsoleKill(t *testing.T) {
	bothRelays(t, func(t *testing.T, relay Config) {
		p := startProxy(t, withRelay(relay, withConsole(Config{})))
		db, other := cluster.NewDatabase(t), cluster.NewDatabase(t)
		ctx := ctxT(t)
		a, b, o := connect(t, p.dsn(db)), connect(t, p.dsn(db)), connect(t, p.dsn(other))
		mustExec(t, a, "CREATE TABLE t (v int)")
		mustExec(t, a, "BEGIN; INSERT INTO t VALUES (1)")
		adm := mustConsole(t, p, "admin")
		pidA := sessionOf(t, p, a).BackendPID
		execOK(t, adm, "KILL "+db)
		for _, c := range []*pgconn.PgConn{a, b} {
			_, err := c.Exec(ctx, "SELECT 1").ReadAll()
			wantCode(t, err, "57P01")
		}
		mustExec(t, o, "SELECT 1")
		direct := connect(t, cluster.Primary.DSN(db))
		if err := pgtest.Poll(ctx, func() (bool, error) {
			res, err := direct.Exec(ctx, fmt.Sprintf("SELECT count(*) FROM pg_stat_activity WHERE pid = %d", pidA)).ReadAll()
			return err == nil && string(res[0].Rows[0][0]) == "0", err
		}); err != nil {
			t.Fatalf("a's backend still there after KILL: %v", err)
		}
		wantValue(t, direct, "SELECT count(*) FROM t", "0")
		// Killed means paused: a new client waits.
		cDone := connectAsync(ctx, p.dsn(db))
		waitPoolWaiting(t, adm, db, 1)
		execOK(t, adm, "RESUME "+db)
		if err := <-cDone; err != nil {
			t.Fatal(err)
		}

		// KILL_CLIENT by SHOW CLIENTS' id.
		var id string
		for _, r := range table(t, adm, "SHOW CLIENTS") {
			if r["addr"]+":"+r["port"] == o.Conn().LocalAddr().String() {
				id = r["id"]
			}
		}
		if _, err := adm.Exec(ctx, "KILL_CLIENT "+id); err != nil {
			t.Fatalf("KILL_CLIENT %s: %v", id, err)
		}
		_, err := o.Exec(ctx, "SELECT 1").ReadAll()
		wantCode(t, err, "57P01")
		_, err = adm.Exec(ctx, "KILL_CLIENT "+id)
		wantCode(t, err, "42704")
	})
}

// TestConsoleDisable: DISABLE db refuses new clients of db (55000, after
// authentication) and leaves its sessions alone; ENABLE lifts it.
func TestConsoleDisable(t *testing.T) {
	p := startProxy(t, withConsole(Config{Interceptor: newGate(t)}))
	db := cluster.NewDatabase(t)
	ctx := ctxT(t)
	open := connect(t, p.dsn(db))
	adm := mustConsole(t, p, "admin")
	execOK(t, adm, "DISABLE "+db)
	_, err := pgconn.Connect(ctx, p.dsn(db))
	wantCode(t, err, "55000")
	mustExec(t, open, "SELECT 1")
	for _, r := range table(t, adm, "SHOW DATABASES") {
		if r["name"] == db && r["disabled"] != "1" {
			t.Errorf("SHOW DATABASES: %v, want disabled", r)
		}
	}
	for stmt, code := range map[string]string{"DISABLE": "42601", "DISABLE " + AdminDatabase: "55000"} {
		_, err := adm.Exec(ctx, stmt)
		wantCode(t, err, code)
	}
	execOK(t, adm, "ENABLE "+db)
	c := connect(t, p.dsn(db))
	mustExec(t, c, "SELECT 1")
}

// TestConsoleReconnect: RECONNECT marks the server connections
// (close_needed), which in session mode close when their client leaves;
// WAIT_CLOSE returns once they have.
func TestConsoleReconnect(t *testing.T) {
	p := startProxy(t, withConsole(Config{}))
	db := cluster.NewDatabase(t)
	ctx := ctxT(t)
	a := connect(t, p.dsn(db))
	adm := mustConsole(t, p, "admin")
	execOK(t, adm, "RECONNECT "+db)
	b := connect(t, p.dsn(db)) // after RECONNECT: not marked
	pidA := strconv.FormatUint(uint64(sessionOf(t, p, a).BackendPID), 10)
	marks := map[string]string{}
	for _, r := range table(t, adm, "SHOW SERVERS") {
		marks[r["remote_pid"]] = r["close_needed"]
	}
	if len(marks) != 2 || marks[pidA] != "1" {
		t.Fatalf("SHOW SERVERS close_needed by backend: %v, want %s marked, the other not", marks, pidA)
	}
	waited := make(chan error, 1)
	go func() { _, err := adm.Exec(ctx, "WAIT_CLOSE "+db); waited <- err }()
	mustExec(t, a, "SELECT 1") // the session works as before
	stillWaiting(t, waited, "WAIT_CLOSE while the marked connection is open")
	a.Close(ctx)
	if err := <-waited; err != nil {
		t.Fatal(err)
	}
	mustExec(t, b, "SELECT 1")
}

// TestConsoleShutdown: SHUTDOWN WAIT_FOR_SERVERS lets an open
// transaction commit (as SIGTERM), then Serve returns; SHUTDOWN closes
// every session at once.
func TestConsoleShutdown(t *testing.T) {
	t.Run("wait_for_servers", func(t *testing.T) {
		p := startProxy(t, withConsole(Config{}))
		db := cluster.NewDatabase(t)
		ctx := ctxT(t)
		a := connect(t, p.dsn(db))
		mustExec(t, a, "CREATE TABLE t (v int)")
		mustExec(t, a, "BEGIN; INSERT INTO t VALUES (1)")
		adm := mustConsole(t, p, "admin")
		obs := mustConsole(t, p, "watcher")
		_, err := obs.Exec(ctx, "SHUTDOWN")
		wantCode(t, err, "42501")
		execOK(t, adm, "SHUTDOWN WAIT_FOR_SERVERS")
		if err := pgtest.Poll(ctx, func() (bool, error) { return p.srv.draining.Load(), nil }); err != nil {
			t.Fatal(err)
		}
		stillWaiting(t, p.done, "Serve with a transaction open")
		mustExec(t, a, "INSERT INTO t VALUES (2)")
		mustExec(t, a, "COMMIT")
		if err := <-p.done; !errors.Is(err, ErrServerClosed) {
			t.Fatalf("Serve: %v", err)
		}
		p.done <- ErrServerClosed // for the cleanup
		direct := connect(t, cluster.Primary.DSN(db))
		wantValue(t, direct, "SELECT count(*) FROM t", "2")
	})
	t.Run("immediate", func(t *testing.T) {
		p := startProxy(t, withConsole(Config{}))
		db := cluster.NewDatabase(t)
		ctx := ctxT(t)
		a := connect(t, p.dsn(db))
		mustExec(t, a, "BEGIN")
		adm := mustConsole(t, p, "admin")
		execOK(t, adm, "SHUTDOWN")
		if err := <-p.done; !errors.Is(err, ErrServerClosed) {
			t.Fatalf("Serve: %v", err)
		}
		p.done <- ErrServerClosed
		_, err := a.Exec(ctx, "SELECT 1").ReadAll()
		wantCode(t, err, "57P01")
		_, err = adm.Exec(ctx, "SHOW STATE")
		if err == nil {
			t.Error("the console still answers after SHUTDOWN")
		}
	})
}

// TestConsoleSwitchover is docs/console.md's switchover, with the gate
// and a gated transaction: PAUSE app returns once the worker's gated
// transaction committed (with its receipt); KILL app ends the sessions,
// app staying paused: a new client waits; RESUME app lets it connect.
func TestConsoleSwitchover(t *testing.T) {
	e := newOpsEnv(t, Config{})
	ctx := ctxT(t)
	l := e.acquire(t, "sw", "w", time.Minute)
	w := e.worker(t, &l)
	tx, err := w.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	execOK(t, tx, upsert, "sw", "before", l.Token)
	adm := mustConsole(t, e.proxy, "admin")
	paused := make(chan error, 1)
	go func() { _, err := adm.Exec(ctx, "PAUSE "+e.db); paused <- err }()
	if err := pgtest.Poll(ctx, func() (bool, error) { return e.proxy.srv.ops.ctl.paused(e.db), nil }); err != nil {
		t.Fatal(err)
	}
	stillWaiting(t, paused, "PAUSE with a gated transaction open")
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("the gated transaction's COMMIT while PAUSE waits: %v", err)
	}
	if err := <-paused; err != nil {
		t.Fatal(err)
	}
	e.wantResult(t, "sw", "before", l.Token)
	e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 'sw'")
	if _, err := adm.Exec(ctx, "KILL "+e.db); err != nil {
		t.Fatalf("KILL of a paused database: %v", err)
	}
	_, err = w.Exec(ctx, "SELECT 1")
	wantCode(t, err, "57P01")
	cDone := make(chan error, 1)
	go func() {
		c, err := pgconn.Connect(ctx, e.proxy.dsn(e.db))
		if err == nil {
			_, err = c.Exec(ctx, "SELECT 1").ReadAll()
			c.Close(ctx)
		}
		cDone <- err
	}()
	waitPoolWaiting(t, adm, e.db, 1)
	execOK(t, adm, "RESUME "+e.db)
	if err := <-cDone; err != nil {
		t.Fatalf("new client after RESUME: %v", err)
	}
}

// TestConsolePauseShutdown: shutting down while paused ends every wait —
// held sessions are idle, so they are closed (57P01), a new client waiting
// for RESUME is refused (57P01), a PAUSE waiting for a transaction gets
// 57P01 — and Shutdown returns once the open transaction has ended.
func TestConsolePauseShutdown(t *testing.T) {
	bothRelays(t, func(t *testing.T, relay Config) {
		p := startProxy(t, withRelay(relay, withConsole(Config{})))
		db, db2 := cluster.NewDatabase(t), cluster.NewDatabase(t)
		ctx := ctxT(t)
		a, b, open := connect(t, p.dsn(db)), connect(t, p.dsn(db)), connect(t, p.dsn(db2))
		mustExec(t, open, "BEGIN")
		adm := mustConsole(t, p, "admin")
		obs := mustConsole(t, p, "watcher")
		execOK(t, adm, "PAUSE "+db)
		adm2 := mustConsole(t, p, "ops")
		paused := make(chan error, 1)
		go func() { _, err := adm2.Exec(ctx, "PAUSE "+db2); paused <- err }() // waits for open's transaction
		// The PAUSE must be in progress (the console answering) before the
		// shutdown, or its console is idle and simply closed.
		if err := pgtest.Poll(ctx, func() (bool, error) { return p.srv.ops.ctl.paused(db2), nil }); err != nil {
			t.Fatalf("PAUSE %s never took effect: %v", db2, err)
		}
		rawSend(t, a, "SELECT 1")
		rawSend(t, b, "SELECT 2")
		cDone := connectAsync(ctx, p.dsn(db))
		waitPoolWaiting(t, obs, db, 3)
		shut := make(chan error, 1)
		go func() { shut <- p.srv.Shutdown(ctx) }()
		for _, c := range []*pgconn.PgConn{a, b} {
			if got := rawAnswers(t, c, 1); len(got) != 1 || got[0] != "57P01" {
				t.Errorf("held client at shutdown: %v, want 57P01", got)
			}
		}
		err := <-cDone
		wantCode(t, err, "57P01")
		err = <-paused
		wantCode(t, err, "57P01")
		stillWaiting(t, shut, "Shutdown with a transaction open")
		mustExec(t, open, "COMMIT")
		if err := <-shut; err != nil {
			t.Fatalf("Shutdown: %v", err)
		}
	})
}
