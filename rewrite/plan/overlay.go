package plan

import (
	"strconv"
	"strings"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/session"
)

// overlay follows the fence settings a query's own SETs change before a
// later statement of the same query runs: the session state has them only
// once the server has answered the statement, the plan needs them before.
// A nil value is a RESET; the key resetAll, a RESET ALL before which
// nothing counts.
type overlay map[string]*string

const resetAll = "*reset"

func (o overlay) apply(st *rewrite.Stmt) {
	for _, g := range st.GUCs {
		switch g.Op {
		case rewrite.GUCSet:
			if session.Tracked(g.Name) && g.ValueParam == 0 && !g.Unknown {
				v := g.Value
				o[g.Name] = &v
			}
		case rewrite.GUCReset:
			if session.Tracked(g.Name) {
				o[g.Name] = nil
			}
		case rewrite.GUCResetAll:
			clear(o)
			o[resetAll] = nil
		}
	}
}

// value is the setting name as the next statement runs with it.
func (o overlay) value(ss *session.State, name string) string {
	if v, ok := o[name]; ok {
		if v == nil {
			return ""
		}
		return *v
	}
	if _, reset := o[resetAll]; reset {
		return ""
	}
	v, _ := ss.Get(name)
	return v
}

// generation is the fence generation the next statement runs with.
func (o overlay) generation(ss *session.State) (fence.Generation, bool) {
	if len(o) == 0 {
		return sessionGeneration(ss)
	}
	k := o.value(ss, session.JobKey)
	e, ok1 := positive(o.value(ss, session.Epoch))
	t, ok2 := positive(o.value(ss, session.Token))
	if k == "" || !ok1 || !ok2 {
		return fence.Generation{}, false
	}
	return fence.Generation{JobKey: k, Epoch: e, Token: t, Step: o.value(ss, session.Step)}, true
}

// positive parses an epoch or a token as the overlay reads it: an integer
// above 0, blanks around it ignored.
func positive(v string) (int64, bool) {
	n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
	return n, err == nil && n > 0
}

// sessionGeneration is the generation the session presents now.
func sessionGeneration(ss *session.State) (fence.Generation, bool) {
	return ss.Generation()
}
