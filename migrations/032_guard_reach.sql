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
-- The changes are made to the live functions' text, each replacement
-- checked (as 029 does), so nothing else of them changes.

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
