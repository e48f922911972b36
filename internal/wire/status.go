package wire

import "sync/atomic"

// closedMark is added to the count in flight when the session is closed
// (CloseIdle); any later increment leaves it negative.
const closedMark = -1 << 40

// Status is what a relay knows of its backend from the messages passing
// through: the transaction status of the last ReadyForQuery, and the count
// of requests in flight whose ReadyForQuery is due (a Query, a
// FunctionCall, an extended-protocol batch up to its Sync). The client
// side counts what it sends (Sent), the server side what is answered
// (Ready); the two may run at once. CloseIdle closes it for good, only
// while it is idle in both senses.
type Status struct {
	tx      atomic.Uint32 // 'I', 'T' or 'E'
	pending atomic.Int64
	inBatch bool // client side: extended-protocol messages sent since the last Sync
}

// Tx returns the transaction status of the last ReadyForQuery: 'I' idle,
// 'T' in a transaction, 'E' in a failed transaction. Any goroutine.
func (st *Status) Tx() byte { return byte(st.tx.Load()) }

// SetTx sets the transaction status: at startup (the backend's first
// ReadyForQuery), or when requests are abandoned.
func (st *Status) SetTx(tx byte) { st.tx.Store(uint32(tx)) }

// Ready records a ReadyForQuery with status tx and returns the count
// still in flight. Server side.
func (st *Status) Ready(tx byte) int64 {
	st.tx.Store(uint32(tx))
	return st.pending.Add(-1)
}

// Sent counts a message of type t sent upstream: every message written
// upstream passes here. It reports false once the status is closed.
// Client side.
func (st *Status) Sent(t byte) bool {
	var n int64
	switch t {
	case 'Q', 'F':
		n = st.pending.Add(1)
	case 'S':
		if st.inBatch {
			st.inBatch = false
			return st.pending.Load() >= 0
		}
		n = st.pending.Add(1)
	case 'P', 'B', 'D', 'E', 'C', 'H':
		if st.inBatch {
			return st.pending.Load() >= 0
		}
		st.inBatch = true
		n = st.pending.Add(1)
	default:
		return st.pending.Load() >= 0
	}
	return n >= 0
}

// Pending returns the count in flight (negative once closed).
func (st *Status) Pending() int64 { return st.pending.Load() }

// Add adds n to the count in flight and returns it: for something the
// caller counts as in flight while it looks at it (the proxy's PAUSE), or
// for requests abandoned unanswered (-n).
func (st *Status) Add(n int64) int64 { return st.pending.Add(n) }

// CloseIdle closes the status if it is idle: not in a transaction and
// nothing in flight. The compare-and-swap on the count makes it race-free
// against the client side: once it succeeds, Sent reports false.
func (st *Status) CloseIdle() bool {
	return st.Tx() == 'I' && st.pending.CompareAndSwap(0, closedMark)
}

// Closed reports whether CloseIdle closed the status.
func (st *Status) Closed() bool { return st.pending.Load() < 0 }
