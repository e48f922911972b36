package audit_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/audit"
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// schema: results keeps one row per job (L1 upsert), outbox one row per
// committed token; both protected.
const schema = `
create table results (job_key text primary key, payload text not null, token bigint not null);
create table outbox (id bigserial primary key, job_key text not null, token bigint not null, event text not null);
select fence.protect('results');
select fence.protect('outbox');
`

var resultTables = []audit.ResultTable{
	{Table: "results", JobKeyColumn: "job_key", TokenColumn: "token", Steps: []string{""}, Upsert: true},
	{Table: "outbox", JobKeyColumn: "job_key", TokenColumn: "token", Steps: []string{""}},
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// history is a clean pgfence history and what its clients recorded.
type history struct {
	t       *testing.T
	db      string
	admin   *pgx.Conn
	leases  map[string]fence.Lease // by name: A, B (takeover), C (after retire), D, E
	clients []audit.ClientRecord
	reads   []audit.ReadRecord
}

func connect(t *testing.T, db string) *pgx.Conn {
	t.Helper()
	conn, err := cluster.Primary.Connect(ctxT(t), db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func (h *history) exec(sql string, args ...any) {
	h.t.Helper()
	if _, err := h.admin.Exec(ctxT(h.t), sql, args...); err != nil {
		h.t.Fatalf("%s: %v", sql, err)
	}
}

// execRaw runs sql as superuser with triggers off: a write that bypasses
// the fence functions and the backstop.
func (h *history) execRaw(sql string, args ...any) {
	h.t.Helper()
	ctx := ctxT(h.t)
	tx, err := h.admin.Begin(ctx)
	if err != nil {
		h.t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "set local session_replication_role = replica"); err != nil {
		h.t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, sql, args...); err != nil {
		h.t.Fatalf("%s: %v", sql, err)
	}
	if err := tx.Commit(ctx); err != nil {
		h.t.Fatal(err)
	}
}

func (h *history) acquire(name, job string) fence.Lease {
	h.t.Helper()
	l, err := fence.Acquire(ctxT(h.t), h.admin, job, name, time.Minute)
	if err != nil {
		h.t.Fatalf("acquire %s for %s: %v", job, name, err)
	}
	h.leases[name] = l
	return l
}

func (h *history) expire(job string) {
	h.exec("update fence.leases set expires_at = clock_timestamp() - interval '1 second' where job_key = $1", job)
}

// write commits the result and an outbox event of l through the fence
// package on conn, and records the attempt as a client would.
func (h *history) write(conn *pgx.Conn, g fence.Generation, payload string) (fence.CommitResult, error) {
	h.t.Helper()
	res, err := fence.RunTx(ctxT(h.t), conn, g, []byte(payload), func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `insert into results (job_key, payload, token) values ($1, $2, $3)
			on conflict (job_key) do update set payload = excluded.payload, token = excluded.token
			where results.token < excluded.token`, g.JobKey, payload, g.Token); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "insert into outbox (job_key, token, event) values ($1, $2, $3)", g.JobKey, g.Token, payload)
		return err
	})
	outcome := audit.OutcomeError
	switch {
	case err == nil && res == fence.Committed:
		outcome = audit.OutcomeCommitted
	case err == nil && res == fence.Replayed:
		outcome = audit.OutcomeReplayed
	case fence.IsStale(err):
		outcome = audit.OutcomeStale
	}
	h.clients = append(h.clients, audit.ClientRecord{Job: g.JobKey, Epoch: g.Epoch, Token: g.Token, Step: g.Step,
		Digest: fence.PayloadDigest([]byte(payload)), Outcome: outcome, At: time.Now()})
	return res, err
}

func (h *history) mustWrite(conn *pgx.Conn, l fence.Lease, payload string, want fence.CommitResult) {
	h.t.Helper()
	res, err := h.write(conn, l.Generation(""), payload)
	if err != nil || res != want {
		h.t.Fatalf("write %q as %s: got %v, %v; want %v", payload, l.Holder, res, err, want)
	}
}

func (h *history) accept(consumer string, l fence.Lease, want bool) {
	h.t.Helper()
	ok, err := fence.AcceptEvent(ctxT(h.t), h.admin, consumer, l.JobKey, l.Epoch, l.Token)
	if err != nil || ok != want {
		h.t.Fatalf("accept %s@%d/%d by %s: got %v, %v; want %v", l.JobKey, l.Epoch, l.Token, consumer, ok, err, want)
	}
}

// cleanHistory drives a history through the fence package: a commit that
// a takeover waits for, a stale commit refused, a replay, a retire and
// re-create, a second job with a takeover that never wrote, consumer
// accepts and rejections.
func cleanHistory(t *testing.T) *history {
	t.Helper()
	ctx := ctxT(t)
	h := &history{t: t, db: cluster.NewDatabase(t), leases: map[string]fence.Lease{}}
	h.admin = connect(t, h.db)
	h.exec(schema)
	worker := connect(t, h.db)

	// A commits while B's takeover waits on the fence row lock.
	a := h.acquire("A", "report")
	txA, err := worker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := fence.Gate(ctx, txA, a.Generation("")); err != nil || r != fence.GateOK {
		t.Fatalf("A's gate: got %v, %v", r, err)
	}
	if _, err := txA.Exec(ctx, "insert into results values ('report', 'A1', $1)", a.Token); err != nil {
		t.Fatal(err)
	}
	if _, err := txA.Exec(ctx, "insert into outbox (job_key, token, event) values ('report', $1, 'A1')", a.Token); err != nil {
		t.Fatal(err)
	}
	h.expire("report")
	other := connect(t, h.db)
	done := pgtest.Blocked(t, h.admin, other.PgConn().PID(), func() (fence.Lease, error) {
		return fence.Acquire(ctx, other, "report", "B", time.Minute)
	}) // B's takeover waits on A's fence row lock
	if r, err := fence.Commit(ctx, txA, a.Generation(""), fence.PayloadDigest([]byte("A1")), fence.PayloadDigestVersion); err != nil || r != fence.Committed {
		t.Fatalf("A's receipt: got %v, %v", r, err)
	}
	if err := txA.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h.clients = append(h.clients, audit.ClientRecord{Job: "report", Epoch: a.Epoch, Token: a.Token,
		Digest: fence.PayloadDigest([]byte("A1")), Outcome: audit.OutcomeCommitted, At: time.Now()})
	r := <-done
	if r.Err != nil {
		t.Fatalf("B's takeover: %v", r.Err)
	}
	b := r.Val
	h.leases["B"] = b

	// A again, now stale; B commits, then retries after a "lost" response.
	if _, err := h.write(worker, a.Generation("second"), "A2"); !fence.IsStale(err) {
		t.Fatalf("A after takeover: got %v, want stale", err)
	}
	h.mustWrite(worker, b, "B1", fence.Committed)
	h.mustWrite(worker, b, "B1", fence.Replayed)
	h.accept("mailer", a, true)
	h.accept("mailer", b, true)
	h.accept("mailer", a, false)
	h.reads = append(h.reads, audit.ReadRecord{Job: "report", GenerationToken: b.Token, SawToken: b.Token},
		audit.ReadRecord{Job: "report", GenerationToken: b.Token, SawToken: 0})

	// Retire and re-create the key: a new epoch, tokens go on.
	if err := fence.Retire(ctx, h.admin, "report", fence.RetireOptions{Force: true}); err != nil {
		t.Fatal(err)
	}
	h.accept("mailer", b, false) // closed epoch
	c := h.acquire("C", "report")
	if c.Epoch == b.Epoch {
		t.Fatalf("re-created job kept epoch %d", c.Epoch)
	}
	h.mustWrite(worker, c, "C1", fence.Committed)
	h.accept("mailer", c, true)
	h.reads = append(h.reads, audit.ReadRecord{Job: "report", GenerationToken: b.Token, SawToken: c.Token})

	// A second job: D commits, E takes over and has not written yet.
	d := h.acquire("D", "other")
	h.mustWrite(worker, d, "D1", fence.Committed)
	h.expire("other")
	h.acquire("E", "other")
	return h
}

func (h *history) audit(opts audit.Options) *audit.Report {
	h.t.Helper()
	if opts.Results == nil {
		opts.Results = resultTables
	}
	rep, err := audit.Run(ctxT(h.t), connect(h.t, h.db), opts)
	if err != nil {
		h.t.Fatalf("audit: %v", err)
	}
	return rep
}

// wantOnly fails unless the report has violations of check (at least one)
// and of no other check.
func wantOnly(t *testing.T, rep *audit.Report, check int) {
	t.Helper()
	var text strings.Builder
	rep.WriteText(&text)
	if rep.OK() || len(rep.ViolationsOf(check)) == 0 {
		t.Fatalf("got no violation of check %d, want one:\n%s", check, text.String())
	}
	for _, v := range rep.Violations {
		if v.Check != check {
			t.Fatalf("got a violation of check %d, want only check %d:\n%s", v.Check, check, text.String())
		}
	}
	t.Logf("report:\n%s", text.String())
}

// wantOne is wantOnly for exactly one violation, whose description
// contains desc.
func wantOne(t *testing.T, rep *audit.Report, check int, desc string) {
	t.Helper()
	wantOnly(t, rep, check)
	if got := rep.ViolationsOf(check); len(got) != 1 || !strings.Contains(got[0].Description, desc) {
		t.Fatalf("got %+v, want one violation of check %d saying %q", got, check, desc)
	}
}

func TestAuditCleanHistory(t *testing.T) {
	t.Parallel()
	h := cleanHistory(t)
	rep := h.audit(audit.Options{Clients: h.clients, Reads: h.reads})
	var text strings.Builder
	if err := rep.WriteText(&text); err != nil {
		t.Fatal(err)
	}
	if !rep.OK() {
		t.Fatalf("clean history: got violations:\n%s", text.String())
	}
	if got := rep.Checks; len(got) != 6 {
		t.Fatalf("checks run: got %v, want 1 to 6", got)
	}
	if rep.Outcomes[audit.OutcomeCommitted] != 4 || rep.Outcomes[audit.OutcomeReplayed] != 1 || rep.Outcomes[audit.OutcomeStale] != 1 {
		t.Fatalf("outcomes: got %v, want committed=4 replayed=1 stale=1", rep.Outcomes)
	}
	if rep.Counts["receipts"] != 4 || rep.Counts["tokens issued"] != 5 || rep.Counts["consumer events accepted"] != 3 || rep.Counts["consumer events rejected"] != 2 {
		t.Fatalf("counts: got %v, want 4 receipts, 5 tokens, 3 accepted, 2 rejected events", rep.Counts)
	}
	if len(rep.Notes) != 0 || len(rep.Skipped) != 0 {
		t.Fatalf("notes %q, skipped %q: want none", rep.Notes, rep.Skipped)
	}
	t.Logf("report:\n%s", text.String())

	// Without client records: checks 1, 2, 5, 6, outcomes from receipts.
	rep = h.audit(audit.Options{})
	if !rep.OK() || len(rep.Checks) != 4 || rep.OutcomeSource != "receipts" || rep.Outcomes[audit.OutcomeCommitted] != 4 {
		t.Fatalf("database-only audit: got ok=%v checks %v outcomes %v from %s", rep.OK(), rep.Checks, rep.Outcomes, rep.OutcomeSource)
	}
	js, err := json.Marshal(rep)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(js), `"ok":true`) {
		t.Fatalf("json: got %s, want ok true", js)
	}

	// A window after the history holds nothing.
	rep = h.audit(audit.Options{Since: time.Now().Add(time.Hour)})
	if !rep.OK() || rep.Counts["receipts"] != 0 || rep.Counts["tokens issued"] != 0 {
		t.Fatalf("empty window: got ok=%v counts %v", rep.OK(), rep.Counts)
	}
	if _, err := audit.Run(ctxT(t), h.admin, audit.Options{Since: time.Now(), Until: time.Now().Add(-time.Hour)}); err == nil {
		t.Fatal("inverted window: got no error")
	}
}

func TestAuditReportsBrokenHistories(t *testing.T) {
	t.Parallel()
	t.Run("check1_receipt_after_takeover", func(t *testing.T) {
		t.Parallel()
		h := cleanHistory(t)
		d := h.leases["D"] // E has taken over "other" and committed its acquire
		h.execRaw("insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version) values ($1, $2, $3, 'late', '\\x00', 'v1')",
			d.JobKey, d.Epoch, d.Token)
		rep := h.audit(audit.Options{})
		wantOnly(t, rep, audit.CheckStaleCommit)
		v := rep.ViolationsOf(audit.CheckStaleCommit)[0]
		if len(v.Rows) != 2 || v.Rows[0].Source != "fence.receipts" || v.Rows[1].Source != "fence.issuance" {
			t.Fatalf("evidence: got %+v, want the receipt and the issuance", v.Rows)
		}
	})
	t.Run("check1_receipt_after_retire", func(t *testing.T) {
		t.Parallel()
		h := cleanHistory(t)
		c := h.leases["C"]
		if err := fence.Retire(ctxT(t), h.admin, "report", fence.RetireOptions{Force: true}); err != nil {
			t.Fatal(err)
		}
		h.execRaw("insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version) values ($1, $2, $3, 'late', '\\x00', 'v1')",
			c.JobKey, c.Epoch, c.Token)
		wantOnly(t, h.audit(audit.Options{}), audit.CheckStaleCommit)
	})
	t.Run("check2_row_without_receipt", func(t *testing.T) {
		t.Parallel()
		h := cleanHistory(t)
		e := h.leases["E"] // issued, never committed
		h.execRaw("insert into outbox (job_key, token, event) values ($1, $2, 'forged')", e.JobKey, e.Token)
		wantOne(t, h.audit(audit.Options{}), audit.CheckReceipts, "no receipt")
	})
	t.Run("check2_receipt_without_row", func(t *testing.T) {
		t.Parallel()
		h := cleanHistory(t)
		h.execRaw("delete from outbox where token = $1", h.leases["D"].Token)
		wantOne(t, h.audit(audit.Options{}), audit.CheckReceipts, "has no row in outbox")
	})
	t.Run("check5_consumer_went_backwards", func(t *testing.T) {
		t.Parallel()
		h := cleanHistory(t)
		a := h.leases["A"]
		h.execRaw("insert into fence.consumer_log (consumer, job_key, epoch, token, accepted) values ('mailer', $1, $2, $3, true)", a.JobKey, a.Epoch, a.Token)
		wantOnly(t, h.audit(audit.Options{}), audit.CheckConsumer)
	})
	t.Run("check5_watermark_behind", func(t *testing.T) {
		t.Parallel()
		h := cleanHistory(t)
		a := h.leases["A"]
		h.execRaw("update fence.consumer_watermarks set epoch = $1, token = $2 where consumer = 'mailer' and job_key = 'report'", a.Epoch, a.Token)
		wantOnly(t, h.audit(audit.Options{}), audit.CheckConsumer)
	})
	t.Run("check6_receipt_epoch_mismatch", func(t *testing.T) {
		t.Parallel()
		h := cleanHistory(t)
		c := h.leases["C"]
		h.execRaw("insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version) values ($1, $2, $3, 'x', '\\x00', 'v1')",
			c.JobKey, c.Epoch+1000, c.Token)
		rep := h.audit(audit.Options{})
		wantOnly(t, rep, audit.CheckLifecycle)
	})
	t.Run("check3_acknowledged_commit_lost", func(t *testing.T) {
		t.Parallel()
		h := cleanHistory(t)
		e, c := h.leases["E"], h.leases["C"]
		clients := append(h.clients,
			audit.ClientRecord{Job: e.JobKey, Epoch: e.Epoch, Token: e.Token, Digest: fence.PayloadDigest([]byte("E1")), Outcome: audit.OutcomeCommitted},
			audit.ClientRecord{Job: c.JobKey, Epoch: c.Epoch, Token: c.Token, Digest: fence.PayloadDigest([]byte("not C1")), Outcome: audit.OutcomeReplayed})
		rep := h.audit(audit.Options{Clients: clients, Reads: h.reads})
		wantOnly(t, rep, audit.CheckAcknowledged)
		if got := rep.ViolationsOf(audit.CheckAcknowledged); len(got) != 2 ||
			!strings.Contains(got[0].Description, "no receipt") || !strings.Contains(got[1].Description, "another digest") {
			t.Fatalf("got %+v, want a missing receipt and a digest mismatch", got)
		}
	})
	t.Run("check4_reader_saw_older_generation", func(t *testing.T) {
		t.Parallel()
		h := cleanHistory(t)
		reads := append(h.reads, audit.ReadRecord{Job: "report", GenerationToken: h.leases["C"].Token, SawToken: h.leases["B"].Token})
		wantOnly(t, h.audit(audit.Options{Clients: h.clients, Reads: reads}), audit.CheckReads)
	})
	t.Run("max_violations", func(t *testing.T) {
		t.Parallel()
		h := cleanHistory(t)
		var reads []audit.ReadRecord
		for range 5 {
			reads = append(reads, audit.ReadRecord{Job: "report", GenerationToken: 10, SawToken: 9})
		}
		rep := h.audit(audit.Options{Reads: reads, MaxViolations: 2})
		if len(rep.Violations) != 2 || rep.Omitted[audit.CheckReads] != 3 || rep.OK() {
			t.Fatalf("got %d violations, %v omitted, want 2 and 3", len(rep.Violations), rep.Omitted)
		}
	})
}

func TestAuditInCallersTransaction(t *testing.T) {
	t.Parallel()
	h := cleanHistory(t)
	ctx := ctxT(t)
	tx, err := h.admin.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	rep, err := audit.Run(ctx, tx, audit.Options{Results: resultTables})
	if err != nil || !rep.OK() {
		t.Fatalf("got %v, %v; want a clean report", rep, err)
	}
	// A bad result table mapping is an error, not a violation.
	_, err = audit.Run(ctx, h.admin, audit.Options{Results: []audit.ResultTable{{Table: "nope", JobKeyColumn: "a", TokenColumn: "b"}}})
	if err == nil || errors.Is(err, context.Canceled) {
		t.Fatalf("unknown result table: got %v, want an error", err)
	}
}

// TestAuditEras: a failover recorded in fence.eras (here made by hand: a
// later era whose floor voids every token of the history). A commit under
// a void token after the era began is a violation of check 1, though no
// larger token was issued (a lost takeover leaves none); commits from
// before it are not. An acknowledged commit absent after an era entered
// without failover_mode sync is counted as lost, not reported; after a
// lossless one it is a violation.
func TestAuditEras(t *testing.T) {
	t.Parallel()
	h := cleanHistory(t)
	era := func(lossless bool) {
		h.exec(`insert into fence.eras (era, system_identifier, timeline, token_floor, valid_floor, lossless, reason)
select max(era) + 1, 42, max(timeline) + 1, (select max(token) from fence.issuance), (select max(token) from fence.issuance), $1, 'a test promotion'
  from fence.eras`, lossless)
	}
	era(false)
	rep := h.audit(audit.Options{Clients: h.clients, Reads: h.reads})
	if !rep.OK() || len(rep.Eras) != 2 || rep.Eras[1].Lossless || len(rep.Notes) != 1 || !strings.Contains(rep.Notes[0], "a test promotion") {
		var text strings.Builder
		rep.WriteText(&text)
		t.Fatalf("history before the era: got ok=%v eras %+v notes %q, want ok, 2 eras, a note on the second:\n%s", rep.OK(), rep.Eras, rep.Notes, text.String())
	}
	d := h.leases["E"] // the current holder of "other", void in the era
	// An acknowledged commit the promotion lost: counted, not a violation.
	lost := append(h.clients, audit.ClientRecord{Job: d.JobKey, Epoch: d.Epoch, Token: d.Token, Step: "lost", Outcome: audit.OutcomeCommitted, At: time.Now()})
	rep = h.audit(audit.Options{Clients: lost, Reads: h.reads})
	if !rep.OK() || rep.Counts["acknowledged commits lost in an asynchronous failover"] != 1 {
		t.Fatalf("a commit lost in an asynchronous failover: got ok=%v counts %v", rep.OK(), rep.Counts)
	}
	// A commit under a void token in the era.
	h.execRaw("insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version, backstop_xid) values ($1, $2, $3, 'zombie', '\\x00', 'v1', pg_current_xact_id())",
		d.JobKey, d.Epoch, d.Token)
	wantOne(t, h.audit(audit.Options{}), audit.CheckStaleCommit, "which voids every token up to")
	// After a lossless era, nothing acknowledged may be missing.
	h.execRaw("delete from fence.receipts where step = 'zombie'")
	h.exec("delete from fence.eras where system_identifier = 42")
	era(true)
	wantOne(t, h.audit(audit.Options{Clients: lost, Reads: h.reads}), audit.CheckAcknowledged, `step "lost" committed, but no receipt exists`)
}
