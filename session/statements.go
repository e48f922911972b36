package session

import (
	"fmt"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
)

// Prepared is a prepared statement. Protocol-level (Parse) and SQL-level
// (PREPARE) statements share one namespace in the server, and here.
type Prepared struct {
	Name string
	// Stmt is the statement's classification; nil for an empty query.
	Stmt *rewrite.Stmt
	// ParamOIDs are the parameter types given in Parse (0: unspecified).
	ParamOIDs []uint32
	// SQL marks a statement created by SQL-level PREPARE.
	SQL bool
	// Text is the PREPARE statement that created an SQL-level statement,
	// and PathEpoch the session's State.PathEpoch when it ran: what the
	// proxy's read routing makes the same statement from on the replica,
	// while the names in it resolve alike (no change of search_path since).
	Text      string
	PathEpoch uint64
	// Raw is the Parse message the server accepted, kept by a caller that
	// must parse the same statement again elsewhere (the proxy's read
	// routing); nil otherwise.
	Raw []byte
}

// Portal is a bound statement, ready for Execute.
type Portal struct {
	Name      string
	Statement *Prepared
}

// Statements are the prepared statements and portals that exist on one
// upstream connection, as the server accepted them (ParseComplete,
// BindComplete, PREPARE's CommandComplete), classified: what an EXECUTE's
// effects on the settings are read from (State.Apply) and what a
// protected write through a prepared statement is found by. They are a
// fact of the server connection, not of the client: the proxy keeps them
// with its per-connection object and a State refers to them (given to New;
// Attach points it at another connection's).
//
// They follow the server's rules, driven through the State that refers to
// them, since those rules are transactional: a portal lives until its
// transaction ends (State.Commit, Rollback, Fail of an implicit
// transaction, TxStatus), DEALLOCATE name and Close drop one statement,
// DEALLOCATE ALL and DISCARD ALL drop every statement (DISCARD ALL every
// portal too), and a Parse or Bind the server refused records nothing.
//
// Like State, Statements are not safe for concurrent use.
type Statements struct {
	prepared map[string]*Prepared
	portals  map[string]*Portal
}

// NewStatements returns the statements of a new connection: none.
func NewStatements() *Statements {
	return &Statements{prepared: make(map[string]*Prepared), portals: make(map[string]*Portal)}
}

// Parse records a protocol-level Parse that the server accepted
// (ParseComplete). The unnamed statement ("") is replaced by each Parse.
// res must hold at most one statement (the server refuses more).
func (ss *Statements) Parse(name string, res *rewrite.Result, paramOIDs []uint32) {
	p := &Prepared{Name: name, ParamOIDs: append([]uint32(nil), paramOIDs...)}
	if res != nil && len(res.Stmts) > 0 {
		p.Stmt = res.Stmts[0]
	}
	ss.prepared[name] = p
}

// Statement returns a prepared statement by name.
func (ss *Statements) Statement(name string) (*Prepared, bool) {
	p, ok := ss.prepared[name]
	return p, ok
}

// CloseStatement applies a Close of a statement, or DEALLOCATE name.
func (ss *Statements) CloseStatement(name string) { delete(ss.prepared, name) }

// Portal returns a portal by name.
func (ss *Statements) Portal(name string) (*Portal, bool) {
	p, ok := ss.portals[name]
	return p, ok
}

// ClosePortal applies a Close of a portal.
func (ss *Statements) ClosePortal(name string) { delete(ss.portals, name) }

// bind records that portal now runs the named statement; the unnamed
// portal is replaced by each Bind.
func (ss *Statements) bind(portal, statement string) error {
	p, ok := ss.prepared[statement]
	if !ok {
		return &fence.Error{Code: CodeInvalidStatementName, Message: fmt.Sprintf("prepared statement %q does not exist", statement)}
	}
	ss.portals[portal] = &Portal{Name: portal, Statement: p}
	return nil
}

// prepare records an SQL-level PREPARE.
func (ss *Statements) prepare(name string, st *rewrite.Stmt, text string, pathEpoch uint64) {
	ss.prepared[name] = &Prepared{Name: name, Stmt: st, SQL: true, Text: text, PathEpoch: pathEpoch}
}

// deallocateAll applies DEALLOCATE ALL.
func (ss *Statements) deallocateAll() { clear(ss.prepared) }

// discard applies DISCARD ALL's DEALLOCATE ALL and CLOSE ALL.
func (ss *Statements) discard() {
	clear(ss.prepared)
	clear(ss.portals)
}

// endTx drops the portals: they do not outlive their transaction.
func (ss *Statements) endTx() { clear(ss.portals) }

// Statements returns the prepared statements and portals the State
// refers to.
func (s *State) Statements() *Statements { return s.stmts }

// Attach makes the State refer to ss, another connection's statements,
// from now on; the State's own settings and transaction are kept. Attach
// between transactions: the portals of a transaction are its
// connection's.
func (s *State) Attach(ss *Statements) { s.stmts = ss }

// Bind records a Bind that the server accepted (BindComplete): portal now
// runs the named statement. The unnamed portal is replaced by each Bind.
// A Bind starts an implicit transaction if none is open.
func (s *State) Bind(portal, statement string) error {
	if err := s.stmts.bind(portal, statement); err != nil {
		return err
	}
	s.ensureTx()
	return nil
}
