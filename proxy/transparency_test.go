package proxy

import (
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// TestGateTransparent is a differential test of the write gate: random
// sessions of writes, reads, transaction control and errors, in simple
// queries (several statements each) and extended-protocol pipelines, run
// statement for statement on two identical databases: straight to
// PostgreSQL, where the table p is plain, and through pgfence with the
// gate, where p is protected and the worker's fence holds. A worker
// whose fence holds must not be able to tell the gate is there: every
// message it receives (command tags, rows, errors with their positions,
// warnings, transaction status) is compared, and so are the tables at
// the end. The generator gives each transaction its own fence.step, as
// a worker that commits several results under one token does.
func TestGateTransparent(t *testing.T) {
	env := newFenceEnv(t)
	ctx := ctxT(t)
	plainDB := cluster.NewDatabase(t)
	const schema = `CREATE TABLE p (k int PRIMARY KEY, v text NOT NULL);
CREATE TABLE u (k int PRIMARY KEY, v text NOT NULL);`
	plain, err := cluster.Primary.Connect(ctx, plainDB)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close(ctx)
	execOK(t, plain, schema)
	execOK(t, env.direct(t), schema+"SELECT fence.protect('p');")
	l := env.acquire(t, "transparent", "tester", time.Hour)
	opts := pgoptions(l)

	seeds := 40
	if v, err := strconv.Atoi(os.Getenv("PGFENCE_TRANSPARENT_SEEDS")); err == nil {
		seeds = v
	}
	if testing.Short() {
		seeds = 5
	}
	for seed := 1; seed <= seeds; seed++ {
		t.Run("seed="+strconv.Itoa(seed), func(t *testing.T) {
			direct := transcriptConn(t, "direct", cluster.Primary.DSN(plainDB), opts)
			gated := transcriptConn(t, "through pgfence", env.proxy.dsn(env.db), opts)
			g := &sessionGen{rng: rand.New(rand.NewPCG(uint64(seed), 0x5eed)), seed: seed}
			var trail []string
			for i := 0; i < 120; i++ {
				op := g.next()
				trail = append(trail, op.String())
				if testing.Verbose() {
					t.Logf("operation %d: %s", i, op)
				}
				want, got := direct.run(t, op), gated.run(t, op)
				if want != got {
					if len(trail) > 10 {
						trail = append([]string{"..."}, trail[len(trail)-10:]...)
					}
					t.Fatalf("operation %d differs through the gate\nthe session so far:\n  %s\ndirect:\n%s\nthrough pgfence:\n%s",
						i, strings.Join(trail, "\n  "), want, got)
				}
				g.idle = strings.HasSuffix(got, "Z I\n")
			}
			end := &op{simple: []string{"ROLLBACK"}}
			direct.run(t, end)
			gated.run(t, end)
			final := &op{simple: []string{"SELECT k, v FROM p ORDER BY k", "SELECT k, v FROM u ORDER BY k"}}
			if want, got := direct.run(t, final), gated.run(t, final); want != got {
				t.Fatalf("the tables differ at the end\ndirect:\n%s\nthrough pgfence:\n%s", want, got)
			}
		})
	}
	// The gate acted: the committed transactions that wrote p left
	// receipts (a run in which none did would prove nothing).
	var receipts int
	if err := env.direct(t).QueryRow(ctxT(t), "SELECT count(*) FROM fence.receipts WHERE job_key = 'transparent'").Scan(&receipts); err != nil {
		t.Fatal(err)
	}
	if receipts < seeds {
		t.Fatalf("%d receipts after %d sessions: the gate hardly acted", receipts, seeds)
	}
	t.Logf("%d gated transactions committed with their receipts", receipts)
}

// op is one client exchange: a simple query (its statements joined with
// ;), or an extended-protocol pipeline of unnamed statements ending in
// one Sync.
type op struct {
	step   string // a SET fence.step sent first when idle (its own exchange)
	copy   string // the data for a COPY FROM STDIN in it
	simple []string
	ext    []extStmt
}

type extStmt struct {
	sql  string
	args []string
	p    bool // writes p (every generated write is one when its table is p)
	// named: a named prepared statement (one name per text): Close and
	// Parse it first, or with reuse Bind it as it is (when an earlier
	// Parse of it was skipped or closed, both sides answer 26000).
	named, reuse bool
}

func (o *op) String() string {
	var b strings.Builder
	if o.step != "" {
		fmt.Fprintf(&b, "[step %s] ", o.step)
	}
	if o.simple != nil {
		b.WriteString("Q: " + strings.Join(o.simple, "; "))
		if strings.Contains(b.String(), "COPY") {
			fmt.Fprintf(&b, " [copy %q]", o.copy)
		}
		return b.String()
	}
	b.WriteString("pipeline:")
	for _, s := range o.ext {
		mode := ""
		if s.reuse {
			mode = "(named, bound again) "
		} else if s.named {
			mode = "(named) "
		}
		fmt.Fprintf(&b, " {%s%s %v}", mode, s.sql, s.args)
	}
	b.WriteString(" Sync")
	return b.String()
}

// sessionGen makes random operations. Keys are few, so inserts collide
// (unique violations) and updates and deletes find rows.
type sessionGen struct {
	rng   *rand.Rand
	seed  int
	n     int
	idle  bool // the last operation left the session idle
	fresh bool // the last operation ended a transaction: the next sets a step
	steps int
}

func (g *sessionGen) key() int { return g.rng.IntN(6) + 1 }

// stmt returns a statement; with a key placeholder ($1) when ext. With
// after (statements that follow a COMMIT or ROLLBACK in the same
// operation) it neither writes p, nor makes a savepoint, nor ends a
// transaction: the transaction it may open has no step of its own until
// the next operation sets one, before any savepoint could undo that.
func (g *sessionGen) stmt(ext, after bool) extStmt {
	for {
		s := g.anyStmt(ext, after)
		if (ext || after) && strings.HasPrefix(s.sql, "COPY") {
			// In a pipeline the messages after COPY's Execute would go
			// into the COPY; after a fenced COMMIT the gate refuses it
			// (FN009): not a transparent case.
			continue
		}
		if !after || !(s.p || s.sql == "SAVEPOINT s1" || ends(s.sql)) {
			return s
		}
	}
}

func (g *sessionGen) anyStmt(ext, after bool) extStmt {
	k := strconv.Itoa(g.key())
	kv := k
	var args []string
	if ext {
		kv, args = "$1", []string{k}
	}
	tbl := "p"
	if after || g.rng.IntN(3) == 0 {
		tbl = "u"
	}
	s := g.pick(tbl, kv, args)
	s.p = s.p && (tbl == "p" || strings.Contains(s.sql, " p ") || strings.Contains(s.sql, "w_p"))
	return s
}

// txControl are pick's statements 11 to 17.
var txControl = [...]string{
	"BEGIN",
	"START TRANSACTION ISOLATION LEVEL REPEATABLE READ",
	"SAVEPOINT s1",
	"ROLLBACK TO SAVEPOINT s1",
	"RELEASE SAVEPOINT s1",
	"COMMIT",
	"ROLLBACK",
}

func (g *sessionGen) pick(tbl, kv string, args []string) extStmt {
	switch n := g.rng.IntN(26); n {
	case 20:
		return extStmt{sql: fmt.Sprintf("MERGE INTO %[1]s USING (SELECT %[2]s::int AS k) s ON %[1]s.k = s.k WHEN MATCHED THEN UPDATE SET v = %[1]s.v || 'm' WHEN NOT MATCHED THEN INSERT VALUES (s.k, 'm')", tbl, kv), args: args, p: true}
	case 21:
		return extStmt{sql: fmt.Sprintf("PREPARE w_%s AS INSERT INTO %s VALUES ($1, 'x') ON CONFLICT (k) DO UPDATE SET v = excluded.v", tbl, tbl)}
	case 22:
		// EXECUTE of a statement that may not exist (26000, both ways).
		return extStmt{sql: fmt.Sprintf("EXECUTE w_%s(%d)", tbl, g.key()), p: true}
	case 23:
		return extStmt{sql: fmt.Sprintf("DEALLOCATE w_%s", tbl)}
	case 24:
		return extStmt{sql: fmt.Sprintf("COPY %s (k, v) FROM STDIN", tbl), p: true}
	case 25:
		return extStmt{sql: fmt.Sprintf("DO $$BEGIN INSERT INTO %s VALUES (%d, 'd') ON CONFLICT (k) DO NOTHING; END$$", tbl, g.key()), p: true}
	case 0, 1, 2:
		return extStmt{sql: fmt.Sprintf("INSERT INTO %s VALUES (%s, 'i')", tbl, kv), args: args, p: true}
	case 3, 4:
		return extStmt{sql: fmt.Sprintf("INSERT INTO %s VALUES (%s, 'o') ON CONFLICT (k) DO UPDATE SET v = excluded.v || %s.v", tbl, kv, tbl), args: args, p: true}
	case 5:
		return extStmt{sql: fmt.Sprintf("UPDATE %s SET v = v || 'u' WHERE k = %s", tbl, kv), args: args, p: true}
	case 6:
		return extStmt{sql: fmt.Sprintf("DELETE FROM %s WHERE k = %s", tbl, kv), args: args, p: true}
	case 7:
		return extStmt{sql: fmt.Sprintf("WITH w AS (INSERT INTO %s VALUES (%s, 'w') ON CONFLICT DO NOTHING RETURNING k) SELECT count(*) FROM w", tbl, kv), args: args, p: true}
	case 8:
		return extStmt{sql: fmt.Sprintf("SELECT k, v FROM %s WHERE k <= %s ORDER BY k", tbl, kv), args: args}
	case 9:
		return extStmt{sql: "SELECT 1/0"}
	case 10:
		return extStmt{sql: "SELECT nosuchcolumn FROM " + tbl}
	case 11, 12, 13, 14, 15, 16, 17:
		return extStmt{sql: txControl[n-11]}
	case 18:
		return extStmt{sql: "UPDATE p SET v = v || 'n' WHERE k > 100", p: true} // writes no row
	default:
		return extStmt{sql: "SELECT count(*) FROM " + tbl}
	}
}

// ends reports whether s ends a transaction (a transaction after it
// needs a step of its own).
func ends(s string) bool {
	return s == "COMMIT" || s == "ROLLBACK"
}

func (g *sessionGen) next() *op {
	o := &op{}
	if g.idle || g.fresh || g.n == 0 {
		g.steps++
		o.step = fmt.Sprintf("s%d-%d", g.seed, g.steps)
	}
	g.n++
	ext := g.rng.IntN(3) == 0
	n := 1 + g.rng.IntN(3)
	if ext {
		o.ext = []extStmt{}
	} else {
		o.simple = []string{}
	}
	g.fresh = false
	o.copy = fmt.Sprintf("%d\tc\n", g.key())
	if g.rng.IntN(2) == 0 {
		o.copy += fmt.Sprintf("%d\tc\n", g.key())
	}
	copied := false
	for i := 0; i < n; i++ {
		s := g.stmt(ext, g.fresh)
		for copied && s.sql == "COMMIT" {
			// Refused by the gate in a fenced transaction (FN009: the
			// receipt must cover the COPY data): not a transparent case.
			s = g.stmt(ext, g.fresh)
		}
		copied = copied || strings.HasPrefix(s.sql, "COPY")
		if ext {
			s.named = g.rng.IntN(3) == 0
			s.reuse = s.named && g.rng.IntN(2) == 0
			o.ext = append(o.ext, s)
		} else {
			o.simple = append(o.simple, s.sql)
		}
		if ends(s.sql) {
			g.fresh = true
			if g.rng.IntN(2) == 0 {
				break
			}
			n = i + 1 + g.rng.IntN(3) // go on after it, sometimes
		}
	}
	return o
}

// transcript is a raw protocol connection whose answers are written down
// message by message.
type transcript struct {
	name string
	c    *pgconn.PgConn
	fe   *pgproto3.Frontend
	copy []byte // COPY FROM STDIN data: sent at each CopyInResponse
	// copies, when set, is the data for each COPY in turn (then copy).
	copies [][]byte
	// syncCopy: send Sync after CopyDone (a COPY run by Execute).
	syncCopy bool
}

func transcriptConn(t *testing.T, name, dsn, opts string) *transcript {
	t.Helper()
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["options"] = opts
	c := connectConfig(t, cfg)
	return &transcript{name: name, c: c, fe: pgproto3.NewFrontend(c.Conn(), c.Conn())}
}

// run sends o and returns what came back, one line per message.
func (tc *transcript) run(t *testing.T, o *op) string {
	t.Helper()
	var b strings.Builder
	tc.copy = []byte(o.copy)
	if o.step != "" {
		tc.fe.Send(&pgproto3.Query{String: "SET fence.step = '" + o.step + "'"})
		tc.read(t, &b, 1)
	}
	if o.simple != nil {
		tc.fe.Send(&pgproto3.Query{String: strings.Join(o.simple, "; ")})
	} else {
		for _, s := range o.ext {
			params := make([][]byte, len(s.args))
			for i, a := range s.args {
				params[i] = []byte(a)
			}
			name := ""
			if s.named {
				name = fmt.Sprintf("n%08x", crc32.ChecksumIEEE([]byte(s.sql)))
			}
			if !s.reuse {
				if name != "" {
					tc.fe.Send(&pgproto3.Close{ObjectType: 'S', Name: name})
				}
				tc.fe.Send(&pgproto3.Parse{Name: name, Query: s.sql})
			}
			tc.fe.Send(&pgproto3.Bind{PreparedStatement: name, Parameters: params})
			tc.fe.Send(&pgproto3.Describe{ObjectType: 'P'})
			tc.fe.Send(&pgproto3.Execute{})
		}
		tc.fe.Send(&pgproto3.Sync{})
	}
	tc.read(t, &b, 1)
	return b.String()
}

func (tc *transcript) read(t *testing.T, b *strings.Builder, rfqs int) {
	t.Helper()
	if err := tc.fe.Flush(); err != nil {
		t.Fatal(err)
	}
	tc.c.Conn().SetReadDeadline(time.Now().Add(20 * time.Second))
	defer tc.c.Conn().SetReadDeadline(time.Time{})
	for rfqs > 0 {
		m, err := tc.fe.Receive()
		if err != nil {
			t.Fatalf("%s: receive (so far:\n%s): %v", tc.name, b.String(), err)
		}
		switch m := m.(type) {
		case *pgproto3.CopyInResponse:
			b.WriteString("G\n")
			data := tc.copy
			if len(tc.copies) > 0 {
				data, tc.copies = tc.copies[0], tc.copies[1:]
			}
			tc.fe.Send(&pgproto3.CopyData{Data: data})
			tc.fe.Send(&pgproto3.CopyDone{})
			if tc.syncCopy {
				tc.fe.Send(&pgproto3.Sync{})
			}
			if err := tc.fe.Flush(); err != nil {
				t.Fatal(err)
			}
		case *pgproto3.ReadyForQuery:
			fmt.Fprintf(b, "Z %c\n", m.TxStatus)
			rfqs--
		case *pgproto3.CommandComplete:
			fmt.Fprintf(b, "C %s\n", m.CommandTag)
		case *pgproto3.RowDescription:
			var names []string
			for _, f := range m.Fields {
				names = append(names, string(f.Name))
			}
			fmt.Fprintf(b, "T %v\n", names)
		case *pgproto3.DataRow:
			var vals []string
			for _, v := range m.Values {
				vals = append(vals, string(v))
			}
			fmt.Fprintf(b, "D %v\n", vals)
		case *pgproto3.ErrorResponse:
			fmt.Fprintf(b, "E %s %s %s: %s (%s) at %d\n", m.Severity, m.SeverityUnlocalized, m.Code, m.Message, m.Detail, m.Position)
		case *pgproto3.NoticeResponse:
			fmt.Fprintf(b, "N %s %s: %s (%s)\n", m.Severity, m.Code, m.Message, m.Detail)
		case *pgproto3.ParameterStatus:
			fmt.Fprintf(b, "S %s=%s\n", m.Name, m.Value)
		case *pgproto3.ParseComplete:
			b.WriteString("1\n")
		case *pgproto3.BindComplete:
			b.WriteString("2\n")
		case *pgproto3.NoData:
			b.WriteString("n\n")
		case *pgproto3.EmptyQueryResponse:
			b.WriteString("I\n")
		default:
			fmt.Fprintf(b, "%T\n", m)
		}
	}
}

// TestGateTwoCopies: a query with two COPY FROM STDIN into a protected
// table, outside a transaction: the gate wraps it, the receipt waits for
// the second COPY's end and its digest covers both streams. The same
// step again with the same data is a replay; with the second stream
// changed, a conflict. (Before, the receipt went out at the first
// CopyDone while the server waited in the second COPY: the session hung.)
func TestGateTwoCopies(t *testing.T) {
	e, opts := plEnv(t, "copies", "-c fence.step=two")
	q := &op{simple: []string{"COPY pl (v) FROM STDIN", "COPY pl (v) FROM STDIN"}}
	attempt := func(first, second string) string {
		tc := transcriptConn(t, "through pgfence", e.proxy.dsn(e.db), opts)
		tc.copies = [][]byte{[]byte(first), []byte(second)}
		return tc.run(t, q)
	}
	if got, want := attempt("a\n", "b\n"), "G\nC COPY 1\nG\nC COPY 1\nZ I\n"; got != want {
		t.Fatalf("first attempt:\n%s\nwant:\n%s", got, want)
	}
	wantRetries(t, "copies", attempt("a\n", "b\n"), attempt("a\n", "c\n"))
	if n := e.count(t, "SELECT count(*) FROM pl"); n != 2 {
		t.Fatalf("%d rows in pl, want the first attempt's 2", n)
	}
}

// TestGateCopyThenCommit: COPY FROM STDIN and COMMIT in one query, in a
// fenced transaction, are refused with FN009 at the COMMIT (the receipt
// could not cover the COPY's data; a COPY after the COMMIT would hold up
// the proxy's wait for the query's answer): nothing is committed, in the
// client's transaction and in an implicit one.
func TestGateCopyThenCommit(t *testing.T) {
	e, opts := plEnv(t, "copycommit", "")
	tc := transcriptConn(t, "through pgfence", e.proxy.dsn(e.db), opts)
	tc.copy = []byte("x\n")
	if got := tc.run(t, &op{simple: []string{"BEGIN"}}); got != "C BEGIN\nZ T\n" {
		t.Fatalf("BEGIN: %s", got)
	}
	got := tc.run(t, &op{simple: []string{"INSERT INTO pl VALUES ('y')", "COPY pl (v) FROM STDIN", "COMMIT"}})
	if !strings.Contains(got, "E ERROR ERROR FN009") || !strings.HasSuffix(got, "Z E\n") {
		t.Fatalf("in a transaction, want FN009 and the transaction failed:\n%s", got)
	}
	if got := tc.run(t, &op{simple: []string{"ROLLBACK"}}); got != "C ROLLBACK\nZ I\n" {
		t.Fatalf("ROLLBACK: %s", got)
	}
	got = tc.run(t, &op{simple: []string{"COPY pl (v) FROM STDIN", "COMMIT"}})
	if !strings.Contains(got, "E ERROR ERROR FN009") || !strings.HasSuffix(got, "Z I\n") {
		t.Fatalf("outside a transaction, want FN009:\n%s", got)
	}
	// The other way round: the COPY after the COMMIT would hold up what
	// the proxy does once the query is answered. Refused at the COMMIT.
	if got := tc.run(t, &op{simple: []string{"BEGIN", "INSERT INTO pl VALUES ('z')"}}); got != "C BEGIN\nC INSERT 0 1\nZ T\n" {
		t.Fatalf("BEGIN; INSERT: %s", got)
	}
	got = tc.run(t, &op{simple: []string{"COMMIT", "COPY pl (v) FROM STDIN"}})
	if !strings.Contains(got, "E ERROR ERROR FN009") || !strings.HasSuffix(got, "Z E\n") {
		t.Fatalf("COMMIT; COPY, want FN009 and the transaction failed:\n%s", got)
	}
	if got := tc.run(t, &op{simple: []string{"ROLLBACK"}}); got != "C ROLLBACK\nZ I\n" {
		t.Fatalf("ROLLBACK: %s", got)
	}
	if n := e.count(t, "SELECT count(*) FROM pl"); n != 0 {
		t.Fatalf("%d rows in pl, want none", n)
	}
	if n := e.count(t, "SELECT count(*) FROM fence.receipts WHERE job_key = 'copycommit'"); n != 0 {
		t.Fatalf("%d receipts, want none", n)
	}
}

// TestGateCopyExtended: a COPY FROM STDIN into a protected table through
// the extended protocol (Parse, Bind, Execute; the data; Sync), outside a
// transaction: its receipt's digest covers the data, so the same step
// with the same data is a replay and with other data a conflict.
func TestGateCopyExtended(t *testing.T) {
	e, opts := plEnv(t, "copyext", "-c fence.step=x")
	attempt := func(data string) string {
		tc := transcriptConn(t, "through pgfence", e.proxy.dsn(e.db), opts)
		tc.copy = []byte(data)
		tc.syncCopy = true
		tc.fe.Send(&pgproto3.Parse{Query: "COPY pl (v) FROM STDIN"})
		tc.fe.Send(&pgproto3.Bind{})
		tc.fe.Send(&pgproto3.Execute{})
		tc.fe.Send(&pgproto3.Flush{})
		var b strings.Builder
		tc.read(t, &b, 1)
		return b.String()
	}
	if got, want := attempt("a\n"), "1\n2\nG\nC COPY 1\nZ I\n"; got != want {
		t.Fatalf("first attempt:\n%s\nwant:\n%s", got, want)
	}
	wantRetries(t, "copyext", attempt("a\n"), attempt("b\n"))
	if n := e.count(t, "SELECT count(*) FROM pl"); n != 1 {
		t.Fatalf("%d rows in pl, want the first attempt's 1", n)
	}
}

// plEnv is a fenced environment with a protected table pl (v text) and
// a lease for job, and the startup options that carry its generation
// (and extra).
func plEnv(t *testing.T, job, extra string) (*fenceEnv, string) {
	e := newFenceEnv(t)
	execOK(t, e.direct(t), "CREATE TABLE pl (v text); SELECT fence.protect('pl')")
	l := e.acquire(t, job, "a", time.Hour)
	return e, strings.TrimSpace(pgoptions(l) + " " + extra)
}

// wantRetries checks the answers to a committed step's retries: with the
// same data a replay (a NOTICE naming the job), with other data a
// conflict; the session idle after each.
func wantRetries(t *testing.T, job, same, other string) {
	t.Helper()
	if !strings.Contains(same, fmt.Sprintf("N NOTICE FN00R: pgfence: idempotent replay: job %q epoch", job)) || !strings.HasSuffix(same, "Z I\n") {
		t.Errorf("the same again, want a replay naming the job:\n%s", same)
	}
	if !strings.Contains(other, "E ERROR ERROR FN003") || !strings.HasSuffix(other, "Z I\n") {
		t.Errorf("other data, want a conflict:\n%s", other)
	}
}
