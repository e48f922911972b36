package proxy

import (
	"errors"

	"github.com/pgfence/pgfence/internal/wire"
)

// errSessionClosing ends a Handler's wait when its session is ending.
var errSessionClosing = errors.New("session closing")

// inject sends msg upstream like Inject; with visible its responses reach
// the client as those of a client request do. Client goroutine only.
func (s *Session) inject(msg []byte, tag any, visible bool) (*Request, error) {
	if !s.account(msg[0]) {
		return nil, errShutdown
	}
	var r *Request
	if wire.ProducesResponse(msg[0]) {
		r = wire.NewInjected(msg[0], tag, visible)
		s.q.Push(r)
	}
	if _, err := s.sw.Write(msg); err != nil {
		return nil, err
	}
	return r, nil
}

// head is the request whose responses are arriving. Server goroutine only.
func (s *Session) head() *Request { return s.q.Front() }
