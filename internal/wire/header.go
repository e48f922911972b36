package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// HeaderLen is the size of a regular message header: a type byte and a
// big-endian int32 length that counts itself but not the type byte.
const HeaderLen = 5

// ErrMessageTooLarge is returned (wrapped in a *ProtocolError) for a
// message whose body is over the limit the framer was given.
var ErrMessageTooLarge = errors.New("message too large")

// ProtocolError is an error that ends the connection: a framing or
// protocol violation by the peer, or any other reason the proxy closes it
// (proxy.ProtocolError is this type; the proxy's package doc lists the
// reasons). The proxy answers it with a FATAL ErrorResponse (SQLSTATE
// Code, Msg, Hint) when the protocol allows, and closes.
type ProtocolError struct {
	Code string // SQLSTATE sent to the client
	Msg  string
	Hint string // optional: what the user can do
	Err  error  // optional cause, for errors.Is
}

func (e *ProtocolError) Error() string {
	if e.Err != nil {
		return e.Msg + ": " + e.Err.Error()
	}
	return e.Msg
}

func (e *ProtocolError) Unwrap() error { return e.Err }

// ParseHeader validates a 5-byte header and returns the message's type
// and total size (type byte included). max bounds the body's length (0:
// unbounded); from names the peer in the error ("client", "server",
// "replica"). A message over max is a *ProtocolError wrapping
// ErrMessageTooLarge, returned with its total size: a caller may read the
// message to drop it.
func ParseHeader(h []byte, max int, from string) (typ byte, total int, err error) {
	typ = h[0]
	n := binary.BigEndian.Uint32(h[1:5])
	if n < 4 || n > 1<<30 {
		return typ, 0, lengthError(typ, n, from)
	}
	if max > 0 && int(n)-4 > max {
		return typ, int(n) + 1, tooLargeError(typ, n, max, from)
	}
	return typ, int(n) + 1, nil
}

// header is ParseHeader's common case, small enough to inline in the
// framers' loops: !ok means the header is bad, and ParseHeader says why.
func header(h []byte, max int) (typ byte, total int, ok bool) {
	n := binary.BigEndian.Uint32(h[1:5])
	if n < 4 || n > 1<<30 || max > 0 && int(n)-4 > max {
		return 0, 0, false
	}
	return h[0], int(n) + 1, true
}

func lengthError(typ byte, n uint32, from string) error {
	return &ProtocolError{Code: "08P01", Msg: fmt.Sprintf("invalid message length %d in %s message of type %q", int32(n), from, typ)}
}

func tooLargeError(typ byte, n uint32, max int, from string) error {
	return &ProtocolError{Code: "08P01", Msg: fmt.Sprintf("%s message of type %q is %d bytes, over max_message_size (%d bytes)", from, typ, n-4, max), Err: ErrMessageTooLarge}
}

// PutHeader writes a message header for typ and a body of n bytes.
func PutHeader(b []byte, typ byte, n int) {
	b[0] = typ
	binary.BigEndian.PutUint32(b[1:HeaderLen], uint32(n+4))
}
