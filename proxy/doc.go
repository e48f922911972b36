// Package proxy is pgfence's PostgreSQL wire-protocol proxy: listener,
// startup (SSLRequest/TLS, GSSENCRequest, protocol negotiation, cancel
// requests), client authentication (trust, SCRAM-SHA-256 against a users
// file), upstream connections through pgconn, the per-session wire loop,
// CancelRequest forwarding, limits and graceful shutdown.
//
// It is session mode: one upstream connection per client, opened after the
// client authenticates and closed when it leaves, plus, with the write gate
// and Config.Replicas, a lazily opened connection to a streaming replica for
// reads the gate routes there (replica.go, route.go, lsn.go; docs/reads.md).
// It is not a pooler and does not parse SQL itself: SQL classification
// (package rewrite), what the write gate adds to a transaction
// (rewrite/plan) and session GUC tracking (package session) live in other
// packages. The write gate (Fence, fence_*.go) plugs in through
// Interceptor and executes their plans; docs/architecture.md follows a
// gated transaction through the files.
//
// # The wire loop
//
// Every session is relayed by one engine, its Server's event loop
// (evloop.go): one OS thread that waits in epoll (Linux) or poll(2)
// (every Unix) for the sockets of all its sessions, as PgBouncer does;
// the package builds on Unix only. A pass-through session's bytes are
// framed by an incremental scanner (wire.Scanner) decoding only the
// 5-byte header, copied once into a buffer for the other side, and
// written when the input runs dry, so pipelined messages coalesce into
// one write (evloop_relay.go); the pass-through path allocates nothing
// per message (BenchmarkPassThrough, TestFramingAllocs). An intercepted
// session's messages are framed whole (wire.Framer) and given to its
// Handler on the loop (evloop_intercept.go, evloop_client.go); what
// would block there runs on a goroutine while its client side is
// parked (offClient). A connection that is not a socket is bridged to
// the loop by a byte pump (evloop_bridge.go). A session the loop cannot
// take is refused with 53000, never relayed some other way
// (Session.refuse).
//
// The loop watches ReadyForQuery to track the transaction status
// (Session.TxStatus) and counts requests in flight; Shutdown closes a
// session only when it is idle in both senses. One teardown order ends
// every session (end.go).
//
// # The seam for the write gate
//
// Config.Interceptor (Interceptor.Open returns a per-session Handler)
// switches a session from pure pass-through to interception:
//
//   - Handler.ClientMessage sees every client message whole (reassembled
//     when larger than the buffer) before it is forwarded, and decides:
//     Forward it, or Drop it after holding (copy, send later), replacing
//     (Session.ForwardMessage) or answering it. Session.Inject sends the
//     proxy's own messages upstream ahead of or instead of the client's
//     (e.g. BEGIN and SELECT fence.gate(...) before the first protected
//     write, SELECT fence.commit(...) before COMMIT). Session.FlushServer
//     plus Request.Done lets it wait for an injected step's outcome before
//     deciding what to do with a held message.
//
//   - Every message that expects a response (Query, Parse, Bind, Describe,
//     Execute, Close, Sync, FunctionCall), forwarded or injected, is pushed
//     on the session's outstanding-request queue (PgBouncer's
//     outstanding_requests). The server→client loop matches each response
//     to the head request (wire.Queue), pops completed ones, and after an
//     extended-protocol ErrorResponse skips the requests PostgreSQL
//     discards up to the next Sync. Responses to injected requests are
//     swallowed exactly, with pipelining; the Handler sees them in
//     Handler.ServerMessage together with their Request (Request.Error
//     holds a copy of an ErrorResponse).
//
//   - Handler.ServerMessage sees every server message (ReadyForQuery
//     status, CommandComplete, ErrorResponse, ParameterStatus, ...) and
//     may drop client-bound messages or write synthetic ones with
//     Session.WriteClient, e.g. to turn the gate's failure into an
//     ErrorResponse to the client's COMMIT.
//
// With no Interceptor none of this runs: no queue, no copies, no calls.
//
// The console, the metrics and read routing ask an Interceptor (or its
// Handlers) for more only through optional interfaces (optional.go:
// GateStatsReporter, GateReporter, ReadRouter), never by its type. The
// write gate itself uses its Session only through gateConn (gateconn.go):
// the exported Handler API plus the few mechanisms only it needs.
//
// # Errors
//
// A client is told of an error in one of two ways, and each has its type.
//
//   - A refusal of a statement or transaction is a *fence.Error, the
//     vocabulary the proxy shares with packages fence and session: class
//     FN (FN008 fencing required, FN009, FN013, ...) or the standard code
//     PostgreSQL itself would give (22023 for a malformed fence setting,
//     42601 for text the gate cannot parse). The proxy has the server
//     raise it in the client's own transaction (raiseSQL), so the
//     transaction aborts exactly as for PostgreSQL's own error. The
//     server's errors are read in the same vocabulary (fence.Setup turns
//     a missing fence schema, or a role without pgfence_worker, into
//     FN014: setupError).
//   - An error that ends the connection is a *ProtocolError, the
//     connection layer's own: a framing or protocol violation (08P01),
//     failed authentication (28P01, 28000), a limit (54000, 53200, 53300),
//     a shutdown or a console's KILL (57P01), an upstream that failed
//     (08006), and the few fence reasons for ending a session (FN012, the
//     gate's idle timeout; a malformed fence setting in the startup
//     packet). It stays a type of its own because it is another thing:
//     most of these arise before a session, a fence state or an upstream
//     exist; it is always FATAL and sent by the proxy itself, never
//     raised by the server; and it carries a cause for errors.Is
//     (ErrAuthFailed, ErrMessageTooLarge) and for the log, where its
//     Error text names the cause. errorResponse is the one place it, or
//     an upstream's *pgconn.PgError, becomes the client's ErrorResponse.
package proxy
