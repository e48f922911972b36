//go:build !unix

package proxy

// The proxy runs on Unix systems only: its one relay engine, the event
// loop (evloop.go), waits in epoll (Linux) or poll(2) (every Unix), and
// there is no other engine to fall back on. This line stops a build
// elsewhere (Windows) with the reason, rather than with a list of
// undefined names.
var _ int = "pgfence runs on Unix systems only: its event loop waits in epoll or poll(2)"
