package wire

// Scanner finds the message boundaries of a stream fed to it in pieces
// of any size, in place: what the event loop reads from a non-blocking
// socket and passes on without framing it into messages. It keeps across
// pieces what a boundary needs: how much of the current message's body
// is still to come, and whether its next byte is a ReadyForQuery's
// transaction status. It checks each header as Framer.Next does
// (ParseHeader with Max and From; with Client, what a client may send),
// so both framers apply one set of rules (FuzzScanner compares them).
//
// The caller owns the bytes: Next reports where to stop passing them on
// and why; a header not yet whole at the end of a piece is the caller's
// to keep and feed again, in front of the next piece.
type Scanner struct {
	Max  int    // largest body length accepted (excluding type byte); 0 = unbounded
	From string // "client" or "server", for errors
	// Client: a client's stream. Next stops at each whole header
	// (AtHeader) before it checks it, so that the caller may hold the
	// message there; Check checks it, Enter passes over it.
	Client bool

	left   int   // body bytes of the current message still to come
	status bool  // the next body byte is a ReadyForQuery's status
	err    error // why Next or Check found a header Bad
}

// Event is what Scanner.Next stopped at, or what Check found.
type Event uint8

const (
	// More: b holds nothing more whole. Everything before at may be
	// passed on; from at on, b holds part of a header (or nothing).
	More Event = iota
	// Ready: b[at-1] is a ReadyForQuery's transaction status byte.
	Ready
	// AtHeader (Client only): b[at:] starts with a whole header, of
	// type b[at], not yet checked: call Check, or stop before it.
	AtHeader
	// Message (Check): a valid header; Enter passes over it.
	Message
	// Oversized (Check): the header of a message over Max that PostgreSQL
	// answers with an error in its place (Answerable).
	Oversized
	// Bad: a bad header, not passed over; Err says what is wrong (a
	// *ProtocolError, as ParseHeader's and Framer.Next's).
	Bad
)

// Next scans b from i, passing over message bodies and (for a server's
// stream) headers, up to the next event: More, Ready, AtHeader (Client)
// or Bad (a server's header).
func (sc *Scanner) Next(b []byte, i int) (at int, ev Event) {
	for {
		if sc.left > 0 {
			if i == len(b) {
				return i, More
			}
			if sc.status {
				sc.status = false
				sc.left--
				return i + 1, Ready
			}
			k := min(sc.left, len(b)-i)
			sc.left -= k
			i += k
			continue
		}
		if len(b)-i < HeaderLen {
			return i, More
		}
		if sc.Client {
			return i, AtHeader
		}
		h := b[i : i+HeaderLen]
		typ, total, ok := header(h, sc.Max)
		if !ok {
			_, _, sc.err = ParseHeader(h, sc.Max, sc.From)
			return i, Bad
		}
		sc.left = total - HeaderLen
		sc.status = typ == 'Z' && total == HeaderLen+1
		i += HeaderLen
	}
}

// Check checks the client header Next stopped at (AtHeader) at b[at:]:
// Message (valid), Oversized or Bad, with the message's total size (type
// byte included) for Message and Oversized. It writes nothing on the
// common path (a valid header), so a caller's atomic operations around it
// do not wait for its stores. Enter passes over a Message of that size.
func (sc *Scanner) Check(b []byte, at int) (total int, ev Event) {
	h := b[at : at+HeaderLen]
	if typ, total, ok := header(h, sc.Max); ok && frontendTypes[typ] {
		return total, Message
	}
	return sc.check(h)
}

// Enter passes over the message of total bytes whose header at b[at:]
// Check found valid, with as much of its body as b holds, and returns
// where Next goes on.
func (sc *Scanner) Enter(b []byte, at, total int) int {
	i := at + HeaderLen
	body := total - HeaderLen
	k := min(body, len(b)-i)
	sc.left = body - k
	return i + k
}

// check is Check's slow path: what is wrong with h, or that it is
// Oversized.
func (sc *Scanner) check(h []byte) (int, Event) {
	typ, total, err := ParseHeader(h, sc.Max, sc.From)
	over, err := checkClient(typ, err)
	switch {
	case err != nil:
		sc.err = err
		return 0, Bad
	case over:
		return total, Oversized
	}
	return total, Message
}

// Err returns what is wrong with the header Next or Check found Bad.
func (sc *Scanner) Err() error { return sc.err }

// Rest reports where the stream stands within a message: how many of
// its body bytes are still to come, and whether the next one is a
// ReadyForQuery's status (a framer that takes the stream over reads
// those first).
func (sc *Scanner) Rest() (left int, status bool) { return sc.left, sc.status }
