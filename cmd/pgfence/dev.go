package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"text/template"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// devDatabase is the database pgfence dev creates for the walkthrough.
const devDatabase = "app"

// devSchema is the demo protected table of the walkthrough: a result per
// job, written with the conditional upsert of L1.
const devSchema = `
CREATE TABLE results (
	job_key text PRIMARY KEY,
	payload text NOT NULL,
	token   bigint NOT NULL,
	written_at timestamptz NOT NULL DEFAULT now()
);
SELECT fence.protect('results');
`

func newDevCmd() *cobra.Command {
	var noReplica bool
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Start a throwaway primary + replica with pgfence and print psql lines to try",
		Long: `dev starts a throwaway PostgreSQL primary and streaming replica from the local
PostgreSQL binaries, installs the fence schema and a demo protected table
"results", and prints a walkthrough: acquire a lease, write, take over from a
second terminal, watch the stale write get refused with FN001.

Everything (processes and files) is removed on Ctrl-C.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runDev(cmd.Context(), cmd.OutOrStdout(), !noReplica)
		},
	}
	cmd.Flags().BoolVar(&noReplica, "no-replica", false, "start the primary only")
	return cmd
}

type devEnv struct {
	Bin      string
	Primary  string
	Replica  string
	Entry    string // the DSN workers use: the proxy when it runs, else the primary
	Database string
	Job      string
}

func runDev(ctx context.Context, out io.Writer, replica bool) error {
	fmt.Fprintln(out, "pgfence dev: starting a throwaway PostgreSQL cluster...")
	c, err := pgtest.Start(ctx, pgtest.Options{Replica: replica})
	if err != nil {
		return err
	}
	defer func() {
		fmt.Fprintln(out, "\npgfence dev: stopping and removing the cluster...")
		c.Close()
		fmt.Fprintln(out, "pgfence dev: done")
	}()
	if err := devSetup(ctx, c); err != nil {
		return err
	}
	env := devEnv{
		Bin:      executablePath(),
		Primary:  c.Primary.DSN(devDatabase),
		Database: devDatabase,
		Job:      "nightly-report",
	}
	if c.Replica != nil {
		env.Replica = c.Replica.DSN(devDatabase)
	}
	env.Entry = env.Primary
	if err := devWalkthrough.Execute(out, env); err != nil {
		return err
	}
	<-ctx.Done()
	return nil
}

func devSetup(ctx context.Context, c *pgtest.Cluster) error {
	admin, err := c.Primary.Connect(ctx, "postgres")
	if err != nil {
		return err
	}
	_, err = admin.Exec(ctx, "CREATE DATABASE "+devDatabase)
	admin.Close(ctx)
	if err != nil {
		return fmt.Errorf("create database: %w", err)
	}
	conn, err := pgx.Connect(ctx, c.Primary.DSN(devDatabase))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if err := migrations.Apply(ctx, conn); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if _, err := conn.Exec(ctx, devSchema); err != nil {
		return fmt.Errorf("demo schema: %w", err)
	}
	if c.Replica != nil {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		if err := c.WaitReplicaCaughtUp(wctx); err != nil {
			return err
		}
	}
	return nil
}

func executablePath() string {
	p, err := os.Executable()
	if err != nil {
		return "pgfence"
	}
	if abs, err := filepath.Abs(p); err == nil {
		return abs
	}
	return p
}

var devWalkthrough = template.Must(template.New("dev").Parse(`
pgfence dev is running. Press Ctrl-C to stop; everything is removed.

  primary:  {{.Primary}}
{{- if .Replica}}
  replica:  {{.Replica}}{{end}}
  workers connect to: {{.Entry}}

A protected table "results" exists in database "{{.Database}}".
Walk through a takeover in a shell (bash):

  # 1. terminal A: take the lease for 15 seconds and write with its token
  eval "$({{.Bin}} lease acquire --database '{{.Primary}}' --job {{.Job}} --holder alice --ttl 15s)"
  export PGOPTIONS="-c fence.job_key={{.Job}} -c fence.epoch=$epoch -c fence.token=$token"
  psql '{{.Entry}}' -c "INSERT INTO results VALUES ('{{.Job}}', 'from alice', $token)
        ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token
        WHERE results.token < excluded.token"

  # 2. terminal B, after alice's 15 s have passed: take over
  eval "$({{.Bin}} lease acquire --database '{{.Primary}}' --job {{.Job}} --holder bob --ttl 60s)"

  # 3. terminal A again: alice's token is stale, her write is refused (FN001)
  psql '{{.Entry}}' -c "UPDATE results SET payload = 'zombie alice' WHERE job_key = '{{.Job}}'"

  # 4. writing without a token at all is refused too (FN008)
  PGOPTIONS= psql '{{.Entry}}' -c "DELETE FROM results"

  # look at the fence
  psql '{{.Primary}}' -c "SELECT * FROM fence.fences" -c "SELECT * FROM results"
`))
