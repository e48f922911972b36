package wire

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"slices"
	"testing"
)

// framerEvents reads in whole with a Framer, as the goroutine path does,
// and lists what a Scanner must report for it: for a client's stream each
// message's header (offset, type, size) and, at a message over max that
// is answered, "oversized"; for a server's stream the offset just after
// each ReadyForQuery's status byte, with the status; and the error at the
// header the stream stops at, if any.
func framerEvents(in []byte, max int, client bool) []string {
	from := "server"
	if client {
		from = "client"
	}
	fr := &Framer{R: bufio.NewReaderSize(bytes.NewReader(in), 64), Max: max, From: from, Client: client}
	var ev []string
	for off := 0; ; {
		typ, total, err := fr.Next()
		var pe *ProtocolError
		switch {
		case errors.As(err, &pe):
			return append(ev, fmt.Sprintf("%d bad %s %s", off, pe.Code, pe.Error()))
		case err != nil:
			return ev // the stream ends in a header
		case client && max > 0 && total-HeaderLen > max:
			return append(ev, fmt.Sprintf("%d oversized %q %d", off, typ, total))
		case client:
			ev = append(ev, fmt.Sprintf("%d message %q %d", off, typ, total))
			if fr.Stream(io.Discard, total) != nil {
				return ev // the stream ends in the body
			}
		default:
			msg, err := fr.ReadInto(nil, total)
			if err != nil {
				return ev
			}
			if st, ok := ReadyStatus(msg); ok {
				ev = append(ev, fmt.Sprintf("%d ready %q", off+total, st))
			}
		}
		off += total
	}
}

// scannerEvents feeds in to a Scanner in pieces cut by cuts, keeping a
// header split between pieces and feeding it again in front of the next,
// as the event loop does, and lists what it reports (framerEvents' form).
func scannerEvents(t *testing.T, in, cuts []byte, max int, client bool) []string {
	from := "server"
	if client {
		from = "client"
	}
	sc := &Scanner{Max: max, From: from, Client: client}
	var ev []string
	base, kept := 0, 0 // in[base:base+kept] is a header held back
	for k := 0; base+kept < len(in); k++ {
		n := len(in) - base - kept
		if k < len(cuts) {
			n = min(n, int(cuts[k])+1)
		}
		b := in[base : base+kept+n]
		i := 0
	scan:
		for {
			at, e := sc.Next(b, i)
			if at < i || at > len(b) {
				t.Fatalf("Next(%d) stopped at %d of %d", i, at, len(b))
			}
			switch e {
			case More:
				if len(b)-at >= HeaderLen {
					t.Fatalf("More at %d with %d bytes left: a whole header", at, len(b)-at)
				}
				base, kept = base+at, len(b)-at
				break scan
			case Ready:
				ev = append(ev, fmt.Sprintf("%d ready %q", base+at, b[at-1]))
				i = at
			case AtHeader:
				switch total, e := sc.Check(b, at); e {
				case Message:
					ev = append(ev, fmt.Sprintf("%d message %q %d", base+at, b[at], total))
					i = sc.Enter(b, at, total)
					continue
				case Oversized:
					return append(ev, fmt.Sprintf("%d oversized %q %d", base+at, b[at], total))
				}
				fallthrough
			case Bad:
				var pe *ProtocolError
				if !errors.As(sc.Err(), &pe) {
					t.Fatalf("Bad with %v, want a *ProtocolError", sc.Err())
				}
				return append(ev, fmt.Sprintf("%d bad %s %s", base+at, pe.Code, pe.Error()))
			}
		}
	}
	return ev
}

// FuzzScanner: the Scanner (the event loop's framing), fed a stream in
// arbitrary pieces, never panics and agrees with the Framer (the
// goroutine path's) reading it whole: the same client messages at the
// same offsets, the same ReadyForQuery status bytes, the same stop at a
// message over the limit, and the same error, with the same SQLSTATE and
// text, at the same bad header. Corpus:
// internal/wire/testdata/fuzz/FuzzScanner.
func FuzzScanner(f *testing.F) {
	f.Add(pipelineBytes(2), []byte{3, 200, 7}, uint16(0), true)
	f.Add([]byte{'Q', 0, 0, 0, 9, 'S', 'E', 'L', 0, 'X', 0, 0, 0, 4, 'Q'}, []byte{1}, uint16(8), true)
	f.Add([]byte{'Q', 0xff, 0xff, 0xff, 0xff}, []byte{2, 2}, uint16(64), true)
	f.Add([]byte{'Q', 0, 0, 0, 5, 0, 'z', 0, 0, 0, 4}, []byte{}, uint16(0), true)
	f.Add([]byte{'S', 0, 0, 0, 4, 'P', 0, 0, 0, 40, 1, 2, 3}, []byte{6, 1}, uint16(16), true)
	f.Add([]byte{'1', 0, 0, 0, 4, 'Z', 0, 0, 0, 5, 'I', 'D', 0, 0, 0, 6, 0, 1, 'Z', 0, 0, 0, 5, 'T'}, []byte{0, 4, 0, 0, 9}, uint16(0), false)
	f.Add([]byte{'Z', 0, 0, 0, 6, 'I', 'x', 'Z', 0, 0, 0, 3}, []byte{5}, uint16(0), false)
	f.Fuzz(func(t *testing.T, in, cuts []byte, max uint16, client bool) {
		want := framerEvents(in, int(max), client)
		got := scannerEvents(t, in, cuts, int(max), client)
		if !slices.Equal(got, want) {
			t.Fatalf("scanner reported\n\t%q\nframer\n\t%q", got, want)
		}
	})
}

func BenchmarkScanServer(b *testing.B) {
	var in []byte
	for range 1000 {
		in = append(in, '1', 0, 0, 0, 4, '2', 0, 0, 0, 4, 'D', 0, 0, 0, 11, 0, 1, 0, 0, 0, 1, '0')
		in = append(in, 'C', 0, 0, 0, 13, 'S', 'E', 'L', 'E', 'C', 'T', ' ', '1', 0, 'Z', 0, 0, 0, 5, 'I')
	}
	sc := &Scanner{From: "server"}
	b.SetBytes(int64(len(in)))
	b.ReportAllocs()
	for b.Loop() {
		for i := 0; ; {
			at, ev := sc.Next(in, i)
			if ev == More {
				break
			}
			i = at
		}
	}
}

func BenchmarkScanClient(b *testing.B) {
	in := pipelineBytes(1000)
	sc := &Scanner{From: "client", Client: true}
	b.SetBytes(int64(len(in)))
	b.ReportAllocs()
	for b.Loop() {
		for i := 0; ; {
			at, ev := sc.Next(in, i)
			if ev != AtHeader {
				break
			}
			total, ev := sc.Check(in, at)
			if ev != Message {
				break
			}
			i = sc.Enter(in, at, total)
		}
	}
}
