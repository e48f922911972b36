package chaos

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

// relay is a TCP relay between one worker slot and its proxy. Armed, it
// cuts the next connection that sends a COMMIT: the COMMIT reaches the
// proxy, its answer never reaches the worker (the way A04 of the acceptance
// tests loses a commit response).
type relay struct {
	ln     net.Listener
	target string
	armed  atomic.Bool
	fired  chan struct{} // receives when an armed cut happened
	wg     sync.WaitGroup
}

func startRelay(target string) (*relay, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &relay{ln: ln, target: target, fired: make(chan struct{}, 1)}
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

func (r *relay) addr() string { return r.ln.Addr().String() }

func (r *relay) close() {
	r.ln.Close()
	r.wg.Wait()
}

func (r *relay) serve(c net.Conn) {
	defer c.Close()
	s, err := net.Dial("tcp", r.target)
	if err != nil {
		return
	}
	defer s.Close()
	var cut atomic.Bool
	done := make(chan struct{})
	go func() {
		// worker → proxy: the startup packet, then typed messages.
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
			if !cut.Load() && isCommitQuery(typ, msg[5:]) && r.armed.CompareAndSwap(true, false) {
				cut.Store(true)
			}
			if _, err := s.Write(msg); err != nil {
				return
			}
		}
	}()
	// proxy → worker: once cut, swallow the answer to the COMMIT and drop
	// both connections at its ReadyForQuery.
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
		return 0, nil, errors.New("bad message length")
	}
	msg = append(msg, make([]byte, n)...)
	if _, err := io.ReadFull(r, msg[5:]); err != nil {
		return 0, nil, err
	}
	return msg[0], msg, nil
}

// isCommitQuery matches a simple Query whose text is COMMIT (what pgx's
// Tx.Commit sends).
func isCommitQuery(typ byte, body []byte) bool {
	return typ == 'Q' && strings.EqualFold(strings.TrimSpace(strings.TrimRight(string(body), "\x00; ")), "commit")
}
