package session

import (
	"errors"
	"reflect"
	"testing"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
)

func TestValidate(t *testing.T) {
	tests := []struct {
		name, value string
		ok          bool
	}{
		{Token, "18", true}, {Token, " +18 ", true}, {Token, "9223372036854775807", true},
		{Token, "abc", false}, {Token, "-1", false}, {Token, "0", false}, {Token, "1.5", false},
		{Token, "9223372036854775808", false}, {Token, "0x10", false}, {Token, "", true},
		{Epoch, "3", true}, {Epoch, "-3", false},
		{Step, "", true}, {Step, string(make([]rune, 200)), true}, {Step, string(make([]byte, 201)), false},
		{JobKey, "nightly", true}, {JobKey, string(make([]byte, 201)), false},
		{PayloadDigest, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", true},
		{PayloadDigest, "E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855", true},
		{PayloadDigest, "e3b0c442", false}, {PayloadDigest, "g3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", false},
		{ReadPolicy, "primary", true}, {ReadPolicy, "wait", true}, {ReadPolicy, "PENDING", true}, {ReadPolicy, "replica", false},
		{ReadWait, "500ms", true}, {ReadWait, "2s", true}, {ReadWait, "1.5 min", true}, {ReadWait, "1m30s", true},
		{ReadWait, "250", true}, {ReadWait, "soon", false}, {ReadWait, "-1s", false},
		{MinLSN, "16/B374D848", true}, {MinLSN, "0/0", true}, {MinLSN, "16B374D848", false}, {MinLSN, "1/123456789", false},
		{"fence.other", "anything", true}, {SearchPath, "a, b", true},
	}
	for _, tt := range tests {
		t.Run(tt.name+"="+tt.value, func(t *testing.T) {
			err := Validate(tt.name, tt.value)
			if (err == nil) != tt.ok {
				t.Fatalf("Validate(%q, %q): got %v, want ok=%v", tt.name, tt.value, err, tt.ok)
			}
			var e *fence.Error
			if err != nil && (!errors.As(err, &e) || e.Code != CodeInvalidParameterValue || e.Hint == "") {
				t.Errorf("got error %#v, want *Error with SQLSTATE 22023 and a hint", err)
			}
		})
	}
}

func TestSetRejectsMalformedAndKeepsState(t *testing.T) {
	s := mustNew(t, nil)
	if err := s.Set(Token, "18", false); err != nil {
		t.Fatal(err)
	}
	if err := s.Set(Token, "abc", false); err == nil {
		t.Fatalf("Set(fence.token, abc): got nil error, want 22023")
	}
	if got, _ := s.Get(Token); got != "18" {
		t.Errorf("fence.token after refused SET: got %q, want 18", got)
	}
}

func mustNew(t *testing.T, params map[string]string) *State {
	t.Helper()
	s, err := New(params, NewStatements())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestParseOptions(t *testing.T) {
	tests := []struct {
		in   string
		want [][2]string
	}{
		{"-c fence.token=18", [][2]string{{"fence.token", "18"}}},
		{"-cfence.token=18 --fence.epoch=3", [][2]string{{"fence.token", "18"}, {"fence.epoch", "3"}}},
		{`-c fence.step=two\ words -c Search_Path=a,b`, [][2]string{{"fence.step", "two words"}, {"search_path", "a,b"}}},
		{"--fence.job-key=k -B 100", [][2]string{{"fence.job_key", "k"}}},
		{`  -c   fence.step=a\\b  `, [][2]string{{"fence.step", `a\b`}}},
		{"", nil},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParseOptions(tt.in)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("ParseOptions(%q): got %q, want %q", tt.in, got, tt.want)
			}
		})
	}
	for _, bad := range []string{"-c", "-c fence.token", "--fence.token"} {
		if _, err := ParseOptions(bad); err == nil {
			t.Errorf("ParseOptions(%q): got nil error, want one", bad)
		}
	}
}

func TestNewFromStartup(t *testing.T) {
	s := mustNew(t, map[string]string{
		"user": "alice", "database": "app",
		"options":     `-c fence.job_key=nightly\ report -c fence.epoch=2 --fence.token=18`,
		"search_path": `"$user", public`,
	})
	g, ok := s.Generation()
	if want := (fence.Generation{JobKey: "nightly report", Epoch: 2, Token: 18}); !ok || g != want {
		t.Errorf("Generation: got (%+v, %v), want (%+v, true)", g, ok, want)
	}
	if got, want := s.SearchPath(), []string{"alice", "public"}; !reflect.DeepEqual(got, want) {
		t.Errorf("SearchPath: got %q, want %q", got, want)
	}
	// RESET returns to the startup value.
	apply(t, s, "SET fence.token = 20", "RESET fence.token")
	if got, _ := s.Get(Token); got != "18" {
		t.Errorf("fence.token after RESET: got %q, want 18", got)
	}
	if _, err := New(map[string]string{"options": "-c fence.token=abc"}, NewStatements()); err == nil {
		t.Errorf("New with fence.token=abc: got nil error, want 22023")
	}
	if got := mustNew(t, nil).SearchPath(); got != nil {
		t.Errorf("SearchPath without one set: got %q, want nil (unknown)", got)
	}
}

// apply runs simple-protocol statements as if each succeeded, ending the
// query with ReadyForQuery status derived from the state.
func apply(t *testing.T, s *State, sqls ...string) {
	t.Helper()
	for _, sql := range sqls {
		res, err := rewrite.Classify(sql)
		if err != nil {
			t.Fatal(err)
		}
		for _, st := range res.Stmts {
			if err := s.Check(st, nil); err != nil {
				t.Fatalf("Check(%q): %v", st.SQL, err)
			}
			tag := ""
			if st.Kind == rewrite.Commit && s.Tx() == Failed {
				tag = "ROLLBACK"
			}
			if err := s.Apply(st, tag, nil); err != nil {
				t.Fatalf("Apply(%q): %v", st.SQL, err)
			}
		}
		if err := s.TxStatus(status(s)); err != nil {
			t.Fatal(err)
		}
	}
}

func status(s *State) byte {
	switch {
	case s.Tx() == Failed:
		return 'E'
	case s.Explicit():
		return 'T'
	}
	return 'I'
}

// Check refuses a malformed fence value it can see; an effect it cannot
// see is not refused but reported by Uncertain, and the proxy reads the
// settings back (issue 19: pg_dump's set_config(name, ...) FROM pg_settings).
func TestCheckRefusesMalformedAndUntrackable(t *testing.T) {
	s := mustNew(t, nil)
	str := func(v string) *string { return &v }
	params := func(vals ...*string) ParamFunc {
		return func(n int) (*string, bool) {
			if n < 1 || n > len(vals) {
				return nil, false
			}
			return vals[n-1], true
		}
	}
	const uncertain = "uncertain" // accepted by Check, reported by Uncertain
	tests := []struct {
		sql    string
		params ParamFunc
		code   string // "" for accepted
	}{
		{"SET fence.token = 18", nil, ""},
		{"SET fence.token = 'abc'", nil, CodeInvalidParameterValue},
		{"SET fence.token = -1", nil, CodeInvalidParameterValue},
		{"SET fence.token = 1, 2", nil, CodeInvalidParameterValue},
		{"SET statement_timeout = 'whatever'", nil, ""},
		{"SELECT set_config('fence.token', 'x', false)", nil, CodeInvalidParameterValue},
		{"SELECT set_config('fence.token', $1, false)", params(str("19")), ""},
		{"SELECT set_config('fence.token', $1, false)", params(str("nope")), CodeInvalidParameterValue},
		{"SELECT set_config('fence.token', $1, false)", params(), uncertain},
		{"SELECT set_config($1, $2, false)", params(str("fence.epoch"), str("0")), CodeInvalidParameterValue},
		{"SELECT set_config($1, $2, false)", params(str("work_mem"), str("0")), ""},
		{"SELECT set_config(name, '1', false) FROM t", nil, uncertain},
		{"SELECT set_config('fence.token', '5', false) FROM t", nil, uncertain},
		{"SELECT set_config(name, '1', false) FROM pg_settings WHERE name IN ('statement_timeout')", nil, uncertain},
		{"SELECT set_config('work_mem', v, false) FROM t", nil, ""},
	}
	for _, tt := range tests {
		t.Run(tt.sql, func(t *testing.T) {
			res, err := rewrite.Classify(tt.sql)
			if err != nil {
				t.Fatal(err)
			}
			err = s.Check(res.Stmts[0], tt.params)
			var e *fence.Error
			if unc := s.Uncertain(res.Stmts[0], tt.params); unc != (tt.code == uncertain) {
				t.Errorf("Uncertain: got %v, want %v", unc, tt.code == uncertain)
			}
			switch {
			case tt.code == uncertain && err != nil:
				t.Errorf("got %v, want accepted (and reported uncertain)", err)
			case tt.code == uncertain:
			case tt.code == "" && err != nil:
				t.Errorf("got %v, want accepted", err)
			case tt.code != "" && (!errors.As(err, &e) || e.Code != tt.code):
				t.Errorf("got %v, want SQLSTATE %s", err, tt.code)
			}
		})
	}
}

func TestApplyBoundSetConfig(t *testing.T) {
	s := mustNew(t, nil)
	res, _ := rewrite.Classify("SELECT set_config($1, $2, $3)")
	vals := []string{"fence.token", "42", "false"}
	p := func(n int) (*string, bool) { return &vals[n-1], true }
	if err := s.Apply(res.Stmts[0], "SELECT 1", p); err != nil {
		t.Fatal(err)
	}
	s.TxStatus('I')
	if got, _ := s.Get(Token); got != "42" {
		t.Errorf("fence.token: got %q, want 42", got)
	}
}

type fakeDigest struct{ n int }

func (d *fakeDigest) Mark() int         { return d.n }
func (d *fakeDigest) Rollback(mark int) { d.n = mark }

func TestGateRestoredByRollbackTo(t *testing.T) {
	s := mustNew(t, nil)
	apply(t, s, "BEGIN", "SAVEPOINT before_gate")
	g := s.Gate()
	d := &fakeDigest{}
	g.Gated, g.Gen, g.Digest = true, fence.Generation{JobKey: "k", Epoch: 1, Token: 18}, d
	d.n = 2 // two write statements digested
	apply(t, s, "SAVEPOINT after_two")
	d.n = 5
	apply(t, s, "ROLLBACK TO after_two")
	if d.n != 2 || !s.Gate().Gated {
		t.Errorf("after ROLLBACK TO after_two: got digest %d gated %v, want 2 true", d.n, s.Gate().Gated)
	}
	apply(t, s, "ROLLBACK TO before_gate")
	if d.n != 0 || s.Gate().Gated || s.Gate().Gen != (fence.Generation{}) {
		t.Errorf("after ROLLBACK TO before_gate: got digest %d gate %+v, want 0 and ungated", d.n, *s.Gate())
	}
	if s.Gate().Digest != d {
		t.Errorf("digest: got %v, want kept for reuse", s.Gate().Digest)
	}
	s.Gate().Gated = true
	apply(t, s, "COMMIT")
	if *s.Gate() != (Gate{}) {
		t.Errorf("gate after COMMIT: got %+v, want zero", *s.Gate())
	}
}

func TestPreparedAndPortals(t *testing.T) {
	s := mustNew(t, nil)
	ss := s.Statements()
	ins, _ := rewrite.Classify("INSERT INTO results VALUES ($1)")
	sel, _ := rewrite.Classify("SELECT 1")
	ss.Parse("", ins, []uint32{23})
	ss.Parse("", sel, nil)
	if p, _ := ss.Statement(""); p.Stmt.Kind != rewrite.Read {
		t.Errorf("unnamed statement after second Parse: got %v, want Read", p.Stmt.Kind)
	}
	ss.Parse("ins", ins, []uint32{23})
	if err := s.Bind("p1", "ins"); err != nil {
		t.Fatal(err)
	}
	if p, ok := ss.Portal("p1"); !ok || !p.Statement.Stmt.Writes() || p.Statement.ParamOIDs[0] != 23 {
		t.Errorf("portal p1: got %+v, want the INSERT", p)
	}
	if err := s.Bind("p2", "missing"); err == nil {
		t.Errorf("Bind of missing statement: got nil error")
	}
	s.TxStatus('I') // Sync: the implicit transaction ends, portals go
	if _, ok := ss.Portal("p1"); ok {
		t.Errorf("portal p1 after the transaction ended: still there")
	}
	apply(t, s, "PREPARE q AS UPDATE results SET v = $1")
	p, ok := ss.Statement("q")
	if !ok || !p.SQL || !p.Stmt.Writes() {
		t.Errorf("SQL PREPARE q: got %+v, want a writing SQL-level statement", p)
	}
	apply(t, s, "DEALLOCATE ins")
	if _, ok := ss.Statement("ins"); ok {
		t.Errorf("ins after DEALLOCATE: still there")
	}
	apply(t, s, "SET fence.token = 3", "DISCARD ALL")
	if _, ok := ss.Statement("q"); ok {
		t.Errorf("q after DISCARD ALL: still there")
	}
	if _, ok := s.Get(Token); ok {
		t.Errorf("fence.token after DISCARD ALL: still set")
	}
	ss.Parse("x", sel, nil)
	ss.CloseStatement("x")
	if _, ok := ss.Statement("x"); ok {
		t.Errorf("x after Close: still there")
	}
}

// TestAttach hands one connection's statements from one client's State to
// another's: what an EXECUTE changes is read from the statements of the
// connection it runs on, and a client keeps its own settings.
func TestAttach(t *testing.T) {
	conn := NewStatements()
	a := mustNew(t, map[string]string{"options": "-c fence.token=5"})
	a.Attach(conn)
	apply(t, a, "PREPARE p AS SELECT set_config('fence.token', '9', false)")
	if _, ok := conn.Statement("p"); !ok {
		t.Fatalf("PREPARE p through the attached State: not on the connection's statements")
	}
	b := mustNew(t, map[string]string{"options": "-c fence.token=7"})
	apply(t, b, "EXECUTE p") // b's own statements: p does not exist there
	if got, _ := b.Get(Token); got != "7" {
		t.Errorf("fence.token after EXECUTE p before the hand-off: got %q, want 7", got)
	}
	b.Attach(conn)
	apply(t, b, "EXECUTE p")
	if got, _ := b.Get(Token); got != "9" {
		t.Errorf("fence.token after EXECUTE p on the handed connection: got %q, want 9", got)
	}
	if got, _ := a.Get(Token); got != "5" {
		t.Errorf("fence.token of the first client: got %q, want 5 (its own)", got)
	}
	sel, _ := rewrite.Classify("SELECT 1")
	conn.Parse("s", sel, nil)
	if err := b.Bind("portal", "s"); err != nil {
		t.Fatal(err)
	}
	b.TxStatus('I')
	if _, ok := conn.Portal("portal"); ok {
		t.Errorf("portal after the transaction of the State attached: still on the connection")
	}
}

func TestTxStatusResync(t *testing.T) {
	tests := []struct {
		name    string
		setup   []string
		status  byte
		wantErr bool
		want    TxState
	}{
		{"implicit ends", []string{}, 'I', false, Idle},
		{"explicit vanished", []string{"BEGIN"}, 'I', true, Idle},
		{"missed begin", []string{}, 'T', true, InTx},
		{"error reported by status", []string{"BEGIN"}, 'E', false, Failed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := mustNew(t, nil)
			apply(t, s, tt.setup...)
			err := s.TxStatus(tt.status)
			if (err != nil) != tt.wantErr {
				t.Errorf("TxStatus(%q): got %v, want error=%v", tt.status, err, tt.wantErr)
			}
			if err != nil && !errors.Is(err, ErrOutOfSync) {
				t.Errorf("got %v, want ErrOutOfSync", err)
			}
			if s.Tx() != tt.want {
				t.Errorf("state: got %v, want %v", s.Tx(), tt.want)
			}
		})
	}
}

func TestCommitTagRollback(t *testing.T) {
	s := mustNew(t, nil)
	apply(t, s, "BEGIN", "SET fence.token = 1")
	res, _ := rewrite.Classify("COMMIT")
	// The server answers ROLLBACK when the transaction had failed
	// without the proxy noticing; the tag decides.
	if err := s.Apply(res.Stmts[0], "ROLLBACK", nil); err != nil {
		t.Fatal(err)
	}
	if _, ok := s.Get(Token); ok || s.Tx() != Idle {
		t.Errorf("after COMMIT answered ROLLBACK: got token set=%v state %v, want unset idle", ok, s.Tx())
	}
}

// TestCommitDiff: what a commit of the open transaction would leave that
// a rollback would not.
func TestCommitDiff(t *testing.T) {
	s, err := New(map[string]string{"user": "u", "options": "-c fence.step=a"}, NewStatements())
	if err != nil {
		t.Fatal(err)
	}
	if d, unknown := s.CommitDiff(); d != nil || unknown {
		t.Fatalf("outside a transaction: %v, %v", d, unknown)
	}
	if err := s.Begin(); err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(s.Set("fence.step", "s1", false))
	must(s.Set("fence.read_policy", "wait", true)) // LOCAL: gone either way
	must(s.Savepoint("x"))
	must(s.Set("fence.step", "s2", false))
	must(s.Set("fence.min_lsn", "0/1", false))
	must(s.Reset("fence.min_lsn", false))
	got, unknown := s.CommitDiff()
	want := []Setting{{Name: "fence.step", Value: "s2"}}
	if len(got) != len(want) || got[0] != want[0] || unknown {
		t.Fatalf("CommitDiff = %+v, want %+v", got, want)
	}
	if v, _ := s.Get("fence.step"); v != "s2" {
		t.Fatalf("CommitDiff changed the state: fence.step %q", v)
	}
	s2, _ := New(map[string]string{"user": "u", "options": "-c fence.step=a"}, NewStatements())
	must(s2.Set("fence.step", "b", false))
	s2.Commit(false) // its implicit transaction
	must(s2.Begin())
	must(s2.Reset("fence.step", false))
	if got, unknown := s2.CommitDiff(); len(got) != 1 || !got[0].Default || got[0].Name != "fence.step" || unknown {
		t.Fatalf("RESET in the transaction: CommitDiff = %+v (unknown %v), want fence.step to its default", got, unknown)
	}
	// A setting whose value at commit the proxy does not know (RESET to a
	// default it never saw): the diff cannot be restored (round 5, J-M1).
	s3, _ := New(map[string]string{"user": "u"}, NewStatements())
	must(s3.Set("search_path", "public, pg_temp", false))
	s3.Commit(false)
	must(s3.Begin())
	must(s3.Reset("search_path", false))
	if got, unknown := s3.CommitDiff(); !unknown {
		t.Fatalf("RESET search_path to an unknown default: CommitDiff = %+v, unknown false", got)
	}
}
