package wire

import (
	"errors"
	"fmt"
)

// frontendTypes are the message types a client may send after startup.
var frontendTypes = func() (t [256]bool) {
	for _, c := range []byte{'B', 'C', 'd', 'c', 'f', 'D', 'E', 'H', 'F', 'P', 'p', 'Q', 'S', 'X'} {
		t[c] = true
	}
	return t
}()

// Terminate is the Terminate message ('X'), which the proxy sends a
// backend it ends. Do not modify.
var Terminate = []byte{'X', 0, 0, 0, 4}

// Answerable reports whether a client message of type t over the size
// limit is answered with an error in its place (the proxy sends
// PostgreSQL a substitute that fails): the types that carry statements
// and data. Another message that long cannot be meant (a Sync, an
// Execute, a Describe) and is a protocol violation.
func Answerable(t byte) bool {
	switch t {
	case 'Q', 'P', 'B', 'F', 'd':
		return true
	}
	return false
}

// ProducesResponse reports whether a client message of type t gets a
// response of its own (and so an entry in the Queue): Query, Parse, Bind,
// Describe, Execute, Close, Sync, FunctionCall.
func ProducesResponse(t byte) bool {
	switch t {
	case 'Q', 'P', 'B', 'D', 'E', 'C', 'S', 'F':
		return true
	}
	return false
}

// checkClient applies the rule for a client message's header to what
// ParseHeader returned for it: a message over the limit is returned to
// its caller (oversized) when its type is Answerable, and is a protocol
// violation otherwise, as is a type a client may not send.
func checkClient(typ byte, err error) (oversized bool, _ error) {
	if err != nil {
		if errors.Is(err, ErrMessageTooLarge) && Answerable(typ) {
			return true, nil
		}
		return false, err
	}
	if !frontendTypes[typ] {
		return false, &ProtocolError{Code: "08P01", Msg: fmt.Sprintf("invalid frontend message type %d", typ)}
	}
	return false, nil
}

// ReadyStatus returns the transaction status of msg, a whole server
// message, when it is a ReadyForQuery ('I' idle, 'T' in a transaction,
// 'E' in a failed one).
func ReadyStatus(msg []byte) (status byte, ok bool) {
	if msg[0] != 'Z' || len(msg) != HeaderLen+1 {
		return 0, false
	}
	return msg[HeaderLen], true
}
