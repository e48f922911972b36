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
