package proxy

import (
	"net"

	"github.com/pgfence/pgfence/internal/wire"
)

// backend is one upstream connection to the primary and what is true of
// it rather than of the client it serves: the socket and its framer, the
// backend's process id and the parameters it reported, the transaction
// status of its last ReadyForQuery and the requests whose ReadyForQuery is
// due (st). A Session owns exactly one for its
// life today (session mode: the client's connection ends with its
// backend's); the Session embeds it, so its fields read as the session's
// (s.server, s.sf, s.st) in the relay code. Embedded by value while
// it is one per session; a pool would hold *backend and give a Session the
// one it has (the change is the embedding and open's literal).
//
// The Handler's own per-connection facts live beside it, on the Handler's
// side of the seam (the write gate's: gateBackend, fence_backend.go):
// the prepared statements and portals that exist on this connection as it
// accepted them (session.Statements, which the client's session.State
// refers to), and how it reads the client's text. The client's side keeps what is the client's:
// its settings as it set them (session.State's GUCs), its prepared
// statements as it named and classified them (fenceSession.stmts).
//
// Transaction pooling would hand a backend from one client to another
// between transactions: only with TxStatus 'I', nothing pending and the
// request queue empty (the conditions Shutdown already waits for,
// tryCloseIdle). Before the next client's first message, a hand-off would
// replay onto it what that client's session assumes and the backend does
// not have:
//
//   - its settings: RESET ALL, then the client's startup parameters and
//     every SET since (session.State has both, with their transactional
//     history already resolved at ReadyForQuery), client_encoding and
//     standard_conforming_strings included, so gateBackend's text state is
//     the client's again; application_name too (a ParameterStatus the
//     client must see if the values differ);
//   - its prepared statements: a Parse of each of the client's named
//     statements the backend lacks (the client side keeps each Parse's
//     text for read routing already, route.go), and a Close of those the
//     backend has that the client never made; SQL-level PREPAREs the same
//     way (the statements of the backend the client leaves know them:
//     gateBackend.stmts); then the session's State is attached to the new
//     backend's statements (session.State.Attach); portals do not survive
//     a transaction and need nothing;
//   - the gate's named statements: nothing (they are parsed for each
//     use);
//   - the identity: BackendPID and the cancel key the client was given
//     stay the client's (the cancel map would point the client's key at
//     the new backend's real key), so pg_backend_pid() would no longer
//     match BackendKeyData: a documented difference of pooling.
type backend struct {
	server net.Conn    // the upstream socket
	sf     wire.Framer // server → proxy
	// serverClosed: closeServer has run (guarded by Session.connMu).
	serverClosed bool
	// serverStopped: closeServer was called, on any relay (Session.connMu).
	serverStopped bool
	// tellLost: the session ends because its upstream connection ended
	// under it, and the client is told so (Session.end, endReason).
	tellLost bool
	// lastServerType is the type of the last message the upstream sent
	// an intercepted session (upstreamMessage; read at the session's
	// end, mayTellUpstreamLost).
	lastServerType byte

	// BackendPID is the upstream backend's process id, which the client
	// was given in BackendKeyData.
	BackendPID uint32
	// ServerParams are the parameters the upstream reported at startup
	// (ParameterStatus: client_encoding, server_encoding,
	// standard_conforming_strings, ...).
	ServerParams map[string]string

	// st is the transaction status (the last ReadyForQuery's: 'I', 'T'
	// or 'E'; while the session's requests run on its replica
	// connection, the replica's reader keeps it too: replica.go) and the
	// requests in flight whose ReadyForQuery is due. Shutdown may close a
	// session only while it is idle in both senses (st.CloseIdle).
	st wire.Status
}
