package main

// How every command finds and opens its database (docs/cli.md, "The
// database"): --database, else $PGFENCE_DATABASE_URL, else $DATABASE_URL,
// else libpq's PG* variables. serve puts PGFENCE_PRIMARY and its config
// file between the flag and the environment (config.go), then uses the
// same chain.

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ownsql"
)

const databaseHelp = "database URL or DSN (default $PGFENCE_DATABASE_URL, else $DATABASE_URL, else libpq's PG* variables)"

// connectTimeout is the connect timeout of a command's connection when
// its DSN (or PGCONNECT_TIMEOUT) sets none.
const connectTimeout = 10 * time.Second

// database is a command's --database and the way to open what the chain
// names. A group (lease, protect) adds the flag once, persistent, for all
// its subcommands.
type database struct {
	flag string // --database as given
	// dsnPath is the search_path the DSN itself sets (a search_path
	// parameter, or -c search_path in its options), "" when none: pinned
	// out of the connection (config), it still names the schemas a table
	// the user gives is looked up in (qualify).
	dsnPath string
}

// addFlag adds --database to fs: cmd.Flags(), or cmd.PersistentFlags()
// for a group.
func (d *database) addFlag(fs *pflag.FlagSet) {
	fs.StringVar(&d.flag, "database", "", databaseHelp)
}

// dsn is the database the chain names for cmd: --database when given,
// else databaseFromEnv ("" leaves it to libpq's PG* variables, which pgx
// reads when it connects).
func (d *database) dsn(cmd *cobra.Command) string {
	if f := cmd.Flag("database"); f != nil && f.Changed {
		return d.flag
	}
	return databaseFromEnv()
}

// config is the connection configuration of cmd's database: a 10 s
// connect timeout and application_name "pgfence <command>" unless the DSN
// (or PGCONNECT_TIMEOUT, PGAPPNAME) sets them, and pgfence's pinned
// settings (ownsql.Pin: search_path pg_catalog, pg_temp, ...), which win
// over the database's, the role's and the DSN's own: a command often runs
// as a DBA, in a database others may create objects in or own (docs/security.md,
// "pgfence's own SQL"). A DSN that does not parse is a usage error.
func (d *database) config(cmd *cobra.Command) (*pgx.ConnConfig, error) {
	cfg, err := pgx.ParseConfig(d.dsn(cmd))
	if err != nil {
		return nil, usageError("--database: " + err.Error())
	}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = connectTimeout
	}
	if _, ok := cfg.RuntimeParams["application_name"]; !ok {
		cfg.RuntimeParams["application_name"] = "pgfence " + cmd.Name()
	}
	d.dsnPath = dsnSearchPath(cfg.RuntimeParams)
	ownsql.Pin(cfg.RuntimeParams)
	// A read a row-security policy would apply to fails rather than run
	// the policy's expressions as the command's user (audit reads tables
	// a user names; pgfence's own tables have no policies).
	cfg.RuntimeParams["row_security"] = "off"
	// A lease function whose commit's wait for the synchronous standby
	// was cancelled fails (FN016): PostgreSQL answers success with only a
	// WARNING (docs/failover.md).
	fence.WatchSyncRep(&cfg.Config)
	return cfg, nil
}

// with runs f on a connection to cmd's database, closed after.
func (d *database) with(cmd *cobra.Command, f func(ctx context.Context, conn *pgx.Conn) error) error {
	cfg, err := d.config(cmd)
	if err != nil {
		return err
	}
	ctx := cmd.Context()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(ctx)
	// migrate makes the schema, and checks for itself (migrations.Apply).
	if cmd.Name() != "migrate" {
		if err := checkFence(ctx, conn, cfg.Database); err != nil {
			return err
		}
	}
	return f(ctx, conn)
}

// checkFence refuses a database whose schema fence pgfence does not trust
// (ownsql.Check: it, or something in it, is not a superuser's): every
// command runs functions and reads tables of schema fence, and in a
// database someone else made, a schema of that name runs their code with
// the command's rights. A database without one passes: the command then
// fails as it would have (the fence schema is not installed).
func checkFence(ctx context.Context, conn *pgx.Conn, db string) error {
	trust, err := ownsql.Check(ctx, conn.PgConn(), nil)
	if err != nil {
		return err
	}
	if trust.Untrusted() {
		return &exitError{code: exitConfig,
			msg:  fmt.Sprintf("database %q has a schema fence that pgfence does not trust: %s; pgfence runs none of its SQL there", db, trust.Problem),
			hint: "schema fence and everything in it must be a superuser's, as pgfence migrate makes it (docs/security.md, \"pgfence's own SQL\")"}
	}
	return nil
}

// userPathSQL reads the search_path settings that apply to this session
// without pgfence's pin and that neither the database's owner nor anyone
// else but the user (and superusers) may set, most specific first: ALTER
// ROLE … IN DATABASE, ALTER ROLE, ALTER ROLE ALL. ALTER DATABASE … SET is
// left out: the database's owner sets it (issue 30, attacker C's H3).
const userPathSQL = `SELECT s.setconfig FROM pg_catalog.pg_db_role_setting AS s
WHERE s.setdatabase OPERATOR(pg_catalog.=) ANY (ARRAY[(SELECT d.oid FROM pg_catalog.pg_database AS d
    WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()), '0'::pg_catalog.oid])
  AND s.setrole OPERATOR(pg_catalog.=) ANY (ARRAY[(SELECT r.oid FROM pg_catalog.pg_roles AS r
    WHERE r.rolname OPERATOR(pg_catalog.=) session_user), '0'::pg_catalog.oid])
  AND NOT (s.setrole OPERATOR(pg_catalog.=) '0'::pg_catalog.oid AND s.setdatabase OPERATOR(pg_catalog.<>) '0'::pg_catalog.oid)
ORDER BY s.setrole OPERATOR(pg_catalog.=) '0'::pg_catalog.oid, s.setdatabase OPERATOR(pg_catalog.=) '0'::pg_catalog.oid`

// ownUserSchemaSQL: whether the schema "$user" names (the session user's
// name) is the user's own or a superuser's. Anyone who may CREATE in the
// database (its owner) can make a schema of the DBA's name, first on
// PostgreSQL's default search_path, and put a view there under the name
// of the table the DBA means (issue 30, attacker C's H3).
const ownUserSchemaSQL = `SELECT NOT EXISTS (SELECT FROM pg_catalog.pg_namespace AS n JOIN pg_catalog.pg_roles AS r ON r.oid OPERATOR(pg_catalog.=) n.nspowner
  WHERE n.nspname OPERATOR(pg_catalog.=) session_user
    AND r.rolname OPERATOR(pg_catalog.<>) session_user AND NOT r.rolsuper)`

// qualifySQL names a relation by its schema, as a search_path set in the
// same transaction finds it. Finding it runs no code: regclass's input
// looks names up, it calls nothing.
const qualifySQL = `SELECT pg_catalog.format('%I.%I', n.nspname, c.relname)
FROM pg_catalog.pg_class AS c JOIN pg_catalog.pg_namespace AS n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
WHERE c.oid OPERATOR(pg_catalog.=) $1::pg_catalog.regclass::pg_catalog.oid`

// qualify returns table, a relation named by the user, qualified by its
// schema as PostgreSQL resolves it on a search_path nobody but the user
// (and superusers) controls: the DSN's, else the role's own settings
// (ALTER ROLE, also IN DATABASE, and ALTER ROLE ALL), else PostgreSQL's
// default "$user", public; not ALTER DATABASE … SET, which the database's
// owner sets, and "$user" only when the schema of the user's name is the
// user's or a superuser's (a search_path in postgresql.conf is not
// readable by every role and is not consulted). The command's own SQL
// then names the table so; what it reads there is checked by its reader
// (audit: a plain table whose reading runs nothing of anyone's).
func (d *database) qualify(ctx context.Context, conn *pgx.Conn, table string) (string, error) {
	path := d.dsnPath
	if path == "" {
		rows, err := conn.Query(ctx, userPathSQL)
		if err != nil {
			return "", fmt.Errorf("read the search_path: %w", err)
		}
		sets, err := pgx.CollectRows(rows, pgx.RowTo[[]string])
		if err != nil {
			return "", fmt.Errorf("read the search_path: %w", err)
		}
	find:
		for _, set := range sets {
			for _, kv := range set {
				if v, ok := strings.CutPrefix(kv, "search_path="); ok {
					path = v
					break find
				}
			}
		}
	}
	if path == "" {
		path = `"$user", public`
	}
	var own bool
	if err := conn.QueryRow(ctx, ownUserSchemaSQL).Scan(&own); err != nil {
		return "", fmt.Errorf("read the search_path: %w", err)
	}
	if !own {
		path = withoutUser(path)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SELECT pg_catalog.set_config('search_path', $1, true)", path); err != nil {
		return "", err
	}
	var q string
	if err := tx.QueryRow(ctx, qualifySQL, table).Scan(&q); err != nil {
		return "", err
	}
	return q, nil
}

// withoutUser is path without its "$user" entries.
func withoutUser(path string) string {
	var keep []string
	for _, p := range strings.Split(path, ",") {
		if q := strings.TrimSpace(p); q != `"$user"` && q != "$user" {
			keep = append(keep, q)
		}
	}
	return strings.Join(keep, ", ")
}

// dsnSearchPath is the search_path a connection's startup parameters set:
// a search_path parameter, else -c search_path=... (or --search_path=...)
// in its options.
func dsnSearchPath(rp map[string]string) string {
	if v, ok := rp["search_path"]; ok {
		return v
	}
	words := optionWords(rp["options"])
	path := ""
	for i := 0; i < len(words); i++ {
		w := words[i]
		switch {
		case w == "-c" && i+1 < len(words):
			i++
			w = words[i]
		case strings.HasPrefix(w, "-c"):
			w = w[2:]
		case strings.HasPrefix(w, "--"):
			w = strings.ReplaceAll(w[2:], "-", "_")
		default:
			continue
		}
		if v, ok := strings.CutPrefix(w, "search_path="); ok {
			path = v
		}
	}
	return path
}

// optionWords splits a startup options string as PostgreSQL does:
// at whitespace, a backslash taking the next character as it is.
func optionWords(s string) []string {
	var out []string
	var b strings.Builder
	in, esc := false, false
	for _, r := range s {
		switch {
		case esc:
			b.WriteRune(r)
			esc, in = false, true
		case r == '\\':
			esc = true
		case r == ' ' || r == '\t' || r == '\n' || r == '\r':
			if in {
				out = append(out, b.String())
				b.Reset()
				in = false
			}
		default:
			b.WriteRune(r)
			in = true
		}
	}
	if in {
		out = append(out, b.String())
	}
	return out
}

// runE is the RunE of a command whose work is f on one connection to its
// database: it connects, runs f with the command's arguments and prints
// the output f returns (output.go).
func (d *database) runE(f func(ctx context.Context, conn *pgx.Conn, args []string) (output, error)) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		var out output
		err := d.with(cmd, func(ctx context.Context, conn *pgx.Conn) (err error) {
			out, err = f(ctx, conn, args)
			return err
		})
		if err != nil {
			return err
		}
		return printResult(cmd, out)
	}
}

// databaseFromEnv is the chain past the flag: the first of
// $PGFENCE_DATABASE_URL and $DATABASE_URL that is set; "" means libpq's
// PG* variables.
func databaseFromEnv() string {
	for _, k := range []string{"PGFENCE_DATABASE_URL", "DATABASE_URL"} {
		if v := os.Getenv(k); v != "" {
			return v
		}
	}
	return ""
}

// libpqEnvDSN is the chain's last step written out, for serve, which hands
// its primary's DSN on to the proxy: a keyword/value DSN naming the server
// libpq's PGHOST, PGHOSTADDR, PGPORT and PGSERVICE point at, or "" when
// none is set (the other PG* variables, PGPASSWORD, PGSSLMODE, ..., are
// read when the proxy connects).
func libpqEnvDSN() string {
	var parts []string
	for _, kv := range []struct{ env, key string }{{"PGHOST", "host"}, {"PGHOSTADDR", "hostaddr"}, {"PGPORT", "port"}, {"PGSERVICE", "service"}} {
		if v := os.Getenv(kv.env); v != "" {
			parts = append(parts, kv.key+"='"+strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(v)+"'")
		}
	}
	return strings.Join(parts, " ")
}
