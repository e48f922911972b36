package proxy

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("guard_reach", bypassGuardReach) }

// bypassGuardReach (round 22, attacker AR): DDL that reaches beyond the
// object it names (migration 032).
//
//   - H1: ALTER TABLE … RENAME COLUMN / ADD COLUMN on a parent recurses
//     into its children and partitions, whose row types a protected
//     column may hold; the guard looked at the named relation's row type
//     only, so the owner swapped or added the attributes every protected
//     row reads (a regclass attribute too, which reads the catalog's
//     current names).
//   - H2: ALTER EXTENSION … ADD made a protected table (a type it holds,
//     its schema) a member of the owner's trusted extension: pg_dump
//     leaves members out, and the restore lost the table and, with it,
//     the whole protected set.
//   - L1: ALTER SCHEMA … RENAME renamed a type protected rows hold.
//
// Each refusal is FN010 for the table owner; an administrator may.
func bypassGuardReach(t *testing.T) {
	c := newCast(t)
	o := c.owner
	c.as(t, c.su, fmt.Sprintf("do $$ begin execute format('grant create on database %%I to %%I', current_database(), '%s'); end $$", o))
	protect := func(t *testing.T, rel string) {
		t.Helper()
		c.as(t, c.su, "select fence.protect('"+rel+"', 'job_key')")
	}
	refused := func(t *testing.T, route, sql string) {
		t.Helper()
		err := castExec(ctxT(t), c.connect(t, route, o, nil), sql, "")
		if got := pgtest.SQLState(err); got != castLocked {
			t.Fatalf("%s as the table owner (%s): %v (SQLSTATE %q), want %s", sql, route, err, got, castLocked)
		}
	}
	// H1: the composite a protected column holds is a child's or a
	// partition's row type, changed through a parent.
	parents := []struct {
		name  string
		scene string // creates gr_<n>_o, whose row type gr_<n>_t.r holds, under gr_<n>_p
		ddl   []string
	}{
		{"inheritance_parent", "create table gr_%[1]s_p (a text, b text); create table gr_%[1]s_o () inherits (gr_%[1]s_p)",
			[]string{"alter table gr_%[1]s_p rename column a to tmp", "alter table gr_%[1]s_p add column z int", "alter table gr_%[1]s_p add column rc regclass"}},
		{"partitioned_parent", "create table gr_%[1]s_p (a text, b text) partition by list (a); create table gr_%[1]s_o partition of gr_%[1]s_p for values in ('x')",
			[]string{"alter table gr_%[1]s_p rename column b to bb", "alter table gr_%[1]s_p add column c int"}},
		{"grandparent", "create table gr_%[1]s_p (a text); create table gr_%[1]s_m () inherits (gr_%[1]s_p); create table gr_%[1]s_o () inherits (gr_%[1]s_m)",
			[]string{"alter table gr_%[1]s_p rename column a to aa", "alter table gr_%[1]s_p add column z int"}},
		{"local_columns_new_parent", "create table gr_%[1]s_o (a text, b int); create table gr_%[1]s_p (a text, b int); alter table gr_%[1]s_o inherit gr_%[1]s_p",
			[]string{"alter table gr_%[1]s_p rename column a to renamed", "alter table gr_%[1]s_p add column z int"}},
	}
	for _, p := range parents {
		for _, route := range castRoutes {
			n := p.name + "_" + route
			t.Run(n, func(t *testing.T) {
				c.as(t, o, fmt.Sprintf(p.scene, n))
				c.as(t, o, fmt.Sprintf("create table gr_%[1]s_t (job_key text not null, r gr_%[1]s_o)", n))
				protect(t, "gr_"+n+"_t")
				for _, d := range p.ddl {
					refused(t, route, fmt.Sprintf(d, n))
				}
			})
		}
	}
	t.Run("unprotected_parent_passes", func(t *testing.T) {
		c.as(t, o, "create table gr_free_p (a text); create table gr_free_o () inherits (gr_free_p); create table gr_free_t (job_key text not null, r gr_free_o)")
		c.as(t, o, "alter table gr_free_p rename column a to b; alter table gr_free_p add column z int")
	})
	// The protected tree's own parent: a protected column holds a
	// protected child's row type.
	t.Run("protected_parent_of_held_row_type", func(t *testing.T) {
		c.as(t, o, "create table gr_tp (job_key text not null, v int); create table gr_tc () inherits (gr_tp); create table gr_th (job_key text not null, r gr_tc)")
		protect(t, "gr_tp")
		protect(t, "gr_th")
		refused(t, "direct", "alter table gr_tp add column w int")
		refused(t, "direct", "alter table gr_tp rename column v to vv")
	})
	// H2: extension membership.
	c.as(t, o, "create extension if not exists citext")
	c.as(t, o, "create table gr_x (job_key text not null, v int); create schema gr_xs; create table gr_xs.t (job_key text not null); create type gr_xe as enum ('a', 'b'); create table gr_xt (job_key text not null, e gr_xe)")
	for _, rel := range []string{"gr_x", "gr_xs.t", "gr_xt"} {
		protect(t, rel)
	}
	for _, ext := range []struct{ name, sql string }{
		{"add_table", "alter extension citext add table gr_x"},
		{"add_schema", "alter extension citext add schema gr_xs"},
		{"add_type", "alter extension citext add type gr_xe"},
	} {
		for _, route := range castRoutes {
			t.Run("extension_"+ext.name+"_"+route, func(t *testing.T) { refused(t, route, ext.sql) })
		}
	}
	t.Run("extension_dba_may", func(t *testing.T) {
		c.as(t, c.dba, "begin; alter extension citext add table gr_x; alter extension citext drop table gr_x; commit")
	})
	// L1: a schema's rename renames the types in it.
	t.Run("schema_rename_moves_type", func(t *testing.T) {
		c.as(t, o, "create schema gr_s7; create type gr_s7.e as enum ('a', 'b'); create table gr_t7 (job_key text not null, e gr_s7.e)")
		protect(t, "gr_t7")
		refused(t, "direct", "alter schema gr_s7 rename to gr_s7b")
		c.as(t, o, "alter table gr_t7 add column n int") // the shape is still the recorded one
	})
	t.Run("schema_rename_of_nothing_read_passes", func(t *testing.T) {
		c.as(t, o, "create schema gr_s8; create table gr_s8.plain (a int); alter schema gr_s8 rename to gr_s8b")
	})
	// Round 23, attacker AU's H3: ALTER INDEX … RENAME renames a table
	// (the guard looked only at ALTER TABLE's tags).
	t.Run("alter_index_renames_table", func(t *testing.T) {
		c.as(t, o, "create table gr_ai (job_key text not null, v int)")
		protect(t, "gr_ai")
		for _, route := range castRoutes {
			refused(t, route, "alter index gr_ai rename to gr_ai_moved")
		}
	})
	// Round 23, attacker AU's H1: a change to a type protected rows read,
	// racing fence.protect. The DBA's protect waits for the owner's open
	// transaction (fence.hold_reads), and a change waiting for a lock
	// meanwhile is judged against the shape protect recorded.
	waiting := func(t *testing.T, pid uint32, done chan error) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			select {
			case err := <-done:
				t.Fatalf("returned (%v) instead of waiting for the owner's transaction", err)
			default:
			}
			if c.count(t, "select count(*) from pg_stat_activity where pid = $1 and wait_event_type = 'Lock'", int(pid)) == 1 {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Fatalf("backend %d never waited for a lock", pid)
	}
	for _, tc := range []struct{ name, scene, change, after string }{
		{"enum_value", "create type gr_e0 as enum ('a', 'b'); create table gr_h0 (job_key text not null, e gr_e0)",
			"alter type gr_e0 rename value 'a' to 'z'", "alter type gr_e0 rename value 'z' to 'y'"},
		{"composite_attributes", "create type gr_pair as (amount int, fee int); create table gr_h2 (job_key text not null, p gr_pair)",
			"alter type gr_pair rename attribute amount to fee_old; alter type gr_pair rename attribute fee to amount; alter type gr_pair rename attribute fee_old to fee",
			"alter type gr_pair rename attribute fee to x"},
	} {
		t.Run("protect_waits_for_open_"+tc.name, func(t *testing.T) {
			c.as(t, o, tc.scene)
			table := tc.scene[strings.LastIndex(tc.scene, "create table ")+len("create table ") : strings.LastIndex(tc.scene, " (job_key")]
			a := c.connect(t, "direct", o, nil)
			if err := castExec(ctxT(t), a, "begin; "+tc.change, ""); err != nil {
				t.Fatal(err)
			}
			dba := c.connect(t, "direct", c.su, nil)
			done := make(chan error, 1)
			go func() { done <- castExec(ctxT(t), dba, "select fence.protect('"+table+"', 'job_key')", "") }()
			waiting(t, dba.PID(), done)
			if err := castExec(ctxT(t), a, "commit", ""); err != nil {
				t.Fatal(err)
			}
			if err := <-done; err != nil {
				t.Fatalf("protect after the owner's commit: %v", err)
			}
			c.refusedAs(t, o, tc.after, castLocked)
		})
	}
	t.Run("change_waiting_for_a_lock_across_protect", func(t *testing.T) {
		c.as(t, o, "create type gr_e1 as enum ('a', 'b'); create table gr_h1 (job_key text not null, e gr_e1)")
		b := c.connect(t, "direct", o, nil)
		if err := castExec(ctxT(t), b, "begin; comment on type gr_e1 is 'hold'", ""); err != nil {
			t.Fatal(err)
		}
		a := c.connect(t, "direct", o, nil)
		done := make(chan error, 1)
		go func() { done <- castExec(ctxT(t), a, "alter type gr_e1 rename value 'a' to 'z'", "") }()
		waiting(t, a.PID(), done)
		protect(t, "gr_h1")
		if err := castExec(ctxT(t), b, "commit", ""); err != nil {
			t.Fatal(err)
		}
		if err := <-done; pgtest.SQLState(err) != castLocked {
			t.Fatalf("the rename that waited across fence.protect: %v (SQLSTATE %q), want %s", err, pgtest.SQLState(err), castLocked)
		}
	})
	// Round 24, attacker AX's H1: a CHECK constraint calling the owner's
	// function lets constraint exclusion drop a member from the tree's
	// queries once the owner replaces the function.
	t.Run("check_constraint_calling_owner_function", func(t *testing.T) {
		c.as(t, o, `create table gr_xp (job_key text not null, v int); create table gr_xc () inherits (gr_xp);
create function public.gr_lim() returns int language sql immutable set search_path = pg_catalog as 'select 100'`)
		protect(t, "gr_xp")
		for _, route := range castRoutes {
			refused(t, route, "alter table gr_xc add constraint gr_k check (v < public.gr_lim())")
		}
		refused(t, "direct", "create table gr_xc2 (check (v < public.gr_lim())) inherits (gr_xp)")
		c.as(t, o, "alter table gr_xc add constraint gr_plain check (v < 1000)") // no function: allowed
		c.as(t, c.dba, "alter table gr_xc add constraint gr_k check (v < public.gr_lim())")
	})
}
