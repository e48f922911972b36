//go:build !unix

package proxy

// clientEvents is 0: there is no event loop.
func clientEvents(*Session) uint64 { return 0 }
