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
// Without the event loop (evloop_linux.go, which relays most sessions on
// Linux on one thread), each Session runs two goroutines: client→server
// (clientLoop) and server→client (serverLoop). The first to end closes
// both connections; run waits for both. Each direction frames messages out of a large
// bufio.Reader (framer) by decoding only the 5-byte header, and writes
// them into a bufio.Writer for the other side. The writer is flushed
// exactly when the reader has no complete input left (framer.fill), so
// pipelined messages coalesce into one write and nothing waits when idle.
// Messages larger than the buffer are streamed through in pieces. The
// pass-through path neither copies a message more than once nor
// allocates (BenchmarkPassThrough, TestFramingAllocs).
//
// The server→client loop watches ReadyForQuery to track the transaction
// status (Session.TxStatus), and the client→server loop counts requests
// in flight; Shutdown closes a session only when it is idle in both senses.
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
//     to the head request (match), pops completed ones, and after an
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
package proxy
