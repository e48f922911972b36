//go:build !linux

package proxy

// relay is the event loop's session state; the loop exists on Linux only.
type relay struct{}

func (r *relay) shutdownServer() {}

// runFast reports false: elsewhere sessions always use goroutines.
func (s *Session) runFast() (error, bool) { return nil, false }
