package proxy

import (
	"fmt"
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
	if _, err := plain.Exec(ctx, schema); err != nil {
		t.Fatal(err)
	}
	if _, err := env.direct(t).Exec(ctx, schema+"SELECT fence.protect('p');"); err != nil {
		t.Fatal(err)
	}
	l := env.acquire(t, "transparent", "tester", time.Hour)
	opts := fmt.Sprintf("-c fence.job_key=%s -c fence.epoch=%d -c fence.token=%d", l.JobKey, l.Epoch, l.Token)

	seeds := 40
	if v, err := strconv.Atoi(os.Getenv("PGFENCE_TRANSPARENT_SEEDS")); err == nil {
		seeds = v
	}
	if testing.Short() {
		seeds = 5
	}
	for seed := 1; seed <= seeds; seed++ {
		t.Run("seed="+strconv.Itoa(seed), func(t *testing.T) {
			direct := transcriptConn(t, cluster.Primary.DSN(plainDB), opts)
			gated := transcriptConn(t, env.proxy.dsn(env.db), opts)
			g := &sessionGen{rng: rand.New(rand.NewPCG(uint64(seed), 0x5eed)), seed: seed}
			var trail []string
			for i := 0; i < 120; i++ {
				op := g.next()
				trail = append(trail, op.String())
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
	simple []string
	ext    []extStmt
}

type extStmt struct {
	sql  string
	args []string
	p    bool // writes p (every generated write is one when its table is p)
}

func (o *op) String() string {
	var b strings.Builder
	if o.step != "" {
		fmt.Fprintf(&b, "[step %s] ", o.step)
	}
	if o.simple != nil {
		b.WriteString("Q: " + strings.Join(o.simple, "; "))
		return b.String()
	}
	b.WriteString("pipeline:")
	for _, s := range o.ext {
		fmt.Fprintf(&b, " {%s %v}", s.sql, s.args)
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
	s.p = s.p && (tbl == "p" || strings.Contains(s.sql, " p "))
	return s
}

func (g *sessionGen) pick(tbl, kv string, args []string) extStmt {
	switch g.rng.IntN(20) {
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
	case 11:
		return extStmt{sql: "BEGIN"}
	case 12:
		return extStmt{sql: "START TRANSACTION ISOLATION LEVEL REPEATABLE READ"}
	case 13:
		return extStmt{sql: "SAVEPOINT s1"}
	case 14:
		return extStmt{sql: "ROLLBACK TO SAVEPOINT s1"}
	case 15:
		return extStmt{sql: "RELEASE SAVEPOINT s1"}
	case 16:
		return extStmt{sql: "COMMIT"}
	case 17:
		return extStmt{sql: "ROLLBACK"}
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
	for i := 0; i < n; i++ {
		s := g.stmt(ext, g.fresh)
		if ext {
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
	c  *pgconn.PgConn
	fe *pgproto3.Frontend
}

func transcriptConn(t *testing.T, dsn, opts string) *transcript {
	t.Helper()
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["options"] = opts
	c, err := pgconn.ConnectConfig(ctxT(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(ctxT(t)) })
	return &transcript{c: c, fe: pgproto3.NewFrontend(c.Conn(), c.Conn())}
}

// run sends o and returns what came back, one line per message.
func (tc *transcript) run(t *testing.T, o *op) string {
	t.Helper()
	var b strings.Builder
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
			tc.fe.Send(&pgproto3.Parse{Query: s.sql})
			tc.fe.Send(&pgproto3.Bind{Parameters: params})
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
			t.Fatalf("receive (so far:\n%s): %v", b.String(), err)
		}
		switch m := m.(type) {
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
