package plan_test

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
)

// The plan cache must return exactly the plan PlanQuery returns, whatever
// session state warmed it. The attack is a key missing a fact: two inputs
// that differ only in it share an entry, and the second gets the first's
// plan. TestPlanCache plans every golden input and a corpus of generated
// session states and queries through one cache, and compares; the corpus
// is rich enough that leaving any one fact out of the key makes it fail
// (TestPlanCacheKeyFacts).

// TestPlanCache: for every golden plan input, twice (the second time with
// the cache warmed by every file's sessions), and for the generated
// corpus, the cached plan is PlanQuery's.
func TestPlanCache(t *testing.T) {
	c := plan.NewCache(nil)
	for pass := range 2 {
		if d := goldenDiffers(t, c); len(d) > 0 {
			t.Fatalf("pass %d: cached plans differ from PlanQuery's for %d golden queries:\n%s", pass, len(d), strings.Join(d, "\n"))
		}
	}
	corpus := cacheCorpus(t, 400)
	for pass := range 2 {
		if d := corpusDiffers(c, corpus); len(d) > 0 {
			t.Fatalf("pass %d: cached plans differ from PlanQuery's for %d of %d generated queries:\n%s", pass, len(d), len(corpus), strings.Join(d[:min(len(d), 6)], "\n"))
		}
	}
	if c.Len() < 50 {
		t.Fatalf("the cache holds %d plans: the corpus hardly exercises it", c.Len())
	}
}

// TestPlanCacheKeyFacts leaves each fact out of the key in turn: each time
// some query of the golden inputs or the corpus must get a wrong plan, or
// the fact is not needed (or the corpus does not show it is).
func TestPlanCacheKeyFacts(t *testing.T) {
	corpus := cacheCorpus(t, 400)
	for f := 1; f < plan.NumFacts; f++ {
		if plan.FactName(f) == "" {
			t.Errorf("fact %d has no name", f)
		}
		c := plan.NewCache(nil)
		c.Omit(f)
		n := 0
		for range 2 { // the second time, each entry is there before every query of its key
			n += len(goldenDiffers(t, c)) + len(corpusDiffers(c, corpus))
		}
		if n == 0 {
			t.Errorf("without %q in the key every plan is still right: the fact is not needed, or no input shows it is", plan.FactName(f))
		}
	}
}

// TestPlanCacheHits: queries that differ only in what the plan copies
// from the session or the text (a worker's fence.step and client digest
// for each transaction, literals of other lengths before a later
// statement) share one entry, and each gets PlanQuery's plan from it.
func TestPlanCacheHits(t *testing.T) {
	write := "INSERT INTO results VALUES ('k', 'v')"
	for _, tc := range []struct {
		name   string
		setups []string
		sqls   []string
	}{
		{"a new fence.step in each transaction", []string{"BEGIN"}, []string{
			"SET LOCAL fence.step = 'a'; " + write + "; COMMIT",
			"SET LOCAL fence.step = 'b'; " + write + "; COMMIT",
			"SET LOCAL fence.step = 'a step of another length'; " + write + "; COMMIT",
		}},
		{"a new fence.step in an implicit transaction", nil, []string{
			"SET LOCAL fence.step = 'a'; " + write,
			"SET LOCAL fence.step = 'b'; " + write,
		}},
		{"a new client digest in each transaction", []string{"BEGIN"}, []string{
			"SET LOCAL fence.payload_digest = '" + strings.Repeat("a", 64) + "'; " + write + "; COMMIT",
			"SET LOCAL fence.payload_digest = '" + strings.Repeat("b", 64) + "'; " + write + "; COMMIT",
		}},
		{"literals of other lengths", []string{"BEGIN"}, []string{
			"INSERT INTO results VALUES ('k', 'v'); INSERT INTO results VALUES ('k', 'v'); COMMIT",
			"INSERT INTO results VALUES ('a longer key', 'v'); INSERT INTO results VALUES ('k', 'a longer value'); COMMIT",
			"INSERT INTO results VALUES ('', ''); INSERT INTO results VALUES ('k', 'v'); COMMIT",
		}},
		{"literals of other lengths before a COPY", nil, []string{
			"SELECT 1; COPY results FROM STDIN",
			"SELECT 12345; COPY results FROM STDIN",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := plan.NewCache(nil)
			for i, sql := range tc.sqls {
				cc := caseSpec{opts: []string{markOpts}, setups: tc.setups, sql: sql}.build(t)
				want := plan.PlanQuery(cc.ss, cc.stmts)
				if want.Action != plan.Rewrite {
					t.Fatalf("%s: planned %v, want a rewritten query", sql, want.Action)
				}
				if got := c.PlanQuery(cc.ss, cc.stmts); !reflect.DeepEqual(got, want) {
					t.Fatalf("%s:\n  cached: %+v\n  planned: %+v", sql, got, want)
				}
				if c.Len() != 1 {
					t.Fatalf("after query %d (%s) the cache holds %d plans, want 1: it missed", i+1, sql, c.Len())
				}
			}
		})
	}
}

// FuzzPlanCache plans a generated session state and query through a cache
// the earlier inputs warmed, and compares with PlanQuery.
func FuzzPlanCache(f *testing.F) {
	f.Add([]byte{0})
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16})
	f.Add([]byte("gated commit with a new step"))
	c := plan.NewCache(nil)
	f.Fuzz(func(t *testing.T, data []byte) {
		cc := newCacheCase(t, &byteChooser{data: data})
		if d := corpusDiffers(c, []cacheCase{cc}); len(d) > 0 {
			t.Fatal(d[0])
		}
	})
}

// goldenDiffers runs every golden plan input through c and returns the
// queries whose cached plan differs.
func goldenDiffers(t *testing.T, c *plan.Cache) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(plansDir, "*.txt"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no plans in %s: %v", plansDir, err)
	}
	var out []string
	for _, file := range files {
		raw, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		input, _, _ := strings.Cut(string(raw), "\n"+separator+"\n")
		s := newSim(t, c)
		s.run(input)
		for _, d := range s.differ {
			out = append(out, filepath.Base(file)+": "+d)
		}
	}
	return out
}

// A cacheCase is a session state and a query to plan in it.
type cacheCase struct {
	desc  string
	ss    plan.Session
	stmts []*rewrite.Stmt
}

// corpusDiffers plans every case through c and returns those whose plan
// differs from PlanQuery's (the first few of them described).
func corpusDiffers(c *plan.Cache, corpus []cacheCase) []string {
	var out []string
	for _, cc := range corpus {
		want := plan.PlanQuery(cc.ss, cc.stmts)
		if got := c.PlanQuery(cc.ss, cc.stmts); !reflect.DeepEqual(got, want) {
			d := "..."
			if len(out) < 5 {
				d = fmt.Sprintf("%s\n  cached: %+v\n  planned: %+v", cc.desc, got, want)
			}
			out = append(out, d)
		}
	}
	return out
}

// cacheCorpus draws n session states and queries, each with a neighbour
// for every way one input can change (variants): pairs that differ in
// one fact of the key, so that a key without it fails.
func cacheCorpus(t *testing.T, n int) []cacheCase {
	r := &randChooser{rand.New(rand.NewPCG(21, 1))}
	var out []cacheCase
	specs := append([]caseSpec(nil), targetedCases...)
	for range n {
		specs = append(specs, drawSpec(r))
	}
	for _, sp := range specs {
		out = append(out, sp.build(t))
		if sp.sql == "" {
			for _, v := range sp.variants() {
				out = append(out, v.build(t))
			}
		}
	}
	return out
}

// chooser picks one of n.
type chooser interface{ pick(n int) int }

type randChooser struct{ r *rand.Rand }

func (c *randChooser) pick(n int) int { return c.r.IntN(n) }

// byteChooser picks from fuzz input, then 0s.
type byteChooser struct{ data []byte }

func (c *byteChooser) pick(n int) int {
	if len(c.data) == 0 {
		return 0
	}
	b := c.data[0]
	c.data = c.data[1:]
	return int(b) % n
}

// The generator's pools.
var (
	cacheOptions = [][]string{
		{"", "-c fence.job_key=k1", "-c fence.job_key=k2"},
		{"", "-c fence.epoch=3", "-c fence.epoch=4"},
		{"", "-c fence.token=18", "-c fence.token=19"},
		{"", "-c fence.step=a", "-c fence.step=b"},
		{"", "", "-c fence.payload_digest=" + strings.Repeat("a", 64), "-c fence.payload_digest=" + strings.Repeat("b", 64)},
	}
	cacheSetups = []string{
		"BEGIN; INSERT INTO results VALUES ('k', 'v')",
		"BEGIN; INSERT INTO results VALUES ('k', 'v'); INSERT INTO results VALUES ('k', 'w')",
		"BEGIN; SELECT f()",
		"SET fence.step = 'c'",
		"SET fence.token = 20",
		"RESET fence.job_key",
		"RESET fence.epoch",
		"SET fence.payload_digest = '" + strings.Repeat("c", 64) + "'",
		"SET search_path = app",
		"PREPARE w AS INSERT INTO results VALUES ('k', 'v')",
		"BEGIN; SAVEPOINT a",
		"INSERT INTO results VALUES ('k', 'v')",
	}
	// cacheStmts are the statements of the queries, each with a twin
	// that differs from it in one of the facts the planner reads of a
	// statement (padded to one width, 100 bytes, the twin leaves the offsets as they
	// are).
	cacheStmts = [][2]string{
		{"INSERT INTO results VALUES ('k', 'v')", "INSERT INTO results VALUES ('kkkkkkkk', 'v')"},
		{"UPDATE other SET v = 1", "DELETE FROM other"},
		{"INSERT INTO app.results VALUES (1)", "INSERT INTO app.results VALUES (2)"},
		{"SELECT 123", "SELECT f()"},
		{"DO $$BEGIN NULL; END$$", "CALL p()"},
		{"EXECUTE w", "CALL p()"},
		{"COMMIT", "COMMIT AND CHAIN"},
		{"ROLLBACK", "COMMIT"},
		{"ROLLBACK AND CHAIN", "ROLLBACK"},
		{"BEGIN", "SELECT 123"},
		{"SAVEPOINT a", "SAVEPOINT b"},
		{"ROLLBACK TO SAVEPOINT a", "ROLLBACK TO SAVEPOINT b"},
		{"RELEASE SAVEPOINT a", "RELEASE SAVEPOINT b"},
		{"SET fence.job_key = ''", "SET fence.step = ''"},
		{"SET fence.token = 22", "SET fence.token = ''"},
		{"SET fence.step = 'x'", "SET fence.step = 'y'"},
		{"SET LOCAL fence.job_key = 'k9'", "SET LOCAL fence.job_key = ''"},
		{"SET fence.token FROM CURRENT", "SET fence.token = ''"},
		{"RESET fence.token", "RESET fence.step"},
		{"RESET ALL", "SELECT 123"},
		{"SET fence.payload_digest = '" + strings.Repeat("d", 64) + "'", "SET fence.payload_digest = '" + strings.Repeat("e", 64) + "'"},
		{"COPY results FROM STDIN", "COPY other FROM STDIN"},
		{"PREPARE TRANSACTION 'x'", "COMMIT"},
		{"SELECT set_config('fence.token', $1, false)", "SELECT set_config('fence.token', '', false)"},
		{"SELECT set_config('fence.token', (SELECT '5'), false)", "SELECT set_config('fence.token', '', false)"},
		{"SET search_path = app", "SET search_path = public"},
		{"SELECT set_config('fence.job_key', 'k1', false)", "SELECT set_config('fence.job_key', '', false)"},
		{"SET fence.payload_digest FROM CURRENT", "SET fence.payload_digest = ''"},
		{"SELECT set_config('fence.payload_digest', (SELECT 'x'), false)", "SELECT set_config('fence.payload_digest', '', false)"},
		{"SET fence.payload_digest = '" + strings.Repeat("d", 64) + "'", "SET fence.other = '" + strings.Repeat("d", 64) + "'"},
		{"SELECT set_config('fence.payload_digest', $1, false)", "SELECT set_config('fence.payload_digest', '', false)"},
	}
	cacheProtected = [][]rewrite.RelName{
		{{Schema: "public", Name: "results"}},
		{{Schema: "public", Name: "results"}, {Schema: "app", Name: "results"}},
		nil,
	}
	cacheGens = []fence.Generation{{}, {JobKey: "k1", Epoch: 3, Token: 18}, {JobKey: "k1", Epoch: 3, Token: 18, Step: "z"}}
)

// targetedCases are inputs (with their variants) the generator seldom
// draws: a statement digested or not before a receipt, a savepoint rolled
// back to or not, settings of the query that present a generation or not
// to the write after them. And, not drawn at all: a savepoint made before
// a COMMIT of the query and rolled back to after it, in transactions whose
// digests have different marks.
var targetedCases = []caseSpec{
	{opts: []string{markOpts}, setups: []string{"BEGIN; INSERT INTO results VALUES ('k', 'v')"}, sql: markQuery},
	{opts: []string{markOpts}, setups: []string{"BEGIN; INSERT INTO results VALUES ('k', 'v'); INSERT INTO results VALUES ('k', 'w')"}, sql: markQuery},
	func() caseSpec {
		sp := targeted("BEGIN; INSERT INTO results VALUES ('k', 'v')", 3, 6)
		sp.drawn = [][2]bool{{}, {}} // SELECT f() not otherwise told apart
		return sp
	}(),
	targeted("BEGIN; INSERT INTO results VALUES ('k', 'v')", 10, 0, 11, 6),
	targeted("", 13, 0),
	targeted("", 17, 0),
	targeted("", 23, 0),
	targeted("", 24, 0),
	targeted("", 26, 0),
	// A generation the query's settings take away is seen when a cached
	// plan's generations are put in: a setting whose operation, name or
	// certainty changes the plan otherwise is one of the client's digest.
	targeted("SET fence.payload_digest = '"+strings.Repeat("a", 64)+"'", 27, 0),
	targeted("SET fence.payload_digest = '"+strings.Repeat("a", 64)+"'", 28, 0),
	targeted("", 29, 0),
	targeted("SET fence.payload_digest = '"+strings.Repeat("a", 64)+"'", 30, 0),
	// Which setting a query sets decides, not only whether its value is
	// valid: a client digest replaces the digest of the statements, a
	// token does not.
	{opts: []string{markOpts}, sql: "SET fence.payload_digest = '" + strings.Repeat("a", 64) + "'; INSERT INTO results VALUES ('k', 'v')"},
	{opts: []string{markOpts}, sql: "SET fence.token = 5; INSERT INTO results VALUES ('k', 'v')"},
}

// targeted is a spec of a fenced session with the protected table results
// that ran setup, and a query of the statements stmts (of cacheStmts).
func targeted(setup string, stmts ...int) caseSpec {
	sp := caseSpec{opts: []string{markOpts}, stmts: stmts, twin: make([]bool, len(stmts)), pad: make([]int, len(stmts))}
	if setup != "" {
		sp.setups = []string{setup}
	}
	return sp
}

const (
	markOpts  = "-c fence.job_key=k1 -c fence.epoch=3 -c fence.token=18"
	markQuery = "SAVEPOINT a; COMMIT; BEGIN; INSERT INTO results VALUES ('k', 'v'); INSERT INTO results VALUES ('k', 'v'); " +
		"INSERT INTO results VALUES ('k', 'v'); ROLLBACK TO SAVEPOINT a; COMMIT"
)

// caseSpec describes a cacheCase: the session's startup options, its
// protected tables, the queries it ran before, what its gate state is
// then made (gate: nil leaves it), whether its transaction failed, and the
// query's statements (stmts, twin, pad) or text (sql), with the answers
// for the protected tables drawn for each statement (drawn) or the
// catalog's.
type caseSpec struct {
	opts    []string
	prot    int
	noFence bool
	setups  []string
	gate    *gateSpec
	fail    bool
	stmts   []int
	twin    []bool
	pad     []int
	sql     string
	drawn   [][2]bool // ProtectedWrite, MayWriteUnseen of each statement
}

type gateSpec struct {
	gated, tentative bool
	digest           int // items in the transaction's digest; -1 none
	gen              int // cacheGens
}

// drawSpec draws a caseSpec from the pools.
func drawSpec(ch chooser) caseSpec {
	var sp caseSpec
	for _, o := range cacheOptions {
		sp.opts = append(sp.opts, o[ch.pick(len(o))])
	}
	sp.prot = ch.pick(len(cacheProtected))
	sp.noFence = ch.pick(8) == 0
	if ch.pick(2) == 0 {
		sp.setups = append(sp.setups, "BEGIN")
	}
	for range ch.pick(3) {
		sp.setups = append(sp.setups, cacheSetups[ch.pick(len(cacheSetups))])
	}
	if ch.pick(2) == 0 {
		sp.gate = &gateSpec{gated: ch.pick(2) == 0, tentative: ch.pick(2) == 0, digest: ch.pick(3) - 1, gen: ch.pick(len(cacheGens))}
	}
	sp.fail = ch.pick(16) == 0
	for range 1 + ch.pick(4) {
		sp.stmts = append(sp.stmts, ch.pick(len(cacheStmts)))
		sp.twin = append(sp.twin, false)
		sp.pad = append(sp.pad, 0)
		if ch.pick(2) == 0 {
			sp.drawn = append(sp.drawn, [2]bool{ch.pick(3) == 0, ch.pick(2) == 0})
		}
	}
	if len(sp.drawn) != len(sp.stmts) {
		sp.drawn = nil
	}
	return sp
}

// variants are sp changed in one input each.
func (sp caseSpec) variants() []caseSpec {
	var out []caseSpec
	change := func(f func(v *caseSpec)) {
		v := sp
		v.opts = append([]string(nil), sp.opts...)
		v.twin = append([]bool(nil), sp.twin...)
		v.pad = append([]int(nil), sp.pad...)
		v.drawn = append([][2]bool(nil), sp.drawn...)
		if sp.gate != nil {
			g := *sp.gate
			v.gate = &g
		}
		f(&v)
		out = append(out, v)
	}
	for i := range sp.opts {
		for _, o := range cacheOptions[i] {
			if o != sp.opts[i] {
				change(func(v *caseSpec) { v.opts[i] = o })
			}
		}
	}
	if sp.gate != nil {
		change(func(v *caseSpec) { v.gate.gated = !v.gate.gated })
		change(func(v *caseSpec) { v.gate.tentative = !v.gate.tentative })
		change(func(v *caseSpec) { v.gate.digest = (v.gate.digest+2)%3 - 1 })
		change(func(v *caseSpec) { v.gate.gen = (v.gate.gen + 1) % len(cacheGens) })
	}
	if len(sp.setups) > 0 && sp.setups[0] == "BEGIN" {
		change(func(v *caseSpec) { v.setups = v.setups[1:] })
	} else {
		change(func(v *caseSpec) { v.setups = append([]string{"BEGIN"}, v.setups...) })
	}
	for i := range sp.stmts {
		change(func(v *caseSpec) { v.twin[i] = !v.twin[i] })
		change(func(v *caseSpec) { v.pad[i]++ })
		if sp.drawn != nil {
			change(func(v *caseSpec) { v.drawn[i][0] = !v.drawn[i][0] })
			change(func(v *caseSpec) { v.drawn[i][1] = !v.drawn[i][1] })
		}
	}
	return out
}

func newCacheCase(t *testing.T, ch chooser) cacheCase { return drawSpec(ch).build(t) }

// build makes the session and classifies the query.
func (sp caseSpec) build(t *testing.T) cacheCase {
	prot := cacheProtected[sp.prot]
	s := &sim{t: t, stmts: map[string]*rewrite.Stmt{}, portals: map[string]*portal{}, prot: rewrite.NewProtected(prot), noFence: sp.noFence}
	opts := strings.Join(strings.Fields(strings.Join(sp.opts, " ")), " ")
	st, err := session.New(map[string]string{"user": "app", "options": opts}, session.NewStatements())
	if err != nil {
		t.Fatalf("startup %q: %v", opts, err)
	}
	s.st = st
	desc := []string{"startup: " + opts, fmt.Sprintf("protected: %v, fence schema %v", prot, !sp.noFence)}
	for _, sql := range sp.setups {
		if s.st.Tx() == session.Failed {
			break // the server would refuse the rest
		}
		desc = append(desc, "run: "+sql)
		s.query(sql, false)
	}
	if g := sp.gate; g != nil {
		sg := s.st.Gate()
		sg.Gated, sg.Tentative, sg.Gen, sg.Digest = g.gated, g.tentative, cacheGens[g.gen], nil
		if g.digest >= 0 {
			d := &fence.Digest{}
			for range g.digest {
				d.Statement("INSERT INTO results VALUES ('k', 'v')", nil)
			}
			sg.Digest = d
		}
		desc = append(desc, fmt.Sprintf("gate: %+v", *g))
	}
	if sp.fail {
		s.st.Fail()
		desc = append(desc, "fail")
	}
	sql := sp.sql
	if sql == "" {
		parts := make([]string, len(sp.stmts))
		for i, n := range sp.stmts {
			text := cacheStmts[n][0]
			if sp.twin[i] {
				text = cacheStmts[n][1]
			}
			parts[i] = fmt.Sprintf("%-*s", 100+sp.pad[i], text)
		}
		sql = strings.Join(parts, ";")
	}
	desc = append(desc, "query: "+sql)
	stmts := classify(t, sql)
	ss := s.session()
	if sp.drawn != nil {
		// Answers independent of the statements, so that no fact of the
		// key stands in for another.
		d := &drawnTables{pw: map[*rewrite.Stmt]bool{}, mwu: map[*rewrite.Stmt]bool{}}
		for i, st := range stmts {
			d.pw[st], d.mwu[st] = sp.drawn[i][0], sp.drawn[i][1]
		}
		ss.Tables = d
		desc = append(desc, fmt.Sprintf("drawn answers (protected, unseen): %v", sp.drawn))
	}
	return cacheCase{desc: strings.Join(desc, "\n  "), ss: ss, stmts: stmts}
}

// drawnTables answers for the protected tables as drawn for each statement.
type drawnTables struct{ pw, mwu map[*rewrite.Stmt]bool }

func (d *drawnTables) ProtectedWrite(st *rewrite.Stmt) bool { return d.pw[st] }
func (d *drawnTables) MayWriteUnseen(st *rewrite.Stmt) bool { return d.mwu[st] }
func (d *drawnTables) ProtectedTable(st *rewrite.Stmt) string {
	if d.pw[st] {
		return "public.results"
	}
	return ""
}
