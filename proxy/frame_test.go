package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"reflect"
	"strings"
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
func pump(f *framer, w *bufio.Writer) error {
	size := f.r.Size()
	for {
		_, total, err := f.next()
		if err != nil {
			return err
		}
		if total <= size {
			msg, err := f.whole(total)
			if err != nil {
				return err
			}
			w.Write(msg)
			f.discard(total)
		} else if err := f.stream(w, total); err != nil {
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
	f := &framer{r: bufio.NewReaderSize(bytes.NewReader(in), 4096), flush: func() error { flushes++; return w.Flush() }, from: "client"}
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
		_, _, err := parseHeader(tc.hdr, tc.max, "client")
		var pe *ProtocolError
		if !errors.As(err, &pe) || pe.Code != "08P01" {
			t.Errorf("header %v: got %v, want 08P01", tc.hdr, err)
		}
		if tc.want != nil && !errors.Is(err, tc.want) {
			t.Errorf("header %v: got %v, want %v", tc.hdr, err, tc.want)
		}
	}
	if _, total, err := parseHeader([]byte{'Q', 0, 0, 1, 4}, 256, "client"); err != nil || total != 261 {
		t.Errorf("limit-sized message: got %d %v, want 261", total, err)
	}
}

// TestFramingAllocs proves the pass-through path allocates nothing per
// message in steady state.
func TestFramingAllocs(t *testing.T) {
	in := pipelineBytes(1000)
	src := bytes.NewReader(in)
	w := bufio.NewWriterSize(io.Discard, 32<<10)
	f := &framer{r: bufio.NewReaderSize(src, 32<<10), flush: w.Flush, from: "client"}
	allocs := testing.AllocsPerRun(20, func() {
		src.Reset(in)
		f.r.Reset(src)
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
	f := &framer{r: bufio.NewReaderSize(src, 32<<10), flush: w.Flush, from: "client"}
	b.SetBytes(int64(len(in)))
	b.ReportAllocs()
	for b.Loop() {
		src.Reset(in)
		f.r.Reset(src)
		pump(f, w)
	}
}

func TestParseStartup(t *testing.T) {
	body := func(b []byte) []byte { return b[4:] }
	st, err := parseStartup(body(startupBytes(3<<16, "user", "alice", "options", "-c fence.token=18", "_pq_.x", "1", "application_name", "w")))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"user": "alice", "database": "alice", "options": "-c fence.token=18", "application_name": "w"}
	if !reflect.DeepEqual(st.params, want) {
		t.Errorf("params %v, want %v", st.params, want)
	}
	if !reflect.DeepEqual(st.unknown, []string{"_pq_.x"}) || !st.needsNegotiation() {
		t.Errorf("unknown %v, want [_pq_.x] and negotiation", st.unknown)
	}
	cancel := []byte{0x04, 0xd2, 0x16, 0x2e, 0, 0, 0, 7, 1, 2, 3, 4}
	st, err = parseStartup(cancel)
	if err != nil || st.kind != startupCancel || st.cancelPID != 7 || !bytes.Equal(st.cancelSecret, []byte{1, 2, 3, 4}) {
		t.Errorf("cancel: got %+v %v", st, err)
	}
	for _, bad := range [][]byte{nil, {0, 3}, {0, 3, 0, 0}, {0, 3, 0, 0, 'u', 0}, {0x04, 0xd2, 0x16, 0x2f, 0}, {0x04, 0xd2, 0x16, 0x2e, 0, 0}} {
		if _, err := parseStartup(bad); err == nil {
			t.Errorf("parseStartup(%q) succeeded, want an error", bad)
		}
	}
}

func TestMatch(t *testing.T) {
	// Each case: request types queued, server message types in order, and
	// the expected completed/skipped log.
	for _, tc := range []struct {
		name string
		reqs string
		resp string
		want string // per request: c completed, s skipped
	}{
		{"simple query", "QQ", "TDCZ" + "CCEZ", "cc"},
		{"extended", "PBDES", "12TDDCZ", "ccccc"},
		{"describe statement", "DS", "tTZ", "cc"},
		{"suspended", "EES", "DsDCZ", "ccc"},
		{"error skips to sync", "PBEPBES" + "PS", "1E" + "Z" + "1Z", "ccssssc" + "cc"},
		{"copy in via execute", "PBES", "12GCZ", "cccc"},
		{"async in between", "Q", "NASTDCZ", "c"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var q queue
			var reqs []*Request
			for _, c := range []byte(tc.reqs) {
				r := &Request{Type: c, done: make(chan struct{})}
				reqs = append(reqs, r)
				q.push(r)
			}
			for _, m := range []byte(tc.resp) {
				var ht byte
				if h := q.front(); h != nil {
					ht = h.Type
				}
				switch match(ht, m) {
				case matchComplete:
					q.pop()
				case matchError:
					q.pop()
					q.skipToSync()
				}
			}
			var got strings.Builder
			for _, r := range reqs {
				select {
				case <-r.done:
					if r.Skipped {
						got.WriteByte('s')
					} else {
						got.WriteByte('c')
					}
				default:
					got.WriteByte('-')
				}
			}
			if got.String() != tc.want {
				t.Fatalf("got %s, want %s", got.String(), tc.want)
			}
		})
	}
}

func TestUsersFile(t *testing.T) {
	v, err := MakeVerifier("alice", "secret")
	if err != nil {
		t.Fatal(err)
	}
	line := QuoteUserLine(`al"ice`, v)
	users, err := parseUsers(strings.NewReader("; comment\n\n# another\n"+line+"\n"), "users.txt")
	if err != nil {
		t.Fatal(err)
	}
	if users[`al"ice`] != v {
		t.Fatalf("got %v, want al\"ice → %s", users, v)
	}
	if _, err := parseUsers(strings.NewReader(`"bob" "md5abc"`), "users.txt"); err == nil || !strings.Contains(err.Error(), "users.txt:1") {
		t.Fatalf("md5 verifier: got %v, want an error naming users.txt:1", err)
	}
	if _, err := parseUsers(strings.NewReader(`"bob`), "users.txt"); err == nil {
		t.Fatal("unterminated quote accepted")
	}
}
