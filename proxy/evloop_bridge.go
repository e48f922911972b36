package proxy

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"
)

// A connection the event loop cannot take as it is, because it is not a
// socket (loopConn false), is bridged to it: the loop gets one end of a
// socketpair and two goroutines copy bytes between the other end and the
// connection, unchanged. Such connections come from a custom
// net.Listener given to Server.Serve: one whose net.Conns wrap the socket
// in a type of their own (golang.org/x/net/netutil.LimitListener, a PROXY
// protocol listener), that terminates TLS itself (tls.NewListener), or
// that has no socket at all (net.Pipe, an in-process transport).
//
// Why a bridge and not a refusal: Serve takes any net.Listener, and
// which net.Conn it yields is known only at Accept, so Serve cannot refuse
// the listener up front; refusing its sessions one by one would break a
// documented API for a configuration that works today. Why not a relay
// of its own: then such sessions would be relayed by another engine,
// with its own framing, limits, PAUSE and gate handling to keep in step
// with the loop's. The bridge is a byte pump, no protocol: everything the
// proxy does with the session's messages is the loop's. It costs two
// goroutines and a copy each way, for these connections only; a plain socket, or TLS that pgfence itself
// terminates (over its tlsTransport), is taken by the loop directly.
//
// The bridge ends with the session: when the loop closes its end, the
// copy to the connection ends and closes the connection, which ends the
// copy from it; when the peer ends the connection, the loop reads the end
// of the stream. Closing the connection (Shutdown's forced close) ends
// both.

// bridge is a connection bridged to the loop: c, and peer, the end of
// the socketpair the goroutines copy to and from.
type bridge struct {
	c    net.Conn
	peer *net.UnixConn
	wg   sync.WaitGroup
}

// bridgeConns bridges s's connections the loop cannot take (a client's,
// in practice: the upstream's are dialed by pgfence) and returns their
// bridges, nil for none. The caller waits for them at the session's end.
func (s *Session) bridgeConns() (*bridges, error) {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	var bs bridges
	for _, c := range []*net.Conn{&s.client, &s.server} {
		if _, ok := loopConn(*c); ok || (c == &s.server && s.serverClosed) {
			continue
		}
		w, rd := s.cw.Flush, &s.cf.R
		if c == &s.server {
			w, rd = s.sw.Flush, &s.sf.R
		}
		if err := w(); err != nil { // what was written to c goes first
			return nil, err
		}
		loopEnd, b, err := newBridge(*c)
		if err != nil {
			return nil, err
		}
		*c = loopEnd
		bs = append(bs, b)
		if c == &s.client {
			s.cw.Reset(loopEnd)
		} else {
			s.sw.Reset(loopEnd)
		}
		*rd = rereader(*rd, loopEnd)
	}
	return &bs, nil
}

// rereader is a reader of src with the size of rd, holding what rd
// holds (dupSockets takes it with the session).
func rereader(rd *bufio.Reader, src io.Reader) *bufio.Reader {
	b := buffered(rd)
	nr := bufio.NewReaderSize(io.MultiReader(bytes.NewReader(b), src), rd.Size())
	nr.Peek(len(b)) // into nr's buffer, all in one read
	return nr
}

// bridges are a session's bridges.
type bridges []*bridge

// wait waits, at the session's end, until each bridge has passed on what
// the loop sent through it (up to a second for a peer that does not
// read) and both its goroutines have ended.
func (bs *bridges) wait() {
	if bs == nil {
		return
	}
	for _, b := range *bs {
		b.c.SetWriteDeadline(time.Now().Add(time.Second))
		b.wg.Wait()
	}
}

// newBridge bridges c to a socketpair and returns the loop's end.
func newBridge(c net.Conn) (net.Conn, *bridge, error) {
	// SOCK_CLOEXEC is not on every Unix (macOS): close-on-exec is set
	// under ForkLock, as the standard library does there.
	syscall.ForkLock.RLock()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err == nil {
		syscall.CloseOnExec(fds[0])
		syscall.CloseOnExec(fds[1])
	}
	syscall.ForkLock.RUnlock()
	if err != nil {
		return nil, nil, fmt.Errorf("socketpair: %w", err)
	}
	loopEnd, err := fileConn(fds[0])
	if err != nil {
		syscall.Close(fds[1])
		return nil, nil, err
	}
	peer, err := fileConn(fds[1])
	if err != nil {
		loopEnd.Close()
		return nil, nil, err
	}
	b := &bridge{c: c, peer: peer.(*net.UnixConn)}
	b.wg.Add(2)
	go func() { // c → loop: the peer's end is the loop's end of the stream
		defer b.wg.Done()
		io.Copy(b.peer, c)
		b.peer.CloseWrite()
	}()
	go func() { // loop → c, until the loop closes its end
		defer b.wg.Done()
		io.Copy(c, b.peer)
		c.Close()
		b.peer.Close()
	}()
	return loopEnd, b, nil
}

// fileConn makes a net.Conn of the socket fd, taking it over.
func fileConn(fd int) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), "")
	defer f.Close() // FileConn has its own duplicate
	c, err := net.FileConn(f)
	if err != nil {
		return nil, fmt.Errorf("socketpair: %w", err)
	}
	return c, nil
}
