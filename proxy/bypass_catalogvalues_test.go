package proxy

import (
	"testing"

	"github.com/jackc/pgx/v5"
)

func init() { registerBypass("catalog_values", bypassCatalogValues) }

// catalogValuesSchema is the class's own types and protected tables (over
// the cast's), all the owner's: a domain, a composite, a nested composite
// and a range over OID-alias types; app.cv_used, protected, whose column p
// uses the composite app.cv_pair (and n, an int); app.cv_of, a protected typed table.
const catalogValuesSchema = `
set session authorization %[1]s;
create domain app.cv_dom as regclass;
create type app.cv_comp as (a int, p regproc);
create type app.cv_nest as (n int, c app.cv_comp);
create type app.cv_range as range (subtype = regclass);
create type app.cv_pair as (a int, b text);
create type app.cv_rec as (k int, job_key text);
create type app.cv_regrec as (k int, job_key text, r regtype);
create table app.cv_used (k int primary key, job_key text not null, p app.cv_pair, n int);
create table app.cv_of of app.cv_rec;
grant select, insert, update, delete on app.cv_used, app.cv_of to %[2]s;
reset session authorization;
select fence.protect('app.cv_used', 'job_key'), fence.protect('app.cv_of', 'job_key');
`

// catalogValueTypes are the types whose values are stored as an OID (or,
// for aclitem, role OIDs) and read as the current name of what they point
// to: every OID-alias type of PostgreSQL 15, and aclitem.
var catalogValueTypes = []string{"regclass", "regproc", "regprocedure", "regoper", "regoperator", "regtype",
	"regconfig", "regdictionary", "regnamespace", "regrole", "regcollation", "aclitem"}

// bypassCatalogValues (attack round 14, AA Break 2): a value that reads
// through the catalog is not the row's own. The owner added an empty
// regclass, regproc and regtype column to a protected table (existing
// rows read NULL), a fenced write stored values in it, and renaming or
// dropping the objects they pointed to changed what those rows read, with
// no DDL on the table. Such a column cannot come to a protected table now
// except by an administrator, whichever way it would come: added
// (directly, as an array, through a domain, inside a composite, a range or
// a multirange, on a partitioned root or an inheritance parent or child),
// by a typed table's type, by a table joining the tree, or by protecting
// a table that has one (55000). So the attack's first step is refused and
// there is nothing for a rename to change.
func bypassCatalogValues(t *testing.T) {
	c := newCast(t)
	o := c.owner
	c.exec(t, sprintfIdents(catalogValuesSchema, c.owner, c.worker))
	cases := [][2]string{
		{"the_attack", "alter table app.ledger add column rc regclass, add column rp regproc, add column rty regtype"},
	}
	for _, ty := range catalogValueTypes {
		cases = append(cases, [2]string{"add_column_" + ty, "alter table app.ledger add column x " + ty})
	}
	cases = append(cases, [][2]string{
		{"add_column_array", "alter table app.ledger add column x regclass[]"},
		{"add_column_domain", "alter table app.ledger add column x app.cv_dom"},
		{"add_column_array_of_domain", "alter table app.ledger add column x app.cv_dom[]"},
		{"add_column_composite", "alter table app.ledger add column x app.cv_comp"},
		{"add_column_nested_composite", "alter table app.ledger add column x app.cv_nest[]"},
		{"add_column_range", "alter table app.ledger add column x app.cv_range"},
		{"add_column_multirange", "alter table app.ledger add column x app.cv_multirange"},
		{"add_column_catalog_row_type", "alter table app.ledger add column x pg_catalog.pg_type"},
		{"add_column_default_null", "alter table app.ledger add column x regclass default null"},
		{"add_column_to_partitioned_root", "alter table res add column x regtype"},
		{"add_column_to_inheritance_parent", "alter table inh add column x regtype"},
		{"add_column_to_inheritance_child", "alter table inh_c add column x regtype"},
		{"add_column_in_a_do_block", "do $$ begin execute 'alter table app.ledger add column x regclass'; end $$"},
		{"typed_table_add_attribute_cascade", "alter type app.cv_rec add attribute r regnamespace cascade"},
		{"create_inheritance_child", "create table public.cv_child (r regclass) inherits (inh)"},
		{"create_grandchild", "create table public.cv_child (r regrole) inherits (inh_c)"},
		{"inherit_empty_table", "create table public.cv_in (k int not null, job_key text not null, v text not null, r app.cv_comp); alter table public.cv_in inherit inh"},
		// Refused before this class (read shapes): a column's type into
		// one, and a composite in use gaining such an attribute.
		{"alter_column_type_oid_to_regclass", "alter table app.ledger add column x oid; alter table app.ledger alter column x type regclass"},
		{"alter_column_type_int_to_regclass", "alter table app.cv_used alter column n type regclass"},
		{"composite_in_use_add_attribute", "alter type app.cv_pair add attribute r regclass"},
	}...)
	c.tryEach(t, castAttempts(o, castLocked, cases))

	t.Run("protect", func(t *testing.T) {
		// fence.protect: 55000 for a non-administrator, with a message
		// that says to store the name as text.
		c.tryEach(t, castAttempts(o, "55000", [][2]string{
			{"table", "create table public.cv_new (k int, job_key text, r regclass); select fence.protect('public.cv_new', 'job_key')"},
			{"array_of_domain", "create table public.cv_new (k int, job_key text, r app.cv_dom[]); select fence.protect('public.cv_new', 'job_key')"},
			{"composite", "create table public.cv_new (k int, job_key text, r app.cv_nest); select fence.protect('public.cv_new')"},
			{"typed_table", "create table public.cv_new of app.cv_regrec; select fence.protect('public.cv_new', 'job_key')"},
			{"inheritance_child", "create table public.cv_new (k int, job_key text); create table public.cv_new_c (r regoper) inherits (public.cv_new); select fence.protect('public.cv_new', 'job_key')"},
			{"partitioned", "create table public.cv_new (k int, job_key text, r regproc) partition by range (k); create table public.cv_new_1 partition of public.cv_new for values from (0) to (10); select fence.protect('public.cv_new', 'job_key')"},
		}))
	})

	t.Run("ordinary_changes_pass", func(t *testing.T) {
		// The same changes with text or oid pass.
		c.as(t, o, `alter table app.ledger add column rc text, add column ro oid;
			create table public.cv_child (r text) inherits (inh);
			create table public.cv_ok (k int, job_key text, r oid, n text[]);
			select fence.protect('public.cv_ok', 'job_key')`)
	})

	t.Run("bypass_member_may", func(t *testing.T) {
		// An administrator may add such a column and protect a table with
		// one (and takes what it reads as it is): the owner's other
		// changes of those tables pass, its new such columns do not.
		c.as(t, c.dba, `alter table app.ledger add column rdba regclass;
			set role `+pgx.Identifier{o}.Sanitize()+`;
			create table public.cv_dba (k int, job_key text, r regclass);
			reset role;
			select fence.protect('public.cv_dba', 'job_key')`)
		c.as(t, o, `alter table app.ledger add column note2 text;
			comment on column app.ledger.rdba is 'the dba''s';
			create table public.cv_dba_c () inherits (public.cv_dba)`)
		c.try(t, attempt{role: o, sql: "alter table app.ledger add column x regtype", code: castLocked})
		c.try(t, attempt{role: o, sql: "create table public.cv_dba_c2 (x regtype) inherits (public.cv_dba)", code: castLocked})
		c.try(t, attempt{role: o, sql: "alter table public.cv_dba add column x regtype", code: castLocked})
		// What docs/security.md's Known limits tells an administrator to
		// do with such a column: turn it into text (or oid).
		c.as(t, c.dba, "alter table app.ledger alter column rdba type text; alter table public.cv_dba alter column r type oid")
	})
}
