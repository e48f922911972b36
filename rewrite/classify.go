package rewrite

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"

	pg_query "github.com/pganalyze/pg_query_go/v6"
)

// Kind is what a statement does, as far as the proxy cares.
type Kind uint8

// Statement kinds.
const (
	Other              Kind = iota // DDL, utility statements, SHOW, FETCH, ...
	Read                           // SELECT, VALUES, TABLE, plain EXPLAIN, DECLARE CURSOR
	Write                          // INSERT, UPDATE, DELETE, MERGE, TRUNCATE, writable CTE, SELECT INTO, CREATE TABLE AS, EXPLAIN ANALYZE of a write
	Begin                          // BEGIN, START TRANSACTION
	Commit                         // COMMIT, END (Chain for AND CHAIN)
	Rollback                       // ROLLBACK, ABORT (Chain for AND CHAIN)
	Savepoint                      // SAVEPOINT Name
	RollbackTo                     // ROLLBACK TO [SAVEPOINT] Name
	Release                        // RELEASE [SAVEPOINT] Name
	PrepareTransaction             // PREPARE TRANSACTION GID
	CommitPrepared                 // COMMIT PREPARED GID
	RollbackPrepared               // ROLLBACK PREPARED GID
	Set                            // SET [LOCAL] Name = value (GUCs[0])
	Reset                          // RESET Name, SET Name TO DEFAULT (GUCs[0])
	ResetAll                       // RESET ALL
	Discard                        // DISCARD ALL|PLANS|TEMP|SEQUENCES (Name)
	Prepare                        // SQL-level PREPARE Name AS Inner
	Execute                        // SQL-level EXECUTE Name
	Deallocate                     // DEALLOCATE Name, or DEALLOCATE ALL (Name empty, All)
	CopyFrom                       // COPY table FROM
	CopyTo                         // COPY table|(query) TO
	Listen                         // LISTEN Name
	Unlisten                       // UNLISTEN Name (All for UNLISTEN *)
	Notify                         // NOTIFY Name
	Call                           // CALL procedure (always Opaque)
	Do                             // DO block (always Opaque)
)

var kindNames = [...]string{
	Other: "Other", Read: "Read", Write: "Write", Begin: "Begin", Commit: "Commit",
	Rollback: "Rollback", Savepoint: "Savepoint", RollbackTo: "RollbackTo",
	Release: "Release", PrepareTransaction: "PrepareTransaction",
	CommitPrepared: "CommitPrepared", RollbackPrepared: "RollbackPrepared",
	Set: "Set", Reset: "Reset", ResetAll: "ResetAll", Discard: "Discard",
	Prepare: "Prepare", Execute: "Execute", Deallocate: "Deallocate",
	CopyFrom: "CopyFrom", CopyTo: "CopyTo", Listen: "Listen", Unlisten: "Unlisten",
	Notify: "Notify", Call: "Call", Do: "Do",
}

func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return "Kind(" + strconv.Itoa(int(k)) + ")"
}

// RelName is a relation name as written in a statement, with identifiers
// folded as PostgreSQL folds them (unquoted lowercased, quoted preserved).
// Schema is empty when the name is unqualified.
type RelName struct {
	Schema string
	Name   string
}

func (r RelName) String() string {
	if r.Schema == "" {
		return quoteIdent(r.Name)
	}
	return quoteIdent(r.Schema) + "." + quoteIdent(r.Name)
}

// quoteIdent quotes s unless it is a plain lowercase identifier. It is for
// display; unlike PostgreSQL's quote_identifier it does not quote keywords.
func quoteIdent(s string) string {
	if s == "" {
		return `""`
	}
	plain := true
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c == '_' || i > 0 && (c >= '0' && c <= '9' || c == '$') {
			continue
		}
		plain = false
		break
	}
	if plain {
		return s
	}
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}

// GUCOp is what a GUC effect does.
type GUCOp uint8

// GUC operations.
const (
	GUCSet      GUCOp = iota // set Name to Value
	GUCReset                 // reset Name to its session default (RESET, SET TO DEFAULT, set_config(name, NULL, ...))
	GUCResetAll              // RESET ALL
	GUCCurrent               // SET Name FROM CURRENT: make the current value the Local/session value
)

// GUC is a change to a run-time parameter made by a statement: SET, SET
// LOCAL, RESET, RESET ALL, or a set_config call found anywhere in it.
//
// Names are lowercased, as PostgreSQL compares parameter names without
// regard to case. The caller decides which names it tracks.
type GUC struct {
	Op    GUCOp
	Name  string // empty for GUCResetAll, or when NameParam or Unknown
	Value string // for GUCSet: the value as PostgreSQL flattens the SET arguments
	Local bool   // SET LOCAL, or set_config(..., true)
	// NArgs is the number of comma-separated SET arguments; PostgreSQL
	// rejects more than one for parameters that are not lists.
	NArgs int

	// Func marks a set_config(name, value, is_local) call. For those,
	// NameParam, ValueParam and LocalParam are the $n index of an argument
	// given as a parameter (0 when it is a literal).
	Func       bool
	NameParam  int
	ValueParam int
	LocalParam int
	// Unknown: some argument of set_config is neither a literal nor a $n
	// parameter, so its effect cannot be known before execution.
	Unknown bool
	// Conditional: the set_config call is not certain to run exactly once
	// (it is not a direct output column of a plain SELECT without FROM,
	// WHERE, GROUP BY, HAVING, LIMIT, set operations or WITH). Its effect
	// cannot be tracked exactly.
	Conditional bool
}

// Uncertain reports whether the effect cannot be tracked from the statement
// text and bound parameters alone.
func (g GUC) Uncertain() bool { return g.Unknown || g.Conditional }

// Stmt is the classification of one statement. A Stmt is immutable after
// Classify returns and safe to share between goroutines.
type Stmt struct {
	// SQL is the statement's own text within the query string.
	SQL string
	// Offset is the byte offset in the query string where the statement's
	// part begins: right after the previous statement's semicolon (so it
	// may include leading whitespace and comments), or 0 for the first.
	// The proxy splices its own statements in at these boundaries.
	Offset int
	Kind   Kind
	// Name is the object a statement kind names: the savepoint, the
	// prepared statement (Prepare, Execute, Deallocate), the GUC (Set,
	// Reset, and SHOW as Other), the DISCARD target (ALL, PLANS, TEMP,
	// SEQUENCES), the notification channel, or the GID of a two-phase
	// transaction.
	Name string
	// All: DEALLOCATE ALL, UNLISTEN *.
	All bool
	// Chain: COMMIT AND CHAIN, ROLLBACK AND CHAIN.
	Chain bool

	// Begin options (BEGIN / START TRANSACTION).
	ReadOnly   bool
	ReadWrite  bool   // READ WRITE given explicitly
	Isolation  string // "serializable", "repeatable read", ... or empty
	Deferrable bool

	// WriteTargets are the relations the statement writes, in order of
	// appearance, without duplicates. See Writes.
	WriteTargets []RelName
	// ReadRelations are the other relations the statement names (read,
	// locked, or referenced by utility statements), without CTE names.
	ReadRelations []RelName

	Opaque           bool // CALL, DO, or a call of a function not known to be read-only (plain EXPLAIN's too: the planner runs immutable ones)
	UserCalls        bool // calls a function not known to be read-only that is not named pg_catalog.<name> (may be anyone's)
	LockingRead      bool // FOR UPDATE / NO KEY UPDATE / SHARE / KEY SHARE anywhere
	CallsFence       bool // calls a function in schema fence
	PrimaryOnlyFuncs bool // calls a function that needs the primary (nextval, advisory locks, pg_notify, set_config, fence.*, ...)
	// SessionLocal: reads the state of the session's own backend or
	// server (sessionLocal: current_setting, pg_prepared_statements,
	// pg_settings, pg_stat_activity, ...), which another connection
	// answers differently: it must run on the session's primary
	// connection.
	SessionLocal    bool
	UnknownGUCWrite bool // a set_config call whose parameter name cannot be determined
	// Builtins are the functions the statement calls by an unqualified
	// name that the classifier took for PostgreSQL's built-ins (neither
	// Opaque nor, but for PrimaryOnlyFuncs, anything else): in order,
	// without duplicates. A function of that name outside pg_catalog may
	// be the one PostgreSQL calls (an overload, a search_path that puts
	// pg_catalog later), which the caller, knowing the database, checks.
	Builtins []string
	// GrammarCalls is the oldest PostgreSQL major version whose grammar
	// reads every construct of the statement as the classifier (pg_query,
	// PostgreSQL 17's grammar) did; 0 when any supported version does.
	// PostgreSQL 16 and 17 made syntax of names that older servers read
	// as plain function calls (json_scalar('k'), json_array(...),
	// json(...), merge_action(), ...: SQL/JSON constructors and queries,
	// IS JSON, MERGE support functions), so on an older server the
	// statement calls functions by those names, which may be anyone's:
	// the caller, knowing the server's version, treats it as running
	// client code (RunsUserCode).
	GrammarCalls int
	// GrammarTypes: below this major version a type name the classifier
	// read as pg_catalog's own (json, a keyword since 16) is looked up on
	// the search path instead, where a domain or a user's type may shadow
	// it: the caller counts the statement as resolving something through
	// the catalog (CatalogExprs).
	GrammarTypes int
	// Temp: the statement names a temporary relation (CREATE TEMP ...,
	// SELECT INTO TEMP, pg_temp.x): the session has, or will have,
	// objects only its own backend sees.
	Temp bool

	// CatalogExprs: an expression PostgreSQL resolves through the catalog
	// where code a user defined may run: an operator (any A_Expr, IN,
	// LIKE, a comparison with a subquery, a row comparison, CASE x WHEN,
	// JOIN USING, ORDER BY USING), a type not named in pg_catalog (a cast
	// to a domain or a user's type), a name after a dot (Fields), or a
	// node the classifier does not know (exprs.go). A statement without
	// one runs only built-in code besides the functions it calls by name.
	CatalogExprs bool
	// Fields are the names after a dot (n.f, (expr).f): PostgreSQL calls
	// a function f of the value before the dot when it has no field f.
	Fields []string

	// GUCs are the parameter changes the statement makes, in order.
	GUCs []GUC

	// Params is the highest $n parameter number used by the statement.
	Params int

	// Inner is the classification of the statement of a SQL-level PREPARE.
	Inner *Stmt
	// Executes names the SQL-level prepared statement this statement runs:
	// EXECUTE name, EXPLAIN ANALYZE EXECUTE name, CREATE TABLE AS EXECUTE name.
	Executes string
	// Explain marks EXPLAIN; with Analyze the statement is executed and
	// classified as what it executes.
	Explain bool
	Analyze bool

	node    *pg_query.Node
	version int32 // parse tree version, required by the deparser
	// canon is the canonical SQL of a write, computed once (Canonical),
	// and shared by a copy made with RunsUserCode; nil for other
	// statements.
	canon *canonical
}

type canonical struct {
	once sync.Once
	text string
	err  error // the deparser's, when it failed (text is then the statement's own)
}

// Writes reports whether the statement writes any relation. Use it, not
// Kind, to decide whether a statement is gated: COPY (DELETE ... RETURNING)
// TO and DDL with writable subqueries write too.
func (s *Stmt) Writes() bool { return len(s.WriteTargets) > 0 }

// MayWrite reports whether the statement may write, by its kind, by what
// it writes (Writes) or by code it runs (Opaque, CALL, DO, EXECUTE, CREATE
// TABLE AS EXECUTE): what a receipt's payload digest holds (plan.Digested).
// Such a statement is never shared by shape (Classifier): its own text,
// not another text of its shape, is what the digest must see.
func (s *Stmt) MayWrite() bool {
	switch s.Kind {
	case Write, CopyFrom, Call, Do, Execute:
		return true
	}
	return s.Writes() || s.Opaque || s.Executes != ""
}

// Canonical returns the statement's canonical SQL for the v1 payload digest:
// pg_query's deparse of its parse tree, so whitespace, comments, keyword case
// and needless quoting do not change it. It is computed on first use and
// kept.
//
// Only statements that write (Writes) are deparsed; for any other statement
// Canonical returns its trimmed text. The digest covers writes only, and the
// C deparser is not robust against every tree the parser accepts (it
// crashes the process on COMMIT PREPARED with an empty GID, for one), so the proxy must not
// feed it arbitrary client statements. If deparsing a write fails with an
// error, the statement's text is used too, still deterministic for a given
// text.
func (s *Stmt) Canonical() string {
	c := s.canon
	if c == nil || s.node == nil || !s.Writes() {
		return strings.TrimSpace(s.SQL)
	}
	c.once.Do(func() {
		c.text = strings.TrimSpace(s.SQL)
		out, err := pg_query.Deparse(&pg_query.ParseResult{Version: s.version, Stmts: []*pg_query.RawStmt{{Stmt: s.node}}})
		if err != nil {
			c.err = err
			return
		}
		c.text = out
	})
	return c.text
}

// RunsUserCode returns a copy of s marked Opaque: the caller knows that
// a function s calls by a built-in's name alone (Builtins), or an
// operator, cast or check s may evaluate, is client code in its
// database. With settings, the set_config s calls is such a function:
// its effects are unknown (UnknownGUCWrite) rather than those of
// PostgreSQL's set_config.
func (s *Stmt) RunsUserCode(settings bool) *Stmt {
	c := *s
	c.Opaque = true
	if settings {
		c.GUCs = nil
		for _, g := range s.GUCs {
			if !g.Func {
				c.GUCs = append(c.GUCs, g)
			}
		}
		c.UnknownGUCWrite = true
	}
	return &c
}

// ForServer returns s as a server of PostgreSQL major version major reads
// it (GrammarCalls, GrammarTypes): s itself when that is as classified,
// else a copy that runs client code or resolves a type through the
// catalog. A major of 0 (unknown) is older than every grammar.
func (s *Stmt) ForServer(major int) *Stmt {
	calls, types := major < s.GrammarCalls, major < s.GrammarTypes
	if !calls && !types {
		return s
	}
	c := s
	if calls {
		c = c.RunsUserCode(false)
	} else {
		cc := *c
		c = &cc
	}
	if types {
		c.CatalogExprs = true
	}
	return c
}

// Result is the classification of a whole query string.
type Result struct {
	Stmts []*Stmt
}

// Writes reports whether any statement writes a relation.
func (r *Result) Writes() bool {
	for _, s := range r.Stmts {
		if s.Writes() {
			return true
		}
	}
	return false
}

// ErrInvalidUTF8 is the ParseError cause for text that is not valid UTF-8.
// A server whose encoding is UTF8 refuses such text too; a proxy in front of
// a SQL_ASCII database should refuse it rather than forward it unclassified.
var ErrInvalidUTF8 = errors.New("statement text is not valid UTF-8")

// ParseError is returned when PostgreSQL's grammar rejects the text.
type ParseError struct {
	Err error
}

func (e *ParseError) Error() string { return "classify: " + e.Err.Error() }
func (e *ParseError) Unwrap() error { return e.Err }

// Classify parses sql (a simple-Query string with any number of statements,
// or the single statement of a Parse message, with $n parameters) and
// classifies each statement. It returns a *ParseError if the grammar rejects
// the text. An empty or comment-only string yields a Result with no
// statements.
func Classify(sql string) (*Result, error) { return ClassifyWith(sql, Options{}) }

// Options are the session settings that change how PostgreSQL reads a
// statement's text. The zero value is PostgreSQL's default.
type Options struct {
	// NonStandardStrings: standard_conforming_strings is off, so a
	// backslash in an ordinary string literal is an escape.
	NonStandardStrings bool
}

// Affects reports whether o makes sql read differently from PostgreSQL's
// default: standard_conforming_strings matters only where a backslash is.
func (o Options) Affects(sql string) bool {
	return o.NonStandardStrings && strings.IndexByte(sql, '\\') >= 0
}

// key prefixes cache keys of texts o affects (a NUL never occurs in query
// text).
func (o Options) key() string { return "\x00scs=off\x00" }

// ClassifyWith is Classify under the session settings o.
func ClassifyWith(sql string, o Options) (*Result, error) {
	if !utf8.ValidString(sql) {
		return nil, &ParseError{Err: ErrInvalidUTF8}
	}
	var tree *pg_query.ParseResult
	var err error
	if o.Affects(sql) {
		tree, err = parseSCSOff(sql)
	} else {
		// Without a backslash the setting makes no difference.
		tree, err = pg_query.Parse(sql)
	}
	if err != nil {
		return nil, &ParseError{Err: err}
	}
	res := &Result{Stmts: make([]*Stmt, 0, len(tree.Stmts))}
	for _, raw := range tree.Stmts {
		text := stmtText(sql, raw)
		st := classifyNode(raw.Stmt, text, tree.Version)
		st.Offset = int(raw.StmtLocation)
		res.Stmts = append(res.Stmts, st)
	}
	return res, nil
}

// stmtText cuts a statement's own text out of the query string. Locations
// are byte offsets; a length of 0 means "to the end".
func stmtText(sql string, raw *pg_query.RawStmt) string {
	start := int(raw.StmtLocation)
	if start < 0 || start > len(sql) {
		return sql
	}
	end := len(sql)
	if raw.StmtLen > 0 && start+int(raw.StmtLen) <= len(sql) {
		end = start + int(raw.StmtLen)
	}
	return strings.TrimSpace(sql[start:end])
}

func classifyNode(node *pg_query.Node, text string, version int32) *Stmt {
	st := &Stmt{SQL: text, node: node, version: version}
	defer func() {
		if st.Writes() {
			st.canon = new(canonical)
		}
	}()
	w := walker{st: st}
	switch n := node.GetNode().(type) {
	case *pg_query.Node_SelectStmt:
		w.markDefiniteSetConfig(n.SelectStmt)
		w.walk(node)
		st.Kind = Read
		if st.Writes() {
			st.Kind = Write
		}
	case *pg_query.Node_InsertStmt, *pg_query.Node_UpdateStmt, *pg_query.Node_DeleteStmt,
		*pg_query.Node_MergeStmt, *pg_query.Node_TruncateStmt, *pg_query.Node_RefreshMatViewStmt:
		w.walk(node)
		st.Kind = Write
	case *pg_query.Node_CreateTableAsStmt:
		w.walk(node)
		st.Kind = Write
		if ex := n.CreateTableAsStmt.GetQuery().GetExecuteStmt(); ex != nil {
			st.Executes = ex.Name
		}
	case *pg_query.Node_CopyStmt:
		w.walk(node)
		if n.CopyStmt.IsFrom {
			st.Kind = CopyFrom
		} else {
			st.Kind = CopyTo
		}
		if r := n.CopyStmt.Relation; r != nil {
			st.Name = rel(r).String()
		}
	case *pg_query.Node_ExplainStmt:
		classifyExplain(st, &w, n.ExplainStmt)
	case *pg_query.Node_DeclareCursorStmt:
		w.walk(node)
		st.Kind = Read
		st.Name = n.DeclareCursorStmt.Portalname
	case *pg_query.Node_TransactionStmt:
		classifyTransaction(st, n.TransactionStmt)
	case *pg_query.Node_VariableSetStmt:
		classifySet(st, n.VariableSetStmt)
	case *pg_query.Node_VariableShowStmt:
		st.Kind = Other
		st.Name = strings.ToLower(n.VariableShowStmt.Name)
	case *pg_query.Node_DiscardStmt:
		st.Kind = Discard
		switch n.DiscardStmt.Target {
		case pg_query.DiscardMode_DISCARD_ALL:
			st.Name = "ALL"
		case pg_query.DiscardMode_DISCARD_PLANS:
			st.Name = "PLANS"
		case pg_query.DiscardMode_DISCARD_SEQUENCES:
			st.Name = "SEQUENCES"
		case pg_query.DiscardMode_DISCARD_TEMP:
			st.Name = "TEMP"
		}
	case *pg_query.Node_PrepareStmt:
		st.Kind = Prepare
		st.Name = n.PrepareStmt.Name
		if q := n.PrepareStmt.Query; q != nil {
			st.Inner = classifyNode(q, text, version)
		}
	case *pg_query.Node_ExecuteStmt:
		w.walk(node) // parameters are expressions and may call functions
		st.Kind = Execute
		st.Name = n.ExecuteStmt.Name
		st.Executes = n.ExecuteStmt.Name
	case *pg_query.Node_DeallocateStmt:
		st.Kind = Deallocate
		st.Name = n.DeallocateStmt.Name
		st.All = n.DeallocateStmt.Isall || n.DeallocateStmt.Name == ""
	case *pg_query.Node_ListenStmt:
		st.Kind = Listen
		st.Name = n.ListenStmt.Conditionname
	case *pg_query.Node_UnlistenStmt:
		st.Kind = Unlisten
		st.Name = n.UnlistenStmt.Conditionname
		st.All = st.Name == ""
	case *pg_query.Node_NotifyStmt:
		st.Kind = Notify
		st.Name = n.NotifyStmt.Conditionname
		st.PrimaryOnlyFuncs = true
	case *pg_query.Node_CallStmt:
		w.walk(node)
		st.Kind = Call
		st.Opaque = true
		if fc := n.CallStmt.Funccall; fc != nil {
			st.Name = funcName(fc).String()
		}
	case *pg_query.Node_DoStmt:
		st.Kind = Do
		st.Opaque = true
	default:
		w.walk(node)
		st.Kind = Other
	}
	return st
}

func classifyExplain(st *Stmt, w *walker, ex *pg_query.ExplainStmt) {
	st.Explain = true
	for _, o := range ex.Options {
		if d := o.GetDefElem(); d != nil && d.Defname == "analyze" {
			st.Analyze = defBool(d.Arg)
		}
	}
	q := ex.Query
	if !st.Analyze {
		// Plain EXPLAIN plans the statement without running it: nothing
		// is written. But the planner folds constants, running every
		// immutable function (a user's too) and, to estimate, stable
		// ones: the calls count as calls (walker.planned). EXPLAIN
		// EXECUTE plans a prepared statement the classifier cannot see
		// here: opaque.
		w.noexec++
		w.planned++
		w.walk(q)
		w.planned--
		w.noexec--
		st.Kind = Read
		if q.GetExecuteStmt() != nil {
			st.Opaque, st.UserCalls = true, true
		}
		return
	}
	switch n := q.GetNode().(type) {
	case *pg_query.Node_ExecuteStmt:
		w.walk(q)
		st.Kind = Execute
		st.Name = n.ExecuteStmt.Name
		st.Executes = n.ExecuteStmt.Name
		return
	case *pg_query.Node_SelectStmt:
		w.markDefiniteSetConfig(n.SelectStmt)
	case *pg_query.Node_CreateTableAsStmt:
		if e := n.CreateTableAsStmt.GetQuery().GetExecuteStmt(); e != nil {
			st.Executes = e.Name
		}
	}
	w.walk(q)
	st.Kind = Read
	if st.Writes() {
		st.Kind = Write
	}
}

// defBool interprets a DefElem argument as PostgreSQL's defGetBoolean
// does. An argument it does not understand counts as true (executing), the
// conservative reading for EXPLAIN ANALYZE.
func defBool(arg *pg_query.Node) bool {
	if arg == nil {
		return true
	}
	switch a := arg.GetNode().(type) {
	case *pg_query.Node_Integer:
		return a.Integer.Ival != 0
	case *pg_query.Node_Boolean:
		return a.Boolean.Boolval
	case *pg_query.Node_String_:
		switch strings.ToLower(a.String_.Sval) {
		case "false", "off", "0", "f", "n", "no":
			return false
		}
	case *pg_query.Node_AConst:
		switch v := a.AConst.Val.(type) {
		case *pg_query.A_Const_Ival:
			return v.Ival.GetIval() != 0
		case *pg_query.A_Const_Boolval:
			return v.Boolval.GetBoolval()
		case *pg_query.A_Const_Sval:
			switch strings.ToLower(v.Sval.GetSval()) {
			case "false", "off", "0", "f", "n", "no":
				return false
			}
		}
	}
	return true
}

func classifyTransaction(st *Stmt, t *pg_query.TransactionStmt) {
	st.Chain = t.Chain
	switch t.Kind {
	case pg_query.TransactionStmtKind_TRANS_STMT_BEGIN, pg_query.TransactionStmtKind_TRANS_STMT_START:
		st.Kind = Begin
		for _, o := range t.Options {
			d := o.GetDefElem()
			if d == nil {
				continue
			}
			switch d.Defname {
			case "transaction_isolation":
				st.Isolation = constString(d.Arg)
			case "transaction_read_only":
				if constInt(d.Arg) != 0 {
					st.ReadOnly = true
					st.ReadWrite = false
				} else {
					st.ReadOnly = false
					st.ReadWrite = true
				}
			case "transaction_deferrable":
				st.Deferrable = constInt(d.Arg) != 0
			}
		}
	default:
		st.Kind = transactionKinds[t.Kind] // Other where it has none
	}
	switch st.Kind {
	case Savepoint, Release, RollbackTo:
		st.Name = t.SavepointName
	case PrepareTransaction, CommitPrepared, RollbackPrepared:
		st.Name = t.Gid
	}
}

// transactionKinds is the Kind of each transaction statement but BEGIN
// and START TRANSACTION (classifyTransaction reads their options).
var transactionKinds = map[pg_query.TransactionStmtKind]Kind{
	pg_query.TransactionStmtKind_TRANS_STMT_COMMIT:            Commit,
	pg_query.TransactionStmtKind_TRANS_STMT_ROLLBACK:          Rollback,
	pg_query.TransactionStmtKind_TRANS_STMT_SAVEPOINT:         Savepoint,
	pg_query.TransactionStmtKind_TRANS_STMT_RELEASE:           Release,
	pg_query.TransactionStmtKind_TRANS_STMT_ROLLBACK_TO:       RollbackTo,
	pg_query.TransactionStmtKind_TRANS_STMT_PREPARE:           PrepareTransaction,
	pg_query.TransactionStmtKind_TRANS_STMT_COMMIT_PREPARED:   CommitPrepared,
	pg_query.TransactionStmtKind_TRANS_STMT_ROLLBACK_PREPARED: RollbackPrepared,
}

func constString(n *pg_query.Node) string {
	if n == nil {
		return ""
	}
	if c := n.GetAConst(); c != nil {
		switch v := c.Val.(type) {
		case *pg_query.A_Const_Sval:
			return v.Sval.GetSval()
		case *pg_query.A_Const_Ival:
			return strconv.Itoa(int(v.Ival.GetIval()))
		case *pg_query.A_Const_Fval:
			return v.Fval.GetFval()
		case *pg_query.A_Const_Boolval:
			return strconv.FormatBool(v.Boolval.GetBoolval())
		}
	}
	if s := n.GetString_(); s != nil {
		return s.Sval
	}
	return ""
}

func constInt(n *pg_query.Node) int {
	if n == nil {
		return 0
	}
	if c := n.GetAConst(); c != nil {
		switch v := c.Val.(type) {
		case *pg_query.A_Const_Ival:
			return int(v.Ival.GetIval())
		case *pg_query.A_Const_Boolval:
			if v.Boolval.GetBoolval() {
				return 1
			}
		}
	}
	return 0
}

func classifySet(st *Stmt, v *pg_query.VariableSetStmt) {
	name := strings.ToLower(v.Name)
	switch v.Kind {
	case pg_query.VariableSetKind_VAR_SET_VALUE:
		st.Kind = Set
		st.Name = name
		st.GUCs = []GUC{{Op: GUCSet, Name: name, Value: flattenSetArgs(name, v.Args), Local: v.IsLocal, NArgs: len(v.Args)}}
	case pg_query.VariableSetKind_VAR_SET_DEFAULT:
		st.Kind = Reset
		st.Name = name
		st.GUCs = []GUC{{Op: GUCReset, Name: name, Local: v.IsLocal}}
	case pg_query.VariableSetKind_VAR_SET_CURRENT:
		st.Kind = Set
		st.Name = name
		st.GUCs = []GUC{{Op: GUCCurrent, Name: name, Local: v.IsLocal}}
	case pg_query.VariableSetKind_VAR_RESET:
		st.Kind = Reset
		st.Name = name
		st.GUCs = []GUC{{Op: GUCReset, Name: name}}
	case pg_query.VariableSetKind_VAR_RESET_ALL:
		st.Kind = ResetAll
		st.GUCs = []GUC{{Op: GUCResetAll}}
	default:
		// SET TRANSACTION ..., SET SESSION CHARACTERISTICS ...
		st.Kind = Other
		st.Name = name
	}
}

// flattenSetArgs renders SET arguments as PostgreSQL's
// flatten_set_variable_args does: integers and numerics as written, strings
// as is, except that search_path (a GUC_LIST_QUOTE parameter) quotes each
// element that is not a plain identifier.
func flattenSetArgs(name string, args []*pg_query.Node) string {
	var b strings.Builder
	for i, a := range args {
		if i > 0 {
			b.WriteString(", ")
		}
		if tc := a.GetTypeCast(); tc != nil {
			a = tc.Arg
		}
		c := a.GetAConst()
		if c == nil {
			continue
		}
		switch v := c.Val.(type) {
		case *pg_query.A_Const_Ival:
			b.WriteString(strconv.Itoa(int(v.Ival.GetIval())))
		case *pg_query.A_Const_Fval:
			b.WriteString(v.Fval.GetFval())
		case *pg_query.A_Const_Sval:
			if name == "search_path" {
				b.WriteString(QuoteIdentifier(v.Sval.GetSval()))
			} else {
				b.WriteString(v.Sval.GetSval())
			}
		case *pg_query.A_Const_Boolval:
			b.WriteString(strconv.FormatBool(v.Boolval.GetBoolval()))
		}
	}
	return b.String()
}

// QuoteIdentifier quotes s as PostgreSQL's quote_identifier does: unless it
// consists of lowercase letters, digits and underscores, starts with a
// letter or underscore, and is not a keyword other than an unreserved one.
func QuoteIdentifier(s string) string {
	safe := s != "" && (s[0] >= 'a' && s[0] <= 'z' || s[0] == '_')
	for i := 0; safe && i < len(s); i++ {
		c := s[i]
		safe = c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_'
	}
	if safe {
		if sc, err := pg_query.Scan(s); err == nil && len(sc.Tokens) == 1 {
			k := sc.Tokens[0].KeywordKind
			safe = k == pg_query.KeywordKind_NO_KEYWORD || k == pg_query.KeywordKind_UNRESERVED_KEYWORD
		}
	}
	if safe {
		return s
	}
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}

func rel(r *pg_query.RangeVar) RelName {
	return RelName{Schema: r.Schemaname, Name: r.Relname}
}

// funcName returns a function's (schema, name).
func funcName(fc *pg_query.FuncCall) RelName {
	var parts []string
	for _, n := range fc.Funcname {
		if s := n.GetString_(); s != nil {
			parts = append(parts, s.Sval)
		}
	}
	switch len(parts) {
	case 0:
		return RelName{}
	case 1:
		return RelName{Name: parts[0]}
	default:
		return RelName{Schema: parts[len(parts)-2], Name: parts[len(parts)-1]}
	}
}

// String renders a statement's classification on one line, for logs.
func (s *Stmt) String() string {
	return fmt.Sprintf("%s writes=%v reads=%v", s.Kind, s.WriteTargets, s.ReadRelations)
}
