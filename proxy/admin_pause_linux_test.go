package proxy

// clientEvents returns how many events the event loop has had for the
// client socket of ss (0 off the loop).
func clientEvents(ss *Session) uint64 {
	ss.connMu.Lock()
	defer ss.connMu.Unlock()
	switch r := ss.fast; {
	case r == nil:
		return 0
	case r.half != nil:
		return r.half.cEvents.Load()
	default:
		return r.cEvents.Load()
	}
}
