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
// trips and the protocol's SQL.
func BenchmarkPlanQuery(b *testing.B) {
	prot := rewrite.NewProtected([]rewrite.RelName{{Schema: "public", Name: "results"}})
	for _, c := range []struct {
		name, sql string
		gated     bool
	}{
		{"autocommit_write", "INSERT INTO results (job_key, payload, token) VALUES ('k', 'v', 18)", false},
		{"lone_commit", "COMMIT", true},
	} {
		b.Run(c.name, func(b *testing.B) {
			st, err := session.New(map[string]string{"options": "-c fence.job_key=k -c fence.epoch=3 -c fence.token=18"})
			if err != nil {
				b.Fatal(err)
			}
			s := &sim{prot: prot, st: st}
			if c.gated {
				st.Begin()
				plan.Gated(st, fence.Generation{JobKey: "k", Epoch: 3, Token: 18}, false)
			}
			stmts := classify(b, c.sql)
			b.ReportAllocs()
			for b.Loop() {
				q := plan.PlanQuery(s.session(), stmts)
				if q.Action != plan.Rewrite {
					b.Fatalf("got action %d, want a rewrite", q.Action)
				}
				q.Text(c.sql, st, stmts)
			}
		})
	}
}
