package plan

import (
	"sort"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/session"
)

// Action is what a plan does with the client's query.
type Action uint8

const (
	// PassThrough: the gate adds nothing; the query goes as the client
	// wrote it (read routing may still send it to a replica).
	PassThrough Action = iota
	// Refuse: nothing of the query runs; the client gets Refusal.
	Refuse
	// AsIs: the gate would act, but the transaction has failed and the
	// server refuses everything but its end: the query goes unchanged,
	// to the primary.
	AsIs
	// Rewrite: the query goes as Steps, ended as Ending says.
	Rewrite
)

// Ending is how a rewritten query ends: what is sent after its text, and
// whose ReadyForQuery the client gets.
type Ending uint8

const (
	// Plain: the rewritten query is all; its ReadyForQuery is the
	// client's.
	Plain Ending = iota
	// LoneCommit: the client's query is a COMMIT alone. The receipt
	// (Steps[0]) runs as the prepared ReceiptStatement in a batch of
	// its own, whose ReadyForQuery is hidden, then the client's COMMIT
	// goes as it is: after a refused receipt it ends the aborted
	// transaction (the server answers ROLLBACK).
	LoneCommit
	// Restore: the query's ReadyForQuery is hidden; RestoreSQL follows,
	// and its ReadyForQuery is the client's.
	Restore
	// AwaitCommit: statements follow the COMMIT (or it chains). The
	// query's ReadyForQuery is hidden; once it is answered, ROLLBACK if
	// a receipt step failed (the COMMIT and everything after it were
	// skipped), else an empty query: either's ReadyForQuery is the
	// client's. After a replay of a receipt step (its COMMIT answered
	// as committed), the transaction ends, and the statements after the
	// COMMIT, which the server skipped, are answered with an error that
	// says why.
	AwaitCommit
	// AfterCopy: a protected COPY FROM in an implicit transaction,
	// which Steps opened with Begin. The query's ReadyForQuery is
	// hidden; after the last COPY's CopyDone, CopyReceipt and COMMIT
	// go as queries of their own (COMMIT's ReadyForQuery is the
	// client's); when the COPY never starts, ROLLBACK instead.
	AfterCopy
)

// Query is the plan of one simple Query.
type Query struct {
	Action  Action
	Refusal *fence.Error // Refuse

	// Steps are the statements of the query as sent (Rewrite, AsIs):
	// the client's (Kind Client, in order) and the injected ones before
	// them.
	Steps       []Step
	Ending      Ending
	CopyReceipt *Step // AfterCopy: the receipt after the COPY's data
	// CopyDigested: a COPY FROM of the query runs in a transaction that
	// owes a receipt: its data goes into the transaction's digest.
	CopyDigested bool
	// Unfenced: the plan refuses a protected write for want of fence
	// settings (FN008).
	Unfenced bool
	// Waits: executing the plan waits for an answer between its
	// messages (a COPY's start, a COMMIT's outcome), so it cannot run
	// where waiting is not allowed (the proxy's event loop).
	Waits bool
}

// PlanQuery plans a simple Query of the classified statements stmts (at
// least one) in session ss.
func PlanQuery(ss Session, stmts []*rewrite.Stmt) Query {
	return planQuery(ss, stmts, nil)
}

// planQuery is PlanQuery, taking the rewritten query's plan from c when c
// is not nil (see Cache).
func planQuery(ss Session, stmts []*rewrite.Stmt, c *Cache) Query {
	st := ss.State
	var refusal *fence.Error
	needGate := false
	isFenced := fenced(st, stmts)
	var protected uint64 // bit i: stmts[i] is a protected write (for c's key)
	for i, s := range stmts {
		if refusal == nil {
			refusal = checkStmt(st, s, nil)
		}
		pw := ss.Tables.ProtectedWrite(s)
		if pw && i < 64 {
			protected |= 1 << i
		}
		if pw || isFenced && ss.Tables.MayWriteUnseen(s) ||
			st.Gate().Due() && (s.Kind == rewrite.Commit || s.Kind == rewrite.PrepareTransaction) {
			needGate = true
		}
	}
	switch {
	case refusal != nil:
		return Query{Action: Refuse, Refusal: refusal}
	case !needGate:
		return Query{Action: PassThrough}
	}
	// A gated COPY FROM may wait for its CopyInResponse, a COMMIT with
	// statements after it for its answer. A COPY FROM the gate leaves
	// alone does not.
	waits := hasKind(stmts, rewrite.CopyFrom) || commitInside(stmts)
	if st.Tx() == session.Failed {
		q := Query{Action: AsIs, Waits: waits}
		for i, s := range stmts {
			q.Steps = append(q.Steps, Step{Kind: Client, Stmt: i, At: s.Offset})
		}
		return q
	}
	var q Query
	if c != nil {
		q = c.rewrite(ss, stmts, protected)
	} else {
		q = rewriteQuery(ss, stmts)
	}
	q.Waits = waits
	return q
}

// running is the receipt digest as the plan follows it through the
// query: the transaction's (fromTx, base its items before the query) or a
// new one, with the query's statements added so far.
type running struct {
	set    bool // a digest is being followed
	fromTx bool
	base   int
	stmts  []int
}

func (r *running) mark() int { return r.base + len(r.stmts) }

func (r *running) rollback(mark int) {
	if n := mark - r.base; n < len(r.stmts) {
		r.stmts = r.stmts[:max(n, 0)]
	}
}

// savepointMark is a savepoint a query makes and the planned digest's
// mark when it was made.
type savepointMark struct {
	name string
	mark int
}

// findSavepoint returns the index of the innermost of sps named name, -1
// for none.
func findSavepoint(sps []savepointMark, name string) int {
	for j := len(sps) - 1; j >= 0; j-- {
		if sps[j].name == name {
			return j
		}
	}
	return -1
}

// rewriteQuery splices the gate's steps into a query that needs them: the
// gate right before the first protected write, the receipt right before
// the client's COMMIT, and an implicit transaction ends with the receipt.
func rewriteQuery(ss Session, stmts []*rewrite.Stmt) Query {
	st := ss.State
	g := st.Gate()
	gated, tentative, gen := g.Gated, g.Tentative, g.Gen
	genFrom := 0                                     // where gen came from (Step.genFrom)
	due := func() bool { return gated || tentative } // a receipt is due at the commit
	explicit := st.Tx() == session.InTx && st.Explicit()
	blockStart := 0 // where the current implicit transaction began
	ov := overlay{}
	q := Query{Action: Rewrite}

	// The receipt's digest must cover this query's own writes, which
	// have not run yet: the plan follows them (the server side adds them
	// to the transaction's digest for real as they complete).
	var d running
	if live, ok := g.Digest.(*fence.Digest); ok && due() {
		d = running{set: true, fromTx: true, base: live.Mark()}
	}
	// sps are the savepoints this query makes, innermost last, each with
	// the planned digest's mark when it was made (0 before the digest
	// started: rolling back to it drops everything the digest has);
	// rolledEarlier: a ROLLBACK TO of a savepoint from an earlier query
	// cut the transaction's digest, which the plan cannot follow.
	var sps []savepointMark
	rolledEarlier := false
	// digestNow is the digest of a receipt before statement from-1, or
	// after the last when from is len(stmts)+1 (Digest.sumFrom).
	digestNow := func(from int) Digest {
		if sum, ok := clientDigest(ov.value(st, session.PayloadDigest), true); ok {
			return Digest{Source: FromClient, Sum: sum, sumFrom: from}
		}
		if !d.set {
			d = running{set: true}
		}
		src := FromStatements
		if d.fromTx {
			src = FromTransaction
		}
		return Digest{Source: src, Stmts: append([]int(nil), d.stmts...)}
	}

	steps := make([]Step, 0, len(stmts)+2)
	inject := func(s Step) { steps = append(steps, s) }
	client := func(i int) { steps = append(steps, Step{Kind: Client, Stmt: i, At: stmts[i].Offset}) }
	// refuse fails the query at statement i with e, as PostgreSQL would
	// fail it: the rest is not sent (the caller breaks the loop).
	refuse := func(i int, e *fence.Error) {
		inject(Step{Kind: Raise, Stmt: i, At: stmts[i].Offset, Err: e})
		client(i)
	}
	wrapped, hasCopy, beforeCommit := false, false, false
	tail := false     // statements follow a COMMIT with a receipt before it
	copyInTx := false // a gated COPY FROM in the current transaction, in this query
	wrapStart := 0    // where the wrapped implicit transaction began
	// blockOnlyAt: the steps index and statement of the first statement
	// of the current implicit transaction that PostgreSQL refuses
	// outside a transaction block (see the end).
	blockOnlyAt, blockOnlyStmt := -1, -1
loop:
	for i, s := range stmts {
		switch {
		case !gated && ss.Tables.ProtectedWrite(s):
			cur, ok := ov.generation(st)
			if !ok {
				q.Unfenced = true
				refuse(i, fencingRequired(ss.Tables.ProtectedTable(s), st, ov))
				break loop
			}
			if !explicit {
				// An implicit transaction: the receipt ends it (see
				// below), and PostgreSQL commits it only if every
				// statement, the gate and the receipt succeeded.
				wrapped, wrapStart = true, blockStart
			}
			inject(Step{Kind: Gate, Stmt: i, At: s.Offset, Gen: cur, genFrom: i + 1})
			if !due() && (!d.set || !d.fromTx) {
				d = running{set: true}
			}
			gated, gen, genFrom = true, cur, i+1
		case !due() && ss.Tables.MayWriteUnseen(s):
			// It may write a protected table where the gate cannot see:
			// the backstop checks it, and the commit writes a receipt if
			// the backstop marked the transaction (tentative). Without a
			// generation the backstop refuses it (FN008): nothing due.
			cur, ok := ov.generation(st)
			if !ok {
				break
			}
			if !explicit {
				wrapped, wrapStart = true, blockStart
			}
			tentative, gen, genFrom = true, cur, i+1
			if !d.set || !d.fromTx {
				d = running{set: true}
			}
		case due() && s.Kind == rewrite.PrepareTransaction:
			refuse(i, prepareTransaction(gen, "commit the transaction with COMMIT: pgfence writes the commit receipt in the same transaction"))
			break loop
		case due() && s.Kind == rewrite.Commit && hasKind(stmts[i+1:], rewrite.CopyFrom):
			// Refused before the COMMIT runs.
			refuse(i, commitThenCopy(gen))
			break loop
		case due() && s.Kind == rewrite.Commit && copyInTx:
			// The COMMIT is refused, and the transaction aborts with
			// nothing of it committed.
			refuse(i, copyThenCommit(gen))
			break loop
		case due() && s.Kind == rewrite.Commit && rolledEarlier:
			// Refused before the COMMIT runs (round 23, AW-M3).
			refuse(i, commitAfterEarlierRollback(gen))
			break loop
		case due() && s.Kind == rewrite.Commit:
			dg := digestNow(i + 1)
			if explicit && i > 0 && i == len(stmts)-1 && !s.Chain {
				// See the end: the receipt in a savepoint, so that what
				// follows the query can tell its failure from an
				// earlier statement's.
				inject(Step{Kind: Savepoint, Stmt: i, At: s.Offset})
			}
			inject(Step{Kind: Receipt, Stmt: i, At: s.Offset, Gen: gen, genFrom: genFrom, Gated: gated, BeforeCommit: true, Digest: dg})
			if i+1 < len(stmts) {
				// On a replay the server skips the rest of the query:
				// the proxy must answer it (AwaitCommit).
				tail = true
			}
			if explicit {
				// The client's own transaction: its COMMIT must run
				// whatever the receipt did (below). A COMMIT ending an
				// implicit one is skipped with the rest of the query
				// when the receipt fails, as PostgreSQL would after any
				// error, and the transaction rolls back all the same.
				beforeCommit = true
			}
		}
		// Savepoints are followed whether or not a receipt is due yet: one
		// made before the first write, rolled back to after it, takes the
		// write out of the digest (round 23, attacker AW's M3: the receipt
		// covered a write the transaction had rolled back); RELEASE ends
		// the savepoint and those after it, as PostgreSQL does.
		switch s.Kind {
		case rewrite.Savepoint:
			m := 0
			if d.set {
				m = d.mark()
			}
			sps = append(sps, savepointMark{s.Name, m})
		case rewrite.RollbackTo:
			if j := findSavepoint(sps, s.Name); j >= 0 {
				if d.set {
					d.rollback(sps[j].mark)
				}
				sps = sps[:j+1]
			} else if d.set && d.fromTx {
				rolledEarlier = true
			}
		case rewrite.Release:
			if j := findSavepoint(sps, s.Name); j >= 0 {
				sps = sps[:j]
			} else {
				sps = sps[:0]
			}
		default:
			if due() && d.set && Digested(s) {
				d.stmts = append(d.stmts, i)
			}
		}
		if !explicit && blockOnlyAt < 0 && refusedImplicit(s) != "" {
			blockOnlyAt, blockOnlyStmt = len(steps), i
		}
		switch s.Kind {
		case rewrite.Begin:
			// In an implicit transaction, BEGIN makes it the client's
			// explicit one (as PostgreSQL does, without a warning): it
			// goes on after this query, and the receipt waits for the
			// client's COMMIT.
			explicit, wrapped = true, false
		case rewrite.Commit, rewrite.Rollback:
			if !s.Chain {
				explicit = false
			}
			gated, tentative, wrapped, copyInTx = false, false, false, false
			d = running{}
			sps, rolledEarlier = nil, false
			if i+1 < len(stmts) {
				blockStart = stmts[i+1].Offset
			}
			blockOnlyAt = -1
		case rewrite.CopyFrom:
			if due() {
				hasCopy, copyInTx = true, true
			}
		}
		ov.apply(s)
		client(i)
	}
	if wrapped && hasCopy {
		// The receipt covers the COPY data, so it can only be sent after
		// CopyDone, in a query of its own: the transaction must outlast
		// this query. Make it explicit from its start (first among the
		// steps there: the sort below keeps their order). A statement
		// PostgreSQL refuses in the implicit transaction (SAVEPOINT, AND
		// CHAIN) would pass in the explicit one: it fails as it would
		// have, with PostgreSQL's error, and the query stops there.
		if blockOnlyAt >= 0 {
			s := stmts[blockOnlyStmt]
			raise := Step{Kind: Raise, Stmt: blockOnlyStmt, At: s.Offset, Err: blockOnly(s)}
			steps = append(steps[:blockOnlyAt], append([]Step{raise}, steps[blockOnlyAt:]...)...)
		}
		steps = append([]Step{{Kind: Begin, Stmt: -1, At: wrapStart}}, steps...)
	}
	// Injected steps go before the client statement at the same offset;
	// steps are in order except a Begin placed back at wrapStart.
	sort.SliceStable(steps, func(a, b int) bool { return steps[a].At < steps[b].At })
	for i := range steps {
		if steps[i].Kind == Begin {
			steps[i].Stmt = firstAt(steps, i)
		}
	}
	q.Steps = steps
	q.CopyDigested = hasCopy
	switch {
	case wrapped && hasCopy:
		// The receipt covers the COPY data: it is sent at CopyDone.
		q.Ending = AfterCopy
		q.CopyReceipt = &Step{Kind: Receipt, Stmt: -1, At: -1, Gen: gen, genFrom: genFrom, Gated: gated, Digest: Digest{Source: FromSession}}
	case wrapped:
		// The receipt is the implicit transaction's last statement. The
		// transaction stays PostgreSQL's implicit one, so the client's
		// statements in it behave as they would straight to PostgreSQL
		// (SAVEPOINT refused, BEGIN turning it explicit), and it
		// commits at the end of the query only if nothing failed.
		q.Steps = append(q.Steps, Step{Kind: Receipt, Stmt: -1, At: -1, Gen: gen, genFrom: genFrom, Gated: gated, Digest: digestNow(len(stmts) + 1)})
		if tail {
			q.Ending = AwaitCommit // an earlier COMMIT's replay
		}
	case beforeCommit && len(stmts) == 1 && lastCommit(stmts, steps):
		// Steps: the receipt, the COMMIT.
		q.Ending = LoneCommit
	case tail:
		// A COMMIT with a receipt before it, and statements after it:
		// on a replay of the receipt the server skips the COMMIT and
		// the rest of the query, and the proxy answers them, once the
		// query is answered.
		q.Ending = AwaitCommit
	case beforeCommit && lastCommit(stmts, steps):
		// The client's statements, the receipt in a savepoint and the
		// client's COMMIT, then a query that ends the transaction only
		// if the receipt failed (the COMMIT was skipped): it returns to
		// the savepoint and rolls back. When a statement of the
		// client's failed before, there is no savepoint: the
		// transaction stays failed, as it would straight to PostgreSQL,
		// until the client rolls it back. After a COMMIT there is no
		// transaction. Either way the restoring query fails at once,
		// unseen.
		q.Ending = Restore
	case beforeCommit:
		// The client's COMMIT with statements after it (or AND CHAIN):
		// whatever follows must see the transaction as PostgreSQL left
		// it, so the proxy waits for the answer.
		q.Ending = AwaitCommit
	}
	return q
}

// firstAt is the client statement a step at steps[i] stands before.
func firstAt(steps []Step, i int) int {
	for _, s := range steps[i:] {
		if s.Kind == Client {
			return s.Stmt
		}
	}
	return -1
}

// lastCommit reports whether the query's last statement is a COMMIT that
// the plan kept as its last step (nothing of the gate's after it).
func lastCommit(stmts []*rewrite.Stmt, steps []Step) bool {
	n := len(steps)
	last := stmts[len(stmts)-1]
	return n > 0 && last.Kind == rewrite.Commit && !last.Chain && steps[n-1].Kind == Client && steps[n-1].Stmt == len(stmts)-1
}

// hasKind reports whether one of stmts is of kind k.
func hasKind(stmts []*rewrite.Stmt, k rewrite.Kind) bool {
	for _, st := range stmts {
		if st.Kind == k {
			return true
		}
	}
	return false
}

// commitInside reports whether a COMMIT of the query is not its last
// statement, or chains.
func commitInside(stmts []*rewrite.Stmt) bool {
	for i, st := range stmts {
		if st.Kind == rewrite.Commit && (st.Chain || i < len(stmts)-1) {
			return true
		}
	}
	return false
}
