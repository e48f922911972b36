package session

import (
	"fmt"
	"maps"
	"testing"
)

// snapshot is the tracked values at one point.
type snapshot map[string]string

func snap(s *State) snapshot {
	out := snapshot{}
	for _, n := range []string{Token, Epoch, Step} {
		if v, ok := s.Get(n); ok {
			out[n] = v
		}
	}
	return out
}

// FuzzTracker drives a State with random operations (each input byte is one)
// and checks invariants that follow from PostgreSQL's rules without a
// server: no panic; the nest level matches the savepoint stack; a ROLLBACK
// restores the values from before BEGIN; ROLLBACK TO restores the values
// from when the most recent savepoint of that name was made; SET LOCAL never
// outlives its transaction when no SET happened; an idle session has no
// portals.
func FuzzTracker(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12})
	f.Add([]byte{6, 0, 9, 1, 9, 2, 11, 12, 7})
	f.Add([]byte{6, 0, 9, 13, 11, 8, 6, 3, 4, 7})
	f.Add([]byte{0, 15, 6, 3, 9, 16, 10, 7})
	f.Fuzz(func(t *testing.T, ops []byte) {
		s, err := New(nil, NewStatements())
		if err != nil {
			t.Fatal(err)
		}
		type spSnap struct {
			name string
			vals snapshot
		}
		var (
			beforeBegin snapshot
			sps         []spSnap
			trace       []string
			onlyLocal   bool // in this transaction, only SET LOCAL changed values
			atTxStart   snapshot
		)
		// lastNamed is the index of the latest savepoint called name in
		// sps, or -1.
		lastNamed := func(name string) int {
			j := len(sps) - 1
			for j >= 0 && sps[j].name != name {
				j--
			}
			return j
		}
		fail := func(format string, args ...any) {
			t.Helper()
			t.Fatalf("after %v: %s", trace, fmt.Sprintf(format, args...))
		}
		names := []string{Token, Epoch, Step}
		for i, op := range ops {
			name := names[int(op>>5)%len(names)]
			val := fmt.Sprint(1 + i%7)
			spName := []string{"a", "b"}[int(op>>4)%2]
			wasIdle := s.Tx() == Idle
			if wasIdle {
				atTxStart = snap(s)
				onlyLocal = true
			}
			switch op % 17 {
			case 0:
				trace = append(trace, "SET "+name)
				if s.Set(name, val, false) == nil {
					onlyLocal = false
				}
			case 1:
				trace = append(trace, "SET LOCAL "+name)
				s.Set(name, val, true)
			case 2:
				trace = append(trace, "RESET "+name)
				if s.Reset(name, false) == nil {
					onlyLocal = false
				}
			case 3, 4:
				trace = append(trace, "BEGIN")
				if wasIdle {
					beforeBegin = snap(s)
				}
				s.Begin()
			case 5:
				trace = append(trace, "COMMIT")
				s.Commit(false)
				sps = sps[:0]
			case 6:
				trace = append(trace, "ROLLBACK")
				explicit := s.Explicit()
				s.Rollback(false)
				if explicit && beforeBegin != nil && !maps.Equal(snap(s), beforeBegin) {
					fail("ROLLBACK: got %v, want %v (before BEGIN)", snap(s), beforeBegin)
				}
			case 7:
				trace = append(trace, "TxStatus(I)")
				if !s.Explicit() && s.Tx() == InTx {
					s.TxStatus('I')
				}
			case 8:
				trace = append(trace, "error")
				s.Fail()
			case 9, 10:
				trace = append(trace, "SAVEPOINT "+spName)
				if s.Savepoint(spName) == nil {
					sps = append(sps, spSnap{spName, snap(s)})
				}
			case 11:
				trace = append(trace, "ROLLBACK TO "+spName)
				if s.RollbackTo(spName) == nil {
					j := lastNamed(spName)
					if j < 0 {
						fail("ROLLBACK TO %s succeeded without a recorded savepoint", spName)
					}
					sps = sps[:j+1]
					if !maps.Equal(snap(s), sps[j].vals) {
						fail("ROLLBACK TO %s: got %v, want %v", spName, snap(s), sps[j].vals)
					}
				}
			case 12:
				trace = append(trace, "RELEASE "+spName)
				if s.Release(spName) == nil {
					j := lastNamed(spName)
					sps = sps[:j]
				}
			case 13:
				trace = append(trace, "RESET ALL")
				if s.ResetAll() == nil {
					onlyLocal = false
				}
			case 14:
				trace = append(trace, "COMMIT AND CHAIN")
				s.Commit(true)
				sps = sps[:0]
				if s.Explicit() {
					beforeBegin = snap(s)
					atTxStart, onlyLocal = snap(s), true
				}
			case 15:
				trace = append(trace, "SET LOCAL TO DEFAULT "+name)
				s.Reset(name, true)
			case 16:
				trace = append(trace, "DISCARD ALL")
				if !s.Explicit() && s.Tx() != Failed {
					if s.Discard() == nil {
						onlyLocal = false
					}
				}
			}
			if s.Tx() == Idle {
				sps = sps[:0]
				beforeBegin = nil
				if !wasIdle && onlyLocal && op%17 != 14 && !maps.Equal(snap(s), atTxStart) {
					fail("only SET LOCAL in the transaction, yet values changed: got %v, want %v", snap(s), atTxStart)
				}
				if s.level != 0 || len(s.sps) != 0 || len(s.stmts.portals) != 0 {
					fail("idle with level %d, %d savepoints, %d portals", s.level, len(s.sps), len(s.stmts.portals))
				}
			} else if s.Tx() == InTx && s.level != len(s.sps)+1 {
				fail("in transaction with level %d and %d savepoints", s.level, len(s.sps))
			}
			if len(sps) != len(s.sps) {
				fail("got %d savepoints, model has %d", len(s.sps), len(sps))
			}
			for _, v := range s.vars {
				for k := 1; k < len(v.stack); k++ {
					if v.stack[k].level <= v.stack[k-1].level {
						fail("GUC stack levels not increasing: %+v", v.stack)
					}
				}
				if n := len(v.stack); n > 0 && v.stack[n-1].level > s.level && s.Tx() != Failed {
					fail("GUC stack entry at level %d above nest level %d", v.stack[n-1].level, s.level)
				}
			}
		}
	})
}
