package proxy

import (
	"fmt"
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func init() { registerBypass("declarations", bypassDeclarations) }

// bypassDeclarations (round 25, attacker BA): PostgreSQL acts on what a
// table's CHECK constraints and partial indexes declare of its rows
// without reading them (constraint exclusion, a partial index answering
// a query whose WHERE implies its predicate, the scans ALTER TABLE …
// SET NOT NULL and CREATE TABLE … PARTITION OF skip), folding their
// immutable expressions when it plans. A declaration whose truth the
// owner controls lets the owner decide which protected rows queries and
// the job's own fenced writes find, with no write:
//
//   - H1: a CHECK calling only pg_catalog's to_tsvector(regconfig, …)
//     or ts_lexize(regdictionary, …) over the owner's text search
//     configuration or dictionary, then ALTER TEXT SEARCH …: a child's
//     rows vanished from every query of the tree, and the job's fenced
//     UPDATE and DELETE missed them and were receipted;
//   - H2: a partial index (the owner's dictionary, or the owner's own
//     function, replaced later) on any protected table: queries returned
//     rows contradicting their WHERE and hid the one that matched;
//   - H3: the same CHECK on a default partition let CREATE TABLE …
//     PARTITION OF skip the default's scan: a job's row left in the
//     wrong partition for good;
//   - H4: the same CHECK let SET NOT NULL skip its scan over a job's
//     NULL row: the next restore lost every row of the table.
//
// Migration 033: a CHECK constraint or an index of a protected table may
// depend on nothing but the table and what only a superuser can change
// (fence.declared_fixed); for the table owner the DDL that leaves one
// otherwise is FN010, and fence.protect of a table that has one 55000.
// An administrator may.
func bypassDeclarations(t *testing.T) {
	c := newCast(t)
	o := c.owner
	c.as(t, o, `create text search configuration public.dc_cfg (copy = pg_catalog.simple);
create text search dictionary public.dc_dict (template = pg_catalog.simple);
create function public.dc_lim() returns int language sql immutable as 'select 0';
create table dc_tp (job_key text not null, v int);
create table dc_tch () inherits (dc_tp);
create table dc_plain (job_key text not null, v int, s text);
create table dc_pt (job_key text not null, v int) partition by range (v);
create table dc_pt_lo partition of dc_pt for values from (0) to (100);
create table dc_pt_def partition of dc_pt default`)
	// A superuser's configuration that maps a token type to the owner's
	// dictionary: what it does is still the owner's to change.
	c.as(t, c.su, `create text search configuration public.dc_sucfg (copy = pg_catalog.simple);
alter text search configuration public.dc_sucfg alter mapping for asciiword with public.dc_dict`)
	for _, rel := range []string{"dc_tp", "dc_plain", "dc_pt"} {
		c.as(t, c.su, "select fence.protect('"+rel+"', 'job_key')")
	}
	cfg := func(name string) string {
		return fmt.Sprintf("case when to_tsvector('public.%s'::regconfig, 'hello') @@ 'hello'::tsquery then 1000 else 0 end", name)
	}
	dict := "case when ts_lexize('public.dc_dict'::regdictionary, 'hello') is not null then 1000 else 0 end"
	refused := []struct{ name, sql string }{
		// H1
		{"check_owner_ts_config", "alter table dc_tch add constraint dc_k1 check (v < (" + cfg("dc_cfg") + "))"},
		{"check_superuser_config_owner_dictionary", "alter table dc_tch add constraint dc_k2 check (v < (" + cfg("dc_sucfg") + "))"},
		{"check_owner_dictionary", "alter table dc_tch add constraint dc_k3 check (v < (" + dict + "))"},
		{"new_child_with_such_check", "create table dc_tch2 (check (v < (" + dict + "))) inherits (dc_tp)"},
		// H2
		{"partial_index_owner_dictionary", "create index dc_i1 on dc_plain (v) where (case when ts_lexize('public.dc_dict'::regdictionary, 'hello') is not null then v > 0 else v < 0 end)"},
		{"partial_index_owner_function", "create index dc_i2 on dc_plain (v) where v > public.dc_lim()"},
		{"expression_index_owner_function", "create index dc_i3 on dc_plain ((v + public.dc_lim()))"},
		{"unique_index_owner_function", "create unique index dc_i4 on dc_plain ((v + public.dc_lim()))"},
		{"partial_index_on_a_child", "create index dc_i5 on dc_tch (v) where v > public.dc_lim()"},
		{"partial_index_on_the_partitioned_root", "create index dc_i6 on dc_pt (v) where v > public.dc_lim()"},
		// H3
		{"check_on_default_partition", "alter table dc_pt_def add constraint dc_k4 check (v < (" + dict + "))"},
		// H4
		{"check_proving_not_null", "alter table dc_plain add constraint dc_k5 check (v is not null or ts_lexize('public.dc_dict'::regdictionary, 'hello') is not null)"},
	}
	for _, tc := range refused {
		for _, route := range castRoutes {
			t.Run(tc.name+"_"+route, func(t *testing.T) {
				err := castExec(ctxT(t), c.connect(t, route, o, nil), tc.sql, "")
				if got := pgtest.SQLState(err); got != castLocked {
					t.Fatalf("%s as the table owner (%s): %v (SQLSTATE %q), want %s", tc.sql, route, err, got, castLocked)
				}
			})
		}
	}
	// What the owner may still do: declarations of built-in functions and
	// constants only, an enum of its own, and keeping up its indexes.
	t.Run("plain_declarations_pass", func(t *testing.T) {
		c.as(t, o, `create type public.dc_state as enum ('pending', 'done');
alter table dc_plain add column st public.dc_state;
create index dc_ok1 on dc_plain (v) where v > 5;
create index dc_ok2 on dc_plain (lower(job_key));
create index dc_ok3 on dc_plain (v) where st = 'pending';
create unique index dc_ok4 on dc_plain (job_key, v);
alter table dc_plain add constraint dc_okc check (v > -1000 and st <> 'done' or v is null);
alter table dc_tch add constraint dc_okc2 check (v < 1000);
reindex index dc_ok1;
alter index dc_ok1 rename to dc_ok1b;
create table dc_pt_mid partition of dc_pt for values from (100) to (1000)`)
	})
	// An administrator may; and fence.protect refuses the owner a table
	// that has one.
	t.Run("protect_refuses_owner_a_table_with_one", func(t *testing.T) {
		c.as(t, o, "create table dc_new (job_key text not null, v int); create index dc_new_i on dc_new (v) where v > public.dc_lim()")
		c.refusedAs(t, o, "select fence.protect('dc_new', 'job_key')", "55000")
		c.as(t, c.dba, "select fence.protect('dc_new', 'job_key')")
		c.as(t, c.dba, "create index dc_i2 on dc_plain (v) where v > public.dc_lim()")
	})
}
