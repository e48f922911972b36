package audit

import (
	"bytes"
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

var (
	receiptCols  = []string{"job_key", "epoch", "token", "step", "committed_at", "commit_ts"}
	issuanceCols = []string{"token", "job_key", "epoch", "holder", "issued_at", "commit_ts"}
)

// receiptSelect selects receipt r's evidence columns as r_*.
func (a *auditor) receiptSelect() string {
	return `r.job_key as r_job_key, r.epoch as r_epoch, r.token as r_token, r.step as r_step,
		r.committed_at as r_committed_at, ` + a.cts("r") + ` as r_commit_ts`
}

// checkStaleCommits is check 1 (see the package doc for the reasoning).
func (a *auditor) checkStaleCommits(ctx context.Context) error {
	rcts := a.cts("r")
	sql := `select ` + a.receiptSelect() + `,
		n.token as i_token, n.job_key as i_job_key, n.epoch as i_epoch, n.holder as i_holder,
		n.issued_at as i_issued_at, n.commit_ts as i_commit_ts
	from fence.receipts r
	cross join lateral (
		select i.token, i.job_key, i.epoch, i.holder, i.issued_at, ` + a.cts("i") + ` as commit_ts
		  from fence.issuance i
		 where i.job_key = r.job_key and i.token > r.token
		 order by i.token
		 limit 1) n
	where ` + window("r.committed_at") + `
	  and case when ` + rcts + ` is not null and n.commit_ts is not null
	           then ` + rcts + ` > n.commit_ts
	           else r.committed_at > n.issued_at end`
	if err := a.violations(ctx, CheckStaleCommit, "receipts after a larger token", sql, nil, func(v vals) (string, []Row) {
		return fmt.Sprintf("job %q: a commit under token %s (epoch %s, step %q) committed after token %s had been issued and committed",
				v.str("r_job_key"), v.str("r_token"), v.str("r_epoch"), v.str("r_step"), v.str("i_token")),
			[]Row{v.row("fence.receipts", "r_", receiptCols...), v.row("fence.issuance", "i_", issuanceCols...)}
	}); err != nil {
		return err
	}
	if a.hasEras {
		// A commit under a generation a failover made void: after an era
		// began (a promotion, a restore), under a token not above its
		// valid_floor. A takeover the old primary committed may be lost,
		// so the issuance log cannot show the larger token; the era can.
		// "After": the receipt's writing transaction is younger than the
		// one that made the era (xid8 goes on across a promotion) and its
		// clock reading is later (a restored copy's xids start again).
		sql = `select ` + a.receiptSelect() + `,
			e.era as e_era, e.timeline as e_timeline, e.began_at as e_began_at, e.valid_floor as e_valid_floor, e.reason as e_reason
		from fence.eras e
		join fence.receipts r on r.token <= e.valid_floor and r.backstop_xid >= e.began_xid and r.committed_at >= e.began_at
		where ` + window("r.committed_at")
		if err := a.violations(ctx, CheckStaleCommit, "receipts under void generations", sql, nil, func(v vals) (string, []Row) {
			return fmt.Sprintf("job %q: a commit under token %s (epoch %s, step %q) committed in era %s, which voids every token up to %s",
					v.str("r_job_key"), v.str("r_token"), v.str("r_epoch"), v.str("r_step"), v.str("e_era"), v.str("e_valid_floor")),
				[]Row{v.row("fence.receipts", "r_", receiptCols...), v.row("fence.eras", "e_", "era", "timeline", "began_at", "valid_floor", "reason")}
		}); err != nil {
			return err
		}
	}
	if !a.commitTS {
		return nil
	}
	// A commit after its epoch was retired. The closed epoch row was last
	// written by the retiring transaction, under the fence row lock.
	sql = `select ` + a.receiptSelect() + `,
		e.epoch as e_epoch, e.job_key as e_job_key, e.closed_at as e_closed_at, e.last_token as e_last_token,
		pg_xact_commit_timestamp(e.xmin) as e_commit_ts
	from fence.receipts r
	join fence.epochs e on e.epoch = r.epoch
	where ` + window("r.committed_at") + `
	  and e.closed_at is not null
	  and pg_xact_commit_timestamp(r.xmin) > pg_xact_commit_timestamp(e.xmin)`
	if err := a.violations(ctx, CheckStaleCommit, "receipts after retirement", sql, nil, func(v vals) (string, []Row) {
		return fmt.Sprintf("job %q: a commit under token %s committed after its epoch %s had been retired",
				v.str("r_job_key"), v.str("r_token"), v.str("r_epoch")),
			[]Row{v.row("fence.receipts", "r_", receiptCols...), v.row("fence.epochs", "e_", "epoch", "job_key", "closed_at", "last_token", "commit_ts")}
	}); err != nil {
		return err
	}
	return nil
}

// checkReceipts is check 2.
func (a *auditor) checkReceipts(ctx context.Context) error {
	var pk bool
	err := a.q.QueryRow(ctx, `select exists (
		select 1 from pg_catalog.pg_constraint c
		 where c.conrelid = 'fence.receipts'::regclass and c.contype = 'p'
		   and array(select a.attname::text
		               from unnest(c.conkey) with ordinality k(attnum, ord)
		               join pg_catalog.pg_attribute a on a.attrelid = c.conrelid and a.attnum = k.attnum
		              order by k.ord) = array['job_key', 'epoch', 'token', 'step'])`).Scan(&pk)
	if err != nil {
		return fmt.Errorf("receipts primary key: %w", err)
	}
	if !pk {
		a.violate(CheckReceipts, "fence.receipts has no primary key (job_key, epoch, token, step): nothing keeps a generation to one receipt per step")
	}
	sql := `select r.job_key as r_job_key, r.epoch as r_epoch, r.token as r_token, r.step as r_step, count(*) as r_count
	from fence.receipts r
	where ` + window("r.committed_at") + `
	group by r.job_key, r.epoch, r.token, r.step
	having count(*) > 1`
	if err := a.violations(ctx, CheckReceipts, "duplicate receipts", sql, nil, func(v vals) (string, []Row) {
		return fmt.Sprintf("job %q: %s receipts for epoch %s token %s step %q", v.str("r_job_key"), v.str("r_count"),
				v.str("r_epoch"), v.str("r_token"), v.str("r_step")),
			[]Row{v.row("fence.receipts", "r_", "job_key", "epoch", "token", "step", "count")}
	}); err != nil {
		return err
	}
	for _, t := range a.opts.Results {
		if err := a.checkResultTable(ctx, t); err != nil {
			return fmt.Errorf("result table %s: %w", t.Table, err)
		}
	}
	return nil
}

// readableSQL resolves a result table ($1, qualified by the caller: the
// connection's search_path is pinned) and says what would make reading it
// run code that is not PostgreSQL's own as the auditor, who is often a
// superuser, in a database whose users may have laid it for them
// (issue 30, attacker C's H3: a view dba.results whose function ran COPY
// ... TO PROGRAM as the DBA). Reading a plain table runs no code of its
// owner's but: its row-security policies (the connection pins
// row_security off, so PostgreSQL refuses a read a policy would apply to
// rather than run it; a table with row security is refused here first),
// the type input, output and cast functions of the columns read (built-in
// types only, through any domain: base types and their casts are a
// superuser's to make), and its inheritance children and partitions,
// which must be plain tables too (a foreign table runs its wrapper). Views,
// materialized views, foreign tables, sequences are refused. Every name
// and operator is qualified; nothing here runs anything of the relation.
const readableSQL = `WITH RECURSIVE rel AS (SELECT $1::pg_catalog.regclass::pg_catalog.oid AS oid),
tree AS (SELECT rel.oid FROM rel
  UNION SELECT i.inhrelid FROM pg_catalog.pg_inherits AS i JOIN tree ON i.inhparent OPERATOR(pg_catalog.=) tree.oid),
col AS (SELECT a.attname, pg_catalog.format_type(a.atttypid, NULL) AS shown,
    (WITH RECURSIVE d AS (SELECT a.atttypid AS t
        UNION SELECT ty.typbasetype FROM pg_catalog.pg_type AS ty JOIN d ON ty.oid OPERATOR(pg_catalog.=) d.t
        WHERE ty.typtype OPERATOR(pg_catalog.=) 'd'::pg_catalog."char")
     SELECT pg_catalog.bool_and(ty.typnamespace OPERATOR(pg_catalog.=) 11::pg_catalog.oid)
     FROM d JOIN pg_catalog.pg_type AS ty ON ty.oid OPERATOR(pg_catalog.=) d.t) AS builtin
  FROM pg_catalog.pg_attribute AS a, rel
  WHERE a.attrelid OPERATOR(pg_catalog.=) rel.oid AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped
    AND a.attname OPERATOR(pg_catalog.=) ANY (ARRAY[$2, $3]::pg_catalog.name[]))
SELECT c.oid::pg_catalog.regclass::pg_catalog.text,
  pg_catalog.concat_ws('; ',
    CASE WHEN c.relkind OPERATOR(pg_catalog.<>) ALL (ARRAY['r', 'p']::pg_catalog."char"[])
      THEN pg_catalog.format('is not a table (relkind %s)', c.relkind) END,
    (SELECT pg_catalog.format('has a member %s that is not a plain table', t.oid::pg_catalog.regclass)
       FROM tree AS t JOIN pg_catalog.pg_class AS m ON m.oid OPERATOR(pg_catalog.=) t.oid
      WHERE m.relkind OPERATOR(pg_catalog.<>) ALL (ARRAY['r', 'p']::pg_catalog."char"[]) LIMIT 1),
    (SELECT pg_catalog.format('has row security (%s)', t.oid::pg_catalog.regclass)
       FROM tree AS t JOIN pg_catalog.pg_class AS m ON m.oid OPERATOR(pg_catalog.=) t.oid
      WHERE m.relrowsecurity LIMIT 1),
    (SELECT pg_catalog.format('column %I has type %s, not a built-in one', col.attname, col.shown)
       FROM col WHERE NOT col.builtin LIMIT 1))
FROM rel JOIN pg_catalog.pg_class AS c ON c.oid OPERATOR(pg_catalog.=) rel.oid`

func (a *auditor) checkResultTable(ctx context.Context, t ResultTable) error {
	if t.Table == "" || t.JobKeyColumn == "" || t.TokenColumn == "" {
		return fmt.Errorf("result table %q needs a table, a job key column and a token column", t.Table)
	}
	var rel, problem string
	if err := a.q.QueryRow(ctx, readableSQL, t.Table, t.JobKeyColumn, t.TokenColumn).Scan(&rel, &problem); err != nil {
		return fmt.Errorf("resolve: %w", err)
	}
	if problem != "" {
		return fmt.Errorf("%s %s: the audit reads only a plain table whose reading runs nothing of anyone's (docs/security.md, \"pgfence's own SQL\")", rel, problem)
	}
	job := "t." + pgx.Identifier{t.JobKeyColumn}.Sanitize()
	tok := "t." + pgx.Identifier{t.TokenColumn}.Sanitize()

	// Rows → receipts: a row written under token t needs a receipt of its
	// job for t (any epoch, any step). The receipt is looked up through the
	// token's issuance (primary keys), then by job alone.
	sql := `select b.job as b_job_key, b.token as b_token, count(*) as b_rows,
		i.epoch as b_epoch, coalesce(b.token <= w.pruned_through_token, false) as pruned
	from (select ` + job + `::text as job, ` + tok + `::bigint as token from ` + rel + ` t) b
	left join fence.issuance i on i.token = b.token
	left join fence.gc_watermarks w on w.job_key = b.job and w.epoch = i.epoch
	where (i.token is null or ` + window("i.issued_at") + `)
	  and (b.job is null or b.token is null or (
	       not exists (select 1 from fence.receipts r where r.job_key = b.job and r.epoch = i.epoch and r.token = b.token)
	   and not exists (select 1 from fence.receipts r where r.job_key = b.job and r.token = b.token)))
	group by b.job, b.token, i.epoch, w.pruned_through_token`
	var pruned int64
	err := a.each(ctx, sql, nil, func(v vals) error {
		if v.bool("pruned") {
			pruned++
			return nil
		}
		desc := fmt.Sprintf("%s: %s row(s) of job %q written under token %s have no receipt", rel,
			v.str("b_rows"), v.str("b_job_key"), v.str("b_token"))
		if v["b_job_key"] == nil || v["b_token"] == nil {
			desc = fmt.Sprintf("%s: %s row(s) carry no generation (job %s, token %s)", rel,
				v.str("b_rows"), v.str("b_job_key"), v.str("b_token"))
		}
		a.violate(CheckReceipts, desc, v.row(rel, "b_", "job_key", "token", "rows", "epoch"))
		return nil
	})
	if err != nil {
		return fmt.Errorf("rows without receipt: %w", err)
	}
	if pruned > 0 {
		a.note(fmt.Sprintf("%s: %d (job, token) groups of rows belong to generations whose receipts gc pruned: not verifiable", rel, pruned))
	}
	if t.Steps == nil {
		return nil
	}
	// Receipts → rows: every receipt of the steps that write this table
	// has its row.
	cmp := "="
	if t.Upsert {
		cmp = ">="
	}
	sql = `select ` + a.receiptSelect() + `
	from fence.receipts r
	where ` + window("r.committed_at") + `
	  and r.step = any($3)
	  and not exists (select 1 from ` + rel + ` t where ` + job + `::text = r.job_key and ` + tok + `::bigint ` + cmp + ` r.token)`
	if err := a.violations(ctx, CheckReceipts, "receipts without row", sql, []any{t.Steps}, func(v vals) (string, []Row) {
		return fmt.Sprintf("job %q: the commit of token %s step %q has no row in %s", v.str("r_job_key"), v.str("r_token"), v.str("r_step"), rel),
			[]Row{v.row("fence.receipts", "r_", receiptCols...)}
	}); err != nil {
		return err
	}
	return nil
}

// checkAcknowledged is check 3: acknowledged commits are present with the
// digest the client sent. Records are looked up in batches by primary key.
func (a *auditor) checkAcknowledged(ctx context.Context) error {
	var acked []ClientRecord
	for _, c := range a.opts.Clients {
		if !a.inWindow(c) {
			continue
		}
		a.rep.Outcomes[c.Outcome]++
		if c.Outcome == OutcomeCommitted || c.Outcome == OutcomeReplayed {
			acked = append(acked, c)
		}
	}
	a.rep.OutcomeSource = "client records"
	const batch = 5000
	var pruned, failover int64
	for start := 0; start < len(acked); start += batch {
		part := acked[start:min(start+batch, len(acked))]
		jobs, steps := make([]string, len(part)), make([]string, len(part))
		epochs, tokens := make([]int64, len(part)), make([]int64, len(part))
		for i, c := range part {
			jobs[i], epochs[i], tokens[i], steps[i] = c.Job, c.Epoch, c.Token, c.Step
		}
		lost := "false"
		if a.hasEras {
			// Made before a promotion that may have lost it: a token at
			// most the floor of an era entered without failover_mode sync.
			lost = "exists (select from fence.eras e where not e.lossless and e.valid_floor >= c.token)"
		}
		sql := `select c.n, r.payload_digest, r.digest_version, r.committed_at,
			coalesce(c.token <= w.pruned_through_token, false) as pruned, ` + lost + ` as lost
		from unnest($1::text[], $2::int8[], $3::int8[], $4::text[]) with ordinality as c(job_key, epoch, token, step, n)
		left join fence.receipts r on r.job_key = c.job_key and r.epoch = c.epoch and r.token = c.token and r.step = c.step
		left join fence.gc_watermarks w on w.job_key = c.job_key and w.epoch = c.epoch
		order by c.n`
		err := a.query(ctx, sql, []any{jobs, epochs, tokens, steps}, func(v vals) error {
			c := part[v["n"].(int64)-1]
			rec := Row{Source: "client record", Fields: []Field{
				{"job_key", c.Job}, {"epoch", format(c.Epoch)}, {"token", format(c.Token)}, {"step", c.Step},
				{"digest", format(c.Digest)}, {"outcome", c.Outcome}, {"at", format(c.At)},
			}}
			switch {
			case v["payload_digest"] == nil && v.bool("pruned"):
				pruned++
			case v["payload_digest"] == nil && v.bool("lost"):
				failover++
			case v["payload_digest"] == nil:
				a.violate(CheckAcknowledged,
					fmt.Sprintf("job %q: a client saw epoch %d token %d step %q %s, but no receipt exists", c.Job, c.Epoch, c.Token, c.Step, c.Outcome),
					rec)
			case c.Digest != nil && !bytes.Equal(c.Digest, v["payload_digest"].([]byte)):
				a.violate(CheckAcknowledged,
					fmt.Sprintf("job %q: a client saw epoch %d token %d step %q %s with another digest than the receipt's", c.Job, c.Epoch, c.Token, c.Step, c.Outcome),
					rec, Row{Source: "fence.receipts", Fields: []Field{
						{"payload_digest", v.str("payload_digest")}, {"digest_version", v.str("digest_version")}, {"committed_at", v.str("committed_at")},
					}})
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("acknowledged commits: %w", err)
		}
	}
	if pruned > 0 {
		a.note(fmt.Sprintf("%d acknowledged commits belong to generations whose receipts gc pruned: not verifiable", pruned))
	}
	if failover > 0 {
		a.rep.Counts["acknowledged commits lost in an asynchronous failover"] = failover
		a.note(fmt.Sprintf("%d acknowledged commits are absent and were made before a promotion that could lose them (asynchronous replication, failover_mode async: see the eras)", failover))
	}
	return nil
}

func (a *auditor) inWindow(c ClientRecord) bool {
	if c.At.IsZero() {
		return true
	}
	if !a.opts.Since.IsZero() && c.At.Before(a.opts.Since) {
		return false
	}
	return a.opts.Until.IsZero() || c.At.Before(a.opts.Until)
}

// checkReads is check 4: a reader carrying generation g saw no result of a
// generation below g.
func (a *auditor) checkReads(context.Context) error {
	for _, r := range a.opts.Reads {
		if r.SawToken > 0 && r.SawToken < r.GenerationToken {
			a.violate(CheckReads,
				fmt.Sprintf("job %q: a reader carrying token %d saw a result of token %d", r.Job, r.GenerationToken, r.SawToken),
				Row{Source: "read record", Fields: []Field{
					{"job_key", r.Job}, {"generation_token", format(r.GenerationToken)}, {"saw_token", format(r.SawToken)},
				}})
		}
	}
	a.rep.Counts["reads"] = int64(len(a.opts.Reads))
	return nil
}

var logCols = []string{"id", "consumer", "job_key", "epoch", "token", "at"}

// checkConsumer is check 5: accepted events of one (consumer, job_key) are
// non-decreasing in (epoch, token) in log order, and the watermark is not
// behind the last accepted event.
func (a *auditor) checkConsumer(ctx context.Context) error {
	const sel = `l.id as l_id, l.consumer as l_consumer, l.job_key as l_job_key, l.epoch as l_epoch, l.token as l_token, l.at as l_at`
	report := func(v vals) error {
		a.violate(CheckConsumer,
			fmt.Sprintf("consumer %q, job %q: accepted epoch %s token %s after having accepted epoch %s token %s",
				v.str("l_consumer"), v.str("l_job_key"), v.str("l_epoch"), v.str("l_token"), v.str("p_epoch"), v.str("p_token")),
			v.row("fence.consumer_log", "l_", logCols...),
			v.row("fence.consumer_log", "p_", logCols...))
		return nil
	}
	// Within the window: against every earlier accepted event (running
	// maximum), shown with the one that set it.
	sql := `select ` + sel + `, p.id as p_id, p.consumer as p_consumer, p.job_key as p_job_key,
		p.epoch as p_epoch, p.token as p_token, p.at as p_at
	from (select l.*, max(array[l.epoch, l.token]) over (partition by l.consumer, l.job_key order by l.id
	                   rows between unbounded preceding and 1 preceding) as prev_max
	        from fence.consumer_log l
	       where l.accepted and ` + window("l.at") + `) l
	cross join lateral (
		select p.* from fence.consumer_log p
		 where p.consumer = l.consumer and p.job_key = l.job_key and p.accepted and p.id < l.id
		   and array[p.epoch, p.token] = l.prev_max
		 order by p.id desc limit 1) p
	where array[l.epoch, l.token] < l.prev_max`
	if err := a.each(ctx, sql, nil, report); err != nil {
		return fmt.Errorf("consumer log: %w", err)
	}
	if a.since != nil {
		// The first accepted event of each key in the window against the
		// last one before it.
		sql = `select ` + sel + `, p.id as p_id, p.consumer as p_consumer, p.job_key as p_job_key,
			p.epoch as p_epoch, p.token as p_token, p.at as p_at
		from (select distinct on (l.consumer, l.job_key) l.*
		        from fence.consumer_log l
		       where l.accepted and ` + window("l.at") + `
		       order by l.consumer, l.job_key, l.id) l
		cross join lateral (
			select p.* from fence.consumer_log p
			 where p.consumer = l.consumer and p.job_key = l.job_key and p.accepted and p.id < l.id
			 order by p.id desc limit 1) p
		where array[l.epoch, l.token] < array[p.epoch, p.token]`
		if err := a.each(ctx, sql, nil, report); err != nil {
			return fmt.Errorf("consumer log at the window's start: %w", err)
		}
	}
	sql = `select w.consumer as w_consumer, w.job_key as w_job_key, w.epoch as w_epoch, w.token as w_token,
		p.id as p_id, p.consumer as p_consumer, p.job_key as p_job_key, p.epoch as p_epoch, p.token as p_token, p.at as p_at
	from fence.consumer_watermarks w
	cross join lateral (
		select p.* from fence.consumer_log p
		 where p.consumer = w.consumer and p.job_key = w.job_key and p.accepted
		 order by p.id desc limit 1) p
	where array[w.epoch, w.token] < array[p.epoch, p.token]`
	err := a.query(ctx, sql, nil, func(v vals) error {
		a.violate(CheckConsumer,
			fmt.Sprintf("consumer %q, job %q: the watermark (epoch %s token %s) is behind the last accepted event (epoch %s token %s)",
				v.str("w_consumer"), v.str("w_job_key"), v.str("w_epoch"), v.str("w_token"), v.str("p_epoch"), v.str("p_token")),
			v.row("fence.consumer_watermarks", "w_", "consumer", "job_key", "epoch", "token"),
			v.row("fence.consumer_log", "p_", logCols...))
		return nil
	})
	if err != nil {
		return fmt.Errorf("consumer watermarks: %w", err)
	}
	return nil
}

// checkLifecycle is check 6, plus the issuance order that check 1 relies
// on (reported under check 1).
func (a *auditor) checkLifecycle(ctx context.Context) error {
	sql := `select ` + a.receiptSelect() + `,
		i.token as i_token, i.job_key as i_job_key, i.epoch as i_epoch, i.holder as i_holder,
		i.issued_at as i_issued_at, ` + a.cts("i") + ` as i_commit_ts
	from fence.receipts r
	left join fence.issuance i on i.token = r.token
	where ` + window("r.committed_at") + `
	  and (i.token is null or i.job_key <> r.job_key or i.epoch <> r.epoch)`
	err := a.violations(ctx, CheckLifecycle, "receipts against issuance", sql, nil, func(v vals) (string, []Row) {
		receipt := v.row("fence.receipts", "r_", receiptCols...)
		if v["i_token"] == nil {
			return fmt.Sprintf("job %q: receipt for epoch %s token %s, but token %s was never issued",
				v.str("r_job_key"), v.str("r_epoch"), v.str("r_token"), v.str("r_token")), []Row{receipt}
		}
		return fmt.Sprintf("job %q: receipt for epoch %s token %s, but token %s was issued to job %q in epoch %s",
				v.str("r_job_key"), v.str("r_epoch"), v.str("r_token"), v.str("r_token"), v.str("i_job_key"), v.str("i_epoch")),
			[]Row{receipt, v.row("fence.issuance", "i_", issuanceCols...)}
	})
	if err != nil {
		return err
	}

	ic, pc := a.cts("i"), a.cts("p")
	sql = `select i.token as i_token, i.job_key as i_job_key, i.epoch as i_epoch, i.holder as i_holder,
		i.issued_at as i_issued_at, ` + ic + ` as i_commit_ts,
		e.epoch as e_epoch, e.job_key as e_job_key, e.opened_at as e_opened_at, e.closed_at as e_closed_at,
		p.token as p_token, p.job_key as p_job_key, p.epoch as p_epoch, p.holder as p_holder,
		p.issued_at as p_issued_at, p.commit_ts as p_commit_ts,
		(e.epoch is null or e.job_key <> i.job_key) as foreign_epoch,
		coalesce(p.epoch > i.epoch, false) as epoch_back,
		coalesce(` + ic + ` < p.commit_ts, false) as commit_back
	from fence.issuance i
	left join fence.epochs e on e.epoch = i.epoch
	left join lateral (
		select p.token, p.job_key, p.epoch, p.holder, p.issued_at, ` + pc + ` as commit_ts
		  from fence.issuance p
		 where p.job_key = i.job_key and p.token < i.token
		 order by p.token desc
		 limit 1) p on true
	where ` + window("i.issued_at") + `
	  and (e.epoch is null or e.job_key <> i.job_key or p.epoch > i.epoch or ` + ic + ` < p.commit_ts)`
	err = a.each(ctx, sql, nil, func(v vals) error {
		cur := v.row("fence.issuance", "i_", issuanceCols...)
		prev := v.row("fence.issuance", "p_", issuanceCols...)
		if v.bool("foreign_epoch") {
			desc := fmt.Sprintf("job %q: token %s was issued in epoch %s, which is not an epoch of this job (epoch's job: %s)",
				v.str("i_job_key"), v.str("i_token"), v.str("i_epoch"), v.str("e_job_key"))
			a.violate(CheckLifecycle, desc, cur, v.row("fence.epochs", "e_", "epoch", "job_key", "opened_at", "closed_at"))
		}
		if v.bool("epoch_back") {
			a.violate(CheckLifecycle,
				fmt.Sprintf("job %q: token %s was issued in epoch %s after token %s in the later epoch %s",
					v.str("i_job_key"), v.str("i_token"), v.str("i_epoch"), v.str("p_token"), v.str("p_epoch")),
				prev, cur)
		}
		if v.bool("commit_back") {
			a.violate(CheckStaleCommit,
				fmt.Sprintf("job %q: the acquire of token %s committed before the acquire of the smaller token %s: takeovers were not serialised",
					v.str("i_job_key"), v.str("i_token"), v.str("p_token")),
				prev, cur)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("issuance order: %w", err)
	}

	// Current state: each fence row names the job's latest issued token
	// and its epoch.
	sql = `select f.job_key as f_job_key, f.epoch as f_epoch, f.max_issued_token as f_max_issued_token, f.retired_at as f_retired_at,
		l.token as l_token, l.epoch as l_epoch, l.issued_at as l_issued_at
	from fence.fences f
	left join lateral (
		select i.token, i.epoch, i.issued_at from fence.issuance i
		 where i.job_key = f.job_key order by i.token desc limit 1) l on true
	where l.token is distinct from f.max_issued_token or l.epoch is distinct from f.epoch`
	err = a.query(ctx, sql, nil, func(v vals) error {
		a.violate(CheckLifecycle,
			fmt.Sprintf("job %q: the fence names epoch %s token %s, the issuance log's latest is epoch %s token %s",
				v.str("f_job_key"), v.str("f_epoch"), v.str("f_max_issued_token"), v.str("l_epoch"), v.str("l_token")),
			v.row("fence.fences", "f_", "job_key", "epoch", "max_issued_token", "retired_at"),
			v.row("fence.issuance", "l_", "token", "epoch", "issued_at"))
		return nil
	})
	if err != nil {
		return fmt.Errorf("fences against issuance: %w", err)
	}
	return nil
}

// count fills the report's counts and, without client records, the
// operations by outcome from the receipts.
func (a *auditor) count(ctx context.Context) error {
	var receipts, noTS, issued int64
	rcts := a.cts("r")
	err := a.q.QueryRow(ctx, `select
		(select count(*) from fence.receipts r where `+window("r.committed_at")+`),
		(select count(*) from fence.receipts r where `+window("r.committed_at")+` and `+rcts+` is null),
		(select count(*) from fence.issuance i where `+window("i.issued_at")+`)`,
		a.since, a.until).Scan(&receipts, &noTS, &issued)
	if err != nil {
		return fmt.Errorf("count history: %w", err)
	}
	a.rep.Counts["receipts"] = receipts
	a.rep.Counts["tokens issued"] = issued
	if a.commitTS && noTS > 0 {
		a.note(fmt.Sprintf("%d receipts have no commit timestamp (committed before track_commit_timestamp was on, or too old): check 1 used their committed_at", noTS))
	}
	if a.hasLog {
		var acc, rej int64
		err := a.q.QueryRow(ctx, `select count(*) filter (where l.accepted), count(*) filter (where not l.accepted)
			from fence.consumer_log l where `+window("l.at"), a.since, a.until).Scan(&acc, &rej)
		if err != nil {
			return fmt.Errorf("count consumer log: %w", err)
		}
		a.rep.Counts["consumer events accepted"] = acc
		a.rep.Counts["consumer events rejected"] = rej
	}
	if a.opts.Clients != nil {
		a.rep.Counts["client records"] = int64(len(a.opts.Clients))
	} else {
		a.rep.OutcomeSource = "receipts"
		a.rep.Outcomes[OutcomeCommitted] = receipts
	}
	return nil
}

// eras fills the report's eras and notes each transition that may have
// lost commits.
func (a *auditor) eras(ctx context.Context) error {
	if !a.hasEras {
		return nil
	}
	err := a.query(ctx, `select e.era, e.timeline, e.began_at, e.lossless, e.reason from fence.eras e order by e.era`, nil, func(v vals) error {
		e := Era{Era: v["era"].(int32), Timeline: v["timeline"].(int32), BeganAt: v["began_at"].(time.Time), Lossless: v.bool("lossless"), Reason: v.str("reason")}
		a.rep.Eras = append(a.rep.Eras, e)
		if len(a.rep.Eras) > 1 && !e.Lossless {
			a.note(fmt.Sprintf("era %d began at %s: %s; commits made on the previous primary after its last replicated transaction are not in this history, and every earlier generation is void", e.Era, e.BeganAt.UTC().Format(time.RFC3339Nano), e.Reason))
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("eras: %w", err)
	}
	return nil
}
