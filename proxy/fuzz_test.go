package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"reflect"
	"strings"
	"testing"
)

// FuzzStartup: parseStartup never panics, and a session startup it accepts
// re-encodes to one that parses to the same parameters. Corpus:
// proxy/testdata/fuzz/FuzzStartup.
func FuzzStartup(f *testing.F) {
	f.Add(startupBytes(3<<16, "user", "u", "database", "d")[4:])
	f.Add(startupBytes(3<<16|2, "user", "u", "_pq_.x", "y", "options", "-c fence.token=1")[4:])
	f.Add([]byte{0x04, 0xd2, 0x16, 0x2f})
	f.Add([]byte{0x04, 0xd2, 0x16, 0x2e, 0, 0, 0, 1, 0, 0, 0, 2})
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := parseStartup(b)
		if err != nil {
			var pe *ProtocolError
			if !errors.As(err, &pe) || len(pe.Code) != 5 {
				t.Fatalf("error %v is not a ProtocolError with a SQLSTATE", err)
			}
			return
		}
		if st.kind != startupSession {
			return
		}
		if st.params["user"] == "" || st.params["database"] == "" {
			t.Fatalf("accepted startup without user/database: %v", st.params)
		}
		var kv []string
		for _, k := range st.order {
			if strings.ContainsRune(k, 0) || strings.ContainsRune(st.params[k], 0) {
				t.Fatalf("NUL inside parameter %q", k)
			}
			kv = append(kv, k, st.params[k])
		}
		again, err := parseStartup(startupBytes(st.version, kv...)[4:])
		if err != nil || !reflect.DeepEqual(again.params, st.params) {
			t.Fatalf("re-encoded startup: %v, params %v, want %v", err, again, st.params)
		}
	})
}

// FuzzFraming: the framer never panics on any byte stream, forwards
// exactly the bytes of the complete messages it accepts, and stops with
// an error (never silently) on the rest. Corpus:
// proxy/testdata/fuzz/FuzzFraming.
func FuzzFraming(f *testing.F) {
	f.Add(pipelineBytes(2), uint16(1024), uint16(0))
	f.Add([]byte{'Q', 0, 0, 0, 9, 'S', 'E', 'L', 0, 'X', 0, 0, 0, 4}, uint16(16), uint16(8))
	f.Add([]byte{'Q', 0xff, 0xff, 0xff, 0xff}, uint16(64), uint16(0))
	f.Add(append([]byte{'d', 0, 0, 8, 4}, bytes.Repeat([]byte{1}, 2048)...), uint16(16), uint16(0))
	f.Fuzz(func(t *testing.T, in []byte, bufSize uint16, max uint16) {
		size := int(bufSize)%8192 + 16
		var out bytes.Buffer
		w := bufio.NewWriterSize(&out, size)
		fr := &framer{r: bufio.NewReaderSize(bytes.NewReader(in), size), max: int(max), flush: w.Flush, from: "client"}
		consumed := 0
		var err error
		for {
			var total int
			if _, total, err = fr.next(); err != nil {
				break
			}
			if total <= size {
				var msg []byte
				if msg, err = fr.whole(total); err != nil {
					break
				}
				w.Write(msg)
				fr.discard(total)
			} else if err = fr.stream(w, total); err != nil {
				break
			}
			consumed += total
		}
		w.Flush()
		if err == nil {
			t.Fatal("framer ended without an error")
		}
		if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
			var pe *ProtocolError
			if !errors.As(err, &pe) {
				t.Fatalf("unexpected error type %T: %v", err, err)
			}
		}
		if !bytes.Equal(out.Bytes()[:consumed], in[:consumed]) {
			t.Fatal("forwarded bytes differ from the input")
		}
		if out.Len() > len(in) {
			t.Fatalf("forwarded %d bytes from %d", out.Len(), len(in))
		}
	})
}
