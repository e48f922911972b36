package plan

import (
	"bytes"
	"encoding/binary"
	"hash/maphash"
	"sync"
	"unsafe"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/lru"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/session"
)

// Cache plans simple queries as PlanQuery does, reusing the plan of a
// rewritten query for every later query that gives the planner the same
// answers: it is a pure function of what it reads, so the same answers
// give the same plan, up to the values it copies into the plan (below),
// which a plan from the cache gets again from the query and the session.
// It is safe for concurrent use, shared by all sessions.
//
// Only the rewriting (rewriteQuery) is cached: PlanQuery's first pass —
// the refusals before anything runs (reserved names, malformed fence
// settings: their messages carry the statement's values), whether the gate
// is needed at all, a failed transaction's as-is plan, Waits — is made
// afresh for every query, so a query the gate leaves alone costs nothing
// more. What the rewriting reads, and where each input is in the key:
//
//   - the statements, by index, through these fields only: Kind, Chain,
//     whether it is digested (Digested: Opaque, Writes, Executes), Name of
//     a SAVEPOINT, ROLLBACK TO or RELEASE (the digest's savepoint marks;
//     no other kind's Name is read), and the GUCs that
//     change what the overlay of the query's own SETs decides: a RESET
//     ALL, and a change of fence.job_key, fence.epoch, fence.token or
//     fence.payload_digest by its Op, its Name, ValueParam (zero or
//     not), Unknown and of its Value only what the overlay decides from
//     (see below). Never the text (Stmt.SQL, the digest's Canonical): a
//     receipt's digest names its statements by index and is computed
//     when it is sent (Resolve), from the query's own statements. So
//     texts of one shape — differing in the literals of a write — share
//     a plan, as the classifier shares their parse. Nor the Offsets: a
//     step's At is its statement's (Step.At), put in again on a hit, so
//     literals of other lengths in a text of several statements do not
//     make it another shape.
//   - the protected tables' answers for each statement: ProtectedWrite
//     (taken from PlanQuery's first pass), and MayWriteUnseen where it is
//     not a protected write (the rewriting asks only then).
//     ProtectedTable is asked only for the FN008 refusal, which is not
//     cached (below).
//   - the session: whether the transaction is gated, tentative, explicit
//     (Tx is Idle or InTx: a failed one never gets here); whether it has
//     a running digest (session.Gate.Digest is a *fence.Digest: its Mark
//     cancels out of every savepoint's, and a savepoint does not outlive
//     a COMMIT of the query); whether
//     fence.payload_digest is a client digest (it decodes: clientDigest);
//     and whether fence.job_key is set and fence.epoch and fence.token are
//     positive integers, which decide whether a generation is presented
//     at each statement (the overlay's test; the session's own,
//     State.Generation, is their conjunction, as the session validates
//     what it stores — parsePositive accepts what the overlay's
//     strconv.ParseInt of the trimmed value accepts above 0). The query's
//     own values of these settings are keyed the same way.
//   - the values the plan copies are not in the key: the generation
//     (fence.step above all: a worker sets a new one for every
//     transaction, which would make every receipt a miss) and the
//     client's digest (a new one for every transaction). Each Gate and
//     Receipt step records where the planner took its Gen from
//     (Step.genFrom: the gate state, or the settings as statement i
//     runs), a receipt with the client's digest where it took the Sum
//     from (Digest.sumFrom), and a plan from the cache gets them from
//     there again: the transaction's session.Gate.Gen, or the session's
//     fence settings with the query's own SETs before statement i
//     replayed, exactly as the planner computed them.
//
// Not read, so not in the key: the search_path and the prepared
// statements (only through the Tables' answers), Replay, the savepoint
// depth, any setting but the fence settings above.
//
// Plans with a refusal inside (a Raise step: FN008, whose message names
// the table and the settings' values; FN009, which names the generation;
// 25P01) are not cached: a refusal is not a path worth a cache, and their
// messages carry what the key leaves out.
//
// A plan from the cache is shared: its Steps, Digest.Stmts, Digest.Sum
// and CopyReceipt must not be modified (the proxy only reads them).
//
// The cache is bounded by the bytes its plans cost (an lru.Pool, which
// the classifier's caches may share): a key and a plan are small (a few
// hundred bytes, the facts of at most 64 statements and the generation's
// strings), but a client chooses the generation's.
type Cache struct {
	lru  *lru.Cache[uint64, *cached]
	seed maphash.Seed
	omit fact // tests only: a fact left out of the key, to show it is needed
}

// cached is a plan in the Cache, under its whole key (the LRU is keyed by
// the key's hash: a collision is a miss).
type cached struct {
	key string
	q   Query
}

// NewCache returns a Cache of plans in p (nil: a pool of its own, of
// rewrite.DefaultCacheMemory).
func NewCache(p *lru.Pool) *Cache {
	if p == nil {
		p = lru.NewPool(rewrite.DefaultCacheMemory)
	}
	return &Cache{lru: lru.New[uint64, *cached](p), seed: maphash.MakeSeed()}
}

// PlanQuery is the package's PlanQuery, its rewriting taken from the
// cache when the cache has it.
func (c *Cache) PlanQuery(ss Session, stmts []*rewrite.Stmt) Query {
	return planQuery(ss, stmts, c)
}

// Len returns the number of cached plans.
func (c *Cache) Len() int { return c.lru.Len() }

// rewrite is rewriteQuery through the cache; protected has bit i set when
// stmts[i] is a protected write.
func (c *Cache) rewrite(ss Session, stmts []*rewrite.Stmt, protected uint64) Query {
	if len(stmts) > 64 {
		return rewriteQuery(ss, stmts)
	}
	k := keys.Get().(*keyWriter)
	defer keys.Put(k)
	k.b, k.omit = k.b[:0], c.omit
	k.session(ss.State, stmts)
	for i, s := range stmts {
		k.stmt(ss.Tables, s, protected&(1<<i) != 0)
	}
	h := maphash.Bytes(c.seed, k.b)
	if e, ok := c.lru.Get(h); ok && e.key == string(k.b) {
		if q, ok := e.plan(ss.State, stmts); ok {
			return q
		}
	}
	q := rewriteQuery(ss, stmts)
	if !refuses(&q) && placed(&q, stmts) {
		e := &cached{key: string(k.b), q: q}
		c.lru.Add(h, e, e.cost())
	}
	return q
}

// cost is what e costs the pool, besides lru.EntryOverhead.
func (e *cached) cost() int64 {
	n := int64(unsafe.Sizeof(*e)) + int64(len(e.key)) + stepsCost(e.q.Steps)
	if e.q.CopyReceipt != nil {
		n += stepsCost([]Step{*e.q.CopyReceipt})
	}
	return n
}

// stepsCost is what steps cost on the heap.
func stepsCost(steps []Step) int64 {
	n := int64(len(steps)) * int64(unsafe.Sizeof(Step{}))
	for _, st := range steps {
		n += int64(len(st.Gen.JobKey) + len(st.Gen.Step) + 8*len(st.Digest.Stmts) + len(st.Digest.Sum) + len(st.Digest.Version))
	}
	return n
}

// keys are the key buffers, reused: a lookup allocates nothing.
var keys = sync.Pool{New: func() any { return &keyWriter{b: make([]byte, 0, 256)} }}

// plan is the cached plan for stmts in session ss: with each step where
// the statement it stands before is in stmts (stepAt), and the session's
// generation and client digest where the planner took them (Step.genFrom,
// Digest.sumFrom). The steps are copied only when one of these differs
// from the cached plan's. ok is false if a generation or a digest is not
// there (it cannot be: the key says it is).
func (e *cached) plan(ss *session.State, stmts []*rewrite.Stmt) (Query, bool) {
	q := e.q
	copied := false
	step := func(i int) *Step {
		if !copied {
			q.Steps = append([]Step(nil), q.Steps...)
			copied = true
		}
		return &q.Steps[i]
	}
	for i := range e.q.Steps {
		s := &e.q.Steps[i]
		if at := stepAt(s, stmts); at != s.At {
			step(i).At = at
		}
		if s.Kind == Gate || s.Kind == Receipt {
			g, ok := generationFrom(ss, stmts, s.genFrom)
			if !ok {
				return Query{}, false
			}
			if g != s.Gen {
				step(i).Gen = g
			}
		}
		if s.Digest.Source == FromClient {
			sum, ok := clientDigest(settingsAt(stmts, s.Digest.sumFrom).value(ss, session.PayloadDigest), true)
			if !ok {
				return Query{}, false
			}
			if !bytes.Equal(sum, s.Digest.Sum) {
				step(i).Digest.Sum = sum
			}
		}
	}
	if r := q.CopyReceipt; r != nil {
		g, ok := generationFrom(ss, stmts, r.genFrom)
		if !ok {
			return Query{}, false
		}
		if g != r.Gen {
			cp := *r
			cp.Gen = g
			q.CopyReceipt = &cp
		}
	}
	return q, true
}

// stepAt is where the planner places step s in the text of stmts: before
// the statement it stands before (at its Offset), or after the last (-1).
func stepAt(s *Step, stmts []*rewrite.Stmt) int {
	if s.Stmt < 0 {
		return -1
	}
	return stmts[s.Stmt].Offset
}

// placed reports whether stepAt gives back where the planner placed each
// step of q, so that a plan from the cache can be placed in the text of
// another query of its key (one whose Offsets differ). A plan it does not
// is not cached.
func placed(q *Query, stmts []*rewrite.Stmt) bool {
	for i := range q.Steps {
		if stepAt(&q.Steps[i], stmts) != q.Steps[i].At {
			return false
		}
	}
	return q.CopyReceipt == nil || q.CopyReceipt.At == -1
}

// generationFrom is the generation as the planner takes it from (see
// Step.genFrom).
func generationFrom(ss *session.State, stmts []*rewrite.Stmt, from int) (fence.Generation, bool) {
	if from == 0 {
		return ss.Gate().Gen, true
	}
	return settingsAt(stmts, from).generation(ss)
}

// settingsAt is the overlay of the query's own SETs as statement from-1
// runs (from is len(stmts)+1: after the last).
func settingsAt(stmts []*rewrite.Stmt, from int) overlay {
	ov := overlay{}
	for _, s := range stmts[:from-1] {
		ov.apply(s)
	}
	return ov
}

// refuses reports whether a plan has a refusal inside.
func refuses(q *Query) bool {
	for i := range q.Steps {
		if q.Steps[i].Kind == Raise {
			return true
		}
	}
	return q.Unfenced
}

// fact is one input of the rewriting in the Cache's key.
type fact uint8

const (
	factNone fact = iota
	factGated
	factTentative
	factExplicit
	factTxDigest
	factPayloadDigest
	factJobKeySet
	factEpochOK
	factTokenOK
	factKind
	factChain
	factOpaque
	factName
	factTables
	factGUCOp
	factGUCName
	factGUCValue
	factGUCValueParam
	factGUCUnknown
	numFacts
)

// keyWriter builds a Cache key: each fact as its tag and its value,
// length-prefixed where it is variable, so that no two inputs write the
// same bytes (a statement starts with its kind's tag, a GUC with its
// op's: their number needs no count of its own).
type keyWriter struct {
	b    []byte
	omit fact
}

func (k *keyWriter) bool(f fact, v bool) {
	if f != k.omit {
		b := byte(0)
		if v {
			b = 1
		}
		k.b = append(k.b, byte(f), b)
	}
}

func (k *keyWriter) int(f fact, v int) {
	if f != k.omit {
		k.b = binary.AppendUvarint(append(k.b, byte(f)), uint64(v))
	}
}

func (k *keyWriter) string(f fact, v string) {
	if f != k.omit {
		k.b = append(binary.AppendUvarint(append(k.b, byte(f)), uint64(len(v))), v...)
	}
}

// session writes the session's facts.
func (k *keyWriter) session(st *session.State, stmts []*rewrite.Stmt) {
	g := st.Gate()
	k.bool(factGated, g.Gated)
	k.bool(factTentative, g.Tentative)
	k.bool(factExplicit, st.Tx() == session.InTx && st.Explicit())
	_, ok := g.Digest.(*fence.Digest)
	k.bool(factTxDigest, ok)
	v, _ := st.Get(session.PayloadDigest)
	_, ok = clientDigest(v, true) // as the planner reads it (digestNow)
	k.bool(factPayloadDigest, ok)
	v, _ = st.Get(session.JobKey)
	k.bool(factJobKeySet, v != "")
	v, _ = st.Get(session.Epoch)
	_, ok = positive(v)
	k.bool(factEpochOK, ok)
	v, _ = st.Get(session.Token)
	_, ok = positive(v)
	k.bool(factTokenOK, ok)
}

// stmt writes a statement's facts; protected is its ProtectedWrite.
func (k *keyWriter) stmt(t Tables, s *rewrite.Stmt, protected bool) {
	k.int(factKind, int(s.Kind))
	k.bool(factChain, s.Chain)
	k.bool(factOpaque, Digested(s)) // the only way the rewriting reads Opaque, Writes, Executes
	if s.Kind == rewrite.Savepoint || s.Kind == rewrite.RollbackTo || s.Kind == rewrite.Release {
		k.string(factName, s.Name)
	}
	// The rewriting asks MayWriteUnseen only of a statement that is not
	// a protected write.
	answer := 2
	if !protected {
		answer = 0
		if t.MayWriteUnseen(s) {
			answer = 1
		}
	}
	k.int(factTables, answer)
	for _, g := range s.GUCs {
		k.guc(g)
	}
}

// The fence settings whose changes the overlay decides from (factGUCName):
// the generation's validity and the client's digest. fence.step is not
// one: its value only goes into a generation (Step.genFrom).
var overlaid = [...]string{1: session.JobKey, 2: session.Epoch, 3: session.Token, 4: session.PayloadDigest}

// guc writes what the overlay reads of a setting a statement changes: a
// RESET ALL, or a change of one of the overlaid settings and, of its
// value, only what the overlay decides from (a job key set, an epoch or a
// token that is a positive integer, a client digest that decodes). Any
// other setting's change, fence.step's included, writes nothing.
func (k *keyWriter) guc(g rewrite.GUC) {
	if g.Op == rewrite.GUCResetAll {
		k.int(factGUCOp, int(g.Op))
		return
	}
	name := 0
	for i, n := range overlaid {
		if n != "" && n == g.Name {
			name = i
		}
	}
	if name == 0 {
		return
	}
	k.int(factGUCOp, int(g.Op))
	k.int(factGUCName, name)
	k.bool(factGUCValueParam, g.ValueParam != 0)
	k.bool(factGUCUnknown, g.Unknown)
	var valid bool
	switch g.Name {
	case session.JobKey:
		valid = g.Value != ""
	case session.Epoch, session.Token:
		_, valid = positive(g.Value)
	case session.PayloadDigest:
		_, valid = clientDigest(g.Value, true)
	}
	k.bool(factGUCValue, valid)
}
