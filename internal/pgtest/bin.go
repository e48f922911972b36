package pgtest

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// serverTools are the programs the harness runs; a directory qualifies as
// a PostgreSQL bin directory only when it holds all of them.
var serverTools = []string{"postgres", "initdb", "pg_ctl", "pg_basebackup"}

// ErrNoServer is returned (wrapped) when no PostgreSQL server binaries are
// found. Tests fail on it: they never skip.
var ErrNoServer = errors.New("no PostgreSQL server binaries found")

// FindBinDir locates the PostgreSQL server binaries: PGFENCE_PG_BINDIR if
// set, then the directory of `postgres` on PATH, then `pg_config --bindir`,
// then /usr/lib/postgresql/*/bin, newest major version first.
func FindBinDir() (string, error) {
	var looked []string
	try := func(dir string) bool {
		if dir == "" {
			return false
		}
		looked = append(looked, dir)
		return hasServerTools(dir)
	}
	if dir := os.Getenv("PGFENCE_PG_BINDIR"); dir != "" {
		if try(dir) {
			return dir, nil
		}
		return "", fmt.Errorf("%w: PGFENCE_PG_BINDIR=%s lacks one of %s", ErrNoServer, dir, strings.Join(serverTools, ", "))
	}
	if p, err := exec.LookPath("postgres"); err == nil {
		if try(filepath.Dir(p)) {
			return filepath.Dir(p), nil
		}
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		if dir := strings.TrimSpace(string(out)); try(dir) {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return majorOf(dirs[i]) > majorOf(dirs[j]) })
	for _, dir := range dirs {
		if try(dir) {
			return dir, nil
		}
	}
	return "", fmt.Errorf("%w: looked for %s on PATH, via `pg_config --bindir` and under /usr/lib/postgresql/*/bin (tried: %s); install them (Debian/Ubuntu: apt-get install -y postgresql) or set PGFENCE_PG_BINDIR",
		ErrNoServer, strings.Join(serverTools, ", "), strings.Join(looked, ", "))
}

func hasServerTools(dir string) bool {
	for _, t := range serverTools {
		fi, err := os.Stat(filepath.Join(dir, t))
		if err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// majorOf extracts N from /usr/lib/postgresql/N/bin; unknown sorts last.
func majorOf(dir string) float64 {
	v, err := strconv.ParseFloat(filepath.Base(filepath.Dir(dir)), 64)
	if err != nil {
		return -1
	}
	return v
}

// Client runs the PostgreSQL client program prog (pg_dump, pg_restore,
// psql, ...) of the cluster's own version against the server at host:port
// (a node of the cluster, or a proxy in front of it) as postgres, with
// pgoptions as PGOPTIONS in place of the environment's, in the C locale,
// and returns what it wrote to stdout and to stderr.
func (c *Cluster) Client(host string, port int, pgoptions, prog string, args ...string) (stdout, stderr string, err error) {
	cmd := exec.Command(filepath.Join(c.BinDir, prog), args...)
	cmd.Env = append(os.Environ(), "PGHOST="+host, "PGPORT="+strconv.Itoa(port), "PGUSER=postgres", "PGSSLMODE=disable",
		"PGCONNECT_TIMEOUT=10", "PGOPTIONS="+pgoptions, "LC_ALL=C", "PGAPPNAME="+prog)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	return out.String(), errOut.String(), err
}
