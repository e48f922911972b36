//go:build pgfence_chaos_broken

package chaos

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/audit"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// brokenBuild: this file is compiled only with the build tag
// pgfence_chaos_broken, which only TestChaosBrokenBuildIsCaught uses, to
// prove that the checker can fail. Its workers skip the fence: they write
// straight to the primary as a superuser with triggers off
// (session_replication_role = replica, so the backstop trigger does not
// fire) and record the receipt themselves, exactly as the proxy would but
// without the fence check. A zombie that wakes up after a takeover then
// commits under its stale token, which check 1 must report.
const brokenBuild = true

func (w *worker) attemptBroken(ctx context.Context, step, payload, digest string) (string, string, string) {
	actx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if w.conn == nil || w.conn.IsClosed() {
		c, err := pgx.Connect(actx, w.cfg.Primary)
		if err != nil {
			return audit.OutcomeError, pgtest.SQLState(err), "connect: " + err.Error()
		}
		w.conn = c
	}
	c := w.conn
	if _, err := c.Exec(actx, "SET session_replication_role = replica"); err != nil {
		return classifyBefore(err)
	}
	d, version := []byte(nil), "broken"
	if digest != "" {
		d, _ = hex.DecodeString(digest)
		version = "client"
	} else {
		s := sha256.Sum256([]byte(payload))
		d = s[:]
	}
	tx, err := c.Begin(actx)
	if err != nil {
		return classifyBefore(err)
	}
	defer tx.Rollback(context.WithoutCancel(actx))
	var stored []byte
	err = tx.QueryRow(actx, `INSERT INTO fence.receipts (job_key, epoch, token, step, payload_digest, digest_version)
		VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING RETURNING payload_digest`,
		w.g.job, w.g.epoch, w.g.token, step, d, version).Scan(&stored)
	if errors.Is(err, pgx.ErrNoRows) {
		if err := tx.QueryRow(actx, `SELECT payload_digest FROM fence.receipts
			WHERE job_key = $1 AND epoch = $2 AND token = $3 AND step = $4`,
			w.g.job, w.g.epoch, w.g.token, step).Scan(&stored); err != nil {
			return classifyBefore(err)
		}
		if bytes.Equal(stored, d) {
			return audit.OutcomeReplayed, "", ""
		}
		return audit.OutcomeConflict, "", ""
	}
	if err != nil {
		return classifyBefore(err)
	}
	for _, q := range []struct {
		sql  string
		args []any
	}{
		{upsertResult, []any{w.g.job, w.g.token, step, payload}},
		{insertLedger, []any{w.g.job, w.g.epoch, w.g.token, step, payload}},
		{insertOutbox, []any{w.g.job, step, payload}},
	} {
		if _, err := tx.Exec(actx, q.sql, q.args...); err != nil {
			return classifyBefore(err)
		}
	}
	if err := tx.Commit(actx); err != nil {
		return classifyCommit(c, err)
	}
	return audit.OutcomeCommitted, "", ""
}
