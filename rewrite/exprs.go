package rewrite

// What in a statement's expressions PostgreSQL resolves through the
// catalog, for read routing (Stmt.CatalogExprs, Stmt.Fields): an
// operator, a cast, a comparison or a name after a dot can run code a
// user defined (an operator's function, a domain's CHECK, a cast's
// function, a function called as a column) without the statement naming
// a function or a relation. The proxy cannot resolve them; it asks its
// read set whether the database has any such code (proxy/fence_catalog.go).

import (
	pg_query "github.com/pganalyze/pg_query_go/v6"
)

// noteExpr looks at one message of the tree (walkMsg calls it for each).
// It is an allowlist: a node it does not know sets CatalogExprs, so a
// construct added to the grammar later fails safe.
func (w *walker) noteExpr(n any) {
	switch n := n.(type) {
	case *pg_query.ColumnRef:
		// n.f may be f(n), a function of n's row (or of the column
		// n's value): PostgreSQL tries a function when there is no
		// column of that name.
		if len(n.Fields) > 1 {
			if s := n.Fields[len(n.Fields)-1].GetString_(); s != nil {
				w.field(s.Sval)
			}
		}
	case *pg_query.A_Indirection:
		// (expr).f: the same, for any expression.
		for _, i := range n.Indirection {
			if s := i.GetString_(); s != nil {
				w.field(s.Sval)
			}
		}
	case *pg_query.TypeName:
		// A type the grammar names in pg_catalog itself (int, bigint,
		// boolean, numeric, timestamp, ...) is a built-in; any other
		// name is looked up on the search path and may be a domain, a
		// type with a user's casts, or a built-in's name shadowed.
		if len(n.Names) < 2 || n.Names[0].GetString_().GetSval() != "pg_catalog" {
			w.st.CatalogExprs = true
		}
	case *pg_query.CaseExpr:
		if n.Arg != nil { // CASE x WHEN v: x = v
			w.st.CatalogExprs = true
		}
	case *pg_query.SortBy:
		if len(n.UseOp) > 0 { // ORDER BY x USING op
			w.st.CatalogExprs = true
		}
	case *pg_query.SubLink:
		switch n.SubLinkType {
		case pg_query.SubLinkType_EXISTS_SUBLINK, pg_query.SubLinkType_EXPR_SUBLINK, pg_query.SubLinkType_ARRAY_SUBLINK:
		default: // x IN (SELECT ...), x op ANY/ALL (...), row comparisons
			w.st.CatalogExprs = true
		}
	case *pg_query.JoinExpr:
		if n.IsNatural || len(n.UsingClause) > 0 { // an implicit =
			w.st.CatalogExprs = true
		}
	case *pg_query.SelectStmt, *pg_query.ResTarget, *pg_query.A_Const, *pg_query.Integer, *pg_query.Float,
		*pg_query.Boolean, *pg_query.String, *pg_query.BitString, *pg_query.List, *pg_query.ParamRef,
		*pg_query.A_Star, *pg_query.A_Indices, *pg_query.FuncCall, *pg_query.WindowDef, *pg_query.TypeCast,
		*pg_query.NullTest, *pg_query.BooleanTest, *pg_query.BoolExpr, *pg_query.CaseWhen,
		*pg_query.CoalesceExpr, *pg_query.MinMaxExpr, *pg_query.A_ArrayExpr, *pg_query.RowExpr,
		*pg_query.SQLValueFunction, *pg_query.CollateClause, *pg_query.GroupingSet, *pg_query.GroupingFunc,
		*pg_query.RangeVar, *pg_query.Alias, *pg_query.RangeSubselect, *pg_query.RangeFunction,
		*pg_query.ColumnDef, *pg_query.WithClause, *pg_query.CommonTableExpr, *pg_query.LockingClause,
		*pg_query.IntoClause, *pg_query.CopyStmt, *pg_query.DeclareCursorStmt, *pg_query.ExplainStmt,
		*pg_query.DefElem, *pg_query.ExecuteStmt:
		// Built-in by construction (the function calls, relations and
		// type names inside are judged on their own).
	default:
		w.st.CatalogExprs = true
	}
}

// field records a name after a dot.
func (w *walker) field(name string) {
	w.st.CatalogExprs = true
	for _, f := range w.st.Fields {
		if f == name {
			return
		}
	}
	w.st.Fields = append(w.st.Fields, name)
}
