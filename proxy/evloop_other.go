//go:build !unix

package proxy

import (
	"fmt"
	"runtime"
)

// The event loop runs on every Unix (evloop.go); this is what a build
// elsewhere (not a target: Windows) needs to compile, every session on
// goroutines.

// relay is the event loop's session state.
type relay struct{ intercept *struct{} }

func (r *relay) stopServer() {}

// serverLoop is a Server's event loop; there is none here.
type serverLoop struct{ poller, used string }

// defaultPoller is Config.Poller's default: none.
const defaultPoller = ""

// checkPoller refuses every poller but the default: there is none here.
func checkPoller(kind string) error {
	if kind != "" {
		return fmt.Errorf("poller %q: there is no event loop on %s", kind, runtime.GOOS)
	}
	return nil
}

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
