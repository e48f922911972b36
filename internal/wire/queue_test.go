package wire

import (
	"strings"
	"testing"
)

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
			var q Queue
			var reqs []*Request
			for _, c := range []byte(tc.reqs) {
				r := &Request{Type: c, done: make(chan struct{})}
				reqs = append(reqs, r)
				q.Push(r)
			}
			for _, m := range []byte(tc.resp) {
				_, match := q.Answering(m)
				q.Advance(match)
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

// TestQueueNeverEmpty: a queue that is never empty (a client pipelining
// without pause, its answers arriving as it sends) keeps its requests in
// order and its array bounded by what is outstanding, not by all it has
// seen; Len counts what is outstanding (the backlog bound reads it).
func TestQueueNeverEmpty(t *testing.T) {
	var q Queue
	var sent, got int
	push := func() { q.Push(&Request{Type: 'C', Tag: sent}); sent++ }
	for range 100 {
		push()
	}
	for range 100_000 {
		push()
		if tag := q.Front().Tag.(int); tag != got {
			t.Fatalf("front is request %d, want %d", tag, got)
		}
		q.Pop()
		got++
		if n := q.Len(); n != 100 {
			t.Fatalf("Len %d, want 100 outstanding", n)
		}
	}
	if cap(q.reqs) > 4096 {
		t.Fatalf("array of %d for 100 outstanding", cap(q.reqs))
	}
}
