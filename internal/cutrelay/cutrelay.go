// Package cutrelay is a TCP relay for PostgreSQL connections that loses a
// response on purpose: once a client message matches Cut, the relay still
// forwards it, then swallows everything the server side answers and closes
// both connections when the answer is complete (at ReadyForQuery). The
// server has finished the request; the client never learns its outcome.
// Acceptance case A04 and the chaos run's cut-commit fault use it to lose
// a COMMIT's answer for real.
package cutrelay

import (
	"bufio"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
)

// Relay relays every connection accepted on its address to Target.
type Relay struct {
	ln     net.Listener
	target string
	cut    func(typ byte, body []byte) bool
	fired  chan struct{}
	wg     sync.WaitGroup
}

// Start listens on a free loopback port and relays to target. cut is
// asked about every client message after the startup packet (type and
// body); the first it matches on a connection makes the relay lose that
// connection's answer. It may be called from several connections at once.
func Start(target string, cut func(typ byte, body []byte) bool) (*Relay, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &Relay{ln: ln, target: target, cut: cut, fired: make(chan struct{}, 1)}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			r.wg.Add(1)
			go func() { defer r.wg.Done(); r.serve(c) }()
		}
	}()
	return r, nil
}

// Addr is the address clients connect to.
func (r *Relay) Addr() string { return r.ln.Addr().String() }

// Fired receives when a cut connection has been closed after the server
// finished the request (at most one pending signal).
func (r *Relay) Fired() <-chan struct{} { return r.fired }

// Close stops accepting and waits for the relayed connections to end.
func (r *Relay) Close() {
	r.ln.Close()
	r.wg.Wait()
}

func (r *Relay) serve(c net.Conn) {
	defer c.Close()
	s, err := net.Dial("tcp", r.target)
	if err != nil {
		return
	}
	defer s.Close()
	var cut atomic.Bool
	done := make(chan struct{})
	go func() {
		// client → server: the startup packet, then typed messages.
		defer close(done)
		defer s.Close()
		cr := bufio.NewReader(c)
		var hdr [4]byte
		if _, err := io.ReadFull(cr, hdr[:]); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(hdr[:])
		if n < 4 || n > 1<<20 {
			return
		}
		body := make([]byte, n-4)
		if _, err := io.ReadFull(cr, body); err != nil {
			return
		}
		if _, err := s.Write(append(hdr[:], body...)); err != nil {
			return
		}
		for {
			typ, msg, err := readMsg(cr)
			if err != nil {
				return
			}
			if !cut.Load() && r.cut(typ, msg[5:]) {
				cut.Store(true)
			}
			if _, err := s.Write(msg); err != nil {
				return
			}
		}
	}()
	// server → client: once cut, swallow the answer and drop both
	// connections at its ReadyForQuery.
	sr := bufio.NewReader(s)
	for {
		typ, msg, err := readMsg(sr)
		if err != nil {
			break
		}
		if cut.Load() {
			if typ == 'Z' {
				select {
				case r.fired <- struct{}{}:
				default:
				}
				break
			}
			continue
		}
		if _, err := c.Write(msg); err != nil {
			break
		}
	}
	c.Close()
	s.Close()
	<-done
}

func readMsg(r *bufio.Reader) (byte, []byte, error) {
	msg := make([]byte, 5)
	if _, err := io.ReadFull(r, msg); err != nil {
		return 0, nil, err
	}
	n := int(binary.BigEndian.Uint32(msg[1:5])) - 4
	if n < 0 || n > 1<<30 {
		return 0, nil, errors.New("cutrelay: bad message length")
	}
	msg = append(msg, make([]byte, n)...)
	if _, err := io.ReadFull(r, msg[5:]); err != nil {
		return 0, nil, err
	}
	return msg[0], msg, nil
}

// IsCommitQuery matches a simple Query whose text is COMMIT (what pgx's
// Tx.Commit and psql send).
func IsCommitQuery(typ byte, body []byte) bool {
	return typ == 'Q' && strings.EqualFold(strings.TrimSpace(strings.TrimRight(string(body), "\x00; ")), "commit")
}
