package main

import (
	"testing"
	"time"

	"github.com/spf13/cobra"
)

// databaseCmd is a command named name with a --database, parsed from args.
func databaseCmd(t *testing.T, name string, args ...string) (*cobra.Command, *database) {
	t.Helper()
	var db database
	cmd := &cobra.Command{Use: name}
	db.addFlag(cmd.Flags())
	if err := cmd.ParseFlags(args); err != nil {
		t.Fatal(err)
	}
	return cmd, &db
}

// The chain of docs/cli.md, "The database": --database, then
// $PGFENCE_DATABASE_URL, then $DATABASE_URL, then libpq's PG* variables.
func TestDatabaseChain(t *testing.T) {
	for _, tt := range []struct {
		name        string
		args        []string
		pgfence, db string
		want        string
	}{
		{"flag over both", []string{"--database", "postgres://flag/db"}, "postgres://pgfence/db", "postgres://env/db", "postgres://flag/db"},
		{"PGFENCE_DATABASE_URL over DATABASE_URL", nil, "postgres://pgfence/db", "postgres://env/db", "postgres://pgfence/db"},
		{"DATABASE_URL", nil, "", "postgres://env/db", "postgres://env/db"},
		{"libpq", nil, "", "", ""},
		{"an empty flag is given", []string{"--database="}, "", "postgres://env/db", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("PGFENCE_DATABASE_URL", tt.pgfence)
			t.Setenv("DATABASE_URL", tt.db)
			cmd, db := databaseCmd(t, "migrate", tt.args...)
			if got := db.dsn(cmd); got != tt.want {
				t.Errorf("dsn %q, want %q", got, tt.want)
			}
		})
	}
}

// A command's connection has a connect timeout and says which command it
// is, unless the DSN says otherwise; a DSN that does not parse is a usage
// error.
func TestDatabaseConfig(t *testing.T) {
	t.Setenv("PGFENCE_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	t.Setenv("PGCONNECT_TIMEOUT", "")
	t.Setenv("PGAPPNAME", "")
	cmd, db := databaseCmd(t, "gc", "--database", "postgres://u@h/db")
	cfg, err := db.config(cmd)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ConnectTimeout != connectTimeout || cfg.RuntimeParams["application_name"] != "pgfence gc" {
		t.Errorf("connect timeout %s, application_name %q; want %s, %q", cfg.ConnectTimeout, cfg.RuntimeParams["application_name"], connectTimeout, "pgfence gc")
	}
	cmd, db = databaseCmd(t, "gc", "--database", "postgres://u@h/db?connect_timeout=3&application_name=cron")
	if cfg, err = db.config(cmd); err != nil {
		t.Fatal(err)
	}
	if cfg.ConnectTimeout != 3*time.Second || cfg.RuntimeParams["application_name"] != "cron" {
		t.Errorf("the DSN's own: connect timeout %s, application_name %q; want 3s, cron", cfg.ConnectTimeout, cfg.RuntimeParams["application_name"])
	}
	cmd, db = databaseCmd(t, "gc", "--database", "postgres://u@h:notaport/db")
	_, err = db.config(cmd)
	wantExit(t, err, exitUsage)
}
