package rewrite

// The walk over a statement's parse tree that finds what it reads and
// writes, the set_config calls it makes, and the function calls it cannot
// see into; classifyNode (classify.go) starts it.

import (
	"slices"
	"strconv"
	"strings"

	pg_query "github.com/pganalyze/pg_query_go/v6"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// walker visits every node of a statement's parse tree through protobuf
// reflection, so no node type can be forgotten, and reacts to the few that
// matter.
type walker struct {
	st *Stmt
	// noexec > 0 inside subtrees that are not executed by the statement
	// (plain EXPLAIN, function bodies, rule actions): their writes count
	// as references only and their calls are not made.
	noexec int
	// planned > 0 inside the statement of a plain EXPLAIN: not run, but
	// planned, and planning runs the functions it folds into constants.
	planned int
	// targets are RangeVars already recorded as write targets.
	targets map[*pg_query.RangeVar]bool
	// ctes is the stack of CTE names in scope.
	ctes []string
	// definite are set_config calls certain to run exactly once.
	definite map[*pg_query.FuncCall]bool
}

func (w *walker) markDefiniteSetConfig(s *pg_query.SelectStmt) {
	if s.IntoClause != nil || len(s.FromClause) > 0 || s.WhereClause != nil || len(s.GroupClause) > 0 ||
		s.HavingClause != nil || len(s.ValuesLists) > 0 || s.LimitCount != nil || s.LimitOffset != nil ||
		s.WithClause != nil || s.Op != pg_query.SetOperation_SETOP_NONE || len(s.DistinctClause) > 0 {
		return
	}
	for _, t := range s.TargetList {
		rt := t.GetResTarget()
		if rt == nil || rt.Val == nil {
			continue
		}
		v := rt.Val
		if tc := v.GetTypeCast(); tc != nil {
			v = tc.Arg
		}
		if fc := v.GetFuncCall(); fc != nil {
			if w.definite == nil {
				w.definite = make(map[*pg_query.FuncCall]bool)
			}
			w.definite[fc] = true
		}
	}
}

func (w *walker) addWrite(r *pg_query.RangeVar) {
	if r == nil {
		return
	}
	if w.noexec > 0 {
		w.addRead(r)
		return
	}
	if w.targets == nil {
		w.targets = make(map[*pg_query.RangeVar]bool)
	}
	w.targets[r] = true
	w.st.WriteTargets = appendRel(w.st.WriteTargets, rel(r))
}

func (w *walker) addRead(r *pg_query.RangeVar) {
	if r.Schemaname == "" {
		for _, c := range w.ctes {
			if c == r.Relname {
				return
			}
		}
	}
	if (r.Schemaname == "" || r.Schemaname == "pg_catalog") && sessionLocalViews[r.Relname] {
		w.st.SessionLocal = true
	}
	w.st.ReadRelations = appendRel(w.st.ReadRelations, rel(r))
}

func appendRel(list []RelName, r RelName) []RelName {
	for _, x := range list {
		if x == r {
			return list
		}
	}
	return append(list, r)
}

// with walks a WITH clause's queries, each with the CTE names it can see
// in scope, and leaves every name of the clause in scope for the rest of
// the statement (the caller's walkMsg drops them at its end). Without
// RECURSIVE a CTE sees only the CTEs before it: a name it uses that is
// its own or a later sibling's is a relation (`WITH results AS (SELECT *
// FROM results) ...` reads the table). With RECURSIVE every CTE sees all
// of them. It returns wc (nil when there is none).
func (w *walker) with(wc *pg_query.WithClause) *pg_query.WithClause {
	if wc == nil {
		return nil
	}
	if wc.Recursive {
		for _, c := range wc.Ctes {
			if cte := c.GetCommonTableExpr(); cte != nil {
				w.ctes = append(w.ctes, cte.Ctename)
			}
		}
		for _, c := range wc.Ctes {
			w.walk(c)
		}
		return wc
	}
	for _, c := range wc.Ctes {
		w.walk(c)
		if cte := c.GetCommonTableExpr(); cte != nil {
			w.ctes = append(w.ctes, cte.Ctename)
		}
	}
	return wc
}

// isTempSchema reports whether a schema name is the session's temporary
// schema (pg_temp, or its real name pg_temp_N).
func isTempSchema(s string) bool {
	return s == "pg_temp" || strings.HasPrefix(s, "pg_temp_")
}

func (w *walker) walk(n *pg_query.Node) {
	if n == nil {
		return
	}
	w.walkMsg(n.ProtoReflect())
}

// dmlStmt is what INSERT, UPDATE, DELETE and MERGE have alike: a WITH
// clause and the one relation they write.
type dmlStmt interface {
	GetWithClause() *pg_query.WithClause
	GetRelation() *pg_query.RangeVar
}

var nodeOneof = (&pg_query.Node{}).ProtoReflect().Descriptor().Oneofs().Get(0)

func (w *walker) walkMsg(m protoreflect.Message) {
	if !m.IsValid() {
		return
	}
	if _, ok := m.Interface().(*pg_query.Node); ok {
		fd := m.WhichOneof(nodeOneof)
		if fd != nil {
			w.walkMsg(m.Get(fd).Message())
		}
		return
	}
	depth := len(w.ctes)
	noexec, planned := w.noexec, w.planned
	w.noteExpr(m.Interface())
	w.noteGrammar(m)
	// with: the statement's WITH clause, walked first (its CTE names are
	// in scope for the rest of the statement) and skipped below.
	var with *pg_query.WithClause
	switch n := m.Interface().(type) {
	case *pg_query.InsertStmt, *pg_query.UpdateStmt, *pg_query.DeleteStmt, *pg_query.MergeStmt:
		d := n.(dmlStmt)
		with = w.with(d.GetWithClause())
		w.addWrite(d.GetRelation())
	case *pg_query.SelectStmt:
		with = w.with(n.WithClause)
		if n.IntoClause != nil {
			w.addWrite(n.IntoClause.Rel)
		}
	case *pg_query.CreateTableAsStmt:
		if n.Into != nil {
			w.addWrite(n.Into.Rel)
		}
	case *pg_query.TruncateStmt:
		for _, r := range n.Relations {
			w.addWrite(r.GetRangeVar())
		}
	case *pg_query.CopyStmt:
		if n.IsFrom {
			w.addWrite(n.Relation)
		}
	case *pg_query.RefreshMatViewStmt:
		w.addWrite(n.Relation)
	case *pg_query.ExplainStmt:
		// Nested EXPLAIN (only reachable through unusual trees): run
		// only with ANALYZE.
		analyze := false
		for _, o := range n.Options {
			if d := o.GetDefElem(); d != nil && d.Defname == "analyze" {
				analyze = defBool(d.Arg)
			}
		}
		if !analyze {
			w.noexec++
			w.planned++
		}
	case *pg_query.CreateFunctionStmt, *pg_query.RuleStmt:
		w.noexec++
	case *pg_query.PrepareStmt:
		// The prepared statement runs only when executed; its writes
		// are reported through Stmt.Inner when PREPARE is the
		// statement itself.
		w.noexec++
	case *pg_query.RangeVar:
		if n.Relpersistence == "t" || isTempSchema(n.Schemaname) {
			w.st.Temp = true
		}
		if !w.targets[n] {
			w.addRead(n)
		}
	case *pg_query.LockingClause:
		if w.noexec == 0 {
			w.st.LockingRead = true
		}
	case *pg_query.ParamRef:
		if int(n.Number) > w.st.Params && w.noexec == 0 {
			w.st.Params = int(n.Number)
		}
	case *pg_query.SQLValueFunction:
		switch n.Op {
		case pg_query.SQLValueFunctionOp_SVFOP_CURRENT_USER, pg_query.SQLValueFunctionOp_SVFOP_CURRENT_ROLE,
			pg_query.SQLValueFunctionOp_SVFOP_USER, pg_query.SQLValueFunctionOp_SVFOP_SESSION_USER,
			pg_query.SQLValueFunctionOp_SVFOP_CURRENT_SCHEMA:
			// The session's identity and search path: reported by the
			// backend that runs it (sessionLocalFuncs).
			w.st.SessionLocal = true
		}
	case *pg_query.FuncCall:
		switch {
		case w.noexec == 0:
			w.funcCall(n)
		case w.planned > 0:
			// Planned, not run: the call may be folded, but a
			// set_config in it changes nothing.
			gucs := len(w.st.GUCs)
			w.funcCall(n)
			w.st.GUCs = w.st.GUCs[:gucs]
		}
	}

	fields := m.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		fd := fields.Get(i)
		if fd.Kind() != protoreflect.MessageKind {
			continue
		}
		if with != nil && fd.Name() == "with_clause" {
			continue
		}
		if fd.IsList() {
			l := m.Get(fd).List()
			for j := 0; j < l.Len(); j++ {
				w.walkMsg(l.Get(j).Message())
			}
			continue
		}
		if m.Has(fd) {
			w.walkMsg(m.Get(fd).Message())
		}
	}
	w.ctes = w.ctes[:depth]
	w.noexec, w.planned = noexec, planned
}

func (w *walker) funcCall(fc *pg_query.FuncCall) {
	fn := funcName(fc)
	builtin := fn.Schema == "" || fn.Schema == "pg_catalog"
	switch {
	case fn.Schema == "fence":
		w.st.CallsFence = true
		w.st.PrimaryOnlyFuncs = true
		w.st.Opaque = true
	case builtin && sessionLocalFuncs[fn.Name]:
		w.st.SessionLocal = true
		if readOnlyFuncs[fn.Name] {
			w.trusted(fn)
		} else {
			w.st.Opaque = true
		}
	case builtin && primaryOnlyFuncs(fn.Name):
		w.st.PrimaryOnlyFuncs = true
		w.trusted(fn)
		if fn.Name == "set_config" {
			w.setConfig(fc)
		}
	case builtin && readOnlyFuncs[fn.Name]:
		w.trusted(fn)
	default:
		w.st.Opaque = true
		if fn.Schema != "pg_catalog" {
			w.st.UserCalls = true
		}
	}
}

// trusted records a call of a function taken for a built-in by its name
// alone (Stmt.Builtins); a call qualified with pg_catalog is exact.
func (w *walker) trusted(fn RelName) {
	if fn.Schema == "" && !slices.Contains(w.st.Builtins, fn.Name) {
		w.st.Builtins = append(w.st.Builtins, fn.Name)
	}
}

// setConfig records the effect of set_config(name, value, is_local).
func (w *walker) setConfig(fc *pg_query.FuncCall) {
	g := GUC{Func: true, Op: GUCSet, Conditional: !w.definite[fc]}
	if len(fc.Args) != 3 {
		// Not the built-in set_config (it takes three arguments): a
		// user function of that name; nothing known.
		w.st.Opaque, w.st.UserCalls = true, true
		return
	}
	var null bool
	switch a := argOf(fc.Args[0]); {
	case a.param > 0:
		g.NameParam = a.param
	case a.literal && !a.null:
		g.Name = strings.ToLower(a.value)
	default:
		g.Unknown = true
		w.st.UnknownGUCWrite = true
	}
	switch a := argOf(fc.Args[1]); {
	case a.param > 0:
		g.ValueParam = a.param
	case a.literal:
		g.Value = a.value
		null = a.null
	default:
		g.Unknown = true
	}
	switch a := argOf(fc.Args[2]); {
	case a.param > 0:
		g.LocalParam = a.param
	case a.literal:
		// A NULL is_local is false in set_config_by_name.
		if !a.null {
			b, ok := ParseBool(a.value)
			if !ok {
				g.Unknown = true
			}
			g.Local = b
		}
	default:
		g.Unknown = true
	}
	if null {
		// set_config(name, NULL, ...) resets the parameter.
		g.Op = GUCReset
		g.Value = ""
	}
	g.NArgs = 1
	w.st.GUCs = append(w.st.GUCs, g)
}

type arg struct {
	literal bool
	null    bool
	value   string
	param   int
}

// argOf reads a function argument that is a literal (possibly cast) or a $n
// parameter (possibly cast).
func argOf(n *pg_query.Node) arg {
	for {
		tc := n.GetTypeCast()
		if tc == nil {
			break
		}
		n = tc.Arg
	}
	if p := n.GetParamRef(); p != nil {
		return arg{param: int(p.Number)}
	}
	c := n.GetAConst()
	if c == nil {
		return arg{}
	}
	if c.Isnull {
		return arg{literal: true, null: true}
	}
	switch v := c.Val.(type) {
	case *pg_query.A_Const_Sval:
		return arg{literal: true, value: v.Sval.GetSval()}
	case *pg_query.A_Const_Ival:
		return arg{literal: true, value: strconv.Itoa(int(v.Ival.GetIval()))}
	case *pg_query.A_Const_Fval:
		return arg{literal: true, value: v.Fval.GetFval()}
	case *pg_query.A_Const_Boolval:
		return arg{literal: true, value: strconv.FormatBool(v.Boolval.GetBoolval())}
	}
	return arg{}
}

// ParseBool accepts PostgreSQL's boolean input forms (boolin): any unique
// prefix of true/false/yes/no, on/off, 1/0, ignoring case and surrounding
// whitespace.
func ParseBool(s string) (bool, bool) {
	s = strings.ToLower(strings.TrimSpace(s))
	if s == "" {
		return false, false
	}
	switch {
	case strings.HasPrefix("true", s), strings.HasPrefix("yes", s), s == "on", s == "1":
		return true, true
	case strings.HasPrefix("false", s), strings.HasPrefix("no", s), s == "off", s == "of", s == "0":
		return false, true
	}
	return false, false
}

// noteGrammar records the constructs an older server's grammar reads
// otherwise than PostgreSQL 17's (Stmt.GrammarCalls, GrammarTypes). Found
// by diffing the keyword lists (pg_get_keywords() of PostgreSQL 15 against
// pg_query's kwlist.h): 16 and 17 added keywords only, none changed its
// category, and the ones that are not unreserved (json, json_array,
// json_arrayagg, json_exists, json_object, json_objectagg, json_query,
// json_scalar, json_serialize, json_table, json_value, merge_action,
// system_user) are exactly where 17 makes syntax of text an older server
// reads as a name:
//   - a SQL/JSON node or MERGE support function: before its version the
//     text is a call of the function of that name (or a syntax error);
//     any Json* node this list does not know counts as 17's;
//   - the type json, which 17's grammar names pg_catalog.json itself and
//     15 looks up on the search path;
//   - json_object(a, b), which 17 reads as pg_catalog.json_object and 15
//     looks up on the search path (a call the walker never trusts anyway:
//     json_object is not a trusted name, so it is opaque);
//   - system_user, a function call to 16 and a column to 15 (which reads
//     it from a relation the statement names, running nothing).
//
// New unreserved keywords change nothing an older server accepts, and the
// other productions 16 and 17 added (MERGE ... RETURNING and BY SOURCE,
// AT LOCAL, new EXPLAIN, COPY and VACUUM options, numeric literals with
// underscores or in hex, octal, binary) are syntax errors to 15. (14 and
// 13 read 0x1F or 1_000 as a number and a column label: the same relations
// and calls.)
func (w *walker) noteGrammar(m protoreflect.Message) {
	v := 0
	switch n := m.Interface().(type) {
	case *pg_query.JsonObjectConstructor, *pg_query.JsonArrayConstructor, *pg_query.JsonArrayQueryConstructor,
		*pg_query.JsonObjectAgg, *pg_query.JsonArrayAgg, *pg_query.JsonAggConstructor, *pg_query.JsonIsPredicate,
		*pg_query.JsonValueExpr, *pg_query.JsonKeyValue, *pg_query.JsonOutput, *pg_query.JsonReturning,
		*pg_query.JsonFormat:
		v = 16
	case *pg_query.MergeSupportFunc:
		v = 17
	case *pg_query.TypeName:
		if len(n.Names) == 2 && n.Names[0].GetString_().GetSval() == "pg_catalog" && n.Names[1].GetString_().GetSval() == "json" {
			w.st.GrammarTypes = max(w.st.GrammarTypes, 16)
		}
		return
	default:
		if strings.HasPrefix(string(m.Descriptor().Name()), "Json") {
			v = 17
		}
	}
	w.st.GrammarCalls = max(w.st.GrammarCalls, v)
}
