package wire

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"
)

// pipelineBytes is a realistic client stream: pgbench -M extended's
// select-only transaction, repeated.
func pipelineBytes(n int) []byte {
	var b []byte
	for i := 0; i < n; i++ {
		b, _ = (&pgproto3.Parse{Query: "SELECT abalance FROM pgbench_accounts WHERE aid = $1"}).Encode(b)
		b, _ = (&pgproto3.Bind{Parameters: [][]byte{[]byte("12345")}}).Encode(b)
		b, _ = (&pgproto3.Describe{ObjectType: 'P'}).Encode(b)
		b, _ = (&pgproto3.Execute{}).Encode(b)
		b, _ = (&pgproto3.Sync{}).Encode(b)
	}
	return b
}

// pump forwards every message from r to w as the pass-through loop does.
func pump(f *Framer, w *bufio.Writer) error {
	size := f.R.Size()
	for {
		_, total, err := f.Next()
		if err != nil {
			return err
		}
		if total <= size {
			msg, err := f.Whole(total)
			if err != nil {
				return err
			}
			w.Write(msg)
			f.Discard(total)
		} else if err := f.Stream(w, total); err != nil {
			return err
		}
	}
}

func TestFramingForwardsExactly(t *testing.T) {
	big := bytes.Repeat([]byte("x"), 100_000)
	var in []byte
	in = append(in, pipelineBytes(3)...)
	in, _ = (&pgproto3.Query{String: string(big)}).Encode(in) // larger than the buffer
	in = append(in, pipelineBytes(2)...)
	var out bytes.Buffer
	w := bufio.NewWriterSize(&out, 4096)
	flushes := 0
	f := &Framer{R: bufio.NewReaderSize(bytes.NewReader(in), 4096), Flush: func() error { flushes++; return w.Flush() }, From: "client"}
	if err := pump(f, w); !errors.Is(err, io.EOF) {
		t.Fatalf("pump: %v", err)
	}
	if !bytes.Equal(out.Bytes(), in) {
		t.Fatalf("forwarded %d bytes, want the %d input bytes unchanged", out.Len(), len(in))
	}
	if flushes > len(in)/4096+3 {
		t.Errorf("%d flushes for %d bytes: writes are not coalesced", flushes, len(in))
	}
}

func TestFramingRejectsBadLengths(t *testing.T) {
	for _, tc := range []struct {
		hdr  []byte
		max  int
		want error
	}{
		{[]byte{'Q', 0, 0, 0, 3}, 0, nil},
		{[]byte{'Q', 0x80, 0, 0, 0}, 0, nil},
		{[]byte{'Q', 0x40, 0, 0, 1}, 0, nil},
		{[]byte{'Q', 0, 0, 1, 5}, 256, ErrMessageTooLarge},
	} {
		_, _, err := ParseHeader(tc.hdr, tc.max, "client")
		var pe *ProtocolError
		if !errors.As(err, &pe) || pe.Code != "08P01" {
			t.Errorf("header %v: got %v, want 08P01", tc.hdr, err)
		}
		if tc.want != nil && !errors.Is(err, tc.want) {
			t.Errorf("header %v: got %v, want %v", tc.hdr, err, tc.want)
		}
	}
	if _, total, err := ParseHeader([]byte{'Q', 0, 0, 1, 4}, 256, "client"); err != nil || total != 261 {
		t.Errorf("limit-sized message: got %d %v, want 261", total, err)
	}
}

// TestFramingAllocs proves the pass-through path allocates nothing per
// message in steady state.
func TestFramingAllocs(t *testing.T) {
	in := pipelineBytes(1000)
	src := bytes.NewReader(in)
	w := bufio.NewWriterSize(io.Discard, 32<<10)
	f := &Framer{R: bufio.NewReaderSize(src, 32<<10), Flush: w.Flush, From: "client"}
	allocs := testing.AllocsPerRun(20, func() {
		src.Reset(in)
		f.R.Reset(src)
		pump(f, w)
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per 5000 messages, want 0", allocs)
	}
}

func BenchmarkPassThrough(b *testing.B) {
	in := pipelineBytes(1000)
	src := bytes.NewReader(in)
	w := bufio.NewWriterSize(io.Discard, 32<<10)
	f := &Framer{R: bufio.NewReaderSize(src, 32<<10), Flush: w.Flush, From: "client"}
	b.SetBytes(int64(len(in)))
	b.ReportAllocs()
	for b.Loop() {
		src.Reset(in)
		f.R.Reset(src)
		pump(f, w)
	}
}

// FuzzFraming: the framer never panics on any byte stream, forwards
// exactly the bytes of the complete messages it accepts, and stops with
// an error (never silently) on the rest. Corpus:
// internal/wire/testdata/fuzz/FuzzFraming.
func FuzzFraming(f *testing.F) {
	f.Add(pipelineBytes(2), uint16(1024), uint16(0))
	f.Add([]byte{'Q', 0, 0, 0, 9, 'S', 'E', 'L', 0, 'X', 0, 0, 0, 4}, uint16(16), uint16(8))
	f.Add([]byte{'Q', 0xff, 0xff, 0xff, 0xff}, uint16(64), uint16(0))
	f.Add(append([]byte{'d', 0, 0, 8, 4}, bytes.Repeat([]byte{1}, 2048)...), uint16(16), uint16(0))
	f.Fuzz(func(t *testing.T, in []byte, bufSize uint16, max uint16) {
		size := int(bufSize)%8192 + 16
		var out bytes.Buffer
		w := bufio.NewWriterSize(&out, size)
		fr := &Framer{R: bufio.NewReaderSize(bytes.NewReader(in), size), Max: int(max), Flush: w.Flush, From: "client"}
		consumed := 0
		var err error
		for {
			var total int
			if _, total, err = fr.Next(); err != nil {
				break
			}
			if total <= size {
				var msg []byte
				if msg, err = fr.Whole(total); err != nil {
					break
				}
				w.Write(msg)
				fr.Discard(total)
			} else if err = fr.Stream(w, total); err != nil {
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
