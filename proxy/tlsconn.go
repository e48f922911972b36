package proxy

import (
	"io"
	"net"
)

// tlsTransport is the connection under a client's tls.Conn (startup).
// Before the event loop relays the session (the handshake, the
// authentication, the startup) it is the accepted socket. Once the loop
// relays it it is the loop's I/O on
// the socket (loop, set by the session goroutine before the loop can see
// the session: evloop_tls.go), which never blocks: a read with
// nothing to read returns errTransportWouldBlock, which tls.Conn takes as
// temporary, keeping its state and any partial record for the next read.
type tlsTransport struct {
	net.Conn
	loop io.ReadWriteCloser
}

func (t *tlsTransport) Read(b []byte) (int, error) {
	if t.loop != nil {
		return t.loop.Read(b)
	}
	return t.Conn.Read(b)
}

func (t *tlsTransport) Write(b []byte) (int, error) {
	if t.loop != nil {
		return t.loop.Write(b)
	}
	return t.Conn.Write(b)
}

func (t *tlsTransport) Close() error {
	if t.loop != nil {
		return t.loop.Close()
	}
	return t.Conn.Close()
}

// errTransportWouldBlock is what a tlsTransport on the loop returns when
// the socket has nothing to read: a net.Error that is temporary (and a
// timeout), so that tls.Conn does not record it as the connection's
// error (crypto/tls readRecordOrCCS).
var errTransportWouldBlock net.Error = transportWouldBlock{}

type transportWouldBlock struct{}

func (transportWouldBlock) Error() string   { return "would block" }
func (transportWouldBlock) Timeout() bool   { return true }
func (transportWouldBlock) Temporary() bool { return true }
