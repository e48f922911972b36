package proxy

import "go.uber.org/zap"

// gateBackend is what the write gate knows of one upstream connection, as
// opposed to the client it serves: whether the gate's named statements
// (plan.Statements) exist on it, and how it reads the client's text.
// fenceSession holds it by pointer, one per upstream connection (backend,
// backend.go); a hand-off of the backend to another client (transaction
// pooling) would hand this over with it, and replay the client's text
// settings onto the connection so that text is the client's again.
//
// prepared and text are shared by the client and server sides, under
// fenceSession.mu; prepareReq and tainted are the client side's.
type gateBackend struct {
	prepared bool // the gate's named statements exist upstream
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
		text:    newTextState(params, log),
		appName: params["application_name"],
	}
}
