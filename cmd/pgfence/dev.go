package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"text/template"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/proxy"
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
	var listen string
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Start a throwaway primary + replica with pgfence and print psql lines to try",
		Long: `dev starts a throwaway PostgreSQL primary and streaming replica from the local
PostgreSQL binaries, installs the fence schema and a demo protected table
"results", and prints a walkthrough: acquire a lease, write, take over from a
second terminal, watch the stale write get refused with FN001.

The proxy runs as pgfence serve would: it logs to stderr (text on a
terminal), and its admin console answers user postgres in the virtual
database pgfence. With --json, the addresses are printed as one JSON object
instead of the walkthrough.

Everything (processes and files) is removed on Ctrl-C.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			log, err := commandLogger(cmd)
			if err != nil {
				return usageError(err.Error())
			}
			return runDev(cmd.Context(), cmd.OutOrStdout(), !noReplica, listen, log, jsonFlag(cmd))
		},
	}
	cmd.Flags().BoolVar(&noReplica, "no-replica", false, "start the primary only")
	cmd.Flags().StringVar(&listen, "listen", "127.0.0.1:6432", "address of the pgfence proxy (port 0 picks a free one; make dev PORT=N sets it)")
	return cmd
}

type devEnv struct {
	Bin      string `json:"-"`
	Primary  string `json:"primary"`
	Replica  string `json:"replica,omitempty"`
	Entry    string `json:"pgfence"` // the DSN workers use: the proxy when it runs, else the primary
	Console  string `json:"console"` // the proxy's admin console
	Database string `json:"database"`
	Job      string `json:"job_key"`
}

func runDev(ctx context.Context, out io.Writer, replica bool, listen string, log *zap.Logger, asJSON bool) error {
	// Listen first: a busy port is found before the cluster starts.
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		ee := exitWith(listenError(listen, "--listen", err))
		if errors.Is(err, syscall.EADDRINUSE) {
			ee.hint += "; with make: make dev PORT=" + portOf(nextPort(listen))
		}
		return ee
	}
	defer ln.Close()
	if !asJSON {
		fmt.Fprintln(out, "pgfence dev: starting a throwaway PostgreSQL cluster...")
	}
	c, err := pgtest.Start(ctx, pgtest.Options{Replica: replica})
	if err != nil {
		return err
	}
	defer func() {
		if !asJSON {
			fmt.Fprintln(out, "\npgfence dev: stopping and removing the cluster...")
		}
		c.Close()
		if !asJSON {
			fmt.Fprintln(out, "pgfence dev: done")
		}
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
	gate, err := proxy.NewFence(proxy.FenceConfig{Primary: c.Primary.DSN("postgres")}, log.Named("gate"))
	if err != nil {
		return err
	}
	defer gate.Close()
	// The console authenticates its users itself (SCRAM), whatever the
	// client auth: a throwaway password for the throwaway cluster.
	consolePW, err := devPassword()
	if err != nil {
		return err
	}
	verifier, err := proxy.MakeVerifier("postgres", consolePW)
	if err != nil {
		return err
	}
	// Clients: trust, on loopback only (Serve refuses it elsewhere): a
	// throwaway cluster whose roles have no passwords.
	srv, err := proxy.New(proxy.Config{Primary: c.Primary.DSN("postgres"), Auth: proxy.AuthTrust, Interceptor: gate,
		AdminUsers: []string{"postgres"}, ConsoleUsers: map[string]string{"postgres": verifier}}, log)
	if err != nil {
		return err
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, ln) }()
	port := ln.Addr().(*net.TCPAddr).Port
	log.Info("listening", zap.String("addr", ln.Addr().String()), zap.String("auth", string(proxy.AuthTrust)), zap.Bool("tls", false))
	env.Entry = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", port, devDatabase)
	env.Console = fmt.Sprintf("postgres://postgres:%s@127.0.0.1:%d/%s?sslmode=disable", consolePW, port, proxy.AdminDatabase)
	walkthrough := func(w io.Writer) error { return devWalkthrough.Execute(w, env) }
	if err := (output{json: env, text: walkthrough}).print(out, asJSON); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
	case err := <-served:
		return err
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	srv.Shutdown(sctx)
	<-served
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

// portOf is the port of addr.
func portOf(addr string) string {
	if i := strings.LastIndexByte(addr, ':'); i >= 0 {
		return addr[i+1:]
	}
	return addr
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
  pgfence:  {{.Entry}}   (workers connect here)
  console:  psql '{{.Console}}' -c 'SHOW HELP'

A protected table "results" exists in database "{{.Database}}".
Walk through a takeover in two shells (bash). Terminal A is alice, a worker
that takes the lease and then stalls; terminal B is bob, who takes over.
(VERBOSITY=verbose makes psql show each error's SQLSTATE; the proxy's log
on this terminal's stderr says what it refused.)

  # A: alice takes the lease for 10 seconds ... and stalls before writing
  eval "$({{.Bin}} lease acquire --database '{{.Primary}}' --job {{.Job}} --holder alice --ttl 10s)"
  export PGOPTIONS="-c fence.job_key={{.Job}} -c fence.epoch=$epoch -c fence.token=$token"

  # B, once alice's 10 s have passed: bob takes over and writes his result
  eval "$({{.Bin}} lease acquire --database '{{.Primary}}' --job {{.Job}} --holder bob --ttl 5m)"
  export PGOPTIONS="-c fence.job_key={{.Job}} -c fence.epoch=$epoch -c fence.token=$token"
  psql -v VERBOSITY=verbose '{{.Entry}}' -c "INSERT INTO results VALUES ('{{.Job}}', 'from bob', $token)
      ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token
      WHERE results.token < excluded.token"

  # A: alice wakes up and writes with her old token: refused, FN001 (stale token)
  psql -v VERBOSITY=verbose '{{.Entry}}' -c "INSERT INTO results VALUES ('{{.Job}}', 'from alice', $token)
      ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token"

  # B: bob lost the answer to his commit and retries the same write:
  #    NOTICE ... idempotent replay, nothing applied twice
  psql -v VERBOSITY=verbose '{{.Entry}}' -c "INSERT INTO results VALUES ('{{.Job}}', 'from bob', $token)
      ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token
      WHERE results.token < excluded.token"

  # B: the same token with different content is a conflict, FN003
  psql -v VERBOSITY=verbose '{{.Entry}}' -c "UPDATE results SET payload = 'something else' WHERE job_key = '{{.Job}}'"

  # anyone: writing a protected table without a token is refused, FN008
  PGOPTIONS= psql -v VERBOSITY=verbose '{{.Entry}}' -c "DELETE FROM results"

  # the state: the fence, the receipts, the result
  PGOPTIONS= psql -v VERBOSITY=verbose '{{.Entry}}' -c "SELECT * FROM fence.fences" -c "SELECT job_key, epoch, token, step, committed_at FROM fence.receipts" -c "SELECT * FROM results"
`))

// devPassword is a random password for pgfence dev's console.
func devPassword() (string, error) {
	b := make([]byte, 9)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}
