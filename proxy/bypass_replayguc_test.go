package proxy

import (
	"fmt"
	"testing"
)

func init() { registerBypass("replayguc", bypassReplayGUC) }

// bypassReplayGUC: the backstop decides nothing from a setting that code
// running inside the statement can set (issue 30, A-M3). The pgfence_replay
// row trigger skipped every row once pgfence.replay equalled the
// transaction's id; a table owner's index expression, default, CHECK or
// trigger set it half-way through a worker's INSERT, UPDATE or DELETE,
// which then stored some of its rows and committed with a receipt. Every
// row of a current generation's statement must be written. And (A-M4) SET
// CONSTRAINTS ALL IMMEDIATE between two fenced writes of one transaction
// does not make the second a replay.
func bypassReplayGUC(t *testing.T) {
	c := newCast(t)
	// A-M4 first, on tables without the owner's hooks below.
	t.Run("set_constraints_immediate_between_writes", func(t *testing.T) {
		for i, route := range castRoutes {
			conn := c.connect(t, route, c.worker, &c.current)
			k := 90 + i
			sql := fmt.Sprintf("set fence.step = 'immediate-%[2]s'; begin; insert into inh values (%[1]d, 'job', 'a'); set constraints all immediate; "+
				"insert into app.ledger values (%[1]d, 'job', 'b'); commit", k, route)
			if _, err := conn.Exec(ctxT(t), sql).ReadAll(); err != nil {
				t.Fatalf("%s: %s: %v", route, sql, err)
			}
			if n := c.count(t, fmt.Sprintf("select count(*) from app.ledger where k = %d", k)); n != 1 {
				t.Fatalf("%s: the second write stored %d rows, want 1", route, n)
			}
		}
	})
	setReplay := "pg_catalog.set_config('pgfence.replay', pg_catalog.pg_current_xact_id()::text, true)"
	c.as(t, c.owner, fmt.Sprintf(`
create function public.idx_hook(t text) returns text language plpgsql immutable set search_path = pg_catalog as $$
begin perform %[1]s; return t; end $$;
create function public.chk_hook(t text) returns boolean language plpgsql immutable set search_path = pg_catalog as $$
begin perform %[1]s; return true; end $$;
`, setReplay))
	// The DDL guard refuses the owner an index calling its own function
	// (FN010, round 25, BA-H2): a bypass member adds them.
	c.refusedAs(t, c.owner, "create index ledger_hook on app.ledger (public.idx_hook(job_key))", "FN010")
	c.as(t, c.dba, `create index ledger_hook on app.ledger (public.idx_hook(job_key));
create index res_hook on res (public.idx_hook(v))`)
	// The DDL guard refuses the owner a CHECK calling its own function
	// (FN010, round 24, AX-H1): a bypass member adds it, so that the
	// replay guard is still tried against it.
	c.refusedAs(t, c.owner, "alter table inh_c add constraint inh_c_hook check (public.chk_hook(v))", "FN010")
	c.as(t, c.dba, "alter table inh_c add constraint inh_c_hook check (public.chk_hook(v))")
	c.as(t, c.dba, "insert into app.ledger values (1001, 'job', 's'), (1002, 'job', 's'), (1003, 'job', 's'); "+
		"insert into inh_c values (1001, 'job', 's'), (1002, 'job', 's'), (1003, 'job', 's')")
	// Each write stores or changes three rows (%[1]d: a fresh key, %[2]s:
	// a fresh value); fence.step names the case and route, so each
	// commits a receipt of its own.
	type rowCase struct {
		name, sql, copyIn, count string
	}
	cases := []rowCase{
		{"index_expression_insert", "insert into app.ledger values (%[1]d, 'job', 'a'), (%[1]d+1, 'job', 'b'), (%[1]d+2, 'job', 'c')", "",
			"select count(*) from app.ledger where k between %[1]d and %[1]d+2"},
		{"index_expression_partitioned_insert", "insert into res values (%[1]d, 'job', 'a'), (%[1]d+1, 'job', 'b'), (%[1]d+2, 'job', 'c')", "",
			"select count(*) from res where k between %[1]d and %[1]d+2"},
		{"check_insert", "insert into inh_c values (%[1]d, 'job', 'a'), (%[1]d+1, 'job', 'b'), (%[1]d+2, 'job', 'c')", "",
			"select count(*) from inh_c where k between %[1]d and %[1]d+2"},
		{"index_expression_update", "update app.ledger set v = '%[2]s' where k between 1001 and 1003", "",
			"select count(*) from app.ledger where v = '%[2]s'"},
		{"check_update", "update inh_c set v = '%[2]s' where k between 1001 and 1003", "",
			"select count(*) from inh_c where v = '%[2]s'"},
		{"index_expression_copy", "copy app.ledger from stdin", "%[1]d\tjob\ta\n%[3]d\tjob\tb\n%[4]d\tjob\tc\n",
			"select count(*) from app.ledger where k between %[1]d and %[1]d+2"},
	}
	next := 10
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, route := range castRoutes {
				t.Run(route, func(t *testing.T) {
					k, val := next, tc.name+"-"+route
					next += 3
					sql := tc.sql
					if tc.copyIn == "" {
						sql = fmt.Sprintf(tc.sql, k, val)
					}
					conn := c.connect(t, route, c.worker, &c.current)
					_, err := conn.Exec(ctxT(t), fmt.Sprintf("set fence.step = '%s'", val)).ReadAll()
					if err == nil {
						copyIn := ""
						if tc.copyIn != "" {
							copyIn = fmt.Sprintf(tc.copyIn, k, val, k+1, k+2)
						}
						err = castExec(ctxT(t), conn, sql, copyIn)
					}
					if err != nil {
						t.Fatalf("%s: %v", sql, err)
					}
					if n := c.count(t, fmt.Sprintf(tc.count, k, val)); n != 3 {
						t.Fatalf("%s stored %d rows, want 3: a setting changed in the statement skipped rows", sql, n)
					}
				})
			}
		})
	}
}
