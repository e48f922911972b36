package proxy

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestBypass/lockidle (issue 30, attacker D's M1): a client WITHOUT fence
// metadata locks a job's protected rows (a locking read, LOCK TABLE, a
// function or DO block that locks them, over either protocol) and falls
// silent. A gated write of that job would wait for it while holding its
// fence row, and the job's takeover behind that. Through the proxy the
// idle watchdog ends such a session like a fenced one: the rows come free
// and its next request gets FN012. (Directly against PostgreSQL nothing
// bounds it but the server's idle_in_transaction_session_timeout:
// docs/security.md, known limits.)
func init() { registerBypass("lockidle", bypassLockIdle) }

func bypassLockIdle(t *testing.T) {
	simple, extended := pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement
	cases := []struct {
		name string
		mode pgx.QueryExecMode
		sqls []string
	}{
		{"for_update", simple, []string{"BEGIN", "SELECT payload FROM results WHERE job_key = 'r' FOR UPDATE"}},
		{"for_no_key_update", simple, []string{"BEGIN", "SELECT payload FROM results WHERE job_key = 'r' FOR NO KEY UPDATE"}},
		{"for_key_share_in_cte", simple, []string{"BEGIN", "WITH x AS (SELECT payload FROM results WHERE job_key = 'r' FOR SHARE) SELECT count(*) FROM x"}},
		{"for_update_extended", extended, []string{"BEGIN", "SELECT payload FROM results WHERE job_key = 'r' FOR UPDATE"}},
		{"lock_table", simple, []string{"BEGIN", "LOCK TABLE results IN ACCESS EXCLUSIVE MODE"}},
		{"lock_table_row_share", simple, []string{"BEGIN", "LOCK TABLE results IN EXCLUSIVE MODE"}},
		{"function_locks", simple, []string{"BEGIN", "SELECT lockidle_lock('r')"}},
		{"function_locks_extended", extended, []string{"BEGIN", "SELECT lockidle_lock('r')"}},
		{"do_block_locks", simple, []string{"BEGIN", "DO $$BEGIN PERFORM 1 FROM results WHERE job_key = 'r' FOR UPDATE; END$$"}},
		{"after_savepoint", simple, []string{"BEGIN", "SAVEPOINT s", "SELECT payload FROM results WHERE job_key = 'r' FOR UPDATE"}},
		// (round 2, attacker E's M2) What the text does not show: the
		// database says which locks the silent transaction holds.
		{"view_for_update", simple, []string{"BEGIN", "SELECT payload FROM lockidle_v"}},
		{"view_for_update_extended", extended, []string{"BEGIN", "SELECT payload FROM lockidle_v"}},
		{"view_calls_locking_function", simple, []string{"BEGIN", "SELECT n FROM lockidle_fv"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			ctx := ctxT(t)
			e := newIdleEnv(t)
			execOK(t, e.direct(t), `CREATE FUNCTION lockidle_lock(k text) RETURNS int LANGUAGE plpgsql AS
				$$BEGIN PERFORM 1 FROM results WHERE job_key = k FOR UPDATE; RETURN 1; END$$;
				CREATE VIEW lockidle_v AS SELECT payload FROM results WHERE job_key = 'r' FOR UPDATE;
				CREATE VIEW lockidle_fv AS SELECT lockidle_lock('r') AS n`)
			w := e.mustConnect(t, client{lease: &e.lease})
			if _, err := w.Exec(ctx, fmt.Sprintf("INSERT INTO results (job_key, payload, token) VALUES ('r', 'mine', %d)", e.lease.Token)); err != nil {
				t.Fatal(err)
			}
			w.Close(ctx)
			locker := e.mustConnect(t, client{})
			idleExec(t, locker, c.mode, c.sqls...)
			if rowsFree(t, e, "r") {
				t.Fatal("the locker does not hold the job's rows")
			}
			wait, cancel := context.WithTimeout(context.Background(), 20*idleBound+10*time.Second)
			defer cancel()
			if err := pgtest.Poll(wait, func() (bool, error) { return rowsFree(t, e, "r"), nil }); err != nil {
				t.Fatalf("a silent client without fence metadata still locks the job's rows: %v", err)
			}
			_, err := locker.Exec(ctx, "SELECT 1")
			wantCode(t, err, fence.CodeGateTimeout)
		})
	}
}

// A silent transaction that holds no lock but ACCESS SHARE (a plain read)
// is asked about and left alone: it blocks no gated write.
func init() { registerBypass("lockidle_plain_read_kept", bypassLockIdlePlainRead) }

func bypassLockIdlePlainRead(t *testing.T) {
	ctx := ctxT(t)
	e := newIdleEnv(t)
	reader := e.mustConnect(t, client{})
	idleExec(t, reader, pgx.QueryExecModeSimpleProtocol, "BEGIN", "SELECT payload FROM results")
	before := e.gate.idle.asked.Load()
	// Asked about twice: silent past the bound each time, and kept.
	if err := pgtest.Poll(ctx, func() (bool, error) { return e.gate.idle.asked.Load() >= before+2, nil }); err != nil {
		t.Fatalf("the watchdog did not ask about the silent transaction: %v", err)
	}
	if _, err := reader.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatalf("a silent transaction holding only ACCESS SHARE was ended: %v", err)
	}
	if !rowsFree(t, e, "r") {
		t.Fatal("a plain read holds the job's rows")
	}
}

// rowsFree reports whether job's rows of results can be locked now.
func rowsFree(t *testing.T, e *reservedEnv, job string) bool {
	t.Helper()
	ctx := ctxT(t)
	c, err := cluster.Primary.Connect(ctx, e.db)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	tx := beginOK(t, c)
	defer tx.Rollback(ctx)
	// NOWAIT covers the rows; lock_timeout the table (LOCK TABLE): both 55P03.
	execOK(t, tx, "SET LOCAL lock_timeout = '100ms'")
	_, err = tx.Exec(ctx, "SELECT 1 FROM results WHERE job_key = $1 FOR UPDATE NOWAIT", job)
	if pgtest.SQLState(err) == "55P03" {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}
