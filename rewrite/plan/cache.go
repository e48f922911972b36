package plan

import (
	"encoding/binary"
	"hash/maphash"
	"sync"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/session"
)

// Cache plans simple queries as PlanQuery does, reusing the plan of a
// rewritten query for every later query that gives the planner the same
// answers: it is a pure function of what it reads, so the same answers
// give the same plan. It is safe for concurrent use, shared by all
// sessions.
//
// Only the rewriting (rewriteQuery) is cached: PlanQuery's first pass —
// the refusals before anything runs (reserved names, malformed fence
// settings: their messages carry the statement's values), whether the gate
// is needed at all, a failed transaction's as-is plan, Waits — is made
// afresh for every query, so a query the gate leaves alone costs nothing
// more. What the rewriting reads, and where each input is in the key:
//
//   - the statements, through these fields only: Offset (each step's At),
//     Kind, Chain, Opaque (Digested), Name of a SAVEPOINT or ROLLBACK TO
//     (the digest's savepoint marks; no other kind's Name is read), and
//     each GUC's Op, Name, Value, ValueParam (zero or not) and Unknown (the
//     overlay of the query's own SETs). Never the text (Stmt.SQL, the
//     digest's Canonical): a receipt's digest names its statements by
//     index and is computed when it is sent (Resolve), from the query's
//     own statements. So texts of one shape — differing in the literals
//     of a write — share a plan, as the classifier shares their parse.
//   - the protected tables' answers for each statement: ProtectedWrite
//     (taken from PlanQuery's first pass), and MayWriteUnseen where it is
//     not a protected write (the rewriting asks only then).
//     ProtectedTable is asked only for the FN008 refusal, which is not
//     cached (below).
//   - the session: whether the transaction is gated, tentative, explicit
//     (Tx is Idle or InTx: a failed one never gets here); whether it has
//     a running digest (session.Gate.Digest is a *fence.Digest) and, when
//     a statement of the query is a ROLLBACK TO, that digest's Mark (a
//     savepoint made before a COMMIT of the query keeps the old base;
//     otherwise the base cancels out of every mark); fence.payload_digest
//     (FromClient's Sum); and whether fence.job_key is set and
//     fence.epoch and fence.token are positive integers, which decide
//     whether a generation is presented at each statement (the overlay's
//     test; the session's own, State.Generation, is their conjunction, as
//     the session validates what it stores — parsePositive accepts what
//     the overlay's strconv.ParseInt of the trimmed value accepts above 0).
//   - the generation itself is not in the key: a worker sets a new
//     fence.step for every transaction, which would make every receipt a
//     miss. Each Gate and Receipt step records where the planner took its
//     Gen from (Step.genFrom: the gate state, or the settings as statement
//     i runs), and a plan from the cache gets the session's generation
//     from there again: the transaction's session.Gate.Gen, or the
//     session's fence settings with the query's own SETs before statement
//     i replayed, exactly as the planner computed it.
//
// Not read, so not in the key: the search_path and the prepared
// statements (only through the Tables' answers), Replay, the savepoint
// depth, any setting but the five fence settings above.
//
// Plans with a refusal inside (a Raise step: FN008, whose message names
// the table and the settings' values; FN009, which names the generation;
// 25P01) are not cached: a refusal is not a path worth a cache, and their
// messages carry what the key leaves out.
//
// A plan from the cache is shared: its Steps, Digest.Stmts and CopyReceipt
// must not be modified (the proxy only reads them).
type Cache struct {
	lru  *lru.Cache[uint64, *cached]
	seed maphash.Seed
	omit fact // tests only: a fact left out of the key, to show it is needed
}

// cached is a plan in the Cache, under its whole key (the LRU is keyed by
// the key's hash: a collision is a miss).
type cached struct {
	key  string
	q    Query
	gens bool // a step has a generation (from genFrom)
}

// NewCache returns a Cache of up to size plans (at least 1).
func NewCache(size int) *Cache {
	c, err := lru.New[uint64, *cached](max(size, 1))
	if err != nil {
		panic("plan: " + err.Error()) // unreachable: size > 0
	}
	return &Cache{lru: c, seed: maphash.MakeSeed()}
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
	if !refuses(&q) {
		c.lru.Add(h, &cached{key: string(k.b), q: q, gens: hasGen(&q)})
	}
	return q
}

// keys are the key buffers, reused: a lookup allocates nothing.
var keys = sync.Pool{New: func() any { return &keyWriter{b: make([]byte, 0, 256)} }}

// plan is the cached plan with the session's generation in each step that
// has one, as the planner took it (Step.genFrom). The steps are copied
// only when a generation differs from the cached one. ok is false if a
// generation is not there (it cannot be: the key says it is).
func (e *cached) plan(ss *session.State, stmts []*rewrite.Stmt) (Query, bool) {
	q := e.q
	if !e.gens {
		return q, true
	}
	copied := false
	for i := range q.Steps {
		s := &q.Steps[i]
		if s.Kind != Gate && s.Kind != Receipt {
			continue
		}
		g, ok := generationFrom(ss, stmts, s.genFrom)
		if !ok {
			return Query{}, false
		}
		if g == s.Gen {
			continue
		}
		if !copied {
			q.Steps = append([]Step(nil), q.Steps...)
			s, copied = &q.Steps[i], true
		}
		s.Gen = g
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

// generationFrom is the generation as the planner takes it from (see
// Step.genFrom).
func generationFrom(ss *session.State, stmts []*rewrite.Stmt, from int) (fence.Generation, bool) {
	if from == 0 {
		return ss.Gate().Gen, true
	}
	ov := overlay{}
	for _, s := range stmts[:from-1] {
		ov.apply(s)
	}
	return ov.generation(ss)
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

// hasGen reports whether a step of q has a generation.
func hasGen(q *Query) bool {
	for i := range q.Steps {
		if k := q.Steps[i].Kind; k == Gate || k == Receipt {
			return true
		}
	}
	return q.CopyReceipt != nil
}

// fact is one input of the rewriting in the Cache's key.
type fact uint8

const (
	factNone fact = iota
	factGated
	factTentative
	factExplicit
	factTxDigest
	factDigestMark
	factPayloadDigest
	factJobKeySet
	factEpochOK
	factTokenOK
	factOffset
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
// same bytes (a statement starts with its offset's tag, a GUC with its
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
	live, ok := g.Digest.(*fence.Digest)
	k.bool(factTxDigest, ok)
	if ok && hasKind(stmts, rewrite.RollbackTo) {
		k.int(factDigestMark, live.Mark())
	}
	v, _ := st.Get(session.PayloadDigest)
	k.string(factPayloadDigest, v)
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
	k.int(factOffset, s.Offset)
	k.int(factKind, int(s.Kind))
	k.bool(factChain, s.Chain)
	k.bool(factOpaque, s.Opaque)
	if s.Kind == rewrite.Savepoint || s.Kind == rewrite.RollbackTo {
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
		k.int(factGUCOp, int(g.Op))
		k.string(factGUCName, g.Name)
		k.string(factGUCValue, g.Value)
		k.bool(factGUCValueParam, g.ValueParam != 0)
		k.bool(factGUCUnknown, g.Unknown)
	}
}
