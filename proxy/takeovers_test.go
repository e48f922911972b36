package proxy

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestTakeoversBounded: whatever is notified, the takeover tracker holds a
// bounded set of job keys to read (hints at most half of it), drops
// payloads that name no possible job, and remembers a bounded number of
// jobs. A notification that finds the set full is not lost: it is
// covered by position (dropped).
func TestTakeoversBounded(t *testing.T) {
	var tk takeovers
	for _, p := range []string{`not json`, `[1]`, `{"job_key": 7}`, `{"job_key": ""}`, `{}`, ``,
		`{"job_key": "` + strings.Repeat("x", maxJobKeyLen+1) + `"}`, `{"job_key": null, "token": 1}`,
		`{"job_key": "a\u0000b"}`} {
		if tk.note(p) {
			t.Fatalf("payload %.40q named a job", p)
		}
	}
	if tk.hasPending() {
		t.Fatal("payloads that name no job left something to read")
	}
	if possibleJobKey("a\xffb") || !possibleJobKey("é") {
		t.Fatal("possibleJobKey: invalid UTF-8 is no key, a non-ASCII one is")
	}
	for i := range 2000 {
		tk.hint(fmt.Sprintf("hint-%d", i))
	}
	if tk.hinted != maxPendingJobs/2 || len(tk.pending) != maxPendingJobs/2 {
		t.Fatalf("hints hold %d keys (%d pending), want at most half the set", tk.hinted, len(tk.pending))
	}
	for i := range 5000 {
		tk.note(fmt.Sprintf(`{"job_key": "job-%d", "token": 9223372036854775807}`, i))
	}
	tk.note(`{"job_key": "hint-1"}`) // already pending: now notified
	if len(tk.pending) != maxPendingJobs || tk.pbytes > maxPendingBytes || !tk.dropped || !tk.pending["hint-1"] {
		t.Fatalf("pending %d keys, %d bytes, dropped %v, hint-1 notified %v", len(tk.pending), tk.pbytes, tk.dropped, tk.pending["hint-1"])
	}
	jobs, dropped, _ := tk.take()
	if len(jobs) != maxPendingJobs || !dropped || tk.hasPending() || tk.pbytes != 0 || tk.hinted != 0 {
		t.Fatalf("take: %d jobs, dropped %v; left pending %v", len(jobs), dropped, tk.hasPending())
	}
	// Long keys: the bytes bound holds before the count.
	long := strings.Repeat("é", maxJobKeyLen-10)
	for i := range 2000 {
		tk.note(fmt.Sprintf(`{"job_key": "%s%d"}`, long, i))
	}
	if tk.pbytes > maxPendingBytes {
		t.Fatalf("pending keys hold %d bytes", tk.pbytes)
	}

	for i := range maxKnownJobs + 100 {
		tk.update(fmt.Sprintf("known-%d", i), takeover{token: int64(i + 1), lsn: LSN(i + 1)})
	}
	if len(tk.jobs) > maxKnownJobs || tk.bytes > maxKnownBytes {
		t.Fatalf("%d jobs known (%d bytes of keys)", len(tk.jobs), tk.bytes)
	}
}

// TestTakeoversUpdate: a fence row read again keeps its first position for
// the same token; a newer token or a retirement is a change.
func TestTakeoversUpdate(t *testing.T) {
	var tk takeovers
	if _, changed := tk.update("j", takeover{epoch: 1, token: 5, lsn: 100}); !changed {
		t.Fatal("a new job is a change")
	}
	if got, changed := tk.update("j", takeover{epoch: 1, token: 5, lsn: 200}); changed || got.lsn != 100 {
		t.Fatalf("the same row read later: %+v, changed %v", got, changed)
	}
	if got, changed := tk.update("j", takeover{epoch: 1, token: 5, retired: true, lsn: 300}); !changed || got.lsn != 100 || !got.retired {
		t.Fatalf("retired: %+v, changed %v", got, changed)
	}
	if got, changed := tk.update("j", takeover{epoch: 1, token: 4, lsn: 400}); changed || got.token != 5 {
		t.Fatalf("an older token: %+v, changed %v", got, changed)
	}
	if got, changed := tk.update("j", takeover{epoch: 2, token: 9, lsn: 500}); !changed || got.lsn != 500 {
		t.Fatalf("a newer token: %+v, changed %v", got, changed)
	}
}

func TestTextArray(t *testing.T) {
	if got := string(textArray([]string{`a"b\c`, "", "x,y"})); got != `{"a\"b\\c","","x,y"}` {
		t.Fatalf("textArray: %s", got)
	}
}

// TestTakeoversFreshness: the tracker is current only within freshWithin
// of its last marker's sending; a read that finds it older than freshAsk
// asks for a marker (one wake of the watcher, however many ask); a
// marker in flight for longer than freshWithin is not waited for; each
// publication wakes the waiters.
func TestTakeoversFreshness(t *testing.T) {
	tk := takeovers{kick: make(chan struct{}, 1)}
	now := time.Now()
	if tk.current(now) {
		t.Fatal("current before any marker")
	}
	if !tk.markAsk.Load() || len(tk.kick) != 1 {
		t.Fatal("a stale read did not ask for a marker")
	}
	<-tk.kick
	tk.current(now)
	if len(tk.kick) != 0 {
		t.Fatal("a second ask woke the watcher again before it took the first")
	}
	tk.markAsk.Store(false)
	ch := tk.published()
	tk.publish(now.Add(-freshAsk / 2))
	select {
	case <-ch:
	default:
		t.Fatal("publish did not wake the waiters")
	}
	if !tk.current(now) || tk.markAsk.Load() {
		t.Fatal("a marker sent freshAsk/2 ago: want current, no ask")
	}
	if !tk.current(now.Add(freshAsk/2+time.Millisecond)) || !tk.markAsk.Load() {
		t.Fatal("past freshAsk: want current and an ask")
	}
	if tk.current(now.Add(freshWithin)) {
		t.Fatal("past freshWithin: want stale")
	}
	tk.publish(now.Add(-time.Hour)) // an older marker never moves it back
	if !tk.current(now) {
		t.Fatal("an older marker made the tracker stale")
	}
	tk.markSent.Store(now.Add(-2 * freshWithin).UnixNano())
	if tk.waitable(now) {
		t.Fatal("a marker in flight for 2*freshWithin is waited for")
	}
	tk.markSent.Store(now.UnixNano())
	if !tk.waitable(now) {
		t.Fatal("a marker just sent is not waited for")
	}
}
