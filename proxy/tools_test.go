package proxy

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// runPsql runs psql -c sql against 127.0.0.1:port.
func runPsql(t *testing.T, port int, user, db, sql string, env ...string) (string, error) {
	t.Helper()
	cmd := exec.Command("psql", "-X", "-h", "127.0.0.1", "-p", fmt.Sprint(port), "-U", user, "-d", db, "-c", sql)
	cmd.Env = append(os.Environ(), append([]string{"PGCONNECT_TIMEOUT=10"}, env...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

const psqlScript = `\set ON_ERROR_STOP 0
CREATE TABLE items(id int PRIMARY KEY, name text);
\copy items FROM '%[1]s'
SELECT count(*), min(id), max(id) FROM items;
BEGIN; INSERT INTO items VALUES (1000, 'a'); INSERT INTO items VALUES (1, 'dup'); COMMIT;
SELECT count(*) FROM items;
SELECT 1/0;
INSERT INTO items VALUES (2000, 'after error') RETURNING *;
\copy (SELECT * FROM items WHERE id < 4 ORDER BY id) TO STDOUT
SELECT id, name FROM items ORDER BY id DESC LIMIT 3; SELECT 'two' AS second
\echo done
`

func TestPsqlScriptSameAsDirect(t *testing.T) {
	p := startProxy(t, Config{})
	dir := t.TempDir()
	data := filepath.Join(dir, "items.tsv")
	var b strings.Builder
	for i := 1; i <= 500; i++ {
		fmt.Fprintf(&b, "%d\titem %d\n", i, i)
	}
	if err := os.WriteFile(data, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(dir, "script.sql")
	if err := os.WriteFile(script, []byte(fmt.Sprintf(psqlScript, data)), 0o644); err != nil {
		t.Fatal(err)
	}
	run := func(port int, db string) string {
		cmd := exec.Command("psql", "-X", "-a", "-h", "127.0.0.1", "-p", fmt.Sprint(port), "-U", "postgres", "-d", db, "-f", script)
		cmd.Env = append(os.Environ(), "PGSSLMODE=disable")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("psql: %v\n%s", err, out)
		}
		return string(out)
	}
	direct := run(cluster.Primary.Port, cluster.NewDatabase(t))
	proxied := run(p.addr.Port, cluster.NewDatabase(t))
	if direct != proxied {
		t.Fatalf("psql output differs\n--- direct\n%s\n--- proxy\n%s", direct, proxied)
	}
	for _, want := range []string{"500 |   1 | 500", "duplicate key", "division by zero", "2000 | after error", "1\titem 1", "two", "done"} {
		if !strings.Contains(proxied, want) {
			t.Errorf("output lacks %q:\n%s", want, proxied)
		}
	}
}

func TestPgbenchThroughProxy(t *testing.T) {
	p := startProxy(t, Config{})
	db := cluster.NewDatabase(t)
	bench := func(args ...string) string {
		args = append([]string{"-h", "127.0.0.1", "-p", fmt.Sprint(p.addr.Port), "-U", "postgres"}, args...)
		cmd := exec.Command("pgbench", append(args, db)...)
		cmd.Env = append(os.Environ(), "PGSSLMODE=disable")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("pgbench %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	bench("-i", "-s", "1", "-q")
	for _, mode := range []string{"simple", "extended", "prepared"} {
		out := bench("-T", "1", "-c", "4", "-j", "2", "-M", mode)
		if !strings.Contains(out, "number of failed transactions: 0") || !strings.Contains(out, "tps =") {
			t.Fatalf("pgbench -M %s:\n%s", mode, out)
		}
	}
}
