package wire

import (
	"bufio"
	"bytes"
	"errors"
	"testing"
)

// TestFramerClient: a client's stream is checked for what a client may
// send: an unknown type is a protocol violation, and a message over the
// limit is returned to be answered only when PostgreSQL answers its type
// with an error.
func TestFramerClient(t *testing.T) {
	for _, tc := range []struct {
		name string
		hdr  []byte
		max  int
		code string // "" : accepted
		msg  string
		over bool // accepted over the limit
	}{
		{"query", []byte{'Q', 0, 0, 0, 5}, 0, "", "", false},
		{"unknown type", []byte{'z', 0, 0, 0, 4}, 0, "08P01", "invalid frontend message type 122", false},
		{"server type", []byte{'Z', 0, 0, 0, 5}, 0, "08P01", "invalid frontend message type 90", false},
		{"answerable over the limit", []byte{'P', 0, 0, 1, 5}, 256, "", "", true},
		{"copy data over the limit", []byte{'d', 0, 0, 1, 5}, 256, "", "", true},
		{"sync over the limit", []byte{'S', 0, 0, 1, 5}, 256, "08P01", `client message of type 'S' is 257 bytes, over max_message_size (256 bytes)`, false},
		{"bad length", []byte{'Q', 0, 0, 0, 3}, 0, "08P01", `invalid message length 3 in client message of type 'Q'`, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := append(tc.hdr, make([]byte, 300)...)
			f := &Framer{R: bufio.NewReaderSize(bytes.NewReader(in), 64), Max: tc.max, From: "client", Client: true}
			typ, total, err := f.Next()
			if tc.code == "" {
				if err != nil || typ != tc.hdr[0] || (total-HeaderLen > tc.max && tc.max > 0) != tc.over {
					t.Fatalf("got %q %d %v, want %q accepted (over the limit: %v)", typ, total, err, tc.hdr[0], tc.over)
				}
				return
			}
			var pe *ProtocolError
			if !errors.As(err, &pe) || pe.Code != tc.code || pe.Msg != tc.msg {
				t.Fatalf("got %v, want %s %q", err, tc.code, tc.msg)
			}
		})
	}
}
