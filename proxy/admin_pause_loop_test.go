//go:build unix

package proxy

// clientEvents returns how many events the event loop has had for the
// client socket of ss (0 off the loop).
func clientEvents(ss *Session) uint64 {
	ss.connMu.Lock()
	defer ss.connMu.Unlock()
	switch r := ss.loopRelay; {
	case r == nil:
		return 0
	case r.intercept != nil:
		return r.intercept.clientEventCount.Load()
	default:
		return r.clientEventCount.Load()
	}
}
