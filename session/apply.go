package session

import (
	"errors"
	"fmt"
	"strings"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
)

// ParamFunc returns the text value of parameter $n of the statement being
// executed (from Bind). value nil means SQL NULL; ok false means the value
// is not available as text (binary format, or no such parameter). A nil
// ParamFunc has no parameters (simple protocol).
type ParamFunc func(n int) (value *string, ok bool)

// effect is a GUC effect with its parameters resolved.
type effect struct {
	op    rewrite.GUCOp
	name  string
	value string
	local bool
}

// resolve turns a classified GUC effect into a concrete one. tracked is
// false when the effect is certainly on a parameter the session does not
// track. An effect on a tracked (or possibly tracked) parameter that cannot
// be known is an error with SQLSTATE 0A000 marked uncertain: the proxy lets
// the statement run and reads the settings back from the server before it
// next depends on them (see State.Uncertain).
func resolve(g rewrite.GUC, params ParamFunc) (e effect, tracked bool, err error) {
	e = effect{op: g.Op, name: g.Name, value: g.Value, local: g.Local}
	if g.Op == rewrite.GUCResetAll {
		return e, true, nil
	}
	if g.NameParam > 0 {
		v, ok := param(params, g.NameParam)
		if !ok || v == nil {
			return e, true, untrackable(g, "its parameter name is not a known text value")
		}
		e.name = rewrite.LowerASCII(*v)
	} else if g.Unknown && g.Name == "" {
		return e, true, untrackable(g, "its parameter name is not a literal")
	}
	if !Tracked(e.name) {
		return e, false, nil
	}
	if g.Unknown {
		return e, true, untrackable(g, "an argument is neither a literal nor a parameter")
	}
	if g.Conditional {
		return e, true, untrackable(g, "it is not certain to run exactly once")
	}
	if g.Op == rewrite.GUCSet && g.NArgs > 1 && e.name != SearchPath {
		return e, true, invalid("SET %s takes only one argument", e.name)
	}
	if g.ValueParam > 0 {
		v, ok := param(params, g.ValueParam)
		if !ok {
			return e, true, untrackable(g, "its value is not available as text")
		}
		if v == nil {
			e.op = rewrite.GUCReset // set_config(name, NULL, ...) resets
		} else {
			e.value = *v
		}
	}
	if g.LocalParam > 0 {
		v, ok := param(params, g.LocalParam)
		if !ok {
			return e, true, untrackable(g, "its is_local argument is not available as text")
		}
		if v != nil {
			b, ok := parseBool(*v)
			if !ok {
				return e, true, untrackable(g, "its is_local argument is not a boolean")
			}
			e.local = b
		}
	}
	return e, true, nil
}

func param(params ParamFunc, n int) (*string, bool) {
	if params == nil {
		return nil, false
	}
	return params(n)
}

func untrackable(g rewrite.GUC, why string) *fence.Error {
	what := "set_config"
	if !g.Func {
		what = "SET"
	}
	name := g.Name
	if name == "" {
		name = "a parameter"
	}
	return &fence.Error{Code: CodeFeatureNotSupported,
		Message: fmt.Sprintf("pgfence cannot track this %s of %s: %s", what, name, why),
		Hint:    "set fence parameters with SET, SET LOCAL, or SELECT set_config('fence.token', '18', false) with literal or bound arguments",
		Err:     errUncertain}
}

// isUncertain reports whether err is resolve's "cannot be known".
func isUncertain(err error) bool { return errors.Is(err, errUncertain) }

// Check validates a statement before the proxy forwards it: every fence
// parameter it sets to a value known from its text or parameters must be
// well-formed (22023 otherwise). A statement failing Check must not be
// forwarded. Effects that cannot be known are not Check's business (see
// Uncertain).
func (s *State) Check(st *rewrite.Stmt, params ParamFunc) error {
	for _, g := range s.effects(st) {
		e, tracked, err := resolve(g, params)
		if isUncertain(err) {
			continue
		}
		if err != nil {
			return err
		}
		if !tracked || e.op != rewrite.GUCSet {
			continue
		}
		if err := Validate(e.name, e.value); err != nil {
			return err
		}
	}
	return nil
}

// Uncertain reports whether the statement may change a tracked parameter
// in a way its text and parameters do not tell (set_config with a name or
// value that is neither a literal nor a bound text parameter, or that may
// run any number of times). Apply leaves such effects out; the proxy reads
// the settings back from the server (Resync) before it next depends on
// them.
func (s *State) Uncertain(st *rewrite.Stmt, params ParamFunc) bool {
	if st.UnknownGUCWrite {
		return true
	}
	for _, g := range s.effects(st) {
		if _, _, err := resolve(g, params); isUncertain(err) {
			return true
		}
	}
	return false
}

// UncertainGeneration reports whether st may set fence.job_key,
// fence.epoch or fence.token to a value the proxy cannot know: a write of
// a setting it cannot name, or an uncertain effect on one of those three
// (or on a setting whose name is not known). A computed fence.step alone
// does not count.
func (s *State) UncertainGeneration(st *rewrite.Stmt, params ParamFunc) bool {
	if st.UnknownGUCWrite {
		return true
	}
	for _, g := range s.effects(st) {
		e, _, err := resolve(g, params)
		if !isUncertain(err) {
			continue
		}
		switch e.name {
		case Step, SearchPath:
		default:
			return true
		}
	}
	return false
}

// Resync sets a tracked parameter to the value the server reports for it
// now (set false: the server has no such setting, which for fence.* means
// unset), as a SET at the current nest level would, so that a rollback
// returns to the value before. Untracked names are ignored. After a Resync
// inside a transaction the tracked values at its end are not known (a SET
// LOCAL the proxy could not see would revert, a SET would not): the proxy
// reads them again after the transaction.
func (s *State) Resync(name, val string, set bool) {
	name = strings.ToLower(name)
	if !Tracked(name) {
		return
	}
	nv := value{s: val, known: true, set: true}
	if !set {
		nv = value{known: true}
	}
	cur := s.variable(name).cur
	if cur.known && cur.s == nv.s {
		return
	}
	if name == SearchPath && (cur.known || cur.set) {
		s.pathEpoch++
	}
	s.assign(name, nv, false)
}

// Apply records the effect of a statement the server completed successfully
// (CommandComplete, EmptyQueryResponse, or the end of COPY). tag is the
// CommandComplete tag ("COMMIT" or "ROLLBACK" for COMMIT, which the server
// turns into a rollback in a failed transaction; "PREPARE TRANSACTION" or
// "ROLLBACK" for PREPARE TRANSACTION). params resolves $n parameters of
// set_config calls (nil for the simple protocol).
//
// An error means the state could not follow the statement (it had not
// passed Check); the proxy should treat the session as unreliable.
func (s *State) Apply(st *rewrite.Stmt, tag string, params ParamFunc) error {
	switch st.Kind {
	case rewrite.Begin:
		return s.Begin()
	case rewrite.Commit:
		if tag == "ROLLBACK" {
			s.Rollback(st.Chain)
		} else {
			s.Commit(st.Chain)
		}
		return nil
	case rewrite.Rollback:
		s.Rollback(st.Chain)
		return nil
	case rewrite.PrepareTransaction:
		// The session leaves the transaction; its SETs persist as at
		// commit (PrepareTransaction runs AtEOXact_GUC(true)).
		if tag == "ROLLBACK" {
			s.Rollback(false)
		} else {
			s.Commit(false)
		}
		return nil
	case rewrite.Savepoint:
		return s.Savepoint(st.Name)
	case rewrite.RollbackTo:
		return s.RollbackTo(st.Name)
	case rewrite.Release:
		return s.Release(st.Name)
	case rewrite.Discard:
		if st.Name == "ALL" {
			return s.Discard()
		}
		s.ensureTx()
		return nil
	case rewrite.Prepare:
		s.ensureTx()
		s.stmts.prepare(st.Name, st.Inner, st.SQL, s.pathEpoch)
		return nil
	case rewrite.Deallocate:
		s.ensureTx()
		if st.All {
			s.stmts.deallocateAll()
		} else {
			s.stmts.CloseStatement(st.Name)
		}
		return nil
	}
	if s.tx == Failed {
		return errInFailed()
	}
	s.ensureTx()
	var uncertain error
	for _, g := range s.effects(st) {
		e, tracked, err := resolve(g, params)
		if isUncertain(err) {
			uncertain = err // left out: the proxy reads the settings back
			continue
		}
		if err != nil {
			return err
		}
		if !tracked {
			continue
		}
		switch e.op {
		case rewrite.GUCSet:
			err = s.Set(e.name, e.value, e.local)
		case rewrite.GUCReset:
			err = s.Reset(e.name, e.local)
		case rewrite.GUCResetAll:
			err = s.ResetAll()
		case rewrite.GUCCurrent:
			err = s.FromCurrent(e.name, e.local)
		}
		if err != nil {
			return err
		}
	}
	return uncertain
}

// effects returns the GUC effects of a statement, including those of the
// SQL-level prepared statement it executes. The latter's $n parameters are
// EXECUTE's argument expressions, which are not resolved: such effects on
// tracked parameters are untrackable.
func (s *State) effects(st *rewrite.Stmt) []rewrite.GUC {
	if st.Executes == "" {
		return st.GUCs
	}
	p, ok := s.stmts.Statement(st.Executes)
	if !ok || p.Stmt == nil || len(p.Stmt.GUCs) == 0 {
		return st.GUCs
	}
	out := append([]rewrite.GUC(nil), st.GUCs...)
	for _, g := range p.Stmt.GUCs {
		if g.NameParam > 0 || g.ValueParam > 0 || g.LocalParam > 0 {
			g.Unknown = true
			if g.NameParam > 0 {
				g.NameParam, g.Name = 0, ""
			}
			g.ValueParam, g.LocalParam = 0, 0
		}
		out = append(out, g)
	}
	return out
}

// parseBool accepts PostgreSQL's boolean input forms.
func parseBool(s string) (bool, bool) {
	switch rewrite.LowerASCII(trimSpace(s)) {
	case "t", "tr", "tru", "true", "y", "ye", "yes", "on", "1":
		return true, true
	case "f", "fa", "fal", "fals", "false", "n", "no", "of", "off", "0":
		return false, true
	}
	return false, false
}

func trimSpace(s string) string {
	for len(s) > 0 && isSpace(s[0]) {
		s = s[1:]
	}
	for len(s) > 0 && isSpace(s[len(s)-1]) {
		s = s[:len(s)-1]
	}
	return s
}
