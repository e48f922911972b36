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
	// Client checks each header as a client's and stops at it (Message,
	// Oversized) for the caller to look at before it is passed over.
	Client bool

	left   int  // body bytes of the current message still to come
	status bool // the next body byte is a ReadyForQuery's status
	typ    byte // the header Next stopped at (Client)
	total  int
	err    error // why Next stopped at Bad
}

// Event is what Scanner.Next stopped at.
type Event uint8

const (
	// More: b holds nothing more whole. Everything before at may be
	// passed on; from at on, b holds part of a header (or nothing).
	More Event = iota
	// Ready: b[at-1] is a ReadyForQuery's transaction status byte.
	Ready
	// Message (Client only): b[at:] starts with a valid header, not yet
	// passed over. Header reports it; Enter passes over it, or the caller
	// stops before it.
	Message
	// Oversized (Client only): b[at:] starts with the header of a message
	// over Max that PostgreSQL answers with an error in its place
	// (Answerable); Header reports it. Not passed over.
	Oversized
	// Bad: b[at:] starts with a bad header; Err says what is wrong (a
	// *ProtocolError, as ParseHeader's and Framer.Next's).
	Bad
)

// Next scans b from i, passing over message bodies and (for a server's
// stream) headers, up to the next event: see Event.
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
		h := b[i : i+HeaderLen]
		typ, total, ok := header(h, sc.Max)
		if ok && (!sc.Client || frontendTypes[typ]) {
			if sc.Client {
				sc.typ, sc.total = typ, total
				return i, Message
			}
			sc.left = total - HeaderLen
			sc.status = typ == 'Z' && total == HeaderLen+1
			i += HeaderLen
			continue
		}
		typ, total, err := ParseHeader(h, sc.Max, sc.From)
		if sc.Client {
			sc.typ, sc.total = typ, total
			over, err := checkClient(typ, err)
			if err != nil {
				sc.err = err
				return i, Bad
			}
			if over {
				return i, Oversized
			}
			return i, Message
		}
		sc.err = err
		return i, Bad
	}
}

// Err returns what is wrong with the header Next stopped at (Bad).
func (sc *Scanner) Err() error { return sc.err }

// Header returns the type and total size (type byte included) of the
// message whose header Next stopped at (Message, Oversized).
func (sc *Scanner) Header() (typ byte, total int) { return sc.typ, sc.total }

// Enter passes over the message whose header Next stopped at (Message)
// at b[at:], as far as b holds it, and returns where Next goes on.
func (sc *Scanner) Enter(b []byte, at int) int {
	i := at + HeaderLen
	k := min(sc.total-HeaderLen, len(b)-i)
	sc.left = sc.total - HeaderLen - k
	return i + k
}

// Rest reports where the stream stands within a message: how many of
// its body bytes are still to come, and whether the next one is a
// ReadyForQuery's status (a framer that takes the stream over reads
// those first).
func (sc *Scanner) Rest() (left int, status bool) { return sc.left, sc.status }
