-- Issue 17 §2: a table owner cannot switch the fence off. Event triggers
-- refuse, with FN010, DDL by a role that is not an administrator (a
-- superuser or a member of pgfence_bypass, by session_user) that would
-- disable, drop, replace or rename the backstop's triggers, add a trigger
-- or a rule to a protected table, rewrite its rows without DML, rename it,
-- move it, give it away, drop it, remove its job-key column, bring rows
-- into a protected tree or take a member out of it. An administrator's DDL
-- passes; the guard then keeps fence.protected_tables current (names,
-- owner, members). pgfence's own DDL passes by fence.own_ddl (007).
--
-- Every function returns at once when no table is protected, and on the
-- first lookup that finds the command touches no protected table: DDL on
-- other tables, and pgfence migrate itself, pay one or two index probes.

-- guard_idle: nothing to guard (no table is protected), or the DDL is
-- pgfence's own (fence.own_ddl).
create function fence.guard_idle() returns boolean
language sql stable
set search_path = pg_catalog, fence
as $$
  select not exists (select 1 from fence.protected_tables)
      or exists (select 1 from fence.own_ddl o where o.xid = pg_current_xact_id_if_assigned())
$$;
revoke all on function fence.guard_idle() from public;

-- guard_ddl_end runs at ddl_command_end. PostgreSQL says which objects a
-- command touched but not what an ALTER TABLE did, so the guard checks
-- the protected trees the command touched as they are now: every member
-- as installed (fence.backstop_problem), and the tree's membership
-- (fence.sync_tree).
create function fence.guard_ddl_end() returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  r record;
  p fence.protected_tables;
  v_roots regclass[] := '{}';
  v_root regclass;
  v_rel regclass;
  v_column text;
  v_tag text;
  v_problem text;
  v_allowed boolean;
  v_changed boolean := false;
begin
  if fence.guard_idle() then
    return;
  end if;
  for r in select c.command_tag, c.classid, c.objid from pg_catalog.pg_event_trigger_ddl_commands() c loop
    if r.classid = 'pg_catalog.pg_class'::regclass then
      if r.command_tag in ('CREATE TABLE', 'ALTER TABLE', 'CREATE FOREIGN TABLE', 'ALTER FOREIGN TABLE') then
        -- The table's own tree, the tree of a protected parent it joined,
        -- and the tree of a protected child it took in.
        v_roots := v_roots || array(
          select q.root from fence.protected_tables q where q.relid = r.objid::regclass
          union
          select q.root from pg_catalog.pg_inherits i join fence.protected_tables q on q.relid = i.inhparent
           where i.inhrelid = r.objid
          union
          select q.root from pg_catalog.pg_inherits i join fence.protected_tables q on q.relid = i.inhrelid
           where i.inhparent = r.objid);
        v_tag := coalesce(v_tag, r.command_tag);
      end if;
    elsif r.classid in ('pg_catalog.pg_trigger'::regclass, 'pg_catalog.pg_rewrite'::regclass) then
      -- CREATE [OR REPLACE] TRIGGER, ALTER TRIGGER, CREATE [OR REPLACE]
      -- RULE on a protected table. Any trigger: one that fires before the
      -- backstop's can change the settings it reads, or a row's job key
      -- after pgfence_job_key checked it; a rule can redirect the writes.
      if r.classid = 'pg_catalog.pg_trigger'::regclass then
        -- (Not the triggers PostgreSQL makes for a foreign key.)
        select t.tgrelid into v_rel from pg_catalog.pg_trigger t where t.oid = r.objid and not t.tgisinternal;
      else
        select w.ev_class into v_rel from pg_catalog.pg_rewrite w where w.oid = r.objid;
      end if;
      if exists (select 1 from fence.protected_tables q where q.relid = v_rel) then
        v_allowed := coalesce(v_allowed, fence.is_admin());
        if not v_allowed then
          raise exception '% on protected table % needs pgfence_bypass, and role "%" is not a member', r.command_tag, v_rel, session_user
            using errcode = 'FN010',
                  detail = 'triggers and rules on a protected table decide what its backstop sees',
                  hint = 'ask a member of pgfence_bypass (a DBA) to make this change';
        end if;
      end if;
    elsif r.classid = 'pg_catalog.pg_namespace'::regclass then
      -- ALTER SCHEMA … RENAME renames every protected table in it.
      v_roots := v_roots || array(
        select q.root from fence.protected_tables q join pg_catalog.pg_class c on c.oid = q.relid
         where c.relnamespace = r.objid);
      v_tag := coalesce(v_tag, r.command_tag);
    end if;
  end loop;
  if cardinality(v_roots) = 0 then
    return;
  end if;
  v_allowed := coalesce(v_allowed, fence.is_admin());
  for v_root in select distinct u.root from unnest(v_roots) as u(root) loop
    select q.job_key_column into v_column from fence.protected_tables q where q.relid = v_root and q.root = v_root;
    if not found then
      continue; -- adopted by another tree earlier in this loop
    end if;
    for p in select q.* from fence.protected_tables q
              where q.root = v_root and exists (select 1 from pg_catalog.pg_class c where c.oid = q.relid) loop
      v_problem := fence.backstop_problem(p);
      if v_problem is null then
        continue;
      end if;
      if not v_allowed then
        raise exception '% on protected table % would %: that needs pgfence_bypass, and role "%" is not a member',
            v_tag, p.relid, v_problem, session_user
          using errcode = 'FN010',
                detail = 'protection follows the table (its OID), not its name, and only an administrator may change what guards it',
                hint = 'ask a member of pgfence_bypass (a DBA) to make this change';
      end if;
      -- An administrator's change. Names and owner follow the table; a
      -- trigger an administrator disabled stays as they left it.
      update fence.protected_tables q
         set schema_name = n.nspname, table_name = c.relname, owner = c.relowner
        from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
       where q.relid = p.relid and c.oid = p.relid
         and (q.schema_name <> n.nspname or q.table_name <> c.relname or q.owner <> c.relowner);
      if found then
        v_changed := true;
      end if;
    end loop;
    if fence.sync_tree(v_root, v_column, v_allowed) then
      v_changed := true;
    end if;
  end loop;
  if v_changed then
    perform pg_notify('pgfence_protected', v_tag);
  end if;
end
$$;

-- guard_sql_drop runs at sql_drop: DROP TABLE of a protected table (also
-- by DROP SCHEMA … CASCADE and DROP OWNED), DROP TRIGGER of one of the
-- backstop's. An administrator's drop removes the table from
-- fence.protected_tables, so its OID, if PostgreSQL gives it to a new
-- table, protects nothing by mistake.
create function fence.guard_sql_drop() returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  r record;
  v_rel regclass;
  v_allowed boolean;
  v_changed boolean := false;
begin
  if fence.guard_idle() then
    return;
  end if;
  for r in select d.classid, d.objid, d.objsubid, d.object_type, d.object_identity, d.address_names
             from pg_catalog.pg_event_trigger_dropped_objects() d loop
    -- (A column is dropped with objsubid its number: ddl_command_end
    -- checks the job-key column.)
    if r.classid = 'pg_catalog.pg_class'::regclass and r.objsubid = 0
       and exists (select 1 from fence.protected_tables q where q.relid = r.objid::regclass) then
      v_allowed := coalesce(v_allowed, fence.is_admin());
      if not v_allowed then
        raise exception 'dropping protected table % needs pgfence_bypass, and role "%" is not a member', r.object_identity, session_user
          using errcode = 'FN010',
                hint = 'ask a member of pgfence_bypass (a DBA) to drop it, or to unprotect it first';
      end if;
      delete from fence.protected_tables q where q.relid = r.objid::regclass;
      v_changed := true;
    elsif r.object_type = 'trigger' and r.address_names[3] like 'pgfence\_%' then
      v_rel := to_regclass(format('%I.%I', r.address_names[1], r.address_names[2]));
      if v_rel is not null and exists (select 1 from fence.protected_tables q where q.relid = v_rel) then
        v_allowed := coalesce(v_allowed, fence.is_admin());
        if not v_allowed then
          raise exception 'dropping trigger % of protected table % needs pgfence_bypass, and role "%" is not a member',
              r.address_names[3], v_rel, session_user
            using errcode = 'FN010',
                  detail = 'the trigger is the backstop that fences every write to the table',
                  hint = 'ask a member of pgfence_bypass (a DBA); to remove the protection, fence.unprotect';
        end if;
      end if;
    end if;
  end loop;
  if v_changed then
    perform pg_notify('pgfence_protected', 'DROP');
  end if;
end
$$;

-- guard_table_rewrite runs before an ALTER TABLE (or ALTER TYPE) rewrites
-- a table: ALTER COLUMN … TYPE (… USING), a volatile default, a stored
-- generated column, SET LOGGED / UNLOGGED, SET ACCESS METHOD. On a
-- protected table the rows would change without a write the backstop sees.
create function fence.guard_table_rewrite() returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  v_rel regclass := pg_catalog.pg_event_trigger_table_rewrite_oid();
  v_reason int := pg_catalog.pg_event_trigger_table_rewrite_reason();
begin
  if not exists (select 1 from fence.protected_tables q where q.relid = v_rel) then
    return;
  end if;
  if exists (select 1 from fence.own_ddl o where o.xid = pg_current_xact_id_if_assigned()) or fence.is_admin() then
    return;
  end if;
  raise exception 'this command would rewrite protected table % (%): its rows would change without a fenced write; that needs pgfence_bypass, and role "%" is not a member',
      v_rel,
      array_to_string(array_remove(array[
        case when v_reason & 1 <> 0 then 'its persistence changes' end,
        case when v_reason & 2 <> 0 then 'a column gets a default or generated value' end,
        case when v_reason & 4 <> 0 then 'a column changes type' end,
        case when v_reason & 8 <> 0 then 'its access method changes' end], null), ', '),
      session_user
    using errcode = 'FN010',
          hint = 'ask a member of pgfence_bypass (a DBA) to make this change; a change of the rows themselves needs a fenced write';
end
$$;

create event trigger pgfence_guard_ddl on ddl_command_end execute function fence.guard_ddl_end();
create event trigger pgfence_guard_drop on sql_drop execute function fence.guard_sql_drop();
create event trigger pgfence_guard_rewrite on table_rewrite execute function fence.guard_table_rewrite();
