package wire

import "testing"

// TestStatus: requests are counted in flight until their ReadyForQuery —
// a Query or FunctionCall each, an extended batch once up to its Sync —
// and the status closes only while idle, after which nothing more is sent.
func TestStatus(t *testing.T) {
	var st Status
	st.SetTx('I')
	for _, c := range []byte("PBDES") {
		if !st.Sent(c) {
			t.Fatalf("Sent(%q) refused while open", c)
		}
	}
	if got := st.Pending(); got != 1 {
		t.Fatalf("an extended batch counts %d in flight, want 1", got)
	}
	st.Sent('Q')
	st.Sent('d') // CopyData: no ReadyForQuery of its own
	if got := st.Pending(); got != 2 {
		t.Fatalf("batch and Query: %d in flight, want 2", got)
	}
	if st.CloseIdle() {
		t.Fatal("closed with requests in flight")
	}
	if n := st.Ready('T'); n != 1 || st.Tx() != 'T' {
		t.Fatalf("after a ReadyForQuery: %d in flight, status %q, want 1, 'T'", n, st.Tx())
	}
	if n := st.Ready('T'); n != 0 || st.CloseIdle() {
		t.Fatalf("in a transaction: %d in flight, closed anyway", n)
	}
	st.Sent('Q')
	st.Ready('I')
	if !st.CloseIdle() || !st.Closed() {
		t.Fatal("idle, not closed")
	}
	if st.Sent('Q') || st.Sent('X') {
		t.Fatal("sent after the status closed")
	}
}
