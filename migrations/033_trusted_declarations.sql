-- Attack round 25 (attacker BA).
--
-- PostgreSQL takes what a table's CHECK constraints and partial indexes
-- declare as true of its rows, and acts on it without looking at the
-- rows: the planner's constraint exclusion drops a member of a tree from
-- a query, a partial index whose predicate a query implies answers it
-- alone (and its qual is dropped), ALTER TABLE ... SET NOT NULL and
-- CREATE TABLE ... PARTITION OF (over a default partition) skip their
-- scans. It folds the immutable expressions of those declarations when it
-- plans or runs the DDL, and 032 (AX-H1) judged only the functions and
-- operators a CHECK calls. But a superuser's immutable function may read
-- objects the table's owner owns and changes at will:
--
-- BA-H1, BA-H3, BA-H4. A CHECK calling only pg_catalog's
-- to_tsvector(regconfig, ...) or ts_lexize(regdictionary, ...) over the
-- owner's text search configuration or dictionary, then ALTER TEXT
-- SEARCH ..., made a member's rows vanish from every query of its tree
-- (the job's own fenced UPDATE and DELETE found nothing and were
-- receipted), left a row in the wrong partition for good, and made a
-- column NOT NULL over a NULL row (the table's next restore lost every
-- row).
-- BA-H2. A partial index did the same on any protected table, with those
-- functions or the owner's own (replaced later): queries returned rows
-- contradicting their WHERE and hid the one that matched. The guard did
-- not look at indexes at all, nor did it see CREATE INDEX as DDL on the
-- table.
--
-- Now a CHECK constraint or an index of a protected table may depend on
-- nothing its owner can change: every object it depends on (pg_depend:
-- functions, operators, types, text search configurations and
-- dictionaries, other relations, ...) other than the table itself must be
-- a superuser's (fence.declared_fixed; a text search configuration's
-- dictionaries too; an enum type or a collation, which cannot be changed
-- to say otherwise, may be anyone's), or the guard refuses the DDL that
-- leaves it, for a non-administrator, and fence.protect a table that has
-- one. CREATE INDEX, ALTER INDEX and REINDEX count as DDL on the index's
-- table.

-- declared_fixed: whether what a CHECK constraint or an index depends on,
-- the object p_oid of catalog p_class, is beyond a non-superuser's reach:
-- made by a superuser (and, for a text search configuration, every
-- dictionary it maps to), an enum type, a collation, or an index (a
-- partitioned table's, which a partition's index depends on). Unknown
-- catalogs are not.
create function fence.declared_fixed(p_class oid, p_oid oid) returns boolean
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  select coalesce(case p_class
    when 'pg_catalog.pg_proc'::pg_catalog.regclass then fence.superuser_made(p_class, p_oid)
    when 'pg_catalog.pg_operator'::pg_catalog.regclass then fence.superuser_made(p_class, p_oid)
    when 'pg_catalog.pg_opclass'::pg_catalog.regclass then fence.superuser_made(p_class, p_oid)
    when 'pg_catalog.pg_opfamily'::pg_catalog.regclass then fence.superuser_made(p_class, p_oid)
    -- An enum's labels keep their order (ADD VALUE only adds), and its
    -- text output is not folded (enum_out is stable).
    when 'pg_catalog.pg_type'::pg_catalog.regclass then fence.superuser_made(p_class, p_oid)
    -- A collation cannot be changed, only renamed.
    when 'pg_catalog.pg_collation'::pg_catalog.regclass then true
    when 'pg_catalog.pg_ts_config'::pg_catalog.regclass then
      (select r.rolsuper from pg_catalog.pg_ts_config x join pg_catalog.pg_roles r on r.oid = x.cfgowner where x.oid = p_oid)
      and not exists (select 1 from pg_catalog.pg_ts_config_map m
                        join pg_catalog.pg_ts_dict d on d.oid = m.mapdict
                        join pg_catalog.pg_roles r on r.oid = d.dictowner
                       where m.mapcfg = p_oid and not r.rolsuper)
    when 'pg_catalog.pg_ts_dict'::pg_catalog.regclass then
      (select r.rolsuper from pg_catalog.pg_ts_dict x join pg_catalog.pg_roles r on r.oid = x.dictowner where x.oid = p_oid)
    -- A partition's index depends on its partitioned table's index,
    -- whose own declaration is judged on that table.
    when 'pg_catalog.pg_class'::pg_catalog.regclass then
      (select r.rolsuper or x.relkind in ('i', 'I') from pg_catalog.pg_class x join pg_catalog.pg_roles r on r.oid = x.relowner where x.oid = p_oid)
    else false end, false)
$$;
revoke all on function fence.declared_fixed(oid, oid) from public;

-- declaration_problem: a CHECK constraint or an index of rel that
-- depends on an object other than rel that is not fixed
-- (fence.declared_fixed), as a phrase for an error, or null.
create function fence.declaration_problem(p_rel regclass) returns text
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  select pg_catalog.format('%s, which depends on %s, not a superuser''s', x.what, pg_catalog.pg_describe_object(x.refclassid, x.refobjid, 0))
    from (select pg_catalog.format('CHECK constraint %I', con.conname) as what, 1 as ord, con.conname::text as name,
                 d.refclassid, d.refobjid
            from pg_catalog.pg_constraint con
            join pg_catalog.pg_depend d
              on d.classid = 'pg_catalog.pg_constraint'::pg_catalog.regclass and d.objid = con.oid
           where con.conrelid = p_rel and con.contype = 'c'
          union all
          select pg_catalog.format('index %s', i.indexrelid::pg_catalog.regclass), 2, i.indexrelid::pg_catalog.regclass::text,
                 d.refclassid, d.refobjid
            from pg_catalog.pg_index i
            join pg_catalog.pg_depend d
              on d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass and d.objid = i.indexrelid
           where i.indrelid = p_rel
             -- an index's own constraint (a primary key, a unique or
             -- exclusion constraint): it declares nothing of its own
             and d.refclassid <> 'pg_catalog.pg_constraint'::pg_catalog.regclass) x
   where not (x.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass and x.refobjid = p_rel)
     and not fence.declared_fixed(x.refclassid, x.refobjid)
   order by x.ord, x.name
   limit 1
$$;
revoke all on function fence.declaration_problem(regclass) from public;

-- exclusion_problem (032's, now for every declaration PostgreSQL
-- trusts), as the guard says it, or null.
create or replace function fence.exclusion_problem(p_rel regclass) returns text
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  select 'keep ' operator(pg_catalog.||) v operator(pg_catalog.||)
         ': PostgreSQL trusts what it declares of the rows (constraint exclusion, a partial index''s predicate, the scans ALTER TABLE skips), and whoever owns that could change what it says'
    from fence.declaration_problem(p_rel) v
   where v is not null
$$;
revoke all on function fence.exclusion_problem(regclass) from public;

do $$
declare
  r record;
  v_def text;
begin
  for r in
    select f, v_old, v_new from (values
      ('fence.guard_ddl_end()'::regprocedure,
          $old$          select q.root from fence.protected_tables q where q.relid = r.objid::regclass
          union$old$,
          $new$          select q.root from fence.protected_tables q where q.relid = r.objid::regclass
          union
          -- (033) CREATE INDEX, ALTER INDEX, REINDEX: the index's table
          select q.root from pg_catalog.pg_index x join fence.protected_tables q on q.relid = x.indrelid
           where x.indexrelid = r.objid
          union$new$),
      ('fence.join_problem(regclass, regclass)'::regprocedure,
          $old$begin
  -- Triggers:$old$,
          $new$begin
  -- (033) A CHECK constraint or an index whose truth its owner controls.
  v := fence.declaration_problem(p_rel);
  if v is not null then
    return v || ': PostgreSQL trusts what it declares of the rows';
  end if;
  -- Triggers:$new$),
      ('fence.protect(regclass, text)'::regprocedure,
          $old$  if fence.sync_tree(tbl, job_key_column, true) then$old$,
          $new$  -- (033) A CHECK constraint or an index whose owner could change
  -- what it declares of the rows: only an administrator may protect the
  -- table as it is.
  if not fence.is_admin() then
    select m.relid, fence.exclusion_problem(m.relid) into v_member, v_what
      from fence.tree_members(tbl) m
     where fence.exclusion_problem(m.relid) is not null
     order by m.relid::text
     limit 1;
    if found then
      raise exception 'cannot protect %: % would %', tbl, v_member, v_what
        using errcode = '55000',
              detail = 'PostgreSQL acts on what a table''s CHECK constraints and partial indexes declare without reading the rows, so changing an object they depend on would change which rows queries and fenced writes find without a fenced write',
              hint = 'drop it, or make it again with only a superuser''s functions, types and text search objects, then protect the table; or ask a member of pgfence_bypass (a DBA) to protect it as it is';
    end if;
  end if;
  if fence.sync_tree(tbl, job_key_column, true) then$new$)
    ) v(f, v_old, v_new)
  loop
    v_def := pg_catalog.pg_get_functiondef(r.f);
    if pg_catalog.strpos(v_def, r.v_old) = 0 then
      raise exception 'trusted declarations migration: % has no %', r.f, r.v_old;
    end if;
    execute pg_catalog.replace(v_def, r.v_old, r.v_new);
  end loop;
end
$$;
