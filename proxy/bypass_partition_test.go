package proxy

import (
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("partition", bypassPartition) }

// bypassPartition: a protected partitioned table is protected as a tree.
// Every statement form, naming the root, a partition or a sub-partition,
// from a stale session or one without fence metadata, is refused; a table
// owner cannot bring rows into the tree or take a partition out of it.
func bypassPartition(t *testing.T) {
	c := newCast(t)
	w, stale := c.worker, &c.stale
	c.tryEach(t, []castCase{
		{"insert_root_stale", attempt{role: w, lease: stale, sql: "insert into res values (2, 'job', 'zombie')", code: castStale}},
		{"insert_root_nometa", attempt{role: w, sql: "insert into res values (2, 'job', 'zombie')", code: castNoMeta}},
		{"update_root_stale", attempt{role: w, lease: stale, sql: "update res set v = 'zombie'", code: castStale}},
		{"delete_root_nometa", attempt{role: w, sql: "delete from res", code: castNoMeta}},
		{"merge_root_stale", attempt{role: w, lease: stale, code: castStale,
			sql: "merge into res r using (values (1), (3)) s(k) on r.k = s.k when matched then update set v = 'zombie' when not matched then insert values (s.k, 'job', 'zombie')"}},
		{"upsert_root_stale", attempt{role: w, lease: stale, code: castStale,
			sql: "insert into res values (1, 'job', 'zombie') on conflict (k) do update set v = excluded.v"}},
		{"copy_root_stale", attempt{role: w, lease: stale, sql: "copy res from stdin", copyIn: "3\tjob\tzombie\n150\tjob\tzombie\n", code: castStale}},
		{"copy_root_nometa", attempt{role: w, sql: "copy res from stdin", copyIn: "3\tjob\tzombie\n", code: castNoMeta}},
		{"truncate_root_nometa", attempt{role: w, sql: "truncate res", code: castNoMeta}},
		{"insert_select_root_stale", attempt{role: w, lease: stale, sql: "insert into res select g, 'job', 'zombie' from generate_series(10, 20) g", code: castStale}},
		{"writable_cte_root_stale", attempt{role: w, lease: stale, sql: "with d as (delete from res returning *) select count(*) from d", code: castStale}},
		{"move_row_across_partitions_stale", attempt{role: w, lease: stale, sql: "update res set k = 170 where k = 1", code: castStale}},
		{"insert_subpartition_stale", attempt{role: w, lease: stale, sql: "insert into res_2a values (130, 'job', 'zombie')", code: castStale}},
		{"update_partition_nometa", attempt{role: w, sql: "update res_1 set v = 'zombie'", code: castNoMeta}},
		{"truncate_subpartition_stale", attempt{role: w, lease: stale, sql: "truncate res_2b", code: castStale}},
		{"delete_partitioned_partition_nometa", attempt{role: w, sql: "delete from res_2", code: castNoMeta}},
		{"do_block_root_stale", attempt{role: w, lease: stale, sql: "do $$ begin update res set v = 'zombie'; end $$", code: castStale}},
		// The table owner's DDL on the tree.
		{"detach_by_owner", attempt{role: c.owner, sql: "alter table res detach partition res_1", code: castLocked}},
		{"detach_subpartition_by_owner", attempt{role: c.owner, sql: "alter table res_2 detach partition res_2b", code: castLocked}},
		{"drop_partition_by_owner", attempt{role: c.owner, sql: "drop table res_2b", code: castLocked}},
		{"unprotect_partition", attempt{role: c.su, sql: "select fence.unprotect('res_1')", code: "42809"}},
	})

	t.Run("protect_partition_alone", func(t *testing.T) {
		// Protecting one partition would leave writes naming its root
		// unfenced: refused, with the root to protect instead.
		c.as(t, c.owner, "create table parts (k int) partition by list (k); create table parts_1 partition of parts for values in (1)")
		c.try(t, attempt{role: c.su, sql: "select fence.protect('parts_1')", code: "42809"})
	})
	t.Run("attach_table_with_rows_by_owner", func(t *testing.T) {
		c.as(t, c.owner, "create table res_x (k int primary key, job_key text not null, v text not null); insert into res_x values (250, 'job', 'smuggled')")
		c.try(t, attempt{role: c.owner, sql: "alter table res attach partition res_x for values from (200) to (300)", code: castLocked})
	})
	t.Run("attach_protected_table_under_unprotected_parent", func(t *testing.T) {
		// Writes naming shadow would reach app.ledger's rows without
		// firing its statement triggers: refused for everyone.
		c.as(t, c.owner, "create table shadow (k int primary key, job_key text not null, v text not null) partition by range (k)")
		c.try(t, attempt{role: c.owner, sql: "alter table shadow attach partition app.ledger for values from (0) to (1000)", code: "55000"})
		c.try(t, attempt{role: c.dba, sql: "alter table shadow attach partition app.ledger for values from (0) to (1000)", code: "55000"})
	})
	t.Run("new_partition_is_protected", func(t *testing.T) {
		// An owner may add an empty partition; it is protected at once.
		c.as(t, c.owner, "create table res_3 partition of res for values from (200) to (300) partition by range (k); create table res_3a partition of res_3 for values from (200) to (300); grant all on res_3, res_3a to "+c.worker)
		c.protectedUnder(t, "res", "res_3", "res_3a") // new partitions
		c.try(t, attempt{role: w, lease: stale, sql: "insert into res_3a values (250, 'job', 'zombie')", code: castStale})
		c.try(t, attempt{role: w, sql: "insert into res values (250, 'job', 'zombie')", code: castNoMeta})
		c.try(t, attempt{role: w, lease: stale, sql: "insert into res_3 values (250, 'job', 'zombie')", code: castStale})
	})
	t.Run("attach_empty_table_is_protected", func(t *testing.T) {
		c.as(t, c.owner, "create table res_4 (k int primary key, job_key text not null, v text not null); alter table res attach partition res_4 for values from (300) to (400); grant all on res_4 to "+c.worker)
		c.try(t, attempt{role: w, lease: stale, sql: "insert into res_4 values (350, 'job', 'zombie')", code: castStale})
		c.try(t, attempt{role: w, sql: "copy res from stdin", copyIn: "350\tjob\tzombie\n", code: castNoMeta})
	})
	t.Run("current_generation_writes", func(t *testing.T) {
		// The control: the holder of the current generation writes the
		// tree by every route.
		c.currentWrites(t, func(route string) string {
			return "update res set v = 'current " + route + "'; insert into res_2b values (170, 'job', '" + route + "') on conflict (k) do update set v = excluded.v"
		})
		if n := c.count(t, "select count(*) from res where v = 'current proxy'"); n != 3 {
			t.Fatalf("rows written by the current generation: %d, want 3", n)
		}
	})
	t.Run("detach_by_bypass_stays_protected", func(t *testing.T) {
		// A DBA may detach; the partition stays protected, as its own root.
		c.as(t, c.dba, "alter table res_2 detach partition res_2b")
		c.protectedUnder(t, "res_2b", "res_2b") // a detached partition, on its own
		c.try(t, attempt{role: w, lease: stale, sql: "delete from res_2b", code: castStale})
		c.try(t, attempt{role: w, sql: "delete from res_2b", code: castNoMeta})
	})
	t.Run("detach_concurrently_by_owner", func(t *testing.T) {
		// DETACH … CONCURRENTLY commits its first transaction before any
		// event trigger runs; the guard refuses the second, so the
		// partition is left "detach pending" — and still protected.
		before := c.count(t, "select count(*) from fence.protected_tables")
		err := castExec(ctxT(t), c.connect(t, "direct", c.owner, nil), "alter table res detach partition res_1 concurrently", "")
		if got := pgtest.SQLState(err); got != castLocked {
			t.Fatalf("detach concurrently: got %v, want SQLSTATE %s", err, castLocked)
		}
		c.protectedUnder(t, "res", "res_1")
		if c.count(t, "select count(*) from fence.protected_tables") != before {
			t.Fatal("the refused concurrent detach changed the protected tables")
		}
		c.try(t, attempt{role: w, lease: stale, sql: "update res_1 set v = 'zombie'", code: castStale})
		c.try(t, attempt{role: w, sql: "delete from res_1", code: castNoMeta})
		c.try(t, attempt{role: c.owner, sql: "alter table res detach partition res_1 finalize", code: castLocked})
	})
}
