package proxy

import (
	"testing"
)

func init() { registerBypass("inheritance", bypassInheritance) }

// bypassInheritance: protecting an inheritance parent protects its
// children, present and future. Writes naming the child, or the parent
// (which reach the child's rows), are refused from a stale session and
// one without fence metadata; a table owner cannot add a child with rows,
// take a child out, or give a child a second, unprotected parent.
func bypassInheritance(t *testing.T) {
	c := newCast(t)
	w, stale := c.worker, &c.stale
	c.tryEach(t, []castCase{
		{"insert_child_stale", attempt{role: w, lease: stale, sql: "insert into inh_c values (3, 'job', 'zombie')", code: castStale}},
		{"insert_child_nometa", attempt{role: w, sql: "insert into inh_c values (3, 'job', 'zombie')", code: castNoMeta}},
		{"delete_child_stale", attempt{role: w, lease: stale, sql: "delete from inh_c", code: castStale}},
		{"update_parent_reaching_child_stale", attempt{role: w, lease: stale, sql: "update inh set v = 'zombie' where k = 2", code: castStale}},
		{"delete_parent_nometa", attempt{role: w, sql: "delete from inh", code: castNoMeta}},
		{"delete_only_parent_stale", attempt{role: w, lease: stale, sql: "delete from only inh", code: castStale}},
		{"truncate_parent_stale", attempt{role: w, lease: stale, sql: "truncate inh", code: castStale}},
		{"truncate_child_nometa", attempt{role: w, sql: "truncate inh_c", code: castNoMeta}},
		{"copy_child_nometa", attempt{role: w, sql: "copy inh_c from stdin", copyIn: "4\tjob\tzombie\n", code: castNoMeta}},
		{"upsert_child_stale", attempt{role: w, lease: stale, code: castStale,
			sql: "insert into inh_c values (2, 'job', 'zombie') on conflict (k) do update set v = excluded.v"}},
		{"merge_child_stale", attempt{role: w, lease: stale, code: castStale,
			sql: "merge into inh_c t using (values (2)) s(k) on t.k = s.k when matched then delete"}},
		{"function_writing_child_nometa", attempt{role: w, sql: "do $$ begin delete from inh_c; end $$", code: castNoMeta}},
		{"no_inherit_by_owner", attempt{role: c.owner, sql: "alter table inh_c no inherit inh", code: castLocked}},
		{"drop_child_by_owner", attempt{role: c.owner, sql: "drop table inh_c", code: castLocked}},
		{"unprotect_child", attempt{role: c.su, sql: "select fence.unprotect('inh_c')", code: "42809"}},
	})

	t.Run("inherit_table_with_rows_by_owner", func(t *testing.T) {
		c.as(t, c.owner, "create table inh_x (k int not null, job_key text not null, v text not null); insert into inh_x values (9, 'job', 'smuggled')")
		c.try(t, attempt{role: c.owner, sql: "alter table inh_x inherit inh", code: castLocked})
	})
	t.Run("second_unprotected_parent", func(t *testing.T) {
		// UPDATE other would reach inh_c's rows through a parent whose
		// statement triggers are not the backstop's: refused for everyone.
		c.as(t, c.owner, "create table other (k int not null, job_key text not null, v text not null)")
		c.try(t, attempt{role: c.owner, sql: "alter table inh_c inherit other", code: "55000"})
		c.try(t, attempt{role: c.dba, sql: "alter table inh_c inherit other", code: "55000"})
		c.try(t, attempt{role: c.owner, sql: "create table inh_y () inherits (inh, other)", code: "55000"})
	})
	t.Run("protected_table_under_unprotected_parent", func(t *testing.T) {
		c.try(t, attempt{role: c.owner, sql: "alter table app.ledger inherit other", code: "55000"})
	})
	t.Run("protect_child_alone", func(t *testing.T) {
		c.as(t, c.owner, "create table base (k int); create table base_c () inherits (base)")
		c.try(t, attempt{role: c.su, sql: "select fence.protect('base_c')", code: "42809"})
	})
	t.Run("new_child_is_protected", func(t *testing.T) {
		c.as(t, c.owner, "create table inh_d () inherits (inh); create table inh_dd () inherits (inh_d); grant all on inh_d, inh_dd to "+c.worker)
		c.protectedUnder(t, "inh", "inh_d", "inh_dd") // new children
		c.try(t, attempt{role: w, lease: stale, sql: "insert into inh_dd values (5, 'job', 'zombie')", code: castStale})
		c.try(t, attempt{role: w, sql: "insert into inh_d values (5, 'job', 'zombie')", code: castNoMeta})
	})
	t.Run("inherit_empty_table_is_protected", func(t *testing.T) {
		c.as(t, c.owner, "create table inh_e (k int not null, job_key text not null, v text not null); alter table inh_e inherit inh; grant all on inh_e to "+c.worker)
		c.try(t, attempt{role: w, lease: stale, sql: "insert into inh_e values (6, 'job', 'zombie')", code: castStale})
	})
	t.Run("no_inherit_by_bypass_stays_protected", func(t *testing.T) {
		c.as(t, c.dba, "alter table inh_e no inherit inh")
		c.protectedUnder(t, "inh_e", "inh_e") // a child taken out of the tree, on its own
		c.try(t, attempt{role: w, sql: "insert into inh_e values (6, 'job', 'zombie')", code: castNoMeta})
	})
	t.Run("current_generation_writes", func(t *testing.T) {
		c.currentWrites(t, func(route string) string { return "update inh set v = '" + route + "'" })
		if n := c.count(t, "select count(*) from inh where v = 'proxy'"); n != 2 {
			t.Fatalf("rows written by the current generation: %d, want 2", n)
		}
	})
}
