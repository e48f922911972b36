package main

import (
	"net"
	"testing"
	"time"
)

// The metrics endpoint's listener holds at most its bound of connections
// open: one more is accepted only once one of them closes (round 25,
// BC-M1: idle connections took the proxy's descriptors).
func TestLimitListener(t *testing.T) {
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := limitListener(raw, 2)
	defer ln.Close()
	accepted := make(chan net.Conn, 3)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	var clients []net.Conn
	for range 3 {
		c, err := net.Dial("tcp", raw.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		clients = append(clients, c)
	}
	first := <-accepted
	<-accepted
	select {
	case <-accepted:
		t.Fatal("a third connection accepted while two were open")
	case <-time.After(200 * time.Millisecond): // a bounded wait for something that must not happen
	}
	first.Close()
	select {
	case c := <-accepted:
		c.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("the third connection was never accepted after one closed")
	}
}
