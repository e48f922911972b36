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
}

// Portal is a bound statement, ready for Execute.
type Portal struct {
	Name      string
	Statement *Prepared
}

// Parse records a protocol-level Parse that the server accepted
// (ParseComplete). The unnamed statement ("") is replaced by each Parse.
// res must hold at most one statement (the server refuses more).
func (s *State) Parse(name string, res *rewrite.Result, paramOIDs []uint32) {
	p := &Prepared{Name: name, ParamOIDs: append([]uint32(nil), paramOIDs...)}
	if res != nil && len(res.Stmts) > 0 {
		p.Stmt = res.Stmts[0]
	}
	s.prepared[name] = p
}

// Statement returns a prepared statement by name.
func (s *State) Statement(name string) (*Prepared, bool) {
	p, ok := s.prepared[name]
	return p, ok
}

// CloseStatement applies a Close of a statement, or DEALLOCATE name.
func (s *State) CloseStatement(name string) { delete(s.prepared, name) }

// Bind records a Bind that the server accepted (BindComplete): portal now
// runs the named statement. The unnamed portal is replaced by each Bind.
func (s *State) Bind(portal, statement string) error {
	p, ok := s.prepared[statement]
	if !ok {
		return &fence.Error{Code: CodeInvalidStatementName, Message: fmt.Sprintf("prepared statement %q does not exist", statement)}
	}
	s.ensureTx()
	s.portals[portal] = &Portal{Name: portal, Statement: p}
	return nil
}

// Portal returns a portal by name.
func (s *State) Portal(name string) (*Portal, bool) {
	p, ok := s.portals[name]
	return p, ok
}

// ClosePortal applies a Close of a portal.
func (s *State) ClosePortal(name string) { delete(s.portals, name) }
