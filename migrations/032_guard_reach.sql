-- Attack round 22 (attacker AR): what a command reaches beyond the object
-- it names.
--
-- AR-H1. fence.guard_ddl_end checked the row type of the relation an
-- ALTER TABLE names, and a protected column may hold a relation's row
-- type. But ALTER TABLE ... RENAME COLUMN and ADD COLUMN recurse into
-- every inheritance child and partition, whose row types change with the
-- parent's, and PostgreSQL reports only the named relation. So a table
-- owner renamed (swapped) or added attributes of a composite that
-- protected rows hold by running the ALTER TABLE on its parent: the rows
-- read their fields under each other's names with no write, and a
-- worker's retry was answered from a receipt that no longer matched them;
-- a regclass attribute added that way re-opened round 14's catalog-value
-- break. Now the row types of the named relation and of all its
-- descendants (pg_inherits, to any depth) are the command's.
--
-- AR-L1. ALTER SCHEMA ... RENAME renamed the types in the schema that
-- protected columns use (documented as refused: "rename or move such a
-- type"), and the guard's next refusal named the wrong change. Now an
-- ALTER SCHEMA checks the read shape of every protected table (it is
-- rare, and a schema holds types, functions and collations that
-- protected rows read through); read_change names a moved enum type as
-- such.
--
-- AR-H2. ALTER EXTENSION ... ADD TABLE made a protected table a member of
-- a trusted extension its owner had created: pg_dump leaves extension
-- members out, so a full dump lost the table and its rows, and the
-- restore's COPY of fence.protected_tables failed as a whole on the
-- missing table (the restored database protected nothing; the lost
-- rows' receipts were restored). ADD TYPE (a type a protected column
-- holds) and ADD SCHEMA (a protected table's schema) did the same, and
-- ALTER EXTENSION ... UPDATE or SET SCHEMA can replace or move the
-- functions and types protected rows are read through. Which members
-- matter is a question of every dependency of every protected table; the
-- answer that cannot be walked around: in a database with protected
-- tables, ALTER EXTENSION (not run by an extension's own script) needs
-- pgfence_bypass, as the trees' other guards do.
--
-- Attack round 23 (attacker AU).
--
-- AU-H3. The guard looked at a relation's tree only for the command tags
-- CREATE/ALTER TABLE and CREATE/ALTER FOREIGN TABLE, but PostgreSQL lets
-- ALTER INDEX ... RENAME rename a table: the owner renamed a protected
-- table, gave its name to an unprotected one, and the workers' writes went
-- there unfenced. Now any command on a relation is the relation's.
--
-- AU-H1. fence.protect recorded no read shape and held nothing of what
-- its tables read through: a change to a type the table's columns use
-- (an enum value renamed, a composite's attributes swapped), made by the
-- owner in a transaction still open while the DBA protected the table, or
-- a command waiting for a lock meanwhile, ended after the protection had
-- committed; the guard found no shape, took the changed one as the
-- table's, and the rows read otherwise with no write. Now fence.protect
-- holds, FOR SHARE, the catalog rows that decide what its tables read
-- (fence.hold_reads: the pg_type, pg_enum, pg_namespace rows of every type
-- their columns read through, and the pg_class and pg_attribute rows of
-- the composites among them): it waits for a transaction that is changing
-- one to end, and one that starts changing one waits for the protection
-- to commit, when the guard sees it. Then it records their shapes.
--
-- Attack round 24 (attacker AX).
--
-- AX-H1. An owner added to a protected member a CHECK constraint calling
-- a function of its own (declared IMMUTABLE), then replaced the function:
-- the planner's constraint exclusion (constraint_exclusion = partition,
-- the default) dropped the member from every query of the tree, and its
-- rows vanished from reads with no write. Now the guard refuses, for a
-- non-administrator, DDL that leaves a member of a tree it touched with a
-- CHECK constraint calling a function (or an operator) that is not a
-- superuser's (fence.exclusion_problem): an administrator may add one.
--
-- The changes are made to the live functions' text, each replacement
-- checked (as 029 does), so nothing else of them changes.

-- exclusion_problem: a CHECK constraint of rel that calls a function or
-- an operator not made by a superuser, as the guard says it, or null.
create function fence.exclusion_problem(p_rel regclass) returns text
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  select pg_catalog.format('keep CHECK constraint %I, which calls %s, not a superuser''s: the planner''s constraint exclusion lets it decide which rows queries of the tree find',
             con.conname,
             case when d.refclassid = 'pg_catalog.pg_proc'::pg_catalog.regclass
                  then d.refobjid::pg_catalog.regprocedure::text
                  else d.refobjid::pg_catalog.regoperator::text end)
    from pg_catalog.pg_constraint con
    join pg_catalog.pg_depend d
      on d.classid = 'pg_catalog.pg_constraint'::pg_catalog.regclass and d.objid = con.oid
   where con.conrelid = p_rel and con.contype = 'c'
     and d.refclassid in ('pg_catalog.pg_proc'::pg_catalog.regclass, 'pg_catalog.pg_operator'::pg_catalog.regclass)
     and not fence.superuser_made(d.refclassid, d.refobjid)
   order by con.conname
   limit 1
$$;
revoke all on function fence.exclusion_problem(regclass) from public;

-- read_dependencies: what rel's columns read through: the types (domains'
-- base types, arrays' elements, composites' attributes, ranges' subtypes,
-- multiranges' ranges, at any depth) with their schemas, and the
-- composites' relations.
create function fence.read_dependencies(p_rel regclass, out classid oid, out objid oid) returns setof record
language sql stable
set search_path = pg_catalog, pg_temp
as $$
  with recursive ty(oid) as (
    select a.atttypid from pg_catalog.pg_attribute a
     where a.attrelid = p_rel and a.attnum > 0 and not a.attisdropped
    union
    select n.t
      from ty join pg_catalog.pg_type t on t.oid = ty.oid
     cross join lateral (
       select t.typbasetype where t.typbasetype <> 0
       union all
       select t.typelem where t.typelem <> 0
       union all
       select a.atttypid from pg_catalog.pg_attribute a
        where t.typrelid <> 0 and a.attrelid = t.typrelid and a.attnum > 0 and not a.attisdropped
       union all
       select r.rngsubtype from pg_catalog.pg_range r where r.rngtypid = t.oid
       union all
       select r.rngtypid from pg_catalog.pg_range r where r.rngmultitypid = t.oid) n(t)
  )
  select 'pg_catalog.pg_type'::pg_catalog.regclass::oid, ty.oid from ty
  union
  select 'pg_catalog.pg_namespace'::pg_catalog.regclass::oid, t.typnamespace from ty join pg_catalog.pg_type t on t.oid = ty.oid
  union
  select 'pg_catalog.pg_class'::pg_catalog.regclass::oid, t.typrelid from ty join pg_catalog.pg_type t on t.oid = ty.oid where t.typrelid <> 0
$$;
revoke all on function fence.read_dependencies(regclass) from public;

-- hold_reads: holds, until the transaction ends, the catalog rows that
-- decide what the members of p_root's tree read (FOR SHARE: a change to
-- one made by a transaction still open is waited for; one that starts
-- later waits for this transaction), then records the shapes of the
-- members that have none for their protection.
create function fence.hold_reads(p_root regclass) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_types oid[];
  v_rels oid[];
  v_nsps oid[];
begin
  select coalesce(array_agg(d.objid) filter (where d.classid = 'pg_catalog.pg_type'::regclass), '{}'),
         coalesce(array_agg(d.objid) filter (where d.classid = 'pg_catalog.pg_class'::regclass), '{}'),
         coalesce(array_agg(d.objid) filter (where d.classid = 'pg_catalog.pg_namespace'::regclass), '{}')
    into v_types, v_rels, v_nsps
    from fence.tree_members(p_root) m cross join lateral fence.read_dependencies(m.relid) d;
  v_nsps := v_nsps || array(select c.relnamespace from fence.tree_members(p_root) m join pg_catalog.pg_class c on c.oid = m.relid);
  perform 1 from pg_catalog.pg_type t where t.oid = any(v_types) for share;
  perform 1 from pg_catalog.pg_enum e where e.enumtypid = any(v_types) for share;
  perform 1 from pg_catalog.pg_class c where c.oid = any(v_rels) for share;
  perform 1 from pg_catalog.pg_attribute a where a.attrelid = any(v_rels) and a.attnum > 0 for share;
  perform 1 from pg_catalog.pg_namespace n where n.oid = any(v_nsps) for share;
  insert into fence.read_shapes as s (relid, protected_at, facts)
  select q.relid, q.protected_at, fence.read_facts(q.relid)
    from fence.protected_tables q join fence.tree_members(p_root) m on m.relid = q.relid
   where not exists (select 1 from fence.read_shapes s where s.relid = q.relid and s.protected_at = q.protected_at)
  on conflict (relid) do update set protected_at = excluded.protected_at, facts = excluded.facts, recorded_at = clock_timestamp();
end
$$;
revoke all on function fence.hold_reads(regclass) from public;

do $$
declare
  r record;
  v_def text;
begin
  for r in
    select v.f, v.v_old, v.v_new from (values
      ('fence.guard_ddl_end()'::regprocedure,
          'for r in select c.command_tag, c.classid, c.objid from pg_catalog.pg_event_trigger_ddl_commands() c loop',
          'for r in select c.command_tag, c.classid, c.objid, c.in_extension from pg_catalog.pg_event_trigger_ddl_commands() c loop'),
      ('fence.guard_ddl_end()'::regprocedure,
          'v_types := v_types || array(select c.reltype from pg_catalog.pg_class c where c.oid = r.objid and c.reltype <> 0);',
          $new$-- (032) And its descendants': ALTER TABLE recurses into every
      -- child and partition, which PostgreSQL does not report.
      v_types := v_types || array(
        with recursive down(rel) as (
          select r.objid
          union
          select i.inhrelid from pg_catalog.pg_inherits i join down on i.inhparent = down.rel)
        select c.reltype from down join pg_catalog.pg_class c on c.oid = down.rel where c.reltype <> 0);$new$),
      ('fence.guard_ddl_end()'::regprocedure,
          $old$    elsif r.classid = 'pg_catalog.pg_namespace'::regclass then$old$,
          $new$    elsif r.classid = 'pg_catalog.pg_extension'::regclass and r.command_tag = 'ALTER EXTENSION' and not r.in_extension then
      -- (032) Extension membership decides what a dump holds, and an
      -- update or a move replaces or renames what rows read through.
      v_allowed := coalesce(v_allowed, fence.is_admin());
      if not v_allowed then
        raise exception 'ALTER EXTENSION in a database with protected tables needs pgfence_bypass, and role "%" is not a member', session_user
          using errcode = 'FN010',
                detail = 'an extension''s members are left out of dumps (a protected table, its schema or a type it holds made a member is lost in a restore), and updating or moving an extension replaces or renames the functions and types protected rows are read through',
                hint = 'ask a member of pgfence_bypass (a DBA) to make this change';
      end if;
    elsif r.classid = 'pg_catalog.pg_namespace'::regclass then
      -- (032) ALTER SCHEMA ... RENAME also renames the types, functions
      -- and collations in it that protected rows read through.
      if r.command_tag = 'ALTER SCHEMA' then
        v_shapes := v_shapes || array(select q.relid from fence.protected_tables q);
      end if;$new$),
      ('fence.guard_ddl_end()'::regprocedure,
          $old$if r.command_tag in ('CREATE TABLE', 'ALTER TABLE', 'CREATE FOREIGN TABLE', 'ALTER FOREIGN TABLE') then$old$,
          $new$if r.command_tag is not null then -- (032) any command: ALTER INDEX ... RENAME renames a table too$new$),
      ('fence.guard_ddl_end()'::regprocedure,
          $old$      v_problem := fence.backstop_problem(p);
$old$,
          $new$      v_problem := fence.backstop_problem(p);
      if v_problem is null and not v_allowed then
        v_problem := fence.exclusion_problem(p.relid); -- (032) round 24, AX-H1
      end if;
$new$),
      ('fence.protect(regclass, text)'::regprocedure,
          $old$    raise notice '% is already protected; nothing to do', tbl;
  end if;
end$old$,
          $new$    raise notice '% is already protected; nothing to do', tbl;
  end if;
  -- (032) What its rows read through is held until the protection
  -- commits, and its shape recorded.
  perform fence.hold_reads(tbl);
end$new$),
      ('fence.read_change(regclass, jsonb, jsonb)'::regprocedure,
          $old$    when 'enum' then
      return format('rename value %L of enum type %s, which it uses', f->>'l', f->>'t');$old$,
          $new$    when 'enum' then
      if exists (select 1 from jsonb_array_elements(p_new) g where g->>'k' = 'enum' and g->>'l' = f->>'l' and g->>'t' <> f->>'t') then
        return format('rename or move enum type %s, which it uses', f->>'t'); -- (032)
      end if;
      return format('rename value %L of enum type %s, which it uses', f->>'l', f->>'t');$new$)
    ) v(f, v_old, v_new)
  loop
    v_def := pg_catalog.pg_get_functiondef(r.f);
    if pg_catalog.strpos(v_def, r.v_old) = 0 then
      raise exception 'guard reach migration: % has no %', r.f, r.v_old;
    end if;
    execute pg_catalog.replace(v_def, r.v_old, r.v_new);
  end loop;
end
$$;
