//go:build !linux

package proxy

// relay is the event loop's session state; the loop exists on Linux only.
type relay struct{ half *struct{} }

func (r *relay) shutdownServer()  {}
func (r *relay) terminateServer() {}

// serverLoop is a Server's event loop; there is none here.
type serverLoop struct{}

func (*serverLoop) stop() {}

// runFast reports false: elsewhere sessions always use goroutines.
func (s *Session) runFast() (error, bool) { return nil, false }
