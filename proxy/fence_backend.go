package proxy

import (
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/session"
)

// gateBackend is what the write gate knows of one upstream connection, as
// opposed to the client it serves: the named statements and portals that
// exist on it, the client's (stmts) and the gate's own (prepared), and how
// it reads the client's text. fenceSession holds it by pointer, one per
// upstream connection (backend, backend.go); a hand-off of the backend to
// another client (transaction pooling) would hand this over with it,
// attach its stmts to that client's session.State (State.Attach), and
// replay the client's text settings onto the connection so that text is
// the client's again.
//
// The statements are here rather than on backend because they are the
// gate's knowledge, classified by package rewrite and driven by the
// gate's server side (fence_server.go) under fenceSession.mu: the relay
// core that backend serves knows no statement, and any other Handler
// would keep its own.
//
// stmts, prepared and text are shared by the client and server sides,
// under fenceSession.mu; prepareReq and tainted are the client side's.
type gateBackend struct {
	// stmts are the client's prepared statements and portals as this
	// connection accepted them; the session's State refers to them
	// (Fence.Open attaches them). With read routing, what the replica
	// connection accepted is recorded here too: the router parses each
	// named statement again on whichever upstream the client uses it
	// (route.go, stmtCopies), so they are one namespace.
	stmts *session.Statements
	// prepared: the gate's named statements (plan.Statements) exist
	// upstream, or their Parse is on its way (prepareGate). Beside stmts
	// rather than in them: it is set when the Parse is sent, and cleared
	// by the gate's server side on its failure and on DISCARD ALL or
	// DEALLOCATE ALL (applyClient).
	prepared bool
	// prepareReq is the last Parse of the gate's statements, until known
	// done (prepareGate).
	prepareReq *Request
	// tainted: since the gate's statements were last parsed, the client
	// ran something that can execute SQL the proxy cannot see (a DO
	// block, a procedure, a user function: any of them may DEALLOCATE
	// and PREPARE under the gate's names), so they are parsed again
	// before their next use (prepareGate).
	tainted bool

	text    textState // how the server reads the client's text (fence_text.go)
	appName string    // application_name as the server last reported it (for the log)
}

// newGateBackend is the gate's view of a connection that has just
// reported its parameters (Session.ServerParams).
func newGateBackend(params map[string]string, log *zap.Logger) *gateBackend {
	return &gateBackend{
		stmts:   session.NewStatements(),
		text:    newTextState(params, log),
		appName: params["application_name"],
	}
}
