package proxy

import "github.com/pgfence/pgfence/internal/wire"

// The protocol's framing rules are package wire's (the framer, the
// loop's scanner, the message-type tables); these are the names the
// proxy's API and its files use for them.

// headerLen is the size of a regular message header (wire.HeaderLen).
const headerLen = wire.HeaderLen

// ErrMessageTooLarge is returned (wrapped in a *ProtocolError) when a client
// message exceeds Config.MaxMessageSize.
var ErrMessageTooLarge = wire.ErrMessageTooLarge

// ProtocolError is an error that ends the connection: a framing or
// protocol violation by the peer, or any other reason the proxy closes it
// (see the package doc's Errors; a refusal that leaves the connection
// open is a *fence.Error). The session answers it with a FATAL
// ErrorResponse (SQLSTATE Code, errorResponse) when the protocol allows
// and closes. It is wire.ProtocolError, which the framers return.
type ProtocolError = wire.ProtocolError

// MessageType returns the type byte of a complete message.
func MessageType(msg []byte) byte { return msg[0] }

// MessageBody returns the body of a complete message (after the header).
func MessageBody(msg []byte) []byte { return msg[headerLen:] }
