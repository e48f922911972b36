//go:build linux

package proxy

import (
	"errors"
	"testing"
)

// FuzzLoopFraming: the event loop's incremental framing check (relay.scan),
// fed the input in arbitrary pieces, never panics and agrees with a
// whole-input reference: every complete valid message before the first bad
// one (invalid length, over the size limit, unknown frontend type) is
// passed on, and the session ends at that message with a ProtocolError,
// or at a Terminate.
func FuzzLoopFraming(f *testing.F) {
	f.Add(pipelineBytes(2), []byte{3, 200, 7}, uint16(0))
	f.Add([]byte{'Q', 0, 0, 0, 9, 'S', 'E', 'L', 0, 'X', 0, 0, 0, 4, 'Q'}, []byte{1}, uint16(8))
	f.Add([]byte{'Q', 0xff, 0xff, 0xff, 0xff}, []byte{2, 2}, uint16(64))
	f.Add([]byte{'Q', 0, 0, 0, 5, 0, 'z', 0, 0, 0, 4}, []byte{}, uint16(0))
	f.Fuzz(func(t *testing.T, in, cuts []byte, max uint16) {
		// Reference: whole-input framing.
		wantN, wantEnd := len(in), error(nil)
		for off := 0; off < len(in); {
			if len(in)-off < headerLen {
				break
			}
			typ, total, err := parseHeader(in[off:off+headerLen], int(max), "client")
			if err == nil && !frontendTypes[typ] {
				err = &ProtocolError{Code: "08P01", Msg: "invalid frontend message type"}
			}
			if err != nil {
				wantN, wantEnd = off, err
				break
			}
			if typ == 'X' {
				wantN, wantEnd = off, errClientTerminate
				break
			}
			off += total
		}

		r := &relay{s: &Session{srv: &Server{}}, max: int(max)}
		p := &pipe{fromClient: true}
		passed, off := 0, 0
		var end error
		for i := 0; off < len(in) && end == nil; i++ {
			n := len(in) - off
			if i < len(cuts) {
				n = min(n, int(cuts[i])+1)
			}
			var cut int
			cut, end = r.scan(p, in[off:off+n])
			if cut < 0 || cut > n {
				t.Fatalf("scan passed on %d of %d bytes", cut, n)
			}
			passed += cut
			off += n
		}
		var pe *ProtocolError
		switch {
		case wantEnd == nil:
			if end != nil || passed != len(in) {
				t.Fatalf("valid input: passed %d of %d bytes, ended with %v", passed, len(in), end)
			}
		case errors.Is(wantEnd, errClientTerminate) && !errors.Is(end, errClientTerminate):
			t.Fatalf("Terminate at %d: ended with %v", wantN, end)
		case !errors.Is(wantEnd, errClientTerminate) && !errors.As(end, &pe):
			t.Fatalf("bad message at %d: ended with %v, want a ProtocolError", wantN, end)
		}
		// The message that ends the session (a Terminate, which the
		// relay replaces with its own, or a bad one) is not passed on,
		// except the part of its header that arrived in earlier reads:
		// the upstream connection is closed at once, so the server never
		// acts on it.
		if wantEnd != nil && (passed < wantN || passed >= wantN+headerLen) {
			t.Fatalf("session ends at the message at %d (%v): passed %d bytes", wantN, wantEnd, passed)
		}
	})
}
