//go:build drivers

package drivers

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// cluster is the package's PostgreSQL: databases cloned from a template
// with the fence schema and the protected table of the fencing checks.
var cluster *pgtest.Cluster

// checkSchema is what every check database starts with: the protected
// table of the fencing flows (the README's results table). The checks
// make their own scratch tables.
const checkSchema = `
CREATE TABLE results (
	job_key text PRIMARY KEY,
	payload text NOT NULL,
	token   bigint NOT NULL
);
SELECT fence.protect('results');
`

func TestMain(m *testing.M) {
	os.Exit(pgtest.Run(m, pgtest.Options{}, func(ctx context.Context, conn *pgx.Conn) error {
		if err := migrations.Prepare(ctx, conn); err != nil {
			return err
		}
		_, err := conn.Exec(ctx, checkSchema)
		return err
	}, &cluster))
}

// serve is a running `pgfence serve` in front of cluster.
type serve struct {
	Port    int
	LogPath string
	cmd     *exec.Cmd
}

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// pgfenceBinary builds cmd/pgfence once per test binary.
func pgfenceBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "pgfence-drivers-bin")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "pgfence")
		out, err := exec.Command("go", "build", "-o", binPath, "../../cmd/pgfence").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build ../../cmd/pgfence: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

// startServe starts `pgfence serve` as a user would, write gate on (its
// default), in front of the cluster's primary on a free loopback port.
// Client authentication is trust, said explicitly: the listener is
// loopback only.
func startServe(t *testing.T) *serve {
	t.Helper()
	bin := pgfenceBinary(t)
	logPath := filepath.Join(t.TempDir(), "pgfence.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "serve", "--listen", "127.0.0.1:0", "--auth", "trust",
		"--primary", cluster.Primary.DSN("postgres"))
	cmd.Env = os.Environ()
	pr, pw := io.Pipe()
	cmd.Stderr = pw
	cmd.Stdout = logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s := &serve{LogPath: logPath, cmd: cmd}
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		pw.Close()
		logf.Close()
	})
	// Every log line goes to the file; the "listening" line names the
	// address.
	found := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			logf.Write(append(sc.Bytes(), '\n'))
			var e struct {
				Msg  string `json:"msg"`
				Addr string `json:"addr"`
			}
			if json.Unmarshal(sc.Bytes(), &e) == nil && e.Msg == "listening" {
				select {
				case found <- e.Addr:
				default:
				}
			}
		}
		io.Copy(io.Discard, pr)
	}()
	select {
	case addr := <-found:
		a, err := net.ResolveTCPAddr("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		s.Port = a.Port
	case <-time.After(60 * time.Second):
		b, _ := os.ReadFile(logPath)
		t.Fatalf("pgfence serve did not log \"listening\" within 60s:\n%s", b)
	}
	return s
}

// target is one way of reaching PostgreSQL: straight or through the proxy.
type target struct {
	Name     string // "direct" or "proxy"
	Port     int
	Database string
}

// DSN is a libpq URL for the target as the superuser postgres.
func (tg target) DSN() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", tg.Port, tg.Database)
}

// ObserverDSN is a direct connection to the target's database, for
// observing (pg_stat_activity, receipts) on a separate connection.
func (tg target) ObserverDSN() string {
	return cluster.Primary.DSN(tg.Database)
}

// Env is the environment of a check script: libpq's PG* variables (which
// node-postgres reads too) and PGFENCE_* for what the scripts need besides.
func (tg target) Env() []string {
	var env []string
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "PG") {
			continue // PGOPTIONS, PGSERVICE, ... of the caller must not leak in
		}
		env = append(env, kv)
	}
	return append(env,
		"PGHOST=127.0.0.1",
		fmt.Sprintf("PGPORT=%d", tg.Port),
		"PGUSER=postgres",
		"PGDATABASE="+tg.Database,
		"PGSSLMODE=disable",
		"PGCONNECT_TIMEOUT=10",
		"PGFENCE_TARGET="+tg.Name,
		"PYTHONDONTWRITEBYTECODE=1",
		fmt.Sprintf("PGFENCE_OBSERVER_PORT=%d", cluster.Primary.Port),
	)
}

// tailFile returns the last n bytes of a file.
func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "(" + err.Error() + ")"
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
