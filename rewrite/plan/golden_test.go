package plan_test

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/golden"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
)

const plansDir = "../testdata/plans"

// separator divides a plan file's input from the plans rendered for it.
const separator = "----"

// TestPlans plans the input of every file in rewrite/testdata/plans and
// compares the rendering with the part of the file after its "----" line.
// Run with -update to regenerate it, then review the diff.
//
// The input is a session and what its client sends, one line each:
//
//	# a comment
//	protected: results, app.other       the database's protected tables (schema public unless named)
//	no fence schema                     the database has no fence schema (else it has one)
//	startup: -c fence.job_key=j ...     the startup options (PGOPTIONS)
//	run: BEGIN; UPDATE results ...      a query the session ran before, answered without error
//	fail                                a statement of the open transaction failed
//	query: COMMIT                       a simple Query to plan
//	parse s INSERT ... ($1)             an extended-protocol Parse of statement s
//	bind p s 'x' 42                     a Bind of portal p to statement s, with text parameters
//	execute p                           an Execute of portal p, planned
//	sync                                a Sync, planned
//
// Between messages the server is taken to answer every statement with
// success: the session state follows the gate's steps and the client's
// statements as the proxy's server side would make it follow them.
func TestPlans(t *testing.T) {
	for _, file := range golden.Files(t, filepath.Join(plansDir, "*.txt")) {
		t.Run(strings.TrimSuffix(filepath.Base(file), ".txt"), func(t *testing.T) {
			raw, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			input, _, found := strings.Cut(string(raw), "\n"+separator+"\n")
			if !found {
				if !golden.Update() {
					t.Fatalf("%s has no %q line (run go test ./rewrite/plan -run TestPlans -update)", file, separator)
				}
				input = strings.TrimSuffix(input, "\n")
			}
			golden.Check(t, file, input+"\n"+separator+"\n"+runPlans(t, input))
		})
	}
}

// sim is the session of one plan file: its state, as the proxy keeps it,
// and what the server would do with what the proxy sends.
type sim struct {
	t       *testing.T
	prot    *rewrite.Protected
	noFence bool // the database has no fence schema
	st      *session.State
	batch   plan.Batch
	stmts   map[string]*rewrite.Stmt
	portals map[string]*portal
	out     strings.Builder
	failed  bool // the extended batch failed: the server skips to the Sync
	// cache, when set, plans every query through it too, and the plan
	// must be PlanQuery's (plans differ: the queries they differ on).
	cache  *plan.Cache
	differ []string
}

type portal struct {
	stmt   *rewrite.Stmt
	params [][]byte
}

func (p *portal) DigestParams() []fence.Param {
	out := make([]fence.Param, len(p.params))
	for i, v := range p.params {
		out[i] = fence.Param{Value: v}
	}
	return out
}

// ProtectedWrite, MayWriteUnseen and ProtectedTable answer as the proxy's
// catalog does (proxy.fenceSession.protectedWrite, maybeWrite).
func (s *sim) ProtectedWrite(st *rewrite.Stmt) bool { return plan.ProtectedWrite(s.prot, s.st, st) }

func (s *sim) MayWriteUnseen(st *rewrite.Stmt) bool {
	return st != nil && !s.noFence && st.Kind != rewrite.CopyFrom && (st.Writes() || plan.Opaque(st))
}

func (s *sim) ProtectedTable(st *rewrite.Stmt) string {
	if rels := s.prot.ProtectedWrites(st, s.st.SearchPath()); len(rels) > 0 {
		return rels[0].String()
	}
	return ""
}

func (s *sim) session() plan.Session { return plan.Session{State: s.st, Tables: s} }

func runPlans(t *testing.T, input string) string {
	return newSim(t, nil).run(input)
}

func newSim(t *testing.T, c *plan.Cache) *sim {
	return &sim{t: t, prot: rewrite.NewProtected(nil), stmts: map[string]*rewrite.Stmt{}, portals: map[string]*portal{}, cache: c}
}

// run runs a plan file's input and returns its plans, rendered.
func (s *sim) run(input string) string {
	t := s.t
	params := map[string]string{"user": "app"}
	sc := bufio.NewScanner(strings.NewReader(input))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		verb, arg, _ := strings.Cut(line, " ")
		verb = strings.TrimSuffix(verb, ":")
		arg = strings.TrimSpace(arg)
		if line == "no fence schema" {
			s.noFence = true
			continue
		}
		if s.st == nil && verb != "protected" && verb != "startup" {
			st, err := session.New(params, session.NewStatements())
			if err != nil {
				t.Fatalf("startup %q: %v", params["options"], err)
			}
			s.st = st
		}
		switch verb {
		case "protected":
			var rels []rewrite.RelName
			for _, name := range strings.Split(arg, ",") {
				schema, table, ok := strings.Cut(strings.TrimSpace(name), ".")
				if !ok {
					schema, table = "public", schema
				}
				rels = append(rels, rewrite.RelName{Schema: schema, Name: table})
			}
			s.prot = rewrite.NewProtected(rels)
		case "startup":
			params["options"] = arg
		case "run":
			s.query(arg, false)
		case "fail":
			s.st.Fail()
		case "query":
			s.query(arg, true)
		case "parse":
			name, sql, _ := strings.Cut(arg, " ")
			s.parse(name, sql)
		case "bind":
			f := strings.Fields(arg)
			s.bind(f[0], f[1], f[2:])
		case "execute":
			s.execute(arg)
		case "sync":
			s.sync()
		default:
			t.Fatalf("unknown line %q", line)
		}
	}
	return s.out.String()
}

func (s *sim) printf(format string, args ...any) { fmt.Fprintf(&s.out, format, args...) }

func classify(t testing.TB, sql string) []*rewrite.Stmt {
	t.Helper()
	res, err := rewrite.Classify(sql)
	if err != nil {
		t.Fatalf("classify %q: %v", sql, err)
	}
	return res.Stmts
}

// query plans a simple Query, shows the plan when show, and applies it as
// the server would answer it.
func (s *sim) query(sql string, show bool) {
	stmts := classify(s.t, sql)
	q := plan.PlanQuery(s.session(), stmts)
	if s.cache != nil {
		if c := s.cache.PlanQuery(s.session(), stmts); !reflect.DeepEqual(c, q) {
			s.differ = append(s.differ, fmt.Sprintf("%s\n  cached: %+v\n  planned: %+v", sql, c, q))
		}
	}
	if show {
		s.showQuery(sql, stmts, &q)
	}
	switch q.Action {
	case plan.Refuse:
		s.st.Fail()
	case plan.PassThrough:
		for i := range stmts {
			s.apply(stmts[i], nil)
		}
	default:
		s.steps(q.Steps, stmts)
		if q.Ending == plan.AfterCopy {
			s.st.Commit(false) // the receipt and COMMIT after the COPY's data
		}
	}
	if s.st.Tx() == session.InTx && !s.st.Explicit() {
		s.st.TxStatus('I')
	}
}

// steps applies a query's steps as the server answers them: the gate's
// row, each statement's completion, and the error of a refusal (which
// makes the server skip the rest).
func (s *sim) steps(steps []plan.Step, stmts []*rewrite.Stmt) {
	for _, step := range steps {
		switch step.Kind {
		case plan.Begin:
			s.st.Begin()
		case plan.Gate:
			plan.Gated(s.st, step.Gen, false)
		case plan.Raise:
			s.st.Fail()
			return
		case plan.Client:
			st := stmts[step.Stmt]
			if s.st.Tx() == session.Failed && st.Kind != rewrite.Commit && st.Kind != rewrite.Rollback && st.Kind != rewrite.RollbackTo {
				return // the server refuses it, and skips the rest
			}
			s.apply(st, nil)
		}
	}
}

// apply follows a statement the server completed, as the proxy's server
// side does (fenceSession.applyClient).
func (s *sim) apply(st *rewrite.Stmt, p *portal) {
	var bound plan.Bound
	if p != nil {
		bound = p
	}
	plan.Completed(s.session(), st, bound)
	if err := s.st.Apply(st, "COMMIT", nil); err != nil {
		s.t.Fatalf("apply %s: %v\n%s", st.SQL, err, s.out.String())
	}
}

func (s *sim) showQuery(sql string, stmts []*rewrite.Stmt, q *plan.Query) {
	s.printf("query: %s\n", sql)
	action := map[plan.Action]string{plan.PassThrough: "pass-through", plan.Refuse: "refuse", plan.AsIs: "as is (failed transaction)", plan.Rewrite: "rewrite"}[q.Action]
	s.printf("  plan: %s", action)
	if q.Action == plan.Rewrite {
		s.printf(", ending %s", map[plan.Ending]string{plan.Plain: "plain", plan.LoneCommit: "lone commit",
			plan.Restore: "restore", plan.AwaitCommit: "await commit", plan.AfterCopy: "after copy"}[q.Ending])
	}
	for _, f := range []struct {
		on   bool
		name string
	}{{q.CopyDigested, "copy digested"}, {q.Unfenced, "unfenced"}, {q.Waits, "waits"}} {
		if f.on {
			s.printf(", %s", f.name)
		}
	}
	s.printf("\n")
	switch q.Action {
	case plan.PassThrough:
		s.printf("  sent:\n    Query %s\n", sql)
		return
	case plan.Refuse:
		s.printf("  refusal: %s %q\n", q.Refusal.Code, q.Refusal.Message)
		s.printf("  sent:\n    Query %s\n", plan.RaiseSQL(q.Refusal))
		return
	}
	s.printf("  steps:\n")
	for _, step := range q.Steps {
		if step.Kind == plan.Client {
			s.printf("    %s: %s\n", step, strings.TrimSpace(stmts[step.Stmt].SQL))
		} else {
			s.printf("    %s\n", step)
		}
	}
	if q.CopyReceipt != nil {
		s.printf("    after the COPY: %s\n", *q.CopyReceipt)
	}
	s.printf("  sent:\n")
	if q.Action == plan.AsIs {
		s.printf("    Query %s\n", sql)
		return
	}
	if q.Ending == plan.LoneCommit {
		r := q.Steps[0]
		sum, version := plan.Resolve(r.Digest, s.st, stmts)
		s.printf("    Bind/Execute %s%s\n    Sync (its ReadyForQuery hidden)\n    Query %s\n",
			plan.ReceiptStatement(r.Gated), args(plan.CommitArgs(r.Gen, sum, version)), sql)
		return
	}
	text, _ := q.Text(sql, s.st, stmts)
	hidden := map[plan.Ending]string{plan.Restore: " (its ReadyForQuery hidden)", plan.AwaitCommit: " (its ReadyForQuery hidden)",
		plan.AfterCopy: " (its ReadyForQuery hidden)"}[q.Ending]
	s.printf("    Query %s%s\n", strings.ReplaceAll(text, "\n", "\n      "), hidden)
	switch q.Ending {
	case plan.Restore:
		s.printf("    Query %s\n", plan.RestoreSQL)
	case plan.AwaitCommit:
		s.printf("    once answered: Query ROLLBACK if a receipt failed, else an empty Query\n")
	case plan.AfterCopy:
		// Its digest covers the COPY data: shown as a placeholder.
		receipt := strings.Replace(plan.StepSQL(q.CopyReceipt, nil, "v1"), `E'\\x'::pg_catalog.bytea`, "<digest with the COPY data>", 1)
		s.printf("    after the last CopyDone: Query %s\n    Query COMMIT\n    (if no COPY starts: Query ROLLBACK)\n", receipt)
	}
}

func args(a [][]byte) string {
	parts := make([]string, len(a))
	for i, v := range a {
		parts[i] = "'" + string(v) + "'"
	}
	return "(" + strings.Join(parts, ", ") + ")"
}

func (s *sim) parse(name, sql string) {
	s.printf("parse %s: %s\n", name, sql)
	if e := plan.CheckName("prepared statement", name); e != nil {
		s.refuseMessage(e)
		return
	}
	if s.failed {
		return
	}
	stmts := classify(s.t, sql)
	s.stmts[name] = stmts[0]
	s.st.Statements().Parse(name, &rewrite.Result{Stmts: stmts}, nil)
}

func (s *sim) bind(name, stmt string, params []string) {
	s.printf("bind %s to %s\n", name, stmt)
	for what, n := range map[string]string{"prepared statement": stmt, "portal": name} {
		if e := plan.CheckName(what, n); e != nil {
			s.refuseMessage(e)
			return
		}
	}
	if s.failed {
		return
	}
	p := &portal{stmt: s.stmts[stmt]}
	for _, v := range params {
		p.params = append(p.params, []byte(strings.Trim(v, "'")))
	}
	s.portals[name] = p
	if err := s.st.Bind(name, stmt); err != nil {
		s.t.Fatalf("bind %s: %v", name, err)
	}
}

// refuseMessage shows the refusal of an extended-protocol message, which
// the proxy raises in its place.
func (s *sim) refuseMessage(e *fence.Error) {
	s.printf("  refusal: %s %q\n  sent:\n    Parse/Bind/Execute %s: %s\n", e.Code, e.Message, plan.RaiseStatement, plan.RaiseSQL(e))
	s.fail()
}

func (s *sim) fail() {
	s.st.Fail()
	s.failed = true
}

func (s *sim) execute(name string) {
	p := s.portals[name]
	s.printf("execute %s: %s\n", name, strings.TrimSpace(p.stmt.SQL))
	ep := s.batch.Execute(s.session(), plan.Exec{Stmt: p.stmt, Portal: name, Bound: p})
	if ep.Refusal != nil {
		s.refuseMessage(ep.Refusal)
		s.printf("    Execute %s (skipped by the server)\n", name)
		return
	}
	var flags []string
	for _, f := range []struct {
		on   bool
		name string
	}{{ep.Decides, "decides"}, {ep.CaptureTx, "capture tx"}, {ep.CopyDigested, "copy digested"}, {ep.Unfenced, "unfenced"}, {ep.AwaitCommit, "await commit"}} {
		if f.on {
			flags = append(flags, f.name)
		}
	}
	if len(flags) == 0 {
		flags = []string{"pass-through"}
	}
	s.printf("  plan: %s\n  sent:\n", strings.Join(flags, ", "))
	if ep.CaptureTx {
		s.printf("    Close/Parse/Bind/Execute %s\n", plan.TxStatement)
	}
	for _, step := range ep.Before {
		s.showNamed(step)
		if s.failed {
			break
		}
	}
	s.printf("    Execute %s\n", name)
	if !s.failed {
		s.apply(p.stmt, p)
	}
}

// showNamed shows a step the proxy runs as one of its named statements,
// and applies it as the server answers it.
func (s *sim) showNamed(step plan.Step) {
	switch step.Kind {
	case plan.Gate:
		s.printf("    %s: Close/Parse/Bind/Execute %s%s\n", step, plan.GateStatement, args(plan.GateArgs(step.Gen)))
		if !s.failed {
			plan.Gated(s.st, step.Gen, false)
		}
	case plan.Savepoint:
		s.printf("    %s: Close/Parse/Bind/Execute %s\n", step, plan.SavepointStatement)
	case plan.Receipt:
		sum, version := plan.Resolve(step.Digest, s.st, nil)
		name := plan.ReceiptStatement(step.Gated)
		if step.TxBound {
			name += " (bound to the transaction: " + plan.TxReceiptStatement + ")"
		}
		s.printf("    %s: Close/Parse/Bind/Execute %s%s\n", step, name, args(plan.CommitArgs(step.Gen, sum, version)))
	case plan.Raise:
		s.printf("    %s: Parse/Bind/Execute %s: %s\n", step, plan.RaiseStatement, plan.RaiseSQL(step.Err))
		s.fail()
	}
}

func (s *sim) sync() {
	s.printf("sync\n")
	sp := s.batch.Sync()
	s.printf("  sent:\n")
	if sp.Receipt != nil {
		s.showNamed(*sp.Receipt)
	}
	if sp.Restore {
		s.printf("    Sync (its ReadyForQuery hidden)\n    Query %s\n", plan.RestoreSQL)
	} else {
		s.printf("    Sync\n")
	}
	s.failed = false
	if s.st.Tx() == session.InTx && !s.st.Explicit() {
		s.st.TxStatus('I')
	}
}
