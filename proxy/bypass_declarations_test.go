package proxy

import (
	"fmt"
	"testing"
	"time"

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
create function public.dc_lim() returns int language sql immutable set search_path = pg_catalog as 'select 0';
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
	// Round 26 (attacker BD): a configuration named by a computed OID
	// (no dependency is recorded), and pg_catalog's immutable
	// pg_partition_root of the owner's index.
	var cfgOID int
	if err := c.admin.QueryRow(ctxT(t), "select 'public.dc_cfg'::regconfig::oid::int").Scan(&cfgOID); err != nil {
		t.Fatal(err)
	}
	c.as(t, o, `create table dc_op (a int) partition by list (a);
create table dc_op1 partition of dc_op for values in (1);
create index dc_opi on dc_op (a)`)
	computed := fmt.Sprintf("case when to_tsvector((%d + 0)::regconfig, 'hello') @@ 'hello'::tsquery then 1000 else 0 end", cfgOID)
	refused = append(refused, []struct{ name, sql string }{
		{"check_computed_config_oid", "alter table dc_tch add constraint dc_k6 check (v < (" + computed + "))"},
		{"partial_index_computed_config_oid", "create index dc_i7 on dc_plain (v) where v < (" + computed + ")"},
		{"check_partition_root_of_owner_index", "alter table dc_tch add constraint dc_k7 check (v < (case when pg_partition_root('public.dc_op1_a_idx'::regclass) is not null then 1000 else 0 end))"},
		{"check_regclass_from_text", "alter table dc_tch add constraint dc_k8 check (v < (case when pg_partition_root(('public.dc_op1_a_' || 'idx')::regclass) is not null then 1000 else 0 end))"},
		{"sub_partition_key_owner_function", "create table dc_pt_sub partition of dc_pt for values from (1000) to (2000) partition by list (public.dc_kf(v))"},
	}...)
	c.as(t, o, "create function public.dc_kf(int) returns int language sql immutable as 'select $1'")
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
	// fence.protect refuses a table that has one, whoever protects it.
	t.Run("protect_refuses_a_table_with_one", func(t *testing.T) {
		c.as(t, o, "create table dc_new (job_key text not null, v int); create index dc_new_i on dc_new (v) where v > public.dc_lim()")
		c.refusedAs(t, o, "select fence.protect('dc_new', 'job_key')", "55000")
		c.refusedAs(t, c.dba, "select fence.protect('dc_new', 'job_key')", "55000")
		c.as(t, o, "drop table dc_new")
	})
	// An administrator may add one; then what it depends on cannot be
	// changed by the owner (its DDL is refused until it is gone).
	t.Run("administrator_declaration_pins_what_it_depends_on", func(t *testing.T) {
		c.as(t, c.dba, "create index dc_i2 on dc_plain (v) where v > public.dc_lim()")
		c.refusedAs(t, o, "create or replace function public.dc_lim() returns int language sql immutable set search_path = pg_catalog as 'select -1000'", castLocked)
		c.refusedAs(t, o, "alter text search dictionary public.dc_dict (accept = false)", castLocked)
		c.as(t, o, "drop index dc_i2") // the owner may drop it
		c.as(t, o, "create or replace function public.dc_lim() returns int language sql immutable set search_path = pg_catalog as 'select 1'")
	})
	// Round 26, BD-H3 (and round 27, BG-M1): CREATE INDEX
	// CONCURRENTLY committed its index before the guard refused it, and
	// REINDEX (no event trigger on PostgreSQL 15) made it valid; the
	// leftover then refused every non-administrator's DDL in the
	// database. A non-administrator may not start one.
	t.Run("concurrent_index_refused_before_it_starts", func(t *testing.T) {
		for _, sql := range []string{
			"create index concurrently dc_cic on dc_plain (v) where v > public.dc_lim()",
			"CREATE INDEX /* x */ CONCURRENTLY dc_cic2 ON dc_plain (v)",
		} {
			c.refusedAs(t, o, sql, castLocked)
		}
		if n := c.count(t, "select count(*) from pg_class where relname in ('dc_cic', 'dc_cic2')"); n != 0 {
			t.Fatalf("%d indexes left behind by refused concurrent builds", n)
		}
		c.as(t, c.dba, "create index concurrently dc_cic3 on dc_plain (v)")
		c.as(t, c.dba, "drop index dc_cic3")
	})
	// Round 27 (attacker BG): declarations whose value is not the row's
	// own (a whole-row test, which ADD COLUMN changes; tableoid and the
	// session's user or clock, which a restore changes), and a function
	// resolving names under the caller's search_path, refused to an
	// administrator too.
	t.Run("declarations_not_of_the_row", func(t *testing.T) {
		for _, sql := range []string{
			"alter table dc_plain add constraint dc_w1 check (dc_plain is not null)",
			"create index dc_w2 on dc_plain (v) where dc_plain is not null",
			"alter table dc_plain add constraint dc_w3 check (tableoid <> 0)",
			"alter table dc_plain add constraint dc_w4 check (current_user <> 'postgres')",
			"alter table dc_plain add constraint dc_w5 check (statement_timestamp() < '2100-01-01')",
			// Round 28, BJ-H1: an output function prints as the session
			// says (extra_float_digits), and REINDEX runs it under the
			// owner's.
			"create index dc_w7 on dc_plain ((textin(float8out(v::float8))))",
			// ... and an XML expression reads xmlbinary, calling no
			// function at all.
			"create index dc_w8 on dc_plain ((xmlserialize(content xmlelement(name a, job_key) as text)))",
		} {
			c.refusedAs(t, o, sql, castLocked)
		}
		c.as(t, c.su, `create function public.dc_su_sql(text) returns text language sql immutable as $$ select $1 || 'x' $$`)
		for _, role := range []string{o, c.dba} {
			c.refusedAs(t, role, "create index dc_w6 on dc_plain ((public.dc_su_sql(job_key)))", castLocked)
		}
	})
	// Round 26, BD-H4: a CHECK added in a transaction open across the
	// DBA's fence.protect is judged once protect holds the lock.
	t.Run("check_in_flight_across_protect", func(t *testing.T) {
		c.as(t, o, "create table dc_rp (job_key text not null, v int); create table dc_rc () inherits (dc_rp)")
		a := c.connect(t, "direct", o, nil)
		if err := castExec(ctxT(t), a, "begin; alter table dc_rc add constraint dc_rk check (v < public.dc_lim())", ""); err != nil {
			t.Fatal(err)
		}
		dba := c.connect(t, "direct", c.su, nil)
		done := make(chan error, 1)
		go func() { done <- castExec(ctxT(t), dba, "select fence.protect('dc_rp', 'job_key')", "") }()
		for start := time.Now(); ; {
			if c.count(t, "select count(*) from pg_stat_activity where pid = $1 and wait_event_type = 'Lock'", int(dba.PID())) == 1 {
				break
			}
			select {
			case err := <-done:
				t.Fatalf("protect did not wait for the open transaction: %v", err)
			default:
			}
			if time.Since(start) > 10*time.Second {
				t.Fatal("protect never waited for the lock")
			}
			time.Sleep(10 * time.Millisecond)
		}
		if err := castExec(ctxT(t), a, "commit", ""); err != nil {
			t.Fatal(err)
		}
		if err := <-done; pgtest.SQLState(err) != "55000" {
			t.Fatalf("protect across the owner's CHECK: %v (SQLSTATE %q), want 55000", err, pgtest.SQLState(err))
		}
	})
}
