package proxy

import (
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/session"
)

// gateBackend is what the write gate knows of one upstream connection, as
// opposed to the client it serves: the client's named statements and
// portals that exist on it (stmts), and how it reads the client's text.
// (The gate's own named statements are parsed for each use: execNamed.) fenceSession holds it by pointer, one per
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
// stmts and text are shared by the client and server sides, under
// fenceSession.mu.
type gateBackend struct {
	// stmts are the client's prepared statements and portals as this
	// connection accepted them; the session's State refers to them
	// (Fence.Open attaches them). With read routing, what the replica
	// connection accepted is recorded here too: the router parses each
	// named statement again on whichever upstream the client uses it
	// (route.go, stmtCopies), so they are one namespace.
	stmts *session.Statements

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
