package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/pgfence/pgfence/fence"
)

// Dump and restore through pgfence serve (issue 19 §1): pg_dump (plain,
// custom, directory with -j 2), pg_dumpall, pg_restore (also -j 2) and
// psql -f of a dump, against a database with protected tables, with and
// without fence metadata in the session, must give what the same run gives
// straight to PostgreSQL, byte for byte (a restore: the restored
// databases' dumps).

// dumpSource is the database the dumps are taken of: two protected tables
// (one with a job-key column), a plain one with awkward types, a view, a
// function, a sequence, a comment and a large object.
const dumpSource = `
CREATE TABLE results (job_key text PRIMARY KEY, payload text NOT NULL, token bigint NOT NULL);
CREATE TABLE ledger (id bigserial PRIMARY KEY, job_key text NOT NULL, amount numeric(12,2), note text,
	at timestamptz NOT NULL DEFAULT '2026-01-01 00:00:00+00');
CREATE INDEX ledger_job ON ledger (job_key);
CREATE TABLE plain (id int PRIMARY KEY, body text, blob bytea, tags text[], doc jsonb);
CREATE VIEW totals AS SELECT job_key, sum(amount) AS total FROM ledger GROUP BY job_key;
CREATE FUNCTION double_it(int) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT $1 * 2';
COMMENT ON TABLE results IS 'one result per job — protected';
INSERT INTO results SELECT 'job-' || g, 'payload ' || g, g FROM generate_series(1, 200) g;
INSERT INTO ledger (job_key, amount, note) SELECT 'job-' || (g % 20), g * 1.25, 'naïve ' || g FROM generate_series(1, 2000) g;
INSERT INTO plain SELECT g, repeat('x', g), decode(md5(g::text), 'hex'), ARRAY['a', g::text], jsonb_build_object('g', g)
	FROM generate_series(1, 500) g;
SELECT lo_from_bytea(424242, 'a large object');
SELECT fence.protect('results');
SELECT fence.protect('ledger', 'job_key');
`

// dumpEnv is the source database, a running pgfence serve and the tools.
type dumpEnv struct {
	src       string // the source database
	proxyPort int
	meta      string // PGOPTIONS carrying a live generation of the source database
	// Dumps of the source taken straight from PostgreSQL, for the restores.
	plain, custom, directory string
	logs                     *observer.ObservedLogs
}

// serveInProcess runs `pgfence serve` (runServe, write gate on, trust on
// loopback) until the test ends and returns its port.
func serveInProcess(t *testing.T) (int, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zapcore.InfoLevel)
	log := zap.New(zapcore.NewTee(zaptest.NewLogger(t, zaptest.Level(zapcore.WarnLevel)).Core(), core))
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- runServe(ctx, serveConfig{Listen: "127.0.0.1:0", Primary: cluster.Primary.DSN("postgres"), Auth: "trust"}, log)
	}()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	// runServe logs "listening" with the address once the listener is up.
	deadline := time.After(30 * time.Second)
	for {
		for _, e := range logs.FilterMessage("listening").All() {
			addr, _ := e.ContextMap()["addr"].(string)
			a, err := net.ResolveTCPAddr("tcp", addr)
			if err != nil {
				t.Fatalf("serve listening on %q: %v", addr, err)
			}
			return a.Port, logs
		}
		select {
		case err := <-done:
			t.Fatalf("serve exited before listening: %v", err)
		case <-deadline:
			t.Fatal("serve did not listen within 30s")
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func newDumpEnv(t *testing.T) *dumpEnv {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// A name of its own, outside the package's t<N>_ databases, so that
	// pg_dumpall can be told to dump it alone.
	src := "pgfence_dumpsrc"
	createDatabase(t, cluster, src, "pgfence_template")
	conn := connect(t, src)
	if _, err := conn.Exec(ctx, dumpSource); err != nil {
		t.Fatal(err)
	}
	// Fence history: a committed generation with its receipt, a lease held.
	l, err := fence.Acquire(ctx, conn, "job-1", "w1", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fence.RunTx(ctx, conn, l.Generation(""), []byte("r1"), func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "UPDATE results SET payload = 'fenced', token = $2 WHERE job_key = $1", l.JobKey, l.Token)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	held, err := fence.Acquire(ctx, conn, "dump-job", "dumper", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	port, logs := serveInProcess(t)
	dir := t.TempDir()
	e := &dumpEnv{
		src:       src,
		proxyPort: port,
		meta:      fmt.Sprintf("-c fence.job_key=%s -c fence.epoch=%d -c fence.token=%d", held.JobKey, held.Epoch, held.Token),
		logs:      logs,
		plain:     filepath.Join(dir, "src.sql"),
		custom:    filepath.Join(dir, "src.dump"),
		directory: filepath.Join(dir, "src.dir"),
	}
	direct := side{name: "direct", port: cluster.Primary.Port}
	for _, args := range [][]string{
		{"-d", src, "-f", e.plain},
		{"-Fc", "-d", src, "-f", e.custom},
		{"-Fd", "-d", src, "-f", e.directory},
	} {
		if _, _, err := e.run(direct, "pg_dump", args...); err != nil {
			t.Fatal(err)
		}
	}
	return e
}

// side is one way of reaching the cluster: direct or through the proxy.
type side struct {
	name      string
	port      int
	pgoptions string
}

// run runs a PostgreSQL tool against side; it returns stdout, stderr and
// the error.
func (e *dumpEnv) run(s side, prog string, args ...string) (string, string, error) {
	stdout, stderr, err := cluster.Client("127.0.0.1", s.port, s.pgoptions, prog, args...)
	if err != nil {
		err = fmt.Errorf("%s %s (%s): %w\n%s", prog, strings.Join(args, " "), s.name, err, lastLinesOf(stderr, 20))
	}
	return stdout, stderr, err
}

func lastLinesOf(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// restrictKey is the random key of psql's \restrict and \unrestrict that
// pg_dump writes into a plain dump (since 15.14): different in every run.
var restrictKey = regexp.MustCompile(`(?m)^\\(un)?restrict [A-Za-z0-9]+$`)

// diff describes the first difference of two outputs, or is nil. The two
// differ only by what differs between any two runs: the random key of
// \restrict.
func diff(what, direct, proxied string) error {
	direct = restrictKey.ReplaceAllString(direct, `\${1}restrict (key)`)
	proxied = restrictKey.ReplaceAllString(proxied, `\${1}restrict (key)`)
	if direct == proxied {
		return nil
	}
	d, p := strings.Split(direct, "\n"), strings.Split(proxied, "\n")
	i := 0
	for i < len(d) && i < len(p) && d[i] == p[i] {
		i++
	}
	line := func(lines []string) string {
		if i < len(lines) {
			return lines[i]
		}
		return ""
	}
	return fmt.Errorf("%s differs at line %d (%d lines direct, %d through the proxy):\n  direct: %.300q\n  proxy:  %.300q", what, i+1, len(d), len(p), line(d), line(p))
}

// archiveCreated is the one timestamp of an archive's TOC listing.
var archiveCreated = regexp.MustCompile(`(?m)^; Archive created at .*$`)

// archiveText is what an archive (custom or directory) holds, in
// comparable form: its TOC listing without the creation time, and the SQL
// script pg_restore makes of it.
func (e *dumpEnv) archiveText(t *testing.T, path string) string {
	t.Helper()
	direct := side{name: "direct", port: cluster.Primary.Port}
	list, _, err := e.run(direct, "pg_restore", "-l", path)
	if err != nil {
		t.Fatal(err)
	}
	script, _, err := e.run(direct, "pg_restore", "-f", "-", path)
	if err != nil {
		t.Fatal(err)
	}
	return archiveCreated.ReplaceAllString(list, "; Archive created at (time)") + "\n-- script --\n" + script
}

// dumpOf is a plain dump of db taken straight from PostgreSQL.
func (e *dumpEnv) dumpOf(t *testing.T, db string) string {
	t.Helper()
	out, _, err := e.run(side{name: "direct", port: cluster.Primary.Port}, "pg_dump", "-d", db)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestDumpRestoreThroughProxy(t *testing.T) {
	e := newDumpEnv(t)
	direct := side{name: "direct", port: cluster.Primary.Port}
	for _, sess := range []struct{ name, pgoptions string }{
		{"no_metadata", ""},
		{"fence_metadata", e.meta},
	} {
		proxied := side{name: "proxy", port: e.proxyPort, pgoptions: sess.pgoptions}
		direct := direct
		direct.pgoptions = sess.pgoptions
		t.Run(sess.name, func(t *testing.T) {
			t.Run("pg_dump_plain", func(t *testing.T) {
				want, _, err := e.run(direct, "pg_dump", "-d", e.src)
				if err != nil {
					t.Fatal(err)
				}
				if !strings.Contains(want, "SELECT pg_catalog.setval('public.ledger_id_seq', 2000, true);") || !strings.Contains(want, "CREATE TRIGGER pgfence_backstop") {
					t.Fatalf("the direct dump lacks the source's objects:\n%.2000s", want)
				}
				got, _, err := e.run(proxied, "pg_dump", "-d", e.src)
				if err == nil {
					err = diff("pg_dump", want, got)
				}
				if err != nil {
					t.Fatal(err)
				}
			})
			t.Run("pg_dump_custom", func(t *testing.T) {
				dir := t.TempDir()
				if _, _, err := e.run(direct, "pg_dump", "-Fc", "-d", e.src, "-f", filepath.Join(dir, "direct.dump")); err != nil {
					t.Fatal(err)
				}
				want := e.archiveText(t, filepath.Join(dir, "direct.dump"))
				_, _, err := e.run(proxied, "pg_dump", "-Fc", "-d", e.src, "-f", filepath.Join(dir, "proxy.dump"))
				if err == nil {
					err = diff("pg_dump -Fc", want, e.archiveText(t, filepath.Join(dir, "proxy.dump")))
				}
				if err != nil {
					t.Fatal(err)
				}
			})
			t.Run("pg_dump_directory_j2", func(t *testing.T) {
				dir := t.TempDir()
				if _, _, err := e.run(direct, "pg_dump", "-Fd", "-j", "2", "-d", e.src, "-f", filepath.Join(dir, "direct")); err != nil {
					t.Fatal(err)
				}
				want := e.archiveText(t, filepath.Join(dir, "direct")) + "\n-- files --\n" + dirFiles(t, filepath.Join(dir, "direct"))
				_, _, err := e.run(proxied, "pg_dump", "-Fd", "-j", "2", "-d", e.src, "-f", filepath.Join(dir, "proxy"))
				if err == nil {
					err = diff("pg_dump -Fd -j 2", want, e.archiveText(t, filepath.Join(dir, "proxy"))+"\n-- files --\n"+dirFiles(t, filepath.Join(dir, "proxy")))
				}
				if err != nil {
					t.Fatal(err)
				}
			})
			t.Run("pg_dumpall", func(t *testing.T) {
				// The roles and the source database alone: the package's
				// other tests' databases come and go.
				args := []string{"--exclude-database", "t[0-9]*", "--exclude-database", "pgfence_template",
					"--exclude-database", "postgres", "--exclude-database", "template1"}
				want, _, err := e.run(direct, "pg_dumpall", args...)
				if err != nil {
					t.Fatal(err)
				}
				if !strings.Contains(want, "CREATE ROLE pgfence_worker;") || !strings.Contains(want, "\\connect "+e.src) {
					t.Fatalf("pg_dumpall lacks pgfence's roles or the source database:\n%.3000s", want)
				}
				got, _, err := e.run(proxied, "pg_dumpall", args...)
				if err == nil {
					err = diff("pg_dumpall", want, got)
				}
				if err != nil {
					t.Fatal(err)
				}
			})
			restores := []struct {
				name string
				prog string
				args func(db string) []string
			}{
				{"pg_restore_custom", "pg_restore", func(db string) []string { return []string{"-d", db, e.custom} }},
				{"pg_restore_directory_j2", "pg_restore", func(db string) []string { return []string{"-j", "2", "-d", db, e.directory} }},
				{"psql_f", "psql", func(db string) []string { return []string{"-X", "-v", "ON_ERROR_STOP=1", "-d", db, "-f", e.plain} }},
			}
			for _, r := range restores {
				t.Run(r.name, func(t *testing.T) {
					base := strings.ToLower(strings.ReplaceAll(sess.name+"_"+r.name, "-", "_"))
					dd, pd := "rd_"+base, "rp_"+base
					createDatabase(t, cluster, dd, "template0")
					createDatabase(t, cluster, pd, "template0")
					wantOut, wantErr, err := e.run(direct, r.prog, r.args(dd)...)
					if err != nil {
						t.Fatal(err)
					}
					want := e.dumpOf(t, dd)
					if !strings.Contains(want, "CREATE TRIGGER pgfence_backstop") || !strings.Contains(want, "job-1\tfenced") {
						t.Fatalf("the database restored direct lacks the source's objects:\n%.2000s", want)
					}
					gotOut, gotErr, err := e.run(proxied, r.prog, r.args(pd)...)
					if err == nil {
						err = first(diff(r.prog+"'s output", wantOut, gotOut),
							diff(r.prog+"'s messages", strings.ReplaceAll(wantErr, dd, "DB"), strings.ReplaceAll(gotErr, pd, "DB")),
							diff("the restored database's dump", want, e.dumpOf(t, pd)))
					}
					if err != nil {
						t.Fatal(err)
					}
				})
			}
		})
	}
}

func first(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// dirFiles lists a directory archive's files with their sizes (the data
// files are compressed table data: equal sizes, equal names).
func dirFiles(t *testing.T, dir string) string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, ent := range ents {
		fi, err := ent.Info()
		if err != nil {
			t.Fatal(err)
		}
		size := fmt.Sprint(fi.Size())
		if ent.Name() == "toc.dat" {
			size = "(holds the time)"
		}
		out = append(out, ent.Name()+" "+size)
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}
