package proxy

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"syscall"
	"time"
)

// This file holds the sockets of a session on the loop as the relays
// read and write them (sock): the socket itself, or a TLS connection over
// it, the client's or the upstream's.
//
// A TLS client's tls.Conn is made over a tlsTransport (tlsconn.go), and
// so is an upstream's (through pgconn.Config.DialFunc: upstreamConfig).
// When the session comes onto the loop its transport becomes a
// loopTransport:
// its reads read the socket without blocking, its writes write what the
// socket takes and hold the rest (ciphertext) for the loop to write when
// the socket has room, as the loop does with plaintext. tls.Conn keeps its
// state across a read that would block (a temporary net.Error), a partial
// record included, so the loop reads it as it reads a plain socket, with
// one difference: tls.Conn may hold decrypted bytes, or whole records,
// that are no longer in the socket, and no poller event comes for them. So
// a read drains it until it would block (or the caller's buffer is full:
// then sock.more is set and the caller reads again when it has room), and
// a session coming onto the loop is read once without an event
// (kick). The peer's close_notify, an alert, or a record that does not
// decrypt end the session as the end of the stream or an error would. A
// post-handshake message (a TLS 1.3 KeyUpdate) is handled inside the read;
// its answer is written like any other ciphertext.
//
// Only the loop thread reads the tls.Conns. The one call off it is a
// blocking call of an intercepted session's client side (offClient: a
// Handler that is not a LoopClient), which may write the upstream while
// the loop reads it: tls.Conn allows one Read and one Write at a time.

// sock is one socket of a relay: fd, and tls with its transport for TLS
// (nil: plain). held, if not nil, is where the bytes the socket has not
// taken wait (hold, writeAll): an intercepted session's clientPending or
// serverPending, or a TLS transport's own buffer.
type sock struct {
	fd   int
	held *[]byte
	tls  *tls.Conn
	tr   *loopTransport
	// more: the last read filled the caller's buffer, so the tls.Conn may
	// hold more than the socket does (TLS only).
	more bool
	err  error // TLS: an end met after bytes that read returned first
}

// loopTransport is a TLS client's transport on the loop.
type loopTransport struct {
	fd int
	// rd reads the socket without blocking (errWouldBlock); nil: fd, once
	// after each readable event (armed).
	rd    io.Reader
	armed bool
	// wr writes the socket (an intercepted session's upstream: the client
	// goroutine's writes block); nil: writeOrHold into held.
	wr func([]byte) (int, error)
	// held is where the ciphertext the socket has not taken waits: the
	// transport's own (out) on the pass-through relay, clientPending on an
	// intercepted session's.
	held *[]byte
	out  []byte
	// wait, at the session's end: writes block up to wait for room, the
	// held bytes first.
	wait time.Duration
}

func (lt *loopTransport) Read(b []byte) (int, error) {
	var n int
	var err error
	if lt.rd != nil {
		n, err = lt.rd.Read(b)
	} else {
		n, err = armedRead(lt.fd, &lt.armed, b)
	}
	if err == errWouldBlock {
		err = errTransportWouldBlock
	}
	return n, err
}

func (lt *loopTransport) Write(b []byte) (int, error) {
	if lt.wait > 0 {
		blockingWrite(lt.fd, *lt.held, lt.wait)
		*lt.held = (*lt.held)[:0]
		blockingWrite(lt.fd, b, lt.wait)
		return len(b), nil
	}
	if lt.wr != nil {
		return lt.wr(b)
	}
	if err := writeOrHold(lt.fd, lt.held, b); err != nil {
		return 0, err
	}
	return len(b), nil
}

func (lt *loopTransport) Close() error { return syscall.Close(lt.fd) }

// loopConn is the socket under c, a session's client or upstream
// connection, and whether it can be relayed on the loop: a plain socket,
// or TLS over our transport.
func loopConn(c net.Conn) (syscall.Conn, bool) {
	if tc, ok := c.(*tls.Conn); ok {
		tr, ok := tc.NetConn().(*tlsTransport)
		if !ok || tr.loop != nil {
			return nil, false
		}
		c = tr.Conn
	} else if tr, ok := c.(*tlsTransport); ok {
		c = tr.Conn // an upstream that fell back to plain (sslmode=prefer)
	}
	sc, ok := c.(syscall.Conn)
	return sc, ok
}

// takeSock makes the loop's sock of c, a session's client or upstream
// connection, whose socket the loop has duplicated as fd, and takes c out
// of Go's netpoller. rd and wr read and write a TLS socket (nil: fd
// itself, see loopTransport); held is where what the socket does not take
// waits (nil: a TLS transport's own). The caller holds s.connMu.
func takeSock(c net.Conn, fd int, rd io.Reader, wr func([]byte) (int, error), held *[]byte) sock {
	tc, ok := c.(*tls.Conn)
	if !ok {
		c.Close()
		return sock{fd: fd, held: held}
	}
	tr := tc.NetConn().(*tlsTransport)
	tr.Conn.Close() // not tc.Close: that would end the TLS stream
	lt := &loopTransport{fd: fd, rd: rd, wr: wr, held: held}
	if held == nil {
		lt.held = &lt.out
	}
	tr.loop = lt
	return sock{fd: fd, held: lt.held, tls: tc, tr: lt, more: true} // tc may hold bytes already
}

// arm lets the next read read a TLS socket once: the loop saw it
// readable.
func (k *sock) arm() {
	if k.tr != nil {
		k.tr.armed = true
	}
}

// read reads what the peer sent into b without blocking, as rawIO
// does: (0, nil) at the end of the stream, EAGAIN when there is nothing.
// For TLS it reads the socket at most once, if armed, and drains the
// tls.Conn until it would block or b is full (then more is set).
func (k *sock) read(b []byte) (int, error) {
	if k.tls == nil {
		return rawIO(syscall.SYS_READ, k.fd, b)
	}
	if k.err != nil {
		return k.end()
	}
	n := 0
	for n < len(b) {
		m, err := k.tls.Read(b[n:])
		n += m
		if err != nil {
			k.more = false
			if errors.Is(err, errTransportWouldBlock) {
				err = nil
			}
			if n > 0 {
				k.err = err
				if err != nil {
					k.more = true // for the end, read again
				}
				return n, nil
			}
			if err == nil {
				return -1, syscall.EAGAIN
			}
			k.err = err
			return k.end()
		}
	}
	k.more = true
	return n, nil
}

// end is what read reports for the end of a TLS stream it has met.
func (k *sock) end() (int, error) {
	if errors.Is(k.err, io.EOF) { // close_notify, or the end at a record boundary
		return 0, nil
	}
	return -1, k.err
}

// write writes b as far as the socket takes it, returning how
// much it took, as writeAvail does. For TLS it first writes what the
// socket did not take before, and takes nothing while some is left: the
// caller keeps b, and waits for room (pending).
func (k *sock) write(b []byte) (int, error) {
	if k.tls == nil {
		return writeAvail(k.fd, b)
	}
	if err := drainHeld(k.fd, k.tr.held, heldSize); err != nil {
		return 0, err
	}
	if len(*k.tr.held) > 0 || len(b) == 0 {
		return 0, nil
	}
	return k.tls.Write(b)
}

// heldSize is the size above which an empty held buffer is let go
// (drainHeld).
const heldSize = 64 << 10

// pending reports whether bytes written wait for room in the socket.
func (k *sock) pending() bool { return k.tr != nil && len(*k.tr.held) > 0 }

// hold writes b, keeping what the socket does not take in k.held
// (writeOrHold), behind what waits there already.
func (k *sock) hold(b []byte) error {
	if k.tls == nil {
		return writeOrHold(k.fd, k.held, b)
	}
	_, err := k.tls.Write(b)
	return err
}

// writeAll writes what waits in k.held, then b, waiting up to d for room
// (the end of a session).
func (k *sock) writeAll(b []byte, d time.Duration) {
	if k.held != nil {
		blockingWrite(k.fd, *k.held, d)
		*k.held = (*k.held)[:0]
	}
	if len(b) == 0 {
		return
	}
	if k.tls == nil {
		blockingWrite(k.fd, b, d)
		return
	}
	k.tr.wait = d
	k.tls.Write(b)
}

// close closes the socket; a TLS peer is sent close_notify first, as
// tls.Conn's Close does, waiting up to d for room.
func (k *sock) close(d time.Duration) {
	if k.tls == nil {
		syscall.Close(k.fd)
		return
	}
	k.tr.wait = d
	k.tls.Close()
}

// Read is a TLS peer's plaintext for an intercepted session's framer:
// errWouldBlock when the tls.Conn has nothing whole and the socket
// nothing more.
func (k *sock) Read(b []byte) (int, error) {
	n, err := k.tls.Read(b)
	if n > 0 {
		return n, nil // an end after n bytes is met again by the next read
	}
	if errors.Is(err, errTransportWouldBlock) {
		err = errWouldBlock
	}
	return n, err
}

// kickIntercepted is kick for an intercepted session: the loop reads
// what the upstream's framer or tls.Conn holds, and the client's.
func (l *evloop) kickIntercepted(r *relay) error {
	if err := r.serverSteps(false); err != nil {
		return err
	}
	if err := l.clientInline(r); err != nil {
		return err
	}
	return l.interceptInterest(r)
}
