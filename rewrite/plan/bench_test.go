package plan_test

import (
	"testing"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/rewrite"
	"github.com/pgfence/pgfence/rewrite/plan"
	"github.com/pgfence/pgfence/session"
)

// BenchmarkPlanQuery plans (and renders) the query of a gated write in
// autocommit, and the lone COMMIT of a gated transaction: what the gate
// adds to a gated write's cost in the proxy's own CPU, beside the round
// trips and the protocol's SQL. The cached runs plan through a Cache
// (every plan after the first comes from it); in new_step each query has a
// generation of its own (a new fence.step, as a worker sets for each
// transaction), which a plan from the cache gets in a copy of its steps.
func BenchmarkPlanQuery(b *testing.B) {
	prot := rewrite.NewProtected([]rewrite.RelName{{Schema: "public", Name: "results"}})
	for _, c := range []struct {
		name, sql string
		gated     bool
	}{
		{"autocommit_write", "INSERT INTO results (job_key, payload, token) VALUES ('k', 'v', 18)", false},
		{"lone_commit", "COMMIT", true},
	} {
		for _, mode := range []string{"", "/cached", "/cached/new_step"} {
			b.Run(c.name+mode, func(b *testing.B) {
				st, err := session.New(map[string]string{"options": "-c fence.job_key=k -c fence.epoch=3 -c fence.token=18"}, session.NewStatements())
				if err != nil {
					b.Fatal(err)
				}
				s := &sim{prot: prot, st: st}
				if c.gated {
					st.Begin()
					plan.Gated(st, fence.Generation{JobKey: "k", Epoch: 3, Token: 18}, false)
				}
				stmts := classify(b, c.sql)
				planQuery := plan.PlanQuery
				if mode != "" {
					planQuery = plan.NewCache(nil).PlanQuery
				}
				steps := [2]string{"a", "b"}
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					if mode == "/cached/new_step" {
						i++
						if err := st.Set(session.Step, steps[i%2], false); err != nil {
							b.Fatal(err)
						}
						st.Gate().Gen.Step = steps[i%2]
					}
					q := planQuery(s.session(), stmts)
					if q.Action != plan.Rewrite {
						b.Fatalf("got action %d, want a rewrite", q.Action)
					}
					q.Text(c.sql, st, stmts)
				}
			})
		}
	}
}
