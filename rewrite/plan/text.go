package plan

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/session"
)

// StepSQL is the text a step of a simple query adds (sum, version: a
// receipt's digest; see Resolve). A Client step adds none.
func StepSQL(s *Step, sum []byte, version string) string {
	switch s.Kind {
	case Begin:
		return "BEGIN"
	case Gate:
		return GateSQL(s.Gen)
	case Savepoint:
		return "SAVEPOINT " + ReceiptSavepoint
	case Receipt:
		return CommitSQL(s.Gated, s.Gen, sum, version)
	case Raise:
		return RaiseSQL(s.Err)
	}
	return ""
}

// Text is the query as sent upstream for a Rewrite plan: the client's
// text sql, with each injected step's SQL spliced in before the statement
// it stands before (a receipt after the last statement is appended after
// a newline). ss and stmts are the session and the query's statements, for
// the receipts' digests (Resolve: callers hold the session state as they
// would to change it). The Insertions say where the injected text is, so
// that an error position in the sent text can be moved back to the
// client's.
func (q *Query) Text(sql string, ss *session.State, stmts []*rewrite.Stmt) (string, Insertions) {
	var b strings.Builder
	b.Grow(len(sql) + 256)
	var ins Insertions
	prev := 0
	for i := range q.Steps {
		s := &q.Steps[i]
		if s.Kind == Client {
			continue
		}
		var sum []byte
		var version string
		if s.Kind == Receipt {
			sum, version = Resolve(s.Digest, ss, stmts)
		}
		text := StepSQL(s, sum, version)
		if s.At < 0 {
			b.WriteString(sql[prev:])
			prev = len(sql)
			b.WriteString("\n;")
			b.WriteString(text)
			continue
		}
		b.WriteString(sql[prev:s.At])
		prev = s.At
		text += ";"
		// In characters: PostgreSQL reports error positions so.
		ins = append(ins, Insertion{At: utf8.RuneCountInString(sql[:s.At]), N: utf8.RuneCountInString(text)})
		b.WriteString(text)
	}
	b.WriteString(sql[prev:])
	return b.String(), ins
}

// Insertion is text the gate spliced into a query: N characters at
// character offset At of the client's text.
type Insertion struct{ At, N int }

// Insertions are a rewritten query's insertions, in order.
type Insertions []Insertion

// ClientPosition moves an error position (1-based, in characters) in the
// rewritten query back to the client's text; a position inside injected
// text points at the client's statement after it.
func (ins Insertions) ClientPosition(pos int32) int32 {
	p := int(pos) - 1
	shift := 0
	for _, in := range ins {
		if p >= in.At+shift+in.N {
			shift += in.N
		} else if p >= in.At+shift {
			return int32(in.At + 1)
		}
	}
	return int32(p - shift + 1)
}

// String renders the step for a reader (the golden plans, logs).
func (s Step) String() string {
	gen := func() string {
		return fmt.Sprintf("job %q epoch %d token %d step %q", s.Gen.JobKey, s.Gen.Epoch, s.Gen.Token, s.Gen.Step)
	}
	switch s.Kind {
	case Client:
		return fmt.Sprintf("statement %d", s.Stmt+1)
	case Begin:
		return "BEGIN"
	case Gate:
		return "gate " + gen()
	case Savepoint:
		return "SAVEPOINT " + ReceiptSavepoint
	case Receipt:
		fn := "fence.commit"
		if !s.Gated {
			fn = "fence.commit_if_written"
		}
		out := "receipt " + fn + " " + gen() + ", digest: " + s.Digest.String()
		if s.BeforeCommit {
			out += ", before the client's COMMIT"
		}
		return out
	case Raise:
		return fmt.Sprintf("raise %s %q", s.Err.Code, s.Err.Message)
	}
	return s.Kind.String()
}

// String says what the digest covers.
func (d Digest) String() string {
	stmts := func() string {
		if len(d.Stmts) == 0 {
			return "no statements"
		}
		parts := make([]string, len(d.Stmts))
		for i, n := range d.Stmts {
			parts[i] = strconv.Itoa(n + 1)
		}
		return "statements " + strings.Join(parts, ", ")
	}
	switch d.Source {
	case FromTransaction:
		return "the transaction's + " + stmts()
	case FromStatements:
		return stmts()
	case FromClient:
		return "the client's own"
	case FromSession:
		return "the client's own, else the transaction's, when sent"
	case FromBatch:
		if d.Version == ClientDigestVersion {
			return "the client's own"
		}
		if d.Items == 1 {
			return "the batch's (1 item)"
		}
		return fmt.Sprintf("the batch's (%d items)", d.Items)
	}
	return "?"
}
