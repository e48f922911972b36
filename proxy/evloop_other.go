//go:build !linux

package proxy

// relay is the event loop's session state; the loop exists on Linux only.
type relay struct{ intercept *struct{} }

func (r *relay) stopServer() {}

// serverLoop is a Server's event loop; there is none here.
type serverLoop struct{}

func (*serverLoop) stop() {}

// runOnLoop reports false: elsewhere sessions always use goroutines.
func (s *Session) runOnLoop() (error, bool) { return nil, false }

// parkClient is never called: a session is never on a loop here.
func (s *Session) parkClient(func() bool, func() error) error { return ErrWait }

// loopReplica is a replica connection read by the event loop; there is
// none here.
type loopReplica struct{}

func (*loopReplica) stop()    {}
func (*loopReplica) release() {}

// replicaOnLoop reports false: the replica's reader is a goroutine.
func (s *Session) replicaOnLoop(rc *replicaConn) (bool, error) { return false, nil }

// deliverOff and parkOff are never called: a session is never on a loop
// here (offClient calls its f itself).
func (s *Session) deliverOff([]byte) error                                     { return ErrWait }
func (s *Session) parkOff(func() error, func(error) error, func(), bool) error { return ErrWait }

// endOnLoop is never called: no loop reads a replica connection here.
func (*loopReplica) endOnLoop() {}
