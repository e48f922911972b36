package proxy

import (
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("session_local_reads", bypassSessionLocalReads) }

// bypassSessionLocalReads (issue 30, round 3, attacker H's M1): a read of
// the session's own state — its prepared statements, cursors, settings,
// the server's activity — was routed to the replica, whose connection
// answered for itself: pg_prepared_statements showed none of the
// session's statements, current_setting('transaction_read_only') said
// on. Such reads run on the session's primary connection; a plain read of
// a table still goes to the replica (the control).
func bypassSessionLocalReads(t *testing.T) {
	e := newRouteEnv(t)
	r := e.reader(t, nil)
	mustExec(t, r, "PREPARE sl_stmt AS SELECT 1")
	// The control: a plain read reaches the replica once it is current.
	if err := pgtest.Poll(ctxT(t), func() (bool, error) {
		_, rep, err := where(t, r, "SELECT count(*), pg_is_in_recovery() FROM audit")
		return rep, err
	}); err != nil {
		t.Fatalf("plain reads never reach the replica: %v", err)
	}
	for _, q := range []string{
		"SELECT count(*), pg_is_in_recovery() FROM pg_prepared_statements WHERE name = 'sl_stmt'",
		"SELECT count(*), pg_is_in_recovery() FROM pg_catalog.pg_prepared_statements",
		"SELECT current_setting('transaction_read_only'), pg_is_in_recovery()",
		"SELECT pg_catalog.current_setting('transaction_read_only'), pg_is_in_recovery()",
		"SELECT setting, pg_is_in_recovery() FROM pg_settings WHERE name = 'transaction_read_only'",
		"SELECT count(*), pg_is_in_recovery() FROM pg_stat_activity WHERE pid = pg_backend_pid()",
		"SELECT count(*), pg_is_in_recovery() FROM pg_cursors",
		"SELECT count(*), pg_is_in_recovery() FROM pg_locks",
		"SELECT inet_server_port(), pg_is_in_recovery()",
		"SELECT pg_my_temp_schema(), pg_is_in_recovery()",
	} {
		t.Run(q, func(t *testing.T) {
			vals, rep, err := where(t, r, q)
			if err != nil {
				t.Fatal(err)
			}
			if rep {
				t.Fatalf("answered by the replica's connection: %v", vals)
			}
		})
	}
}
