// Package ownsql is how pgfence runs SQL of its own — the proxy's control
// connections (the catalog watcher, the replica pollers, the console's
// SHOW FENCES, the auth lookup) and the CLI's connections — in databases
// where others may create objects and change settings (docs/security.md,
// "pgfence's own SQL").
//
// Such SQL often runs as a superuser (the proxy's primary DSN, a DBA's
// CLI), in a database a client names. Whatever PostgreSQL resolves by name
// when it runs a statement — a function, an operator, a type, a cast's
// target, a conversion — it looks up on the session's search_path, and a
// database's owner sets that path for everyone (ALTER DATABASE … SET); a
// role that may CREATE in a schema on the path can add an operator or a
// function that matches a call better than pg_catalog's. Its code then
// runs with the caller's rights. And a schema named fence can be anyone's
// in a database someone else made. So pgfence's own SQL
//
//   - starts every connection with Pin: search_path pg_catalog, pg_temp and
//     every other setting a database's owner could use against it, in the
//     startup packet, which PostgreSQL applies over ALTER DATABASE and
//     ALTER ROLE … SET and over the DSN's options;
//   - names every function, operator, type and relation by its schema
//     (OPERATOR(pg_catalog.=), pg_catalog.now(), ::pg_catalog.text): with
//     the pinned path alone no other schema's object can be picked, and the
//     qualified text holds even on a connection someone forgot to pin;
//   - reads nothing in schema fence before Check has found, from pg_catalog
//     alone, that the schema and the relations it reads are a superuser's
//     and plain tables that run no code when read.
package ownsql

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// SearchPath is the search_path of every connection of pgfence's own:
// pg_catalog, then this session's own temporary schema, named last so
// that it is searched last for relations (PostgreSQL never searches it for
// functions or operators). Another session's temporary objects are never
// on it.
const SearchPath = "pg_catalog, pg_temp"

// pins are the settings every connection of pgfence's own starts with,
// whatever the database, the role or the DSN's options set. Each is one a
// database's owner may set for everyone (ALTER DATABASE … SET needs no
// superuser for these) and that would change what pgfence's SQL means or
// runs, or would take its connections down:
var pins = map[string]string{
	// Where unqualified names are looked up (the class of issue 30).
	"search_path": SearchPath,
	// ALTER DATABASE … SET role makes every session there, a superuser's
	// included, run as that role from its start.
	"role": "none",
	// Libraries from $libdir/plugins loaded into every session; a name
	// that is not there fails every connection.
	"local_preload_libraries": "",
	// The text of the names read, and the encoding conversion chosen for
	// it (conversions are looked up on the search_path too).
	"client_encoding": "UTF8",
	// With it off a backslash in a string literal is an escape.
	"standard_conforming_strings": "on",
	// = NULL read as IS NULL.
	"transform_null_equals": "off",
	// A serializable, deferrable default makes a read-only statement wait
	// for a safe snapshot, as long as someone's serializable transaction
	// stays open.
	"default_transaction_isolation":  "read committed",
	"default_transaction_deferrable": "off",
	// Timeouts that would end pgfence's statements or its idle watcher
	// (it waits for notifications between statements), and an error that
	// would end the session.
	"statement_timeout":                   "0",
	"lock_timeout":                        "0",
	"idle_in_transaction_session_timeout": "0",
	"idle_session_timeout":                "0",
	"exit_on_error":                       "off",
}

// readOnlyPins are added by PinReadOnly: the proxy's control connections
// only read, so a write — ALTER ROLE, an INSERT — fails in them even if
// something ever ran code there; and a relation with row security fails
// instead of running its policies.
var readOnlyPins = map[string]string{
	"default_transaction_read_only": "on",
	"row_security":                  "off",
	"jit":                           "off",
}

// Pin sets the pinned settings in a connection's startup parameters
// (pgconn.Config.RuntimeParams): PostgreSQL applies them after the
// database's and the role's own settings and after the DSN's options, so
// they win over all of them.
func Pin(rp map[string]string) {
	for k, v := range pins {
		rp[k] = v
	}
}

// PinReadOnly is Pin and the read-only connection's settings: for
// connections that never write (the proxy's control connections).
func PinReadOnly(rp map[string]string) {
	Pin(rp)
	for k, v := range readOnlyPins {
		rp[k] = v
	}
}

// Pins returns the settings Pin (readOnly: PinReadOnly) sets, sorted by
// name (docs, tests).
func Pins(readOnly bool) []string {
	m := map[string]string{}
	if readOnly {
		PinReadOnly(m)
	} else {
		Pin(m)
	}
	out := make([]string, 0, len(m))
	for k, v := range m {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
}

// Built-in type OIDs a trusted relation's columns are checked against.
const (
	TypeText        uint32 = 25
	TypeInt8        uint32 = 20
	TypeRegclass    uint32 = 2205
	TypeTimestamptz uint32 = 1184
)

// Rel is a relation of schema fence pgfence reads, with the columns it
// reads and their built-in types.
type Rel struct {
	Name string
	Cols map[string]uint32
}

// The relations of schema fence that pgfence's control connections read.
var (
	ProtectedTables = Rel{"protected_tables", map[string]uint32{"relid": TypeRegclass}}
	Fences          = Rel{"fences", map[string]uint32{"job_key": TypeText, "epoch": TypeInt8, "max_issued_token": TypeInt8, "retired_at": TypeTimestamptz}}
	Leases          = Rel{"leases", map[string]uint32{"job_key": TypeText, "holder": TypeText, "token": TypeInt8, "expires_at": TypeTimestamptz}}
)

// CheckSQL reads, from pg_catalog alone, what Check judges schema fence by:
// one row for the schema (kind 's') when it exists, and one per relation
// named in $1 (kind 'r') that exists in it. It names nothing in schema
// fence, so it runs no code anyone could have put there. Columns: kind,
// name, owner, owner is a superuser, relkind, row security, forced row
// security, roles that are not superusers with CREATE on the schema,
// columns (name:type oid,...), objects in the schema not owned by a
// superuser (the first five).
const CheckSQL = `SELECT 's'::pg_catalog.text, n.nspname::pg_catalog.text, o.rolname::pg_catalog.text, o.rolsuper,
  ''::pg_catalog."char", false, false,
  pg_catalog.array_to_string(ARRAY(SELECT coalesce(g.rolname::pg_catalog.text, 'PUBLIC')
      FROM pg_catalog.aclexplode(n.nspacl) AS a
      LEFT JOIN pg_catalog.pg_roles AS g ON g.oid OPERATOR(pg_catalog.=) a.grantee
      WHERE a.privilege_type OPERATOR(pg_catalog.=) 'CREATE' AND NOT coalesce(g.rolsuper, false)), ','),
  ''::pg_catalog.text,
  pg_catalog.array_to_string(ARRAY(SELECT pg_catalog.format('%s %s (%s)', k.kind, k.name, r.rolname)
      FROM (SELECT 'relation'::pg_catalog.text, c.relname::pg_catalog.text, c.relowner FROM pg_catalog.pg_class AS c
              WHERE c.relnamespace OPERATOR(pg_catalog.=) n.oid
            UNION ALL SELECT 'function', p.proname::pg_catalog.text, p.proowner FROM pg_catalog.pg_proc AS p
              WHERE p.pronamespace OPERATOR(pg_catalog.=) n.oid
            UNION ALL SELECT 'type', t.typname::pg_catalog.text, t.typowner FROM pg_catalog.pg_type AS t
              WHERE t.typnamespace OPERATOR(pg_catalog.=) n.oid
            UNION ALL SELECT 'operator', o.oprname::pg_catalog.text, o.oprowner FROM pg_catalog.pg_operator AS o
              WHERE o.oprnamespace OPERATOR(pg_catalog.=) n.oid) AS k(kind, name, owner)
      JOIN pg_catalog.pg_roles AS r ON r.oid OPERATOR(pg_catalog.=) k.owner
      WHERE NOT r.rolsuper ORDER BY 1 LIMIT 5), ', ')
FROM pg_catalog.pg_namespace AS n JOIN pg_catalog.pg_roles AS o ON o.oid OPERATOR(pg_catalog.=) n.nspowner
WHERE n.nspname OPERATOR(pg_catalog.=) 'fence'
UNION ALL
SELECT 'r'::pg_catalog.text, c.relname::pg_catalog.text, o.rolname::pg_catalog.text, o.rolsuper,
  c.relkind, c.relrowsecurity, c.relforcerowsecurity, ''::pg_catalog.text,
  pg_catalog.array_to_string(ARRAY(SELECT pg_catalog.format('%s:%s', a.attname, a.atttypid::pg_catalog.int8)
      FROM pg_catalog.pg_attribute AS a
      WHERE a.attrelid OPERATOR(pg_catalog.=) c.oid AND a.attnum OPERATOR(pg_catalog.>) '0'::pg_catalog.int2 AND NOT a.attisdropped), ','),
  ''::pg_catalog.text
FROM pg_catalog.pg_class AS c
  JOIN pg_catalog.pg_namespace AS n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
  JOIN pg_catalog.pg_roles AS o ON o.oid OPERATOR(pg_catalog.=) c.relowner
WHERE n.nspname OPERATOR(pg_catalog.=) 'fence' AND c.relname::pg_catalog.text OPERATOR(pg_catalog.=) ANY ($1::pg_catalog.text[])`

// Trust is what Check found.
type Trust struct {
	// Schema: a schema named fence exists.
	Schema bool
	// Problem says why pgfence does not trust it ("" when it does, or
	// when there is no such schema).
	Problem string
}

// Trusted reports whether the database has a fence schema pgfence reads.
func (t Trust) Trusted() bool { return t.Schema && t.Problem == "" }

// Untrusted reports whether the database has a schema named fence that
// pgfence does not trust (not the same as having none).
func (t Trust) Untrusted() bool { return t.Schema && t.Problem != "" }

// Rows is a result of CheckSQL, as text.
type Rows [][]string

// Judge decides on rows of CheckSQL run for rels. pgfence trusts schema
// fence when it and everything in it belong to superusers (relations,
// functions, types, operators), nobody else may create objects in it
// (CREATE on it), and every
// relation of rels is there, a plain table (not a view, a foreign or a
// partitioned table, whose reading would run someone's code) a superuser
// owns, without row security (whose policies would run as the reader),
// and has the columns of rels with their built-in types.
func Judge(rows Rows, rels []Rel) Trust {
	var t Trust
	got := map[string][]string{}
	for _, r := range rows {
		if len(r) < 10 {
			continue
		}
		switch r[0] {
		case "s":
			t.Schema = true
			switch {
			case r[3] != "t":
				t.Problem = fmt.Sprintf("schema fence is owned by %q, not a superuser", r[2])
			case r[7] != "":
				t.Problem = fmt.Sprintf("roles that are not superusers may create objects in schema fence: %s", r[7])
			case r[9] != "":
				t.Problem = fmt.Sprintf("schema fence holds objects that are not a superuser's: %s", r[9])
			}
		case "r":
			got[r[1]] = r
		}
	}
	if !t.Schema || t.Problem != "" {
		return t
	}
	for _, rel := range rels {
		r, ok := got[rel.Name]
		switch {
		case !ok:
			t.Problem = fmt.Sprintf("fence.%s does not exist", rel.Name)
		case r[3] != "t":
			t.Problem = fmt.Sprintf("fence.%s is owned by %q, not a superuser", rel.Name, r[2])
		case r[4] != "r":
			t.Problem = fmt.Sprintf("fence.%s is not a plain table (relkind %q)", rel.Name, r[4])
		case r[5] == "t" || r[6] == "t":
			t.Problem = fmt.Sprintf("fence.%s has row-level security", rel.Name)
		default:
			cols := map[string]string{}
			for _, c := range strings.Split(r[8], ",") {
				if n, typ, ok := strings.Cut(c, ":"); ok {
					cols[n] = typ
				}
			}
			names := make([]string, 0, len(rel.Cols))
			for n := range rel.Cols {
				names = append(names, n)
			}
			sort.Strings(names)
			for _, n := range names {
				if want := fmt.Sprint(rel.Cols[n]); cols[n] != want {
					t.Problem = fmt.Sprintf("fence.%s.%s is not of the built-in type pgfence reads (type oid %q, want %s)", rel.Name, n, cols[n], want)
					break
				}
			}
		}
		if t.Problem != "" {
			return t
		}
	}
	return t
}

// Names is the names of rels, CheckSQL's parameter.
func Names(rels []Rel) []string {
	out := make([]string, len(rels))
	for i, r := range rels {
		out[i] = r.Name
	}
	return out
}

// Check runs CheckSQL on conn and judges it for rels.
func Check(ctx context.Context, conn *pgconn.PgConn, rels []Rel) (Trust, error) {
	param := "{" + strings.Join(Names(rels), ",") + "}"
	res := conn.ExecParams(ctx, CheckSQL, [][]byte{[]byte(param)}, nil, nil, nil).Read()
	if res.Err != nil {
		return Trust{}, fmt.Errorf("check schema fence: %w", res.Err)
	}
	rows := make(Rows, 0, len(res.Rows))
	for _, r := range res.Rows {
		row := make([]string, len(r))
		for i, v := range r {
			row[i] = string(v)
		}
		rows = append(rows, row)
	}
	return Judge(rows, rels), nil
}
