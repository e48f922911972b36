package session

import (
	"context"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/rewrite"
)

var cluster *pgtest.Cluster

var diffSeqs = flag.Int("diffseqs", 60, "number of random sequences TestDifferentialRandom replays")

func TestMain(m *testing.M) {
	flag.Parse()
	if f := flag.Lookup("test.fuzz"); f != nil && f.Value.String() != "" {
		// Fuzzing (go test -run '^$' -fuzz FuzzTracker): every fuzz
		// worker runs TestMain, and FuzzTracker needs no server.
		os.Exit(m.Run())
	}
	os.Exit(pgtest.Run(m, pgtest.Options{}, nil, &cluster))
}

// watched are the parameters compared with the server after every step.
var watched = []string{Token, Epoch, Step, JobKey, SearchPath}

// mirror drives a real PostgreSQL session and a State side by side, as the
// proxy's wire loop would: Apply on each CommandComplete, Fail on an
// ErrorResponse, TxStatus on ReadyForQuery.
type mirror struct {
	t     *testing.T
	conn  *pgx.Conn
	st    *State
	trace []string
}

func newMirror(t *testing.T, db string, options string) *mirror {
	t.Helper()
	ctx := context.Background()
	cfg, err := pgx.ParseConfig(cluster.Primary.DSN(db))
	if err != nil {
		t.Fatal(err)
	}
	params := map[string]string{"user": cfg.User}
	if options != "" {
		cfg.RuntimeParams["options"] = options
		params["options"] = options
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	st, err := New(params, NewStatements())
	if err != nil {
		t.Fatalf("New(%v): %v", params, err)
	}
	return &mirror{t: t, conn: conn, st: st}
}

// step runs one simple Query on both sides and compares the outcome.
func (m *mirror) step(sql string) {
	m.t.Helper()
	m.trace = append(m.trace, sql)
	res, err := rewrite.Classify(sql)
	if err != nil {
		m.t.Fatalf("classify %q: %v", sql, err)
	}
	for _, s := range res.Stmts {
		if err := m.st.Check(s, nil); err != nil {
			m.t.Fatalf("%s\nCheck(%q): %v", m.where(), s.SQL, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	mrr := m.conn.PgConn().Exec(ctx, sql)
	i := 0
	var failed error
	for mrr.NextResult() {
		tag, err := mrr.ResultReader().Close()
		if err != nil {
			failed = err
			break
		}
		if i < len(res.Stmts) {
			if err := m.st.Apply(res.Stmts[i], tag.String(), nil); err != nil {
				m.t.Fatalf("%s\nApply(%q, %q): %v", m.where(), res.Stmts[i].SQL, tag, err)
			}
		}
		i++
	}
	if err := mrr.Close(); err != nil && failed == nil {
		failed = err
	}
	if failed != nil {
		m.st.Fail()
	}
	status := m.conn.PgConn().TxStatus()
	if err := m.st.TxStatus(status); err != nil {
		m.t.Fatalf("%s\nTxStatus(%q): %v (tracked %v explicit=%v)", m.where(), status, err, m.st.Tx(), m.st.Explicit())
	}
	m.compare(status)
}

func (m *mirror) where() string {
	return "after steps:\n  " + strings.Join(m.trace, "\n  ")
}

func (m *mirror) compare(status byte) {
	m.t.Helper()
	var want TxState
	switch status {
	case 'I':
		want = Idle
	case 'T':
		want = InTx
	case 'E':
		want = Failed
	}
	if got := m.st.Tx(); got != want {
		m.t.Fatalf("%s\ntransaction state: got %v, want %v (server %q)", m.where(), got, want, status)
	}
	if status == 'E' {
		return // the server answers nothing in a failed transaction
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	vals := make([]*string, len(watched))
	dest := make([]any, len(watched))
	for i := range vals {
		dest[i] = &vals[i]
	}
	q := "SELECT current_setting('fence.token', true), current_setting('fence.epoch', true), " +
		"current_setting('fence.step', true), current_setting('fence.job_key', true), current_setting('search_path')"
	if err := m.conn.QueryRow(ctx, q, pgx.QueryExecModeSimpleProtocol).Scan(dest...); err != nil {
		m.t.Fatalf("%s\nread settings: %v", m.where(), err)
	}
	for i, name := range watched {
		server := ""
		if vals[i] != nil {
			server = *vals[i]
		}
		got, ok := m.st.Get(name)
		if name == SearchPath {
			v := m.st.vars[SearchPath]
			if v == nil || !v.cur.known {
				continue // the tracker does not claim to know it
			}
			got, ok = v.cur.s, true
		}
		if !ok {
			got = ""
		}
		if got != server {
			m.t.Fatalf("%s\n%s: got %q, want %q (server)", m.where(), name, got, server)
		}
	}
}

// TestDifferential replays sequences of simple Queries against PostgreSQL
// and a State, and requires that after every step the tracked parameters
// and transaction state equal the server's. PostgreSQL is the oracle.
func TestDifferential(t *testing.T) {
	db := cluster.NewDatabase(t)
	tests := []struct {
		name    string
		options string
		steps   []string
	}{
		{"set", "", []string{"SET fence.token = 5", "SET fence.token = '6'", "SET Fence.Token = 7"}},
		{"set rolled back", "", []string{"BEGIN", "SET fence.token = 5", "ROLLBACK"}},
		{"set committed", "", []string{"BEGIN", "SET fence.token = 5", "COMMIT"}},
		{"end and abort", "", []string{"START TRANSACTION", "SET fence.token = 5", "END", "BEGIN", "SET fence.token = 6", "ABORT"}},
		{"local ends at commit", "", []string{"SET fence.token = 1", "BEGIN", "SET LOCAL fence.token = 2", "COMMIT"}},
		{"set then local", "", []string{"BEGIN", "SET fence.token = 3", "SET LOCAL fence.token = 4", "COMMIT"}},
		{"local then set", "", []string{"BEGIN", "SET LOCAL fence.token = 4", "SET fence.token = 3", "COMMIT"}},
		{"set local set", "", []string{"BEGIN", "SET fence.token = 3", "SET LOCAL fence.token = 4", "SET fence.token = 5", "COMMIT"}},
		{"local outside transaction", "", []string{"SET LOCAL fence.token = 9", "SET fence.token = 1", "SET LOCAL fence.token = 9"}},
		{"reset rolled back", "", []string{"SET fence.token = 1", "BEGIN", "RESET fence.token", "ROLLBACK"}},
		{"reset committed", "", []string{"SET fence.token = 1", "BEGIN", "RESET fence.token", "COMMIT"}},
		{"set to default", "", []string{"SET fence.token = 1", "SET fence.token TO DEFAULT", "SET fence.token = 2", "BEGIN", "SET LOCAL fence.token TO DEFAULT", "COMMIT"}},
		{"from current", "", []string{"BEGIN", "SET LOCAL fence.token = 5", "SET fence.token FROM CURRENT", "COMMIT"}},
		{"rollback to savepoint", "", []string{"BEGIN", "SET fence.token = 1", "SAVEPOINT a", "SET fence.token = 2", "ROLLBACK TO a", "COMMIT"}},
		{"release keeps set", "", []string{"BEGIN", "SAVEPOINT a", "SET fence.token = 2", "RELEASE a", "COMMIT"}},
		{"release keeps local until commit", "", []string{"BEGIN", "SAVEPOINT a", "SET LOCAL fence.token = 2", "RELEASE a", "COMMIT"}},
		{"repeated savepoint names", "", []string{"BEGIN", "SET fence.token = 1", "SAVEPOINT a", "SET fence.token = 2", "SAVEPOINT a", "SET fence.token = 3", "ROLLBACK TO a", "RELEASE a", "ROLLBACK TO a", "COMMIT"}},
		{"rollback to twice", "", []string{"BEGIN", "SAVEPOINT a", "SET fence.token = 1", "ROLLBACK TO a", "SET fence.token = 2", "ROLLBACK TO SAVEPOINT a", "SET fence.epoch = 3", "COMMIT"}},
		{"error rolls back", "", []string{"BEGIN", "SET fence.token = 1", "SELECT 1/0", "ROLLBACK"}},
		{"commit of failed transaction", "", []string{"SET fence.step = 'kept'", "BEGIN", "SET fence.token = 1", "SELECT 1/0", "COMMIT"}},
		{"error in savepoint", "", []string{"BEGIN", "SET fence.token = 1", "SAVEPOINT s", "SET fence.token = 2", "SELECT 1/0", "ROLLBACK TO s", "COMMIT"}},
		{"error in nested savepoint", "", []string{"BEGIN", "SAVEPOINT a", "SET fence.token = 1", "SAVEPOINT b", "SET fence.token = 2", "SELECT 1/0", "ROLLBACK TO a", "SET fence.epoch = 4", "COMMIT"}},
		{"error then rollback to inner", "", []string{"BEGIN", "SAVEPOINT a", "SET fence.token = 1", "SAVEPOINT b", "SET fence.token = 2", "SELECT 1/0", "ROLLBACK TO b", "RELEASE a", "COMMIT"}},
		{"release in failed transaction", "", []string{"BEGIN", "SAVEPOINT a", "SET fence.token = 1", "SELECT 1/0", "RELEASE a", "ROLLBACK TO a", "COMMIT"}},
		{"multi-statement", "", []string{"SET fence.token = 1; SET fence.epoch = 2"}},
		{"multi-statement error", "", []string{"SET fence.token = 1; SELECT 1/0"}},
		{"multi-statement local", "", []string{"SET LOCAL fence.token = 3; SELECT 1"}},
		{"implicit becomes explicit", "", []string{"SET fence.token = 1; BEGIN; SET fence.epoch = 2; ROLLBACK"}},
		{"commit in implicit block", "", []string{"SET fence.token = 1; COMMIT; SET fence.token = 2; SELECT 1/0"}},
		{"rollback in implicit block", "", []string{"SET fence.token = 1; ROLLBACK"}},
		{"explicit then implicit", "", []string{"BEGIN; SET fence.token = 1; COMMIT; SET fence.token = 2"}},
		{"error in multi-statement block", "", []string{"BEGIN; SET fence.token = 1", "SELECT 1/0; SELECT 2", "ROLLBACK"}},
		{"open block in one query", "", []string{"BEGIN; SET fence.token = 1", "SET LOCAL fence.epoch = 2; SAVEPOINT a; SET fence.token = 3", "ROLLBACK TO a; COMMIT"}},
		{"reset all", "", []string{"SET fence.token = 1", "SET fence.step = 'a'", "BEGIN", "RESET ALL", "ROLLBACK", "RESET ALL"}},
		{"discard all", "", []string{"SET fence.token = 1", "SET fence.job_key = 'k'", "DISCARD ALL"}},
		{"discard all in block fails", "", []string{"BEGIN", "SET fence.token = 1", "DISCARD ALL", "ROLLBACK"}},
		{"set_config", "", []string{"SELECT set_config('fence.token', '7', false)", "BEGIN", "SELECT set_config('fence.token', '8', true)", "COMMIT"}},
		{"set_config null resets", "", []string{"SET fence.token = 1", "SELECT set_config('fence.token', NULL, false)"}},
		{"set_config rolled back", "", []string{"BEGIN", "SELECT set_config('fence.epoch', '3', false), 1", "ROLLBACK"}},
		{"set_config in failing statement", "", []string{"SELECT set_config('fence.token', '4', false), 1/0"}},
		{"commit and chain", "", []string{"BEGIN", "SET LOCAL fence.token = 1", "SET fence.step = 'x'", "COMMIT AND CHAIN", "SET fence.token = 2", "ROLLBACK"}},
		{"rollback and chain", "", []string{"BEGIN", "SET fence.token = 1", "ROLLBACK AND CHAIN", "SET fence.token = 2", "COMMIT"}},
		{"begin twice", "", []string{"BEGIN", "BEGIN", "SET fence.token = 1", "COMMIT", "COMMIT"}},
		{"errors outside transactions", "", []string{"SELECT 1/0", "SAVEPOINT a", "ROLLBACK TO a", "RELEASE a", "COMMIT", "ROLLBACK"}},
		{"unknown savepoint", "", []string{"BEGIN", "SET fence.token = 1", "ROLLBACK TO nope", "ROLLBACK"}},
		{"reset rolled back to savepoint", "", []string{"SET fence.token = 1", "BEGIN", "SET fence.token = 2", "SAVEPOINT a", "RESET fence.token", "ROLLBACK TO a", "COMMIT"}},
		{"local then set in savepoint", "", []string{"BEGIN", "SET LOCAL fence.token = 1", "SAVEPOINT a", "SET fence.token = 2", "RELEASE a", "COMMIT"}},
		{"set then local in savepoint", "", []string{"BEGIN", "SET fence.token = 1", "SAVEPOINT a", "SET LOCAL fence.token = 2", "RELEASE a", "COMMIT"}},
		{"nested release merges", "", []string{"BEGIN", "SET fence.token = 1", "SAVEPOINT a", "SET LOCAL fence.token = 2", "SAVEPOINT b", "SET fence.token = 3", "RELEASE a", "COMMIT"}},
		{"nested local rollback", "", []string{"BEGIN", "SAVEPOINT a", "SET fence.token = 2", "SAVEPOINT b", "SET LOCAL fence.token = 3", "ROLLBACK TO b", "RELEASE a", "COMMIT"}},
		{"deep release", "", []string{"BEGIN", "SAVEPOINT a", "SET fence.token = 1", "SAVEPOINT b", "SET LOCAL fence.token = 2", "SAVEPOINT c", "SET fence.step = 's'", "RELEASE a", "SET LOCAL fence.epoch = 9", "COMMIT"}},
		{"commit with open savepoints", "", []string{"BEGIN", "SET fence.token = 1", "SAVEPOINT a", "SET LOCAL fence.token = 2", "SAVEPOINT b", "SET fence.epoch = 3", "SAVEPOINT c", "SET LOCAL fence.epoch = 4", "COMMIT"}},
		{"search_path", "", []string{"SET search_path = app, \"My Schema\", public", "BEGIN", "SET LOCAL search_path = 'x', 'Y'", "COMMIT", "SET search_path TO \"$user\", public"}},
		{"startup options", "-c fence.token=18 -c search_path=app,public --fence.job-key=nightly\\ report", []string{
			"RESET fence.token", "SET fence.token = 5", "RESET ALL", "BEGIN", "SET LOCAL fence.token = 4", "COMMIT",
			"SET fence.token = 6", "SET fence.token TO DEFAULT", "SET search_path = other", "RESET search_path", "DISCARD ALL"}},
		{"execute prepared set_config", "", []string{"PREPARE p AS SELECT set_config('fence.token', '9', false)", "EXECUTE p", "BEGIN", "SET fence.token = 1", "EXECUTE p", "ROLLBACK"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := newMirror(t, db, tt.options)
			for _, sql := range tt.steps {
				m.step(sql)
			}
		})
	}
}

// TestDifferentialRandom replays random sequences drawn from a pool of
// statements (seeded, so failures reproduce) against PostgreSQL and a State.
func TestDifferentialRandom(t *testing.T) {
	db := cluster.NewDatabase(t)
	seqs, length := *diffSeqs, 14
	if testing.Short() {
		seqs = 10
	}
	for i := 0; i < seqs; i++ {
		seed := int64(i + 1)
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			m := newMirror(t, db, "")
			for _, sql := range randomSteps(rand.New(rand.NewSource(seed)), length) {
				m.step(sql)
			}
		})
	}
}

// randomSteps draws statements, sometimes several in one simple Query.
func randomSteps(r *rand.Rand, n int) []string {
	names := []string{"fence.token", "fence.epoch"}
	sps := []string{"a", "b"}
	stmt := func() string {
		name := names[r.Intn(len(names))]
		sp := sps[r.Intn(len(sps))]
		switch r.Intn(20) {
		case 0, 1, 2:
			return fmt.Sprintf("SET %s = %d", name, 1+r.Intn(9))
		case 3, 4:
			return fmt.Sprintf("SET LOCAL %s = %d", name, 1+r.Intn(9))
		case 5:
			return "RESET " + name
		case 6:
			return "BEGIN"
		case 7:
			return "COMMIT"
		case 8:
			return "ROLLBACK"
		case 9, 10:
			return "SAVEPOINT " + sp
		case 11:
			return "ROLLBACK TO " + sp
		case 12:
			return "RELEASE " + sp
		case 13:
			return "SELECT 1/0"
		case 14:
			return fmt.Sprintf("SELECT set_config('%s', '%d', %v)", name, 1+r.Intn(9), r.Intn(2) == 0)
		case 15:
			return "RESET ALL"
		case 16:
			return fmt.Sprintf("SET LOCAL %s TO DEFAULT", name)
		case 17:
			return "COMMIT AND CHAIN"
		case 18:
			return "SELECT 1"
		default:
			return "BEGIN"
		}
	}
	steps := make([]string, n)
	for i := range steps {
		k := 1
		if r.Intn(4) == 0 {
			k = 2 + r.Intn(3)
		}
		parts := make([]string, k)
		for j := range parts {
			parts[j] = stmt()
		}
		steps[i] = strings.Join(parts, "; ")
	}
	return steps
}
