package proxy

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// A statement whose effect on the fence settings its text does not tell
// (pg_dump's set_config(name, ...) FROM pg_settings) passes, and the gate
// reads the settings back before it next decides from them (issue 19 §1):
// its view of the session never differs from the server's.
func TestSettingsReadBack(t *testing.T) {
	for _, m := range []struct {
		name string
		mode pgx.QueryExecMode
	}{{"simple", pgx.QueryExecModeSimpleProtocol}, {"extended", pgx.QueryExecModeDescribeExec}} {
		t.Run(m.name, func(t *testing.T) {
			e := newFenceEnv(t)
			r := e.acquire(t, "r", "w1", time.Minute)
			other := e.acquire(t, "s", "w1", time.Minute)
			c := e.mustConnect(t, client{lease: &r, mode: m.mode})
			ctx := ctxT(t)
			// pg_dump's own form still runs.
			if _, err := c.Exec(ctx, "SELECT set_config(name, '0', false) FROM pg_settings WHERE name IN ('statement_timeout', 'lock_timeout')"); err != nil {
				t.Fatalf("pg_dump's set_config: %v", err)
			}
			// The same form switching the session to job s's generation.
			q := fmt.Sprintf(`SELECT set_config(n, v, false) FROM (VALUES ('fence.job_key', 's'), ('fence.epoch', '%d'), ('fence.token', '%d')) AS x(n, v)`, other.Epoch, other.Token)
			execOK(t, c, q)
			if _, err := c.Exec(ctx, upsert, "s", "via-s", other.Token); err != nil {
				t.Fatalf("write with the read-back generation: %v", err)
			}
			e.wantCount(t, 1, "SELECT count(*) FROM fence.receipts WHERE job_key = 's' AND token = $1 AND digest_version = 'v1'", other.Token)
			e.wantCount(t, 0, "SELECT count(*) FROM fence.receipts WHERE job_key = 'r'")
		})
	}
}
