-- Attack round 18 (attacker AH): what joins a protected tree.
--
-- AH-H1. fence.sync_tree checked an arriving member (fence.join_problem,
-- fence.tree_is_empty) before anything stopped writers to it: the
-- backstop's CREATE TRIGGER took the first such lock. ALTER TABLE ...
-- INHERIT locks the new child's own children (the tree's grandchildren)
-- only ACCESS SHARE, so the owner's second session, holding ROW EXCLUSIVE
-- on one of them, inserted job B's row and created a BEFORE ROW trigger
-- of its own while the guard waited for it: the member joined with a row
-- no generation wrote and a trigger that ran in the workers' writes.
-- Now sync_tree locks every arriving member SHARE ROW EXCLUSIVE first and
-- checks it afterwards; a non-administrator's DDL that adds members must
-- run READ COMMITTED (its checks must see what was committed before the
-- lock).
--
-- AH-H2, AH-L1. Nothing looked at a member's persistence: CREATE UNLOGGED
-- TABLE ... PARTITION OF (or INHERITS, or ATTACH of an empty unlogged
-- table) made a protected member whose rows a crash truncates and no
-- standby has, while their receipts stay (the retry was a replay of a
-- write that was gone); a temporary child was dropped at its session's
-- end without an event trigger and left its entry. Now only permanent
-- tables join a protected tree, for everyone (fence.protect included);
-- ALTER TABLE ... SET UNLOGGED was already refused.
--
-- Existing unlogged or temporary members are named by a WARNING here
-- (a DBA decides: ALTER TABLE ... SET LOGGED, or fence.unprotect).
--
-- AM-H1 (round 20). A protected table made to depend on an object in a
-- temporary schema (ALTER TABLE ... OF pg_temp.type, ADD COLUMN of a
-- pg_temp domain) was dropped, or lost the column and its rows, when
-- that session ended: PostgreSQL drops temporary objects as DROP ...
-- CASCADE does and fires no event trigger. fence.temp_dependency finds
-- such a dependency, direct or indirect; no member may join with one,
-- and DDL that makes one is refused (event trigger pgfence_guard_temp),
-- for everyone.

-- fence.temp_dependency: the first object in a temporary schema that a
-- protected member depends on, directly or through other objects (its
-- columns' types, its typed table's type, the types, functions and
-- collations of its defaults, constraints and indexes, and what those
-- depend on), described; NULL when there is none. PostgreSQL drops a
-- session's temporary objects at its end (or DISCARD TEMP) as DROP ...
-- CASCADE does, firing no event trigger: the table, or the column, that
-- depends on one goes with it (round 20, attacker AM's H1: ALTER TABLE
-- ... OF pg_temp.t, ADD COLUMN z pg_temp.d).
create function fence.temp_dependency(p_rel regclass) returns text
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  with recursive parts(classid, objid) as (
    select 'pg_catalog.pg_class'::pg_catalog.regclass::pg_catalog.oid, p_rel::pg_catalog.oid
    union
    select d.classid, d.objid from pg_catalog.pg_depend d
     where d.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass and d.refobjid = p_rel::pg_catalog.oid
       and d.deptype in ('a', 'i')
  ), reach(classid, objid) as (
    select p.classid, p.objid from parts p
    union
    select d.refclassid, d.refobjid from reach r
      join pg_catalog.pg_depend d on d.classid = r.classid and d.objid = r.objid
     where d.deptype in ('n', 'a', 'i')
  )
  select pg_catalog.pg_describe_object(r.classid, r.objid, 0)
    from reach r, pg_catalog.pg_identify_object(r.classid, r.objid, 0) i
   where pg_catalog.left(coalesce(case when r.classid = 'pg_catalog.pg_namespace'::pg_catalog.regclass then i.name else i.schema end, ''), 7) = 'pg_temp'
      or pg_catalog.left(coalesce(case when r.classid = 'pg_catalog.pg_namespace'::pg_catalog.regclass then i.name else i.schema end, ''), 13) = 'pg_toast_temp'
   limit 1
$$;
revoke all on function fence.temp_dependency(regclass) from public;

create or replace function fence.sync_tree(p_root regclass, p_column text, p_allowed boolean) returns boolean
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  m record;
  p fence.protected_tables;
  v_members regclass[];
  v_changed boolean := false;
  v_mine boolean;
  v_what text;
  v_found boolean;
begin
  -- A protected root that now has a parent: adopted by the parent's tree
  -- (when the parent is protected; its own sync does it), or reachable
  -- from an unprotected table, which is refused for everyone.
  select string_agg(i.inhparent::regclass::text, ', ') into v_what
    from pg_catalog.pg_inherits i
   where i.inhrelid = p_root and not exists (select 1 from fence.protected_tables q where q.relid = i.inhparent);
  if v_what is not null then
    raise exception 'protected table % would become a partition or child of %, which is not protected', p_root, v_what
      using errcode = '55000',
            detail = 'writes naming the parent reach the child''s rows without firing the child''s statement triggers, so they would not be fenced',
            hint = format('protect the parent''s tree first (fence.protect on its root), then attach %s', p_root);
  end if;
  if exists (select 1 from pg_catalog.pg_inherits i where i.inhrelid = p_root) then
    return false;
  end if;

  select array_agg(t.relid) into v_members from fence.tree_members(p_root) t;
  -- (030, AH-H1) Every arriving member is locked against writers and
  -- trigger DDL (SHARE ROW EXCLUSIVE, what CREATE TRIGGER takes) before
  -- it is checked: ALTER TABLE ... INHERIT locks the new child's own
  -- children only ACCESS SHARE, and a session already writing one of
  -- them put rows and a trigger into it between the checks below and
  -- the backstop's installation. The checks then read the catalog in
  -- statements begun after the lock; a non-administrator's transaction
  -- must be READ COMMITTED for that (a REPEATABLE READ snapshot taken
  -- before the lock would not show what the other session committed).
  for m in select t.relid from fence.tree_members(p_root) t
            where not exists (select 1 from fence.protected_tables q where q.relid = t.relid and q.root = p_root)
            order by t.relid loop
    if not p_allowed and pg_catalog.current_setting('transaction_isolation') <> 'read committed' then
      raise exception 'adding % to the protected tree of % needs pgfence_bypass in a % transaction; role "%" is not a member',
          m.relid, p_root, pg_catalog.upper(pg_catalog.current_setting('transaction_isolation')), session_user
        using errcode = 'FN010',
              detail = 'a table is checked before it joins a protected tree, under a lock taken in the DDL''s transaction; only a READ COMMITTED transaction sees what others committed before that lock',
              hint = 'run the DDL in a READ COMMITTED transaction (the default), or ask a member of pgfence_bypass (a DBA)';
    end if;
    execute pg_catalog.format('lock table %s in share row exclusive mode', m.relid::regclass);
  end loop;
  v_mine := fence.own_ddl_begin();
  for m in select t.relid, t.relkind, c.relname, n.nspname, c.relowner, c.relpersistence
             from fence.tree_members(p_root) t
             join pg_catalog.pg_class c on c.oid = t.relid
             join pg_catalog.pg_namespace n on n.oid = c.relnamespace loop
    -- Multiple inheritance out of the tree: writes naming the other parent
    -- would reach this member's rows unfenced.
    select string_agg(i.inhparent::regclass::text, ', ') into v_what
      from pg_catalog.pg_inherits i
     where i.inhrelid = m.relid and i.inhparent <> all (v_members);
    if v_what is not null then
      raise exception '% would inherit from % as well as from the protected tree of %', m.relid, v_what, p_root
        using errcode = '55000',
              detail = 'writes naming the other parent would reach its rows unfenced',
              hint = 'a member of a protected tree may have parents only inside that tree';
    end if;
    select * into p from fence.protected_tables q where q.relid = m.relid for update;
    v_found := found;
    if v_found and p.root = p_root then
      continue;
    end if;
    if m.relkind not in ('r', 'p') then
      raise exception '% cannot join the protected tree of %: it is a foreign table', m.relid, p_root
        using errcode = '42809',
              detail = 'its rows live on another server, where no backstop runs',
              hint = 'keep foreign tables out of protected trees';
    end if;
    -- (030, AH-H2, AH-L1) Only a permanent table: an unlogged one loses
    -- its rows in a crash and on every standby while their receipts
    -- stay (a retry is then a replay of a write that is gone); a
    -- temporary one is dropped without an event trigger and leaves its
    -- entry behind.
    v_what := fence.temp_dependency(m.relid);
    if v_what is not null then
      raise exception '% cannot join the protected tree of %: it depends on %, which is temporary', m.relid, p_root, v_what
        using errcode = '55000',
              detail = 'a session''s temporary objects are dropped at its end as by DROP ... CASCADE, with what depends on them, and no event trigger fires',
              hint = 'use a permanent type, domain, function or collation';
    end if;
    if m.relpersistence <> 'p' then
      raise exception '% cannot join the protected tree of %: it is an % table', m.relid, p_root,
          case m.relpersistence when 'u' then 'unlogged' else 'temporary' end
        using errcode = '55000',
              detail = case m.relpersistence
                         when 'u' then 'an unlogged table loses its rows in a crash and is empty on every standby, while the receipts of the writes stay: a retry would be answered as a replay of a write that is gone'
                         else 'a temporary table is private to one session and dropped without notice' end,
              hint = 'make it a permanent table (CREATE TABLE, or ALTER TABLE ... SET LOGGED before it joins)';
    end if;
    if p_column is not null and not exists (
        select 1 from pg_catalog.pg_attribute a
         where a.attrelid = m.relid and a.attname = p_column and a.attnum > 0 and not a.attisdropped) then
      raise exception '% cannot join the protected tree of %: it has no job-key column "%"', m.relid, p_root, p_column
        using errcode = '42703';
    end if;
    if v_found then
      -- A protected tree joins this one (it was attached or made a child).
      if p.job_key_column is distinct from p_column then
        raise exception '% is protected with job key column %, the tree of % with %', m.relid,
            coalesce(quote_ident(p.job_key_column), 'none'), p_root, coalesce(quote_ident(p_column), 'none')
          using errcode = '55000', hint = 'unprotect one of them and protect it with the other''s column';
      end if;
    end if;
    if not p_allowed and not v_found then
      -- (015) A table joining the tree brings nothing of its owner's
      -- that would run in, or decide, the writes and reads of its rows.
      v_what := fence.join_problem(m.relid, p_root);
      if v_what is not null then
        raise exception 'adding % to the protected tree of % needs pgfence_bypass: it would bring %, and role "%" is not a member',
            m.relid, p_root, v_what, session_user
          using errcode = 'FN010',
                detail = 'a table joins a protected tree only with what its members already have: no trigger, rule, row-level security, or default, constraint, index, statistics, column type or collation of its own that runs code no superuser wrote',
                hint = format('drop it from %s first, or ask a member of pgfence_bypass (a DBA) to attach the table', m.relid);
      end if;
    end if;
    if not p_allowed and not fence.tree_is_empty(m.relid) then
      raise exception 'adding % to the protected tree of % needs pgfence_bypass: it has rows, which would join the tree without a fenced write, and role "%" is not a member',
          m.relid, p_root, session_user
        using errcode = 'FN010',
              hint = format('empty %s first (TRUNCATE), or ask a member of pgfence_bypass (a DBA) to attach it', m.relid);
    end if;
    if v_found then
      update fence.protected_tables q set root = p_root where q.relid = m.relid;
    else
      perform fence.install_backstop(m.relid, m.relkind, p_column);
      insert into fence.protected_tables (relid, schema_name, table_name, job_key_column, root, owner)
      values (m.relid, m.nspname, m.relname, p_column, p_root, m.relowner);
    end if;
    v_changed := true;
  end loop;
  perform fence.own_ddl_end(v_mine);

  -- Members that left: each top one becomes the root of what is below it.
  for m in select q.relid from fence.protected_tables q
            where q.root = p_root and q.relid <> all (v_members)
              and not exists (select 1 from pg_catalog.pg_inherits i
                               join fence.protected_tables o on o.relid = i.inhparent
                              where i.inhrelid = q.relid and o.root = p_root and o.relid <> all (v_members)) loop
    if not p_allowed then
      raise exception 'removing % from the protected tree of % needs pgfence_bypass; role "%" is not a member', m.relid, p_root, session_user
        using errcode = 'FN010',
              hint = format('ask a member of pgfence_bypass (a DBA) to detach it; %s then stays protected on its own', m.relid);
    end if;
    update fence.protected_tables q set root = m.relid
     where q.root = p_root and q.relid in (select t.relid from fence.tree_members(m.relid) t);
    v_changed := true;
  end loop;
  return v_changed;
end
$$;

do $$
declare
  v text;
begin
  select string_agg(p.relid::regclass::text || ' (' || case c.relpersistence when 'u' then 'unlogged' else 'temporary' end || ')', ', ')
    into v
    from fence.protected_tables p join pg_catalog.pg_class c on c.oid = p.relid
   where c.relpersistence <> 'p';
  if v is not null then
    raise warning 'protected tables that are not permanent: %', v
      using hint = 'make each permanent (ALTER TABLE ... SET LOGGED, as a member of pgfence_bypass) or unprotect it: an unlogged table loses its rows in a crash while their receipts stay';
  end if;
end
$$;

-- Later DDL: a protected member made to depend on a temporary object
-- (ALTER TABLE ... OF, ADD COLUMN or ALTER COLUMN ... TYPE of a temporary
-- type or domain, a default or constraint calling a temporary function)
-- is refused for everyone at ddl_command_end, after any DDL: the
-- dependency may come through a permanent object that depends on another
-- session's temporary one (CREATE DOMAIN own.d AS pg_temp.t in one
-- session, ADD COLUMN of own.d, or a function a partition key or
-- constraint calls replaced to use it, in another: round 21, attacker
-- AO).
create function fence.guard_temp() returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  m record;
  v_what text;
begin
  -- pgfence's own DDL (fence.protect's backstops: fence.sync_tree checks
  -- each member it adds), and a database where no temporary schema holds
  -- anything a permanent object could depend on (the walk is per member).
  if exists (select 1 from fence.own_ddl o where o.xid = pg_catalog.pg_current_xact_id_if_assigned())
     or not exists (select 1 from pg_catalog.pg_namespace n
                     where pg_catalog.left(n.nspname, 8) = 'pg_temp_'
                       and (exists (select 1 from pg_catalog.pg_type t where t.typnamespace = n.oid)
                            or exists (select 1 from pg_catalog.pg_proc f where f.pronamespace = n.oid)
                            or exists (select 1 from pg_catalog.pg_collation l where l.collnamespace = n.oid)
                            or exists (select 1 from pg_catalog.pg_operator o where o.oprnamespace = n.oid)
                            or exists (select 1 from pg_catalog.pg_class c where c.relnamespace = n.oid))) then
    return;
  end if;
  for m in select q.relid from fence.protected_tables q
            where exists (select 1 from pg_catalog.pg_class c where c.oid = q.relid) loop
    v_what := fence.temp_dependency(m.relid);
    if v_what is not null then
      raise exception '% on protected table %: it would depend on %, which is temporary', tg_tag, m.relid, v_what
        using errcode = '55000',
              detail = 'a session''s temporary objects are dropped at its end as by DROP ... CASCADE, with what depends on them (the table, a column and its rows), and no event trigger fires',
              hint = 'use a permanent type, domain, function or collation';
    end if;
  end loop;
end
$$;
revoke all on function fence.guard_temp() from public;

create event trigger pgfence_guard_temp on ddl_command_end execute function fence.guard_temp();

do $$
declare
  v text;
begin
  select string_agg(p.relid::regclass::text || ' (' || fence.temp_dependency(p.relid) || ')', ', ')
    into v
    from fence.protected_tables p
   where exists (select 1 from pg_catalog.pg_class c where c.oid = p.relid)
     and fence.temp_dependency(p.relid) is not null;
  if v is not null then
    raise warning 'protected tables that depend on temporary objects, dropped when their session ends: %', v
      using hint = 'change the column or type to a permanent one now, in the session that owns the temporary object';
  end if;
end
$$;
