-- Issue 19 §3: the protected set is always current. Whatever way a row
-- gets into fence.protected_tables — fence.protect, a direct INSERT, COPY,
-- a data-only pg_restore of it — the statement that adds it also installs
-- the backstop the row names, so the first transaction that begins after
-- it commits is fenced by the database itself, whatever the proxy knows.
-- A full restore (pg_restore, psql -f of pg_dump or pg_dumpall output)
-- brings the backstop's triggers with the rows: they are in the dump's
-- post-data section, after the data, as the triggers below are. No route
-- depends on a notification: pgfence_protected is still sent, so the
-- proxy reloads at once, but only as a hint (the proxy's side:
-- maybeWrite in proxy/fence_session.go).
--
-- Triggers on fence.protected_tables, ENABLE ALWAYS: they fire under
-- session_replication_role = replica too (a superuser's, or a logical
-- replication subscription applying rows). None acts on pgfence's own
-- changes (fence.protect, fence.unprotect, the DDL guard: a fence.own_ddl
-- row for the transaction), which install and remove what they write and
-- notify naming the table; they pay one index probe a statement.
--
-- * pgfence_set_added (AFTER INSERT, per statement, so a COPY's rows are
--   seen together whatever their order): every new row must name an
--   existing table outside schema fence (42P01, 42809) and, if it has
--   one, an existing text job-key column (42703, 42804). Names and owner
--   are taken from the catalog (they are never the truth: relid is). A
--   row's table that lacks the backstop, or carries it not as installed,
--   gets it; one that carries it is left alone (a schema-only restore
--   followed by a data-only one). A root's row protects its whole tree
--   (fence.sync_tree, as fence.protect); a member's row without its
--   root's is refused (42809).
-- * pgfence_set_refuse (BEFORE UPDATE of relid or job_key_column),
--   pgfence_set_removed (BEFORE DELETE), pgfence_set_truncated (BEFORE
--   TRUNCATE): FN010, for everyone. Removing a row of an existing table
--   would switch its fence off behind the DDL guard, its triggers left in
--   place untracked: fence.unprotect is the way. The row of a table that
--   no longer exists may go (the DDL guard's sql_drop handler deletes
--   it; so do DROP SCHEMA … CASCADE and DROP OWNED through it).
-- * pgfence_set_notify (AFTER any change, per statement): pg_notify on
--   pgfence_protected.
--
-- The event triggers pgfence_guard_set_ddl and pgfence_guard_set_drop
-- (fence.guard_set) refuse (FN010), for everyone, DDL that leaves one of
-- these triggers dropped, disabled, in replica mode or replaced: rows
-- added meanwhile would go unprotected. So a data-only restore of
-- fence.protected_tables with --disable-triggers reports that error for
-- its ALTER TABLE … DISABLE TRIGGER ALL (and the rows still go in, fenced);
-- it needs no --disable-triggers. DROP SCHEMA fence CASCADE and
-- pg_restore --clean (which drops event triggers first) are not refused.

create function fence.set_added() returns trigger
language plpgsql
security definer
set search_path = pg_catalog
as $$
declare
  r record;
  p fence.protected_tables;
  v_mine boolean;
  v_root regclass;
  v_column text;
  v_what text;
begin
  if exists (select 1 from fence.own_ddl o where o.xid = pg_current_xact_id()) then
    return null; -- fence.protect or the DDL guard: they install what they insert
  end if;
  for r in select a.relid, a.job_key_column, c.relkind, n.nspname, col.typ
             from added a
             left join pg_catalog.pg_class c on c.oid = a.relid
             left join pg_catalog.pg_namespace n on n.oid = c.relnamespace
             left join lateral (select t.atttypid::regtype as typ from pg_catalog.pg_attribute t
                                 where t.attrelid = a.relid and t.attname = a.job_key_column
                                   and t.attnum > 0 and not t.attisdropped) col on true loop
    if r.relkind is null then
      raise exception 'fence.protected_tables: no table has OID %', r.relid::oid
        using errcode = '42P01',
              hint = 'a row of fence.protected_tables names an existing table: create or restore the tables before its rows';
    end if;
    if r.relkind not in ('r', 'p') or r.nspname = 'fence' then
      raise exception 'fence.protected_tables: % cannot be protected: only tables outside schema fence can', r.relid
        using errcode = '42809';
    end if;
    if r.job_key_column is not null and r.typ is null then
      raise exception 'fence.protected_tables: % has no column "%" for its job key', r.relid, r.job_key_column
        using errcode = '42703';
    end if;
    if r.typ not in ('text'::regtype, 'character varying'::regtype, 'character'::regtype) then
      raise exception 'fence.protected_tables: the job key column "%" of % has type %, want text', r.job_key_column, r.relid, r.typ
        using errcode = '42804';
    end if;
  end loop;

  v_mine := fence.own_ddl_begin();
  update fence.protected_tables q
     set schema_name = n.nspname, table_name = c.relname, owner = c.relowner
    from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
   where c.oid = q.relid and q.relid in (select a.relid from added a)
     and (q.schema_name, q.table_name, q.owner::oid) is distinct from (n.nspname::text, c.relname::text, c.relowner);
  for p in select q.* from fence.protected_tables q where q.relid in (select a.relid from added a) loop
    if fence.backstop_problem(p) is not null then
      if exists (select 1 from pg_catalog.pg_trigger t where t.tgrelid = p.relid and t.tgname like 'pgfence\_%') then
        perform fence.uninstall_backstop(p.relid); -- some, not as installed
      end if;
      perform fence.install_backstop(p.relid, (select c.relkind from pg_catalog.pg_class c where c.oid = p.relid), p.job_key_column);
    end if;
  end loop;
  for v_root in select distinct rt.root from added a cross join lateral fence.tree_roots(a.relid) as rt(root) loop
    select q.job_key_column into v_column from fence.protected_tables q where q.relid = v_root;
    if not found then
      select string_agg(a.relid::text, ', ') into v_what
        from added a where v_root in (select fence.tree_roots(a.relid));
      raise exception 'fence.protected_tables: % cannot be protected without the root % of its tree', v_what, v_root
        using errcode = '42809',
              detail = 'writes naming the root would reach its rows without firing its statement triggers',
              hint = format('add the row of %s (a root''s row protects its whole tree), or run fence.protect(%L)', v_root, v_root::text);
    end if;
    select string_agg(q.relid::text, ', ') into v_what
      from fence.protected_tables q join fence.tree_members(v_root) m on m.relid = q.relid
     where q.job_key_column is distinct from v_column;
    if v_what is not null then
      raise exception 'fence.protected_tables: % in the tree of % have another job-key column than its root (%)', v_what, v_root,
          coalesce(quote_ident(v_column), 'none')
        using errcode = '55000', hint = 'every member of a protected tree has its root''s job-key column';
    end if;
    perform fence.sync_tree(v_root, v_column, true);
  end loop;
  perform fence.own_ddl_end(v_mine);
  return null;
end
$$;

create function fence.set_refuse() returns trigger
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  v_what text;
begin
  if exists (select 1 from fence.own_ddl o where o.xid = pg_current_xact_id_if_assigned()) then
    return case when tg_op = 'DELETE' then old else new end;
  end if;
  if tg_op = 'TRUNCATE' then
    select string_agg(q.relid::text, ', ') into v_what
      from fence.protected_tables q where exists (select 1 from pg_catalog.pg_class c where c.oid = q.relid);
  elsif exists (select 1 from pg_catalog.pg_class c where c.oid = old.relid) then
    v_what := old.relid::text;
  end if;
  if v_what is null then
    return case when tg_op = 'DELETE' then old else new end; -- the table was dropped
  end if;
  raise exception '% of fence.protected_tables would switch the fence of % off, untracked', tg_op, v_what
    using errcode = 'FN010',
          detail = 'the rows of fence.protected_tables change only with the backstop they name',
          hint = 'an administrator runs fence.unprotect(table) (and fence.protect(table, column) for another job-key column)';
end
$$;

create function fence.set_notify() returns trigger
language plpgsql
security definer
set search_path = pg_catalog
as $$
begin
  if not exists (select 1 from fence.own_ddl o where o.xid = pg_current_xact_id_if_assigned()) then
    perform pg_notify('pgfence_protected', 'fence.protected_tables');
  end if; -- (pgfence's own functions notify, naming the table)
  return null;
end
$$;

create trigger pgfence_set_added after insert on fence.protected_tables
  referencing new table as added for each statement execute function fence.set_added();
create trigger pgfence_set_refuse before update on fence.protected_tables for each row
  when (old.relid is distinct from new.relid or old.job_key_column is distinct from new.job_key_column)
  execute function fence.set_refuse();
create trigger pgfence_set_removed before delete on fence.protected_tables for each row
  execute function fence.set_refuse();
create trigger pgfence_set_truncated before truncate on fence.protected_tables for each statement
  execute function fence.set_refuse();
create trigger pgfence_set_notify after insert or update or delete or truncate on fence.protected_tables
  for each statement execute function fence.set_notify();
alter table fence.protected_tables enable always trigger pgfence_set_added;
alter table fence.protected_tables enable always trigger pgfence_set_refuse;
alter table fence.protected_tables enable always trigger pgfence_set_removed;
alter table fence.protected_tables enable always trigger pgfence_set_truncated;
alter table fence.protected_tables enable always trigger pgfence_set_notify;

-- guard_set keeps the triggers above as installed: at ddl_command_end of
-- a command that touched fence.protected_tables or a trigger of it, and
-- at sql_drop of such a trigger. Any firing mode but disabled will do
-- (ENABLE TRIGGER ALL, as pg_restore runs it, makes ALWAYS ORIGIN).
create function fence.guard_set() returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  v_set regclass := pg_catalog.to_regclass('fence.protected_tables');
  v_problem text;
begin
  if v_set is null then
    return;
  end if;
  if tg_event = 'sql_drop' then
    if not exists (select 1 from pg_catalog.pg_event_trigger_dropped_objects() d
                    where d.object_type = 'trigger' and d.address_names[1] = 'fence' and d.address_names[2] = 'protected_tables') then
      return;
    end if;
  elsif not exists (select 1 from pg_catalog.pg_event_trigger_ddl_commands() c
                     where c.classid = 'pg_catalog.pg_class'::regclass and c.objid = v_set
                        or c.classid = 'pg_catalog.pg_trigger'::regclass
                           and exists (select 1 from pg_catalog.pg_trigger t where t.oid = c.objid and t.tgrelid = v_set)) then
    return;
  end if;
  if exists (select 1 from fence.own_ddl o where o.xid = pg_current_xact_id_if_assigned()) then
    return;
  end if;
  select string_agg(format('%s its trigger %s', case when t.oid is null then 'drop'
                                                     when t.tgfoid <> e.fn then 'replace'
                                                     else 'disable' end, e.name), ', ')
    into v_problem
    from (values ('pgfence_set_added', 'fence.set_added()'::regprocedure),
                 ('pgfence_set_refuse', 'fence.set_refuse()'::regprocedure),
                 ('pgfence_set_removed', 'fence.set_refuse()'::regprocedure),
                 ('pgfence_set_truncated', 'fence.set_refuse()'::regprocedure),
                 ('pgfence_set_notify', 'fence.set_notify()'::regprocedure)) e(name, fn)
    left join pg_catalog.pg_trigger t on t.tgrelid = v_set and t.tgname = e.name
   where t.oid is null or t.tgfoid <> e.fn or t.tgenabled not in ('O', 'A');
  if v_problem is not null then
    raise exception 'this command would % of fence.protected_tables: rows added then would protect nothing', v_problem
      using errcode = 'FN010',
            detail = 'those triggers install the backstop of every table a new row names, and keep rows from being removed behind fence.unprotect',
            hint = 'restore fence.protected_tables without --disable-triggers (it needs none); to protect or unprotect, use fence.protect and fence.unprotect';
  end if;
end
$$;

create event trigger pgfence_guard_set_ddl on ddl_command_end
  when tag in ('ALTER TABLE', 'CREATE TRIGGER', 'ALTER TRIGGER')
  execute function fence.guard_set();
create event trigger pgfence_guard_set_drop on sql_drop
  execute function fence.guard_set();

revoke all on function fence.set_added(), fence.set_refuse(), fence.set_notify(), fence.guard_set() from public;
