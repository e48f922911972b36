package proxy

import (
	"fmt"
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("guard_snapshot", bypassGuardSnapshot) }

// bypassGuardSnapshot (round 19, attacker AJ's H1): the DDL guard decides
// what is protected from what its transaction reads. A table owner's
// REPEATABLE READ session that took its snapshot before a table was
// protected saw it unprotected, while PostgreSQL changed the real table:
// the backstop's triggers disabled, an owner's trigger created, the table
// renamed, dropped with its rows, its rows rewritten by ALTER COLUMN …
// TYPE … USING. Migration 031: DDL by a non-administrator that touches
// more than its own temporary objects runs only READ COMMITTED (FN010).
// Each case: the owner's first session creates a partition of the
// protected tree (protected at once, committed) after the second took its
// snapshot; the second then runs the DDL on it, directly and through the
// proxy. Before 031 every one succeeded.
func bypassGuardSnapshot(t *testing.T) {
	c := newCast(t)
	o := c.owner
	// Before each case any DDL on the tree: the guard's read shapes of
	// every member are recorded, so the second session's DDL meets no
	// serialization failure of their upsert (which would hide the case
	// behind 40001).
	c.as(t, o, "create or replace function public.gs_trg() returns trigger language plpgsql as $$ begin new.v := 'owner'; return new; end $$")
	ddls := []struct{ name, sql string }{
		{"disable_trigger_all", "alter table %s disable trigger all"},
		{"create_trigger", "create trigger a_owner before insert or update on %s for each row execute function public.gs_trg()"},
		{"rename", "alter table %s rename to %[1]s_moved"},
		{"drop", "drop table %s"},
		{"set_default", "alter table %s alter column v set default 'owner'"},
		{"set_unlogged_rewrite", "alter table %s set unlogged"},
		{"no_inherit_detach", "alter table res detach partition %s"},
	}
	n := 0
	for _, d := range ddls {
		for _, route := range castRoutes {
			n++
			name, lo := fmt.Sprintf("gs_p%d", n), 800+10*n
			t.Run(d.name+"_"+route, func(t *testing.T) {
				c.as(t, o, "comment on table res is 'guard_snapshot'")
				s2 := c.connect(t, route, o, nil)
				if err := castExec(ctxT(t), s2, "begin isolation level repeatable read; select 1", ""); err != nil {
					t.Fatal(err)
				}
				c.as(t, o, fmt.Sprintf("create table %s partition of res for values from (%d) to (%d)", name, lo, lo+10))
				c.protectedUnder(t, "res", name)
				err := castExec(ctxT(t), s2, fmt.Sprintf(d.sql, name), "")
				if got := pgtest.SQLState(err); got != castLocked {
					t.Fatalf("%s in a REPEATABLE READ transaction begun before %s was protected: %v (SQLSTATE %q), want %s",
						fmt.Sprintf(d.sql, name), name, err, got, castLocked)
				}
				castExec(ctxT(t), s2, "rollback", "")
				c.protectedUnder(t, "res", name)
			})
		}
	}
	t.Run("rr_unprotected_table", func(t *testing.T) {
		c.as(t, o, "create table gs_plain (a int)")
		c.refusedAs(t, o, "begin isolation level repeatable read; alter table gs_plain add column b int; commit", castLocked)
	})
	// Round 20, attacker AM's M1: a temporary child of a permanent table
	// is not the session's own temporary objects only: it joins the
	// parent's tree, which the stale snapshot showed unprotected.
	for i, ddl := range []string{"create temp table gs_tc%d () inherits (%s)", "create temp table gs_tc%d (k int not null, job_key text not null, v text not null); alter table gs_tc%[1]d inherit %[2]s"} {
		t.Run(fmt.Sprintf("rr_temp_child_%d", i), func(t *testing.T) {
			parent := fmt.Sprintf("gs_u%d", i)
			c.as(t, o, "create table "+parent+" (k int not null, job_key text not null, v text not null)")
			s2 := c.connect(t, "direct", o, nil)
			if err := castExec(ctxT(t), s2, "begin isolation level repeatable read; select 1", ""); err != nil {
				t.Fatal(err)
			}
			c.as(t, c.su, "select fence.protect('"+parent+"')")
			err := castExec(ctxT(t), s2, fmt.Sprintf(ddl, i, parent), "")
			if got := pgtest.SQLState(err); got != castLocked {
				t.Fatalf("a temporary child of %s in a snapshot from before it was protected: %v (SQLSTATE %q), want %s", parent, err, got, castLocked)
			}
		})
	}
	t.Run("rr_own_temporary_objects_pass", func(t *testing.T) {
		c.as(t, o, "begin isolation level repeatable read; create temp table gs_tmp (a int); create index on gs_tmp (a); drop table gs_tmp; commit")
		c.as(t, c.worker, "begin isolation level serializable; create temp table gs_tmp2 (a int); commit")
	})
	t.Run("rr_dba_passes", func(t *testing.T) {
		c.as(t, c.dba, "begin isolation level repeatable read; create table gs_dba (a int); alter table gs_dba add column b int; commit")
	})
}
