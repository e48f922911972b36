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
// (or PGCONNECT_TIMEOUT, PGAPPNAME) sets them. A DSN that does not parse
// is a usage error.
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
	return f(ctx, conn)
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
