package proxy

import (
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgproto3"
)

// The limits on what clients make the proxy hold (docs/proxy.md,
// "Limits"): one message is at most Config.MaxMessageSize long, and the
// messages held whole by all sessions together fit Config.MemoryBudget.
//
// Pass-through sessions, and CopyData everywhere, are streamed through
// the session's fixed buffers and hold nothing. With an Interceptor, a
// Query, Parse or Bind larger than the buffer is read whole for the
// Handler; the budget is taken for it before its body is read, so a
// message that does not fit is never read.
//
// A message over the limit is read and thrown away as it arrives (never
// held), and the proxy sends PostgreSQL, in its place, a substitute that
// fails there, where the message would have been executed: a Query (or
// FunctionCall) becomes an EXECUTE of a prepared statement that does not
// exist, a Parse or Bind an Execute of a portal that does not exist, a
// CopyData a CopyFail. PostgreSQL then does exactly what it does for a
// statement that fails there — aborts the transaction; skips the rest of
// an extended-protocol batch up to its Sync; ends the COPY, dropping the
// CopyData that follows — and answers with an ErrorResponse in the right
// place among the responses, which the server side replaces with the
// proxy's own 54000 (oversizedError). The substitute's names carry a
// secret of the proxy's, so no client can create what they refer to.

// heldMessageCost is how many times its length a message held whole for
// the Handler counts against the memory budget, so that the budget bounds
// the process's resident memory, not just the bytes: the message itself,
// what the write gate spends classifying it (the text copied, the parse
// tree built in C and decoded in Go: 3 to 5 times the message), and the
// garbage collector's headroom (Go frees lazily, up to twice the live
// heap by default). Measured with a real pgfence serve (TestMemoryBudgetRSS):
// 6 to 7 times the length of 4 MiB queries, held and classified at once.
const heldMessageCost = 8

// heldCost is what holding a message with a body of n bytes costs the
// budget.
func heldCost(n int) int64 { return int64(n) * heldMessageCost }

// memBudget is the memory budget for held client messages, which the
// write gate's caches share (CacheMemoryUser): they take what messages
// leave, up to their own bound (FenceConfig.CacheMemory), and give way to
// a message that does not fit (shrink), so a message fits whenever it
// would without them.
type memBudget struct {
	limit int64
	total atomic.Int64 // held messages and cached entries
	used  atomic.Int64 // held messages
	peak  atomic.Int64 // the most messages held at once (for observation: tests)
	// shrink makes the caches give at least n bytes back; nil without
	// caches.
	shrink func(n int64) int64
}

// take reserves n bytes for a message, or reports false when they do not
// fit even with the caches empty.
func (m *memBudget) take(n int64) bool {
	if !m.reserve(n) {
		if m.shrink == nil || n > m.limit-m.used.Load() {
			return false
		}
		m.shrink(m.total.Load() + n - m.limit)
		if !m.reserve(n) {
			return false
		}
	}
	u := m.used.Add(n)
	for p := m.peak.Load(); u > p && !m.peak.CompareAndSwap(p, u); p = m.peak.Load() {
	}
	return true
}

// reserve takes n bytes of the budget if they fit.
func (m *memBudget) reserve(n int64) bool {
	for {
		t := m.total.Load()
		if t+n > m.limit {
			return false
		}
		if m.total.CompareAndSwap(t, t+n) {
			return true
		}
	}
}

// give returns n bytes taken for a message.
func (m *memBudget) give(n int64) {
	m.used.Add(-n)
	m.total.Add(-n)
}

// cacheBudget is the budget as the caches take from it (lru.Budget):
// what messages leave, never making them give way.
type cacheBudget struct{ m *memBudget }

func (b cacheBudget) Take(n int64) bool { return b.m.reserve(n) }
func (b cacheBudget) Give(n int64)      { b.m.total.Add(-n) }

// overBudget is the error for a message the budget cannot hold: the
// session ends with it.
func (s *Server) overBudget(total int) error {
	return &ProtocolError{
		Code: "53200",
		Msg: fmt.Sprintf("pgfence: out of memory for client messages: holding this %d-byte message would exceed memory_budget (%d bytes, shared by all sessions)",
			total-headerLen, s.cfg.MemoryBudget),
		Hint: "Retry later, send smaller messages, or raise memory_budget (--memory-budget, PGFENCE_MEMORY_BUDGET).",
	}
}

// overShare is the error for a message that would take more than one
// session's share of the budget (Config.ClientMemory): the session ends
// with it, and the budget stays for the others.
func (s *Server) overShare(total int) error {
	return &ProtocolError{
		Code: "53200",
		Msg: fmt.Sprintf("pgfence: out of memory for client messages: holding this %d-byte message would take %d bytes, more than one session's share of memory_budget (client_memory, %d bytes)",
			total-headerLen, heldCost(total-headerLen), s.cfg.ClientMemory),
		Hint: "Send smaller messages, or raise client_memory (--client-memory, PGFENCE_CLIENT_MEMORY) within memory_budget.",
	}
}

// oversizedPrefix starts the names of the substitutes' missing objects.
const oversizedPrefix = "pgfence_oversized_"

// substituteOversized answers a message of type typ and total bytes over
// MaxMessageSize, read and dropped (the event loop drops it in pieces as
// they arrive): the substitute goes upstream in its place.
func (s *Session) substituteOversized(typ byte, total int) error {
	s.oversized.Store(true)
	sub := s.srv.substitute(typ, total-headerLen)
	if typ == 'd' {
		// The Handler sees the COPY end, as with the client's own
		// CopyFail.
		if s.h != nil {
			return s.deliver(sub)
		}
	} else {
		if !s.account(sub[0]) {
			return errShutdown
		}
		if s.h != nil {
			s.q.Push(&Request{Type: sub[0]})
		}
	}
	if _, err := s.sw.Write(sub); err != nil {
		return fmt.Errorf("server: %w", err)
	}
	return nil
}

// substitute is the message sent upstream in place of a message of type
// typ and n body bytes over the limit. The name it refers to carries the
// type and size for oversizedError.
func (s *Server) substitute(typ byte, n int) []byte {
	name := s.oversizedTag + "_" + string(typ) + "_" + strconv.Itoa(n)
	var m pgproto3.FrontendMessage
	switch typ {
	case 'P', 'B':
		m = &pgproto3.Execute{Portal: name}
	case 'd':
		m = &pgproto3.CopyFail{Message: name}
	default: // 'Q', 'F'
		m = &pgproto3.Query{String: `EXECUTE "` + name + `"`}
	}
	b, _ := m.Encode(nil)
	return b
}

// oversizedError returns the proxy's 54000 ErrorResponse when msg, an
// ErrorResponse from PostgreSQL, answers a substitute; otherwise msg.
func (s *Server) oversizedError(msg []byte) []byte {
	var e pgproto3.ErrorResponse
	if len(msg) < headerLen || e.Decode(msg[headerLen:]) != nil {
		return msg
	}
	i := strings.Index(e.Message, s.oversizedTag+"_")
	if i < 0 || e.Severity == "FATAL" || e.Severity == "PANIC" {
		return msg
	}
	rest := e.Message[i+len(s.oversizedTag)+1:]
	if len(rest) < 3 || rest[1] != '_' {
		return msg
	}
	typ, digits := rest[0], rest[2:]
	if j := strings.IndexFunc(digits, func(r rune) bool { return r < '0' || r > '9' }); j >= 0 {
		digits = digits[:j]
	}
	n, err := strconv.Atoi(digits)
	if err != nil {
		return msg
	}
	what := map[byte]string{'Q': "query", 'P': "Parse", 'B': "Bind", 'F': "function call", 'd': "COPY data"}[typ]
	text := fmt.Sprintf("pgfence: %s message of %d bytes is over max_message_size (%d bytes)", what, n, s.cfg.MaxMessageSize)
	if typ == 'd' {
		text += "; the COPY is aborted"
	}
	out := &pgproto3.ErrorResponse{
		Severity: e.Severity, SeverityUnlocalized: e.SeverityUnlocalized, Code: "54000", Message: text,
		Hint: "Raise max_message_size (--max-message-size, PGFENCE_MAX_MESSAGE_SIZE) on pgfence, or send less in one message.",
	}
	b, err := out.Encode(nil)
	if err != nil {
		return msg
	}
	return b
}
