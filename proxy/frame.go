package proxy

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
)

// headerLen is the size of a regular message header: a type byte and a
// big-endian int32 length that counts itself but not the type byte.
const headerLen = 5

// ErrMessageTooLarge is returned (wrapped in a *ProtocolError) when a client
// message exceeds Config.MaxMessageSize.
var ErrMessageTooLarge = errors.New("message too large")

// ProtocolError is an error that ends the connection: a framing or
// protocol violation by the peer, or any other reason the proxy closes it
// (see the package doc's Errors; a refusal that leaves the connection
// open is a *fence.Error). The session answers it with a FATAL
// ErrorResponse (SQLSTATE Code, errorResponse) when the protocol allows
// and closes.
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

// framer reads PostgreSQL messages from a bufio.Reader without copying them.
// It never allocates: messages are returned as slices of the reader's
// buffer, valid until the next call that reads.
//
// Before any read that could block (the buffer lacks the bytes needed),
// it calls flush, so the writer feeding the peer is flushed exactly when no
// more input is available: writes coalesce under load and nothing waits
// when idle.
type framer struct {
	r     *bufio.Reader
	max   int // largest body length accepted (excluding type byte); 0 = unbounded
	flush func() error
	from  string // "client" or "server", for errors
	// count, when non-nil, counts the bytes consumed (the console's
	// SHOW STATS).
	count *atomic.Int64
}

// fill makes at least n bytes (n <= buffer size) available, flushing first
// if that needs a read.
func (f *framer) fill(n int) ([]byte, error) {
	if f.r.Buffered() < n && f.flush != nil {
		if err := f.flush(); err != nil {
			return nil, err
		}
	}
	return f.r.Peek(n)
}

// next reads the header of the next message and returns its type and total
// size (type byte included). The header is not consumed.
func (f *framer) next() (typ byte, total int, err error) {
	h, err := f.fill(headerLen)
	if err != nil {
		return 0, 0, err
	}
	return parseHeader(h, f.max, f.from)
}

// parseHeader validates a 5-byte header. It is separate for fuzzing and for
// the allocation benchmark.
func parseHeader(h []byte, max int, from string) (typ byte, total int, err error) {
	typ = h[0]
	n := binary.BigEndian.Uint32(h[1:5])
	if n < 4 || n > 1<<30 {
		return typ, 0, &ProtocolError{Code: "08P01", Msg: fmt.Sprintf("invalid message length %d in %s message of type %q", int32(n), from, typ)}
	}
	if max > 0 && int(n)-4 > max {
		// total is returned too: a caller may read the message to drop it.
		return typ, int(n) + 1, &ProtocolError{Code: "08P01", Msg: fmt.Sprintf("%s message of type %q is %d bytes, over max_message_size (%d bytes)", from, typ, n-4, max), Err: ErrMessageTooLarge}
	}
	return typ, int(n) + 1, nil
}

// whole returns the complete message of the given total size, which must
// fit in the buffer. The caller consumes it with discard.
func (f *framer) whole(total int) ([]byte, error) { return f.fill(total) }

func (f *framer) discard(n int) {
	_, _ = f.r.Discard(n)
	if f.count != nil {
		f.count.Add(int64(n))
	}
}

// stream copies the next total bytes (a message larger than the buffer)
// to w in buffer-sized pieces, so large messages never need their own
// allocation.
func (f *framer) stream(w io.Writer, total int) error {
	for total > 0 {
		n := f.r.Buffered()
		if n == 0 {
			if _, err := f.fill(1); err != nil {
				return err
			}
			n = f.r.Buffered()
		}
		n = min(n, total)
		b, _ := f.r.Peek(n)
		if _, err := w.Write(b); err != nil {
			return err
		}
		f.discard(n)
		total -= n
	}
	return nil
}

// readInto appends the next total bytes to dst (used when a whole large
// message must be seen, e.g. by an Interceptor).
func (f *framer) readInto(dst []byte, total int) ([]byte, error) {
	for total > 0 {
		n := f.r.Buffered()
		if n == 0 {
			if _, err := f.fill(1); err != nil {
				return dst, err
			}
			n = f.r.Buffered()
		}
		n = min(n, total)
		b, _ := f.r.Peek(n)
		dst = append(dst, b...)
		f.discard(n)
		total -= n
	}
	return dst, nil
}

// frontendTypes are the message types a client may send after startup.
var frontendTypes = func() (t [256]bool) {
	for _, c := range []byte{'B', 'C', 'd', 'c', 'f', 'D', 'E', 'H', 'F', 'P', 'p', 'Q', 'S', 'X'} {
		t[c] = true
	}
	return t
}()

// MessageType returns the type byte of a complete message.
func MessageType(msg []byte) byte { return msg[0] }

// MessageBody returns the body of a complete message (after the header).
func MessageBody(msg []byte) []byte { return msg[headerLen:] }
