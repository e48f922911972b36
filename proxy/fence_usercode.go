package proxy

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/rewrite"
)

// Which built-ins a database lets the classifier trust by name.
//
// The classifier takes a call of count, lower, now, set_config, ... by its
// name alone for PostgreSQL's own function (rewrite.Stmt.Builtins): it does
// not know the database. PostgreSQL resolves the name in the session's
// search_path, with pg_catalog first unless the path names it later, and
// by the arguments: a user's public.version(text) is called for
// version('x') whatever the path (pg_catalog's takes none), and a
// public.lower(text) for lower('x') when the path (a startup option, an
// ALTER ROLE, a function's set_config) puts public first. Either would be
// taken for a built-in that reads no relation and runs nothing: routed to
// a lagging replica, left out of what the gate counts as code it cannot
// see into. So the watcher reads, with the protected tables, which of the
// trusted names also exist outside pg_catalog in the database (in any
// schema: no search_path need be resolved, and none can change the
// answer unseen; pg_temp is never searched for functions unqualified, but
// its functions are counted too, to fail closed), and a statement that
// calls one is treated as one that runs client code (Stmt.RunsUserCode).
// (Code run inside expressions, operators, casts, domain checks, fields,
// is the read set's business: readCodeQuery in fence_catalog.go.)

// userCode is what a database makes of the names and expressions the
// classifier trusts. A nil *userCode is not known (not loaded yet):
// nothing is trusted. A DDL notification does not drop it (fence_catalog.go).
type userCode struct {
	shadowed map[string]bool // trusted names that exist outside pg_catalog too
	// major is the server's PostgreSQL major version (its server_version
	// ParameterStatus), 0 when unknown: a statement is judged as that
	// version's grammar reads it (rewrite.Stmt.ForServer), not only as
	// the classifier's (PostgreSQL 17's) does.
	major int
}

// serverMajor is the major version in a server_version ParameterStatus
// ("15.18 (Debian 15.18-0+deb12u1)", "9.6.24", "17beta1"), 0 when it
// cannot be read: older than every grammar, the safe side.
func serverMajor(v string) int {
	n := 0
	for _, c := range v {
		if c < '0' || c > '9' {
			break
		}
		n = n*10 + int(c-'0')
		if n > 1000 {
			return 0
		}
	}
	return n
}

// shadowedQuery lists the trusted names ($1, and those beginning with one
// of $2) of functions outside pg_catalog (OID 11). Every name and
// operator is qualified: it runs in a database whose users may define
// their own.
var shadowedQuery = own("watcher: functions named like built-ins", onControl, `SELECT DISTINCT p.proname::pg_catalog.text FROM pg_catalog.pg_proc p
WHERE p.pronamespace OPERATOR(pg_catalog.<>) 11::pg_catalog.oid
  AND (p.proname OPERATOR(pg_catalog.=) ANY ($1::pg_catalog.name[])
    OR EXISTS (SELECT FROM pg_catalog.unnest($2::pg_catalog.text[]) AS x(prefix)
               WHERE pg_catalog.starts_with(p.proname::pg_catalog.text, x.prefix)))`)

// trustedNames and trustedPrefixes are shadowedQuery's parameters.
var trustedNames, trustedPrefixes = func() ([]byte, []byte) {
	names, prefixes := rewrite.TrustedByName()
	return []byte("{" + strings.Join(names, ",") + "}"), []byte("{" + strings.Join(prefixes, ",") + "}")
}()

// loadUserCode reads what the database makes of the trusted names and
// expressions.
func loadUserCode(ctx context.Context, conn *pgconn.PgConn) (*userCode, error) {
	uc := &userCode{shadowed: map[string]bool{}, major: serverMajor(conn.ParameterStatus("server_version"))}
	rr := conn.ExecParams(ctx, shadowedQuery, [][]byte{trustedNames, trustedPrefixes}, nil, nil, nil)
	for rr.NextRow() {
		uc.shadowed[string(rr.Values()[0])] = true
	}
	if _, err := rr.Close(); err != nil {
		return nil, fmt.Errorf("functions named like built-ins: %w", err)
	}
	return uc, nil
}

// trusts reports whether the built-in names st relies on are the
// database's built-ins.
func (uc *userCode) trusts(st *rewrite.Stmt) bool {
	if len(st.Builtins) == 0 {
		return true
	}
	if uc == nil {
		return false
	}
	for _, n := range st.Builtins {
		if uc.shadowed[n] {
			return false
		}
	}
	return true
}

// userCode returns res with every statement that calls a function by the
// name of a built-in the database also has outside pg_catalog (or any
// such name, while the database's are not known) marked as running
// client code (Stmt.RunsUserCode). It returns res itself when there is
// none: the common case costs no copy.
func (h *fenceSession) userCode(res *rewrite.Result) *rewrite.Result {
	if res == nil {
		return nil
	}
	uc := h.cat.code.Load()
	var out *rewrite.Result
	major := 0 // unknown (not loaded): older than every grammar
	if uc != nil {
		major = uc.major
	}
	for i, st := range res.Stmts {
		// As the server's grammar reads it (issue 30, attacker C's H2):
		// json_scalar('k') is SQL/JSON syntax to the classifier and a
		// call of a function json_scalar to a server older than 17.
		// Two compares for every statement; a copy only for those.
		old := st.ForServer(major)
		if old == st && uc.trusts(st) {
			continue
		}
		if out == nil {
			out = &rewrite.Result{Stmts: append([]*rewrite.Stmt(nil), res.Stmts...)}
		}
		if !uc.trusts(st) {
			settings := slices.Contains(st.Builtins, "set_config") && (uc == nil || uc.shadowed["set_config"])
			old = old.RunsUserCode(settings)
		}
		out.Stmts[i] = old
	}
	if out == nil {
		return res
	}
	return out
}
