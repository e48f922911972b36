package wire

import (
	"bufio"
	"io"
	"sync/atomic"
)

// Framer reads PostgreSQL messages from a bufio.Reader without copying
// them. It never allocates: messages are returned as slices of the
// reader's buffer, valid until the next call that reads.
//
// Before any read that could block (the buffer lacks the bytes needed),
// it calls Flush, so the writer feeding the peer is flushed exactly when
// no more input is available: writes coalesce under load and nothing
// waits when idle.
type Framer struct {
	R     *bufio.Reader
	Max   int          // largest body length accepted (excluding type byte); 0 = unbounded
	Flush func() error // optional: called before a read that could block
	From  string       // "client", "server" or "replica", for errors
	// Client checks each header as a client's (checkClient): its type,
	// and a message over Max returned when its type is Answerable.
	Client bool
	// Count, when non-nil, counts the bytes consumed (the console's
	// SHOW STATS).
	Count *atomic.Int64
}

// Fill makes at least n bytes (n <= buffer size) available, flushing
// first if that needs a read.
func (f *Framer) Fill(n int) ([]byte, error) {
	if f.R.Buffered() < n && f.Flush != nil {
		if err := f.Flush(); err != nil {
			return nil, err
		}
	}
	return f.R.Peek(n)
}

// Next reads the header of the next message and returns its type and
// total size (type byte included). The header is not consumed. A bad
// header is a *ProtocolError (ParseHeader); the reader's errors are
// returned as they are. With Client, a message over Max of an Answerable
// type is returned without an error (total-HeaderLen > Max): the caller
// answers it.
func (f *Framer) Next() (typ byte, total int, err error) {
	h, err := f.Fill(HeaderLen)
	if err != nil {
		return 0, 0, err
	}
	if typ, total, ok := header(h, f.Max); ok && (!f.Client || frontendTypes[typ]) {
		return typ, total, nil
	}
	typ, total, err = ParseHeader(h, f.Max, f.From)
	if f.Client {
		if _, err = checkClient(typ, err); err != nil {
			return 0, 0, err
		}
	}
	return typ, total, err
}

// Whole returns the complete message of the given total size, which must
// fit in the buffer. The caller consumes it with Discard.
func (f *Framer) Whole(total int) ([]byte, error) { return f.Fill(total) }

// Discard consumes n bytes.
func (f *Framer) Discard(n int) {
	_, _ = f.R.Discard(n)
	if f.Count != nil {
		f.Count.Add(int64(n))
	}
}

// Stream copies the next total bytes (a message larger than the buffer)
// to w in buffer-sized pieces, so large messages never need their own
// allocation.
func (f *Framer) Stream(w io.Writer, total int) error {
	for total > 0 {
		b, err := f.Piece(total)
		if err != nil {
			return err
		}
		if _, err := w.Write(b); err != nil {
			return err
		}
		f.Discard(len(b))
		total -= len(b)
	}
	return nil
}

// ReadInto appends the next total bytes to dst (when a whole large
// message must be seen).
func (f *Framer) ReadInto(dst []byte, total int) ([]byte, error) {
	for total > 0 {
		b, err := f.Piece(total)
		if err != nil {
			return dst, err
		}
		dst = append(dst, b...)
		f.Discard(len(b))
		total -= len(b)
	}
	return dst, nil
}

// Piece returns what is buffered of the next at most n bytes, reading
// (once, flushing first) when nothing is. The caller consumes it with
// Discard.
func (f *Framer) Piece(n int) ([]byte, error) {
	k := f.R.Buffered()
	if k == 0 {
		if _, err := f.Fill(1); err != nil {
			return nil, err
		}
		k = f.R.Buffered()
	}
	b, _ := f.R.Peek(min(k, n))
	return b, nil
}
