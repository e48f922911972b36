package session

import (
	"fmt"
	"sort"
	"strings"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
)

// TxState is the transaction state, as ReadyForQuery reports it.
type TxState uint8

// Transaction states.
const (
	Idle   TxState = iota // 'I': no transaction
	InTx                  // 'T' when explicit; an implicit transaction reports 'I' at its end
	Failed                // 'E': an explicit transaction block that failed, waiting for ROLLBACK
)

func (t TxState) String() string {
	switch t {
	case Idle:
		return "idle"
	case InTx:
		return "in transaction"
	case Failed:
		return "failed"
	}
	return fmt.Sprintf("TxState(%d)", uint8(t))
}

// value is a parameter value. known is false for a value the proxy cannot
// know (search_path's server default). set records that the value came from
// SET or set_config in this session (PostgreSQL's PGC_S_SESSION source): RESET
// ALL skips parameters whose value did not, and a RESET or SET TO DEFAULT
// clears it.
type value struct {
	s     string
	known bool
	set   bool
}

// gucState mirrors GucStackState in PostgreSQL's guc.c.
type gucState uint8

const (
	gucSet      gucState = iota // a SET at this nest level
	gucLocal                    // a SET LOCAL at this nest level
	gucSetLocal                 // a SET then a SET LOCAL at this nest level
)

type stackEntry struct {
	level  int
	state  gucState
	prior  value // value before this nest level changed it
	masked value // SET value hidden by a later SET LOCAL (gucSetLocal)
}

type variable struct {
	cur   value
	reset value // session default: the startup value, else unknown/empty
	stack []stackEntry
}

type savepoint struct {
	name       string
	level      int
	gate       Gate
	digestMark int
}

// State is one client connection's session state. Create it with New.
type State struct {
	user string
	vars map[string]*variable
	// pathEpoch: PathEpoch.
	pathEpoch uint64
	tx        TxState
	explicit  bool
	level     int // GUC nest level: 0 outside a transaction, 1 in it, +1 per savepoint
	sps       []savepoint
	stmts     *Statements // the connection's, which the State refers to (statements.go)
	gate      Gate
}

// New returns the state of a new connection from its startup parameters:
// "user", "options" (the server's switches, of which -c name=value and
// --name=value set settings, with backslash escaping, as PGOPTIONS
// carries them) and any other parameter, which the server treats as a
// setting (search_path=...). They are read exactly as the server reads
// them (startup.go): options first, then the other parameters, which
// override them; what the server would refuse, or what the proxy could
// read differently, is refused with an *Error. The values become the
// session defaults that RESET returns to. Malformed fence values are
// refused with an *Error. The State refers to stmts, the statements of
// the connection it runs on (NewStatements for a new one), until Attach
// points it at another's.
func New(params map[string]string, stmts *Statements) (*State, error) {
	s := &State{
		user:  params["user"],
		vars:  make(map[string]*variable),
		stmts: stmts,
	}
	opts, err := ParseOptions(params["options"])
	if err != nil {
		return nil, err
	}
	for _, o := range opts {
		if err := s.setStartup(o[0], o[1]); err != nil {
			return nil, err
		}
	}
	// Then the packet's other parameters. Their order does not matter
	// unless two name the same setting, which only a difference in case
	// allows (the packet's names are a map's keys): refused.
	seen := make(map[string]string, len(params))
	for k := range params {
		switch k {
		case "user", "database", "options", "replication":
			continue
		}
		name := strings.ToLower(k)
		if other, dup := seen[name]; dup && Tracked(name) {
			e := invalid("pgfence: startup parameters %q and %q name the same setting; PostgreSQL applies them in packet order, which the proxy does not keep", other, k)
			e.Code = CodeProtocolViolation
			e.Hint = "Send each setting once."
			return nil, e
		}
		seen[name] = k
	}
	for name, k := range seen {
		if err := s.setStartup(name, params[k]); err != nil {
			return nil, err
		}
	}
	return s, nil
}

func (s *State) setStartup(name, val string) error {
	if !Tracked(name) {
		return nil
	}
	if err := Validate(name, val); err != nil {
		return err
	}
	v := value{s: val, known: true}
	s.vars[name] = &variable{cur: v, reset: v}
	return nil
}

// User returns the session user from the startup packet.
func (s *State) User() string { return s.user }

// Tx returns the transaction state.
func (s *State) Tx() TxState { return s.tx }

// Explicit reports whether the current transaction is an explicit block
// (BEGIN) rather than an implicit one (a lone statement, a multi-statement
// simple query, an extended-protocol pipeline up to Sync).
func (s *State) Explicit() bool { return s.tx != Idle && s.explicit }

// Depth returns the number of open savepoints.
func (s *State) Depth() int { return len(s.sps) }

// Get returns the tracked parameter's current value; ok is false when it is
// unset (or empty) or unknown.
func (s *State) Get(name string) (string, bool) {
	v, ok := s.vars[strings.ToLower(name)]
	if !ok || !v.cur.known || v.cur.s == "" {
		return "", false
	}
	return v.cur.s, true
}

// PathEpoch counts the changes of search_path the session has made or
// the proxy has observed (SET, RESET, set_config, a value read back that
// differs from a known one). Learning the value of a default the proxy
// did not know is not a change.
func (s *State) PathEpoch() uint64 { return s.pathEpoch }

// SearchPath returns the session's search_path as schema names, with
// "$user" replaced by the session user, or nil when the proxy does not know
// it (never set at startup or by SET: the server default, possibly changed
// by ALTER ROLE/DATABASE, applies).
func (s *State) SearchPath() []string {
	v, ok := s.vars[SearchPath]
	if !ok || !v.cur.known {
		return nil
	}
	path := rewrite.ParseSearchPath(v.cur.s)
	for i, p := range path {
		if p == "$user" && s.user != "" {
			path[i] = s.user
		}
	}
	return path
}

// Generation returns the fence generation the session presents:
// fence.job_key, fence.epoch, fence.token and fence.step. ok is false
// unless job_key, epoch and token are all set (they were validated when
// set).
func (s *State) Generation() (g fence.Generation, ok bool) {
	jobKey, ok1 := s.Get(JobKey)
	es, ok2 := s.Get(Epoch)
	ts, ok3 := s.Get(Token)
	step, _ := s.Get(Step)
	if !ok1 || !ok2 || !ok3 {
		return fence.Generation{}, false
	}
	e, err1 := parsePositive(es)
	t, err2 := parsePositive(ts)
	if err1 != nil || err2 != nil {
		return fence.Generation{}, false
	}
	return fence.Generation{JobKey: jobKey, Epoch: e, Token: t, Step: step}, true
}

// variable returns the tracked variable, creating it with an empty (for
// fence.*) or unknown (search_path) session default.
func (s *State) variable(name string) *variable {
	v, ok := s.vars[name]
	if !ok {
		d := value{known: name != SearchPath}
		v = &variable{cur: d, reset: d}
		s.vars[name] = v
	}
	return v
}

// ensureTx starts an implicit transaction if none is open: every statement
// runs in a transaction.
func (s *State) ensureTx() {
	if s.tx == Idle {
		s.tx = InTx
		s.explicit = false
		s.level = 1
	}
}

// Set changes a tracked parameter as SET (local false) or SET LOCAL (local
// true) does, after validating the value; untracked names are ignored. An
// empty value clears a fence parameter. Outside a transaction it starts an
// implicit one: a SET LOCAL made there ends with it.
func (s *State) Set(name, val string, local bool) error {
	if err := Validate(strings.ToLower(name), val); err != nil { // nil for untracked names
		return err
	}
	return s.change(name, local, func(*variable) value { return value{s: val, known: true, set: true} })
}

// Reset sets a tracked parameter back to its session default (RESET name,
// SET name TO DEFAULT; local for SET LOCAL name TO DEFAULT).
func (s *State) Reset(name string, local bool) error {
	return s.change(name, local, func(v *variable) value { return v.reset })
}

// ResetAll resets every tracked parameter to its session default, as RESET
// ALL does (transactionally, like a SET of each). Like PostgreSQL it skips
// parameters whose current value was not set in the session (for example
// after SET LOCAL ... TO DEFAULT, whose masked SET value then returns at
// commit).
func (s *State) ResetAll() error {
	if s.tx == Failed {
		return errInFailed()
	}
	s.ensureTx()
	for _, name := range s.names() {
		if v := s.vars[name]; v.cur.set {
			s.assign(name, v.reset, false)
		}
	}
	return nil
}

// FromCurrent applies SET name FROM CURRENT: the current value becomes the
// session (or, with local, transaction) value.
func (s *State) FromCurrent(name string, local bool) error {
	return s.change(name, local, func(v *variable) value {
		cur := v.cur
		cur.set = true
		return cur
	})
}

// change assigns a tracked parameter the value to gives from its variable,
// as a SET (local false) or SET LOCAL does, starting an implicit
// transaction if none is open; untracked names are ignored.
func (s *State) change(name string, local bool, to func(*variable) value) error {
	name = strings.ToLower(name)
	if !Tracked(name) {
		return nil
	}
	if s.tx == Failed {
		return errInFailed()
	}
	s.ensureTx()
	if name == SearchPath {
		s.pathEpoch++
	}
	s.assign(name, to(s.variable(name)), local)
	return nil
}

// Discard applies DISCARD ALL: RESET ALL, DEALLOCATE ALL, CLOSE ALL.
func (s *State) Discard() error {
	if err := s.ResetAll(); err != nil {
		return err
	}
	s.stmts.discard()
	return nil
}

func (s *State) names() []string {
	names := make([]string, 0, len(s.vars))
	for n := range s.vars {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// assign is set_config_option's value change at the current nest level,
// with push_old_value's bookkeeping.
func (s *State) assign(name string, nv value, local bool) {
	v := s.variable(name)
	if s.level > 0 {
		n := len(v.stack)
		if n > 0 && v.stack[n-1].level >= s.level {
			e := &v.stack[n-1]
			if !local {
				e.state = gucSet // SET overrides any prior action at this level
				e.masked = value{}
			} else if e.state == gucSet {
				e.masked = v.cur // SET then SET LOCAL: remember SET's value
				e.state = gucSetLocal
			}
		} else {
			st := gucSet
			if local {
				st = gucLocal
			}
			v.stack = append(v.stack, stackEntry{level: s.level, state: st, prior: v.cur})
		}
	}
	v.cur = nv
}

// endLevel is AtEOXact_GUC(isCommit, nestLevel): pop every stack entry at
// nestLevel or deeper, restoring or merging as PostgreSQL does.
func (s *State) endLevel(commit bool, level int) {
	for _, v := range s.vars {
		for len(v.stack) > 0 && v.stack[len(v.stack)-1].level >= level {
			n := len(v.stack)
			e := v.stack[n-1]
			var prev *stackEntry
			if n > 1 {
				prev = &v.stack[n-2]
			}
			restorePrior, restoreMasked := false, false
			switch {
			case !commit:
				restorePrior = true
			case e.level == 1:
				switch e.state {
				case gucSetLocal:
					restoreMasked = true
				case gucSet:
					// keep the current value
				default:
					restorePrior = true
				}
			case prev == nil || prev.level < level-1:
				// No entry at the next level down: this one
				// becomes it.
				v.stack[n-1].level--
				continue
			default:
				switch e.state {
				case gucSet:
					prev.state = gucSet
					prev.masked = value{}
				case gucLocal:
					if prev.state == gucSet {
						prev.masked = e.prior
						prev.state = gucSetLocal
					}
				case gucSetLocal:
					prev.masked = e.masked
					prev.state = gucSetLocal
				}
			}
			if restoreMasked {
				v.cur = e.masked
			} else if restorePrior {
				v.cur = e.prior
			}
			v.stack = v.stack[:n-1]
		}
	}
}

// Begin applies BEGIN / START TRANSACTION. Inside an implicit transaction
// (earlier statements of the same simple query or pipeline) it turns that
// transaction into the explicit block; inside a block it is a no-op (the
// server warns).
func (s *State) Begin() error {
	switch s.tx {
	case Failed:
		return errInFailed()
	case Idle:
		s.ensureTx()
	}
	s.explicit = true
	return nil
}

// Commit applies a successful COMMIT / END (tag "COMMIT"), or PREPARE
// TRANSACTION: the transaction's SETs persist, SET LOCALs end. With chain
// (COMMIT AND CHAIN) a new explicit transaction starts. Committing a failed
// transaction rolls it back, as the server does (tag "ROLLBACK"). Outside a
// transaction it is a no-op.
func (s *State) Commit(chain bool) {
	switch s.tx {
	case Idle:
		return
	case Failed:
		s.Rollback(chain)
		return
	}
	// Open savepoints are committed one level at a time, innermost
	// first, as CommitSubTransaction does for each.
	for l := s.level; l >= 1; l-- {
		s.endLevel(true, l)
	}
	s.endTx(chain)
}

// Rollback applies ROLLBACK / ABORT: every change made in the transaction is
// undone. With chain a new explicit transaction starts.
func (s *State) Rollback(chain bool) {
	if s.tx == Idle {
		return
	}
	s.endLevel(false, 1)
	s.endTx(chain)
}

func (s *State) endTx(chain bool) {
	s.level = 0
	s.sps = s.sps[:0]
	s.tx = Idle
	s.explicit = false
	s.gate = Gate{}
	s.stmts.endTx()
	if chain {
		s.ensureTx()
		s.explicit = true
	}
}

// Savepoint applies SAVEPOINT name. Names may repeat.
func (s *State) Savepoint(name string) error {
	if err := s.inBlock("SAVEPOINT", false); err != nil {
		return err
	}
	sp := savepoint{name: name, level: s.level + 1, gate: s.gate}
	if s.gate.Digest != nil {
		sp.digestMark = s.gate.Digest.Mark()
	}
	s.sps = append(s.sps, sp)
	s.level++
	return nil
}

// inBlock refuses cmd outside a transaction block and, unless it runs
// there too (ROLLBACK TO), in a failed one, as PostgreSQL does.
func (s *State) inBlock(cmd string, inFailed bool) error {
	switch {
	case s.tx == Failed && !inFailed:
		return errInFailed()
	case s.tx == Idle || !s.explicit:
		return &fence.Error{Code: CodeNoActiveTransaction, Message: cmd + " can only be used in transaction blocks"}
	}
	return nil
}

// findSavepoint returns the index of the most recent savepoint named name,
// for cmd (ROLLBACK TO, RELEASE), which must be in a transaction block.
func (s *State) findSavepoint(cmd, name string, inFailed bool) (int, error) {
	if err := s.inBlock(cmd, inFailed); err != nil {
		return -1, err
	}
	for i := len(s.sps) - 1; i >= 0; i-- {
		if s.sps[i].name == name {
			return i, nil
		}
	}
	return -1, &fence.Error{Code: CodeInvalidSavepoint, Message: fmt.Sprintf("savepoint %q does not exist", name)}
}

// RollbackTo applies ROLLBACK TO SAVEPOINT name: everything since the most
// recent savepoint of that name is undone (parameters, the gate state, the
// digest's statements), the savepoint stays, and a failed transaction is
// usable again.
func (s *State) RollbackTo(name string) error {
	i, err := s.findSavepoint("ROLLBACK TO SAVEPOINT", name, true)
	if err != nil {
		return err
	}
	sp := s.sps[i]
	s.endLevel(false, sp.level)
	s.sps = s.sps[:i+1]
	s.level = sp.level
	digest := s.gate.Digest
	s.gate = sp.gate
	if digest != nil {
		digest.Rollback(sp.digestMark)
		s.gate.Digest = digest
	}
	s.tx = InTx
	return nil
}

// Release applies RELEASE SAVEPOINT name: the most recent savepoint of that
// name and every later one are merged into the enclosing level.
func (s *State) Release(name string) error {
	i, err := s.findSavepoint("RELEASE SAVEPOINT", name, false)
	if err != nil {
		return err
	}
	for l := s.level; l >= s.sps[i].level; l-- {
		s.endLevel(true, l)
	}
	s.level = s.sps[i].level - 1
	s.sps = s.sps[:i]
	return nil
}

// Fail records that a statement failed (ErrorResponse). An implicit
// transaction is rolled back and the session is idle again; in an explicit
// block the innermost (sub)transaction is aborted and the block is Failed
// until ROLLBACK or ROLLBACK TO SAVEPOINT.
func (s *State) Fail() {
	switch {
	case s.tx == Idle:
	case !s.explicit:
		s.Rollback(false)
	case s.tx == InTx:
		s.endLevel(false, s.level)
		s.tx = Failed
	}
}

// TxStatus applies the transaction status of a ReadyForQuery message ('I',
// 'T' or 'E'). At 'I' an implicit transaction ends with a commit (a failure
// would have been reported through Fail). If the status contradicts the
// tracked state, the state is forced to match (an explicit transaction the
// server no longer has is taken as rolled back) and ErrOutOfSync is
// returned.
func (s *State) TxStatus(b byte) error {
	switch b {
	case 'I':
		switch {
		case s.tx == Idle:
			// An implicit transaction the state never opened (a simple
			// Query's autocommit statement) has ended, committed or
			// failed: what the gate noted of it goes with it (round 27,
			// BH-H2: a failed autocommit write left the gate set, and the
			// next transaction, even an empty one, wrote a receipt for its
			// step).
			s.gate = Gate{}
			return nil
		case !s.explicit && s.tx == InTx:
			s.Commit(false)
			return nil
		default:
			s.Rollback(false)
			return ErrOutOfSync
		}
	case 'T':
		switch {
		case s.tx == InTx && s.explicit:
			return nil
		case s.tx == Failed:
			s.tx = InTx
		default:
			s.ensureTx()
			s.explicit = true
		}
		return ErrOutOfSync
	case 'E':
		switch {
		case s.tx == Failed:
			return nil
		case s.tx == InTx && s.explicit:
			s.Fail()
			return nil
		default:
			s.ensureTx()
			s.explicit = true
			s.Fail()
			return ErrOutOfSync
		}
	}
	return fmt.Errorf("session: unknown transaction status %q", b)
}

func errInFailed() *fence.Error {
	return &fence.Error{Code: CodeInFailedTransaction,
		Message: "current transaction is aborted, commands ignored until end of transaction block"}
}

// Setting is a tracked parameter's value for RestoreSettings: Default
// means RESET (the session default), else Value by SET.
type Setting struct {
	Name    string
	Value   string
	Default bool
}

// CommitDiff returns the tracked parameters whose value a commit of the
// open transaction would leave different from what a rollback would: the
// session-level SETs made in it (and in its savepoints). A retry whose
// transaction the database answers as a replay is rolled back, but its
// client was told it committed (the proxy's replay answer): these are
// what that client believes its session has, which the proxy sets again
// after the rollback. Nothing of s changes; a parameter whose committed
// value the proxy does not know is left out, and unknown says there is
// one: then the session cannot be put back as the commit left it.
func (s *State) CommitDiff() (diff []Setting, unknown bool) {
	if s.tx == Idle || s.level == 0 {
		return nil, false
	}
	committed, rolled := s.cloneVars(), s.cloneVars()
	for l := s.level; l >= 1; l-- {
		(&State{vars: committed}).endLevel(true, l)
	}
	(&State{vars: rolled}).endLevel(false, 1)
	names := make([]string, 0, len(committed))
	for n := range committed {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		c, r := committed[n].cur, rolled[n].cur
		if c == r {
			continue
		}
		if !c.known {
			unknown = true
			continue
		}
		diff = append(diff, Setting{Name: n, Value: c.s, Default: !c.set})
	}
	return diff, unknown
}

func (s *State) cloneVars() map[string]*variable {
	out := make(map[string]*variable, len(s.vars))
	for n, v := range s.vars {
		c := *v
		c.stack = append([]stackEntry(nil), v.stack...)
		out[n] = &c
	}
	return out
}
