-- Issue 17: the backstop decides bypass on session_user (§3), marks the
-- transactions it lets write (§4), and protection covers whole partition
-- and inheritance trees (§1). 008 keeps the trees whole as DDL changes
-- them.

-- Protected trees (§1): every member of a protected partition tree or
-- inheritance tree is listed, with the root it is protected through. owner
-- caches the table's owner, so the DDL guard (008) can tell an OWNER TO;
-- schema_name and table_name are kept current on renames by the guard and
-- are never the truth (relid is).
alter table fence.protected_tables add column root regclass;
alter table fence.protected_tables add column owner regrole;
update fence.protected_tables p
   set root = p.relid,
       owner = (select c.relowner from pg_catalog.pg_class c where c.oid = p.relid);
-- Rows of tables dropped while protected (nothing removed them before the
-- guard): their relid may be reused by a new table.
delete from fence.protected_tables p where not exists (select 1 from pg_catalog.pg_class c where c.oid = p.relid);
alter table fence.protected_tables alter column root set not null;
alter table fence.protected_tables alter column owner set not null;
create index protected_tables_root_idx on fence.protected_tables (root);
comment on column fence.protected_tables.root is 'the protected table this member is protected through (itself for a root)';

-- Our own DDL (fence.protect, fence.unprotect and the guard's installing
-- of triggers on new members) passes the DDL guard by a row here keyed by
-- the transaction: only the definer functions can write it, and it is
-- removed before they return. No row ever commits.
create unlogged table fence.own_ddl (
  xid xid8 primary key
);
comment on table fence.own_ddl is 'in-flight: pgfence''s own DDL in this transaction; the DDL guard lets it pass; no row commits';

-- backstop: as in 003, plus the owner in the fast path's condition (the
-- slow path raises FN011 for another role's generation) and the mark: the
-- first statement of a transaction that changes a protected table under a
-- generation records so in fence.write_marks, whose deferred trigger writes
-- the receipt at COMMIT if nobody else did. The setting pgfence.marked only
-- saves the insert on the transaction's later statements (and fence.gate
-- sets it: a gated transaction writes its receipt with fence.commit); a
-- client that forges or clears it can only lose its own receipt or insert a
-- second mark (which the deferred trigger tolerates): it never skips the
-- fence check. Keep the value in step with fence.gate.
create or replace function fence.backstop() returns trigger
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  v_key text collate pg_catalog."default" := current_setting('fence.job_key', true);
  v_epoch_s text := current_setting('fence.epoch', true);
  v_token_s text := current_setting('fence.token', true);
  v_step text collate pg_catalog."default" := coalesce(current_setting('fence.step', true), '');
  v_epoch bigint;
  v_token bigint;
  f fence.fences;
  v_replay boolean;
  v_mark text;
begin
  if v_key is null or v_key = '' then
    -- Not reached through the WHEN clause (backstop_nometa handles it).
    raise exception 'fencing required: % on protected table %.% without fence metadata',
        tg_op, quote_ident(tg_table_schema), quote_ident(tg_table_name)
      using errcode = 'FN008',
            hint = 'set fence.job_key, fence.epoch and fence.token to a generation from fence.acquire (or connect through pgfence)';
  end if;
  if v_epoch_s is null or v_epoch_s !~ '^\s*-?[0-9]{1,18}\s*$' then
    raise exception 'fencing required: % on protected table %.% with fence.job_key "%" but fence.epoch is %',
        tg_op, quote_ident(tg_table_schema), quote_ident(tg_table_name), v_key,
        case when v_epoch_s is null or v_epoch_s = '' then 'not set' else format('not an integer (%L)', v_epoch_s) end
      using errcode = 'FN008',
            hint = 'set fence.epoch and fence.token to the values returned by fence.acquire';
  end if;
  if v_token_s is null or v_token_s !~ '^\s*-?[0-9]{1,18}\s*$' then
    raise exception 'fencing required: % on protected table %.% with fence.job_key "%" but fence.token is %',
        tg_op, quote_ident(tg_table_schema), quote_ident(tg_table_name), v_key,
        case when v_token_s is null or v_token_s = '' then 'not set' else format('not an integer (%L)', v_token_s) end
      using errcode = 'FN008',
            hint = 'set fence.epoch and fence.token to the values returned by fence.acquire';
  end if;
  v_epoch := trim(v_epoch_s)::bigint;
  v_token := trim(v_token_s)::bigint;
  select fe.epoch, fe.max_issued_token, fe.retired_at, fe.owner_role,
         exists (select 1 from fence.receipts r
                  where r.job_key = v_key and r.epoch = v_epoch and r.token = v_token and r.step = v_step)
    into f.epoch, f.max_issued_token, f.retired_at, f.owner_role, v_replay
    from fence.fences fe where fe.job_key = v_key
     for update of fe;
  if (not v_replay and f.epoch = v_epoch and f.retired_at is null and f.max_issued_token = v_token
      and f.owner_role = session_user) is not true then
    if fence.gate_slow(v_key, v_epoch, v_token, v_step) = 'replay' then
      return null;
    end if;
  end if;
  v_mark := format('%s %s %s %L %L', pg_current_xact_id(), v_epoch, v_token, v_key, v_step);
  if current_setting('pgfence.marked', true) is distinct from v_mark then
    insert into fence.write_marks (job_key, epoch, token, step, digest)
    values (v_key, v_epoch, v_token, v_step, sha256(convert_to(coalesce(current_query(), ''), 'UTF8')));
    perform set_config('pgfence.marked', v_mark, true);
  end if;
  return null;
end
$$;

-- backstop_nometa: as in 003, deciding on the session (session_bypass),
-- not on current_user. It stays SECURITY INVOKER: a superuser's SET ROLE
-- to a bypass member counts, and it needs current_user for that.
create or replace function fence.backstop_nometa() returns trigger
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  if fence.session_bypass() then
    raise log 'pgfence: role % (session %) bypassed the fence backstop: % on %.%',
      current_user, session_user, tg_op, quote_ident(tg_table_schema), quote_ident(tg_table_name);
    return null;
  end if;
  raise exception 'fencing required: % on protected table %.% without fence metadata (role %)',
      tg_op, quote_ident(tg_table_schema), quote_ident(tg_table_name), session_user
    using errcode = 'FN008',
          hint = 'set fence.job_key, fence.epoch and fence.token to a generation from fence.acquire (or connect through pgfence); DBAs repairing data need membership in pgfence_bypass';
end
$$;

-- backstop_row: as in 003, deciding bypass on the session.
create or replace function fence.backstop_row() returns trigger
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v_key text := nullif(current_setting('fence.job_key', true), '');
  v_col text := tg_argv[0];
  v_row text;
begin
  if v_key is null then
    if fence.session_bypass() then
      return case when tg_op = 'DELETE' then old else new end;
    end if;
    raise exception 'fencing required: % on protected table %.% without fence metadata (role %)',
        tg_op, quote_ident(tg_table_schema), quote_ident(tg_table_name), session_user
      using errcode = 'FN008',
            hint = 'set fence.job_key, fence.epoch and fence.token to a generation from fence.acquire';
  end if;
  if tg_op in ('INSERT', 'UPDATE') then
    v_row := to_jsonb(new) ->> v_col;
    if v_row is distinct from v_key then
      raise exception 'fencing required: % of a row with %.% = % on %.%, but this session is fenced for job "%"',
          tg_op, quote_ident(tg_table_name), quote_ident(v_col), coalesce(quote_literal(v_row), 'NULL'),
          quote_ident(tg_table_schema), quote_ident(tg_table_name), v_key
        using errcode = 'FN008',
              hint = format('a fenced session may only write rows whose %s is its own fence.job_key', v_col);
    end if;
  end if;
  if tg_op in ('UPDATE', 'DELETE') then
    v_row := to_jsonb(old) ->> v_col;
    if v_row is distinct from v_key then
      raise exception 'fencing required: % of a row with %.% = % on %.%, but this session is fenced for job "%"',
          tg_op, quote_ident(tg_table_name), quote_ident(v_col), coalesce(quote_literal(v_row), 'NULL'),
          quote_ident(tg_table_schema), quote_ident(tg_table_name), v_key
        using errcode = 'FN008',
              hint = format('a fenced session may only change rows whose %s is its own fence.job_key', v_col);
    end if;
  end if;
  return case when tg_op = 'DELETE' then old else new end;
end
$$;

-- Trees. PostgreSQL fires statement-level triggers only on the table a
-- statement names, and clones row-level triggers to partitions but not
-- statement-level ones (nor anything to inheritance children). So every
-- member of a protected tree carries the two statement triggers itself,
-- and every member that stores rows (relkind r) its own row triggers: none
-- is put on a partitioned table, whose row triggers PostgreSQL would clone
-- (and then refuse to attach a protected table that has its own).

-- tree_members: rel and everything below it (partitions, sub-partitions,
-- inheritance children), each once.
create function fence.tree_members(rel regclass) returns table (relid regclass, relkind "char")
language sql stable
set search_path = pg_catalog
as $$
  with recursive down(oid) as (
    select rel::oid
    union
    select i.inhrelid from pg_catalog.pg_inherits i join down d on i.inhparent = d.oid
  )
  select d.oid::regclass, c.relkind from down d join pg_catalog.pg_class c on c.oid = d.oid
$$;

-- tree_roots: the tables above rel that have no parent (rel itself when it
-- has none; several under multiple inheritance).
create function fence.tree_roots(rel regclass) returns setof regclass
language sql stable
set search_path = pg_catalog
as $$
  with recursive up(oid) as (
    select rel::oid
    union
    select i.inhparent from pg_catalog.pg_inherits i join up u on i.inhrelid = u.oid
  )
  select u.oid::regclass from up u
   where not exists (select 1 from pg_catalog.pg_inherits i where i.inhrelid = u.oid)
$$;

-- own_ddl_begin / own_ddl_end bracket pgfence's own DDL, which the DDL
-- guard (008) then lets pass: a row keyed by the transaction, written only
-- here (these functions run only inside pgfence's definer functions;
-- PUBLIC cannot execute them). own_ddl_begin returns whether it made the
-- row, so nested brackets leave it to the outermost.
create function fence.own_ddl_begin() returns boolean
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  insert into fence.own_ddl (xid) values (pg_current_xact_id()) on conflict do nothing;
  return found;
end
$$;

create function fence.own_ddl_end(p_mine boolean) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  if p_mine then
    delete from fence.own_ddl o where o.xid = pg_current_xact_id();
  end if;
end
$$;

-- install_backstop puts the backstop's triggers on one member (see 003 for
-- what each does). Run inside own_ddl_begin/own_ddl_end.
create function fence.install_backstop(rel regclass, p_kind "char", p_column text) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  -- Exactly one of the two statement triggers fires for a statement: the
  -- WHEN clauses split on whether the session carries fence.job_key.
  execute format('create trigger pgfence_backstop before insert or update or delete or truncate on %s '
                 'for each statement when (pg_catalog.current_setting(''fence.job_key'', true) operator(pg_catalog.<>) '''') '
                 'execute function fence.backstop()', rel);
  execute format('create trigger pgfence_backstop_nometa before insert or update or delete or truncate on %s '
                 'for each statement when (coalesce(pg_catalog.current_setting(''fence.job_key'', true), '''') operator(pg_catalog.=) '''') '
                 'execute function fence.backstop_nometa()', rel);
  if p_kind = 'r' then
    execute format('create trigger pgfence_replay before insert or update or delete on %s for each row '
                   'when (pg_catalog.current_setting(''pgfence.replay'', true) operator(pg_catalog.=) '
                   'pg_catalog.pg_current_xact_id()::pg_catalog.text) '
                   'execute function fence.replay_skip()', rel);
    if p_column is not null then
      execute format('create trigger pgfence_job_key before insert or update or delete on %s '
                     'for each row execute function fence.backstop_row(%L)', rel, p_column);
    end if;
  end if;
end
$$;

create function fence.uninstall_backstop(rel regclass) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  execute format('drop trigger if exists pgfence_backstop on %s', rel);
  execute format('drop trigger if exists pgfence_backstop_nometa on %s', rel);
  execute format('drop trigger if exists pgfence_job_key on %s', rel);
  execute format('drop trigger if exists pgfence_replay on %s', rel);
end
$$;

-- backstop_problem says what is wrong with a protected member, or NULL:
-- one of its triggers is missing, disabled (or ENABLE REPLICA/ALWAYS: not
-- as installed) or runs another function; it was renamed, moved to
-- another schema or given to another owner; its job-key column is gone.
create function fence.backstop_problem(p fence.protected_tables) returns text
language plpgsql stable
set search_path = pg_catalog, fence
as $$
declare
  v_kind "char";
  v_schema name;
  v_name name;
  v_owner oid;
  v text;
begin
  select c.relkind, n.nspname, c.relname, c.relowner into v_kind, v_schema, v_name, v_owner
    from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
   where c.oid = p.relid;
  select string_agg(format('%s its trigger %s', case when t.oid is null then 'drop'
                                                     when t.tgfoid <> e.fn then 'replace'
                                                     when t.tgenabled = 'D' then 'disable'
                                                     else 'change the firing mode of' end, e.name), ', ')
    into v
    from (values ('pgfence_backstop', 'fence.backstop()'::regprocedure, true),
                 ('pgfence_backstop_nometa', 'fence.backstop_nometa()'::regprocedure, true),
                 ('pgfence_replay', 'fence.replay_skip()'::regprocedure, v_kind = 'r'),
                 ('pgfence_job_key', 'fence.backstop_row()'::regprocedure, v_kind = 'r' and p.job_key_column is not null)) e(name, fn, wanted)
    left join pg_catalog.pg_trigger t on t.tgrelid = p.relid and t.tgname = e.name
   where e.wanted and (t.oid is null or t.tgfoid <> e.fn or t.tgenabled <> 'O');
  if v is not null then
    return v;
  end if;
  if v_schema <> p.schema_name or v_name <> p.table_name then
    return format('rename it (it was %I.%I)', p.schema_name, p.table_name);
  end if;
  if v_owner <> p.owner then
    return format('give it to another owner (it belonged to %s)', p.owner);
  end if;
  if p.job_key_column is not null and not exists (
      select 1 from pg_catalog.pg_attribute a
       where a.attrelid = p.relid and a.attname = p.job_key_column and a.attnum > 0 and not a.attisdropped) then
    return format('remove or rename its job-key column %I', p.job_key_column);
  end if;
  return null;
end
$$;

-- tree_is_empty: no member of rel's tree has a heap page. Size, not a
-- query: a query's snapshot may not see rows another transaction committed
-- after it began.
create function fence.tree_is_empty(rel regclass) returns boolean
language sql stable
set search_path = pg_catalog, fence
as $$
  select not exists (select 1 from fence.tree_members(rel) m
                      where m.relkind = 'r' and pg_catalog.pg_relation_size(m.relid) > 0)
$$;

-- sync_tree makes fence.protected_tables and the triggers match the tree
-- below p_root as PostgreSQL has it now, and returns whether anything
-- changed. A member that arrived (CREATE TABLE … PARTITION OF / INHERITS,
-- ATTACH PARTITION, INHERIT) gets the backstop; one that left (DETACH
-- PARTITION, NO INHERIT) stays protected, as the root of its own tree
-- (fail closed). When p_allowed is false (the session is no administrator)
-- a member may arrive only empty, and none may leave: FN010.
create function fence.sync_tree(p_root regclass, p_column text, p_allowed boolean) returns boolean
language plpgsql
set search_path = pg_catalog, fence
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
  v_mine := fence.own_ddl_begin();
  for m in select t.relid, t.relkind, c.relname, n.nspname, c.relowner
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

-- protect protects a table and its whole tree: every partition and
-- sub-partition, every inheritance child, and (by the DDL guard, 008)
-- every member added later. A member of a tree is not protected alone: the
-- error names the root to protect. Protecting again the same way is a
-- no-op (NOTICE); with another job-key column it is an error.
create or replace function fence.protect(tbl regclass, job_key_column text default null) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  v_kind "char";
  v_schema name;
  v_name name;
  v_type regtype;
  v_existing fence.protected_tables;
  v_protected boolean;
  v_roots text;
begin
  if tbl is null then
    raise exception 'fence.protect needs a table' using errcode = '22023';
  end if;
  select c.relkind, n.nspname, c.relname into v_kind, v_schema, v_name
    from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
   where c.oid = tbl;
  if v_kind is distinct from 'r' and v_kind is distinct from 'p' then
    raise exception 'cannot protect %: only tables can be protected', tbl
      using errcode = '42809', hint = 'protect the table beneath the view; writes through views are fenced by its trigger';
  end if;
  if v_schema = 'fence' then
    raise exception 'cannot protect %: pgfence''s own tables are guarded by privileges', tbl using errcode = '42809';
  end if;
  if job_key_column is not null then
    select a.atttypid::regtype into v_type
      from pg_catalog.pg_attribute a
     where a.attrelid = tbl and a.attname = job_key_column and a.attnum > 0 and not a.attisdropped;
    if not found then
      raise exception 'cannot protect %: column "%" does not exist', tbl, job_key_column using errcode = '42703';
    end if;
    if v_type not in ('text'::regtype, 'character varying'::regtype, 'character'::regtype) then
      raise exception 'cannot protect %: job key column "%" has type %, want text', tbl, job_key_column, v_type
        using errcode = '42804';
    end if;
  end if;

  select * into v_existing from fence.protected_tables p where p.relid = tbl for update;
  v_protected := found;
  if v_protected and v_existing.job_key_column is distinct from job_key_column then
    raise exception 'cannot protect %: it is already protected with job key column %', tbl,
        coalesce(quote_ident(v_existing.job_key_column), 'none')
      using errcode = '55000', hint = 'unprotect it first (fence.unprotect), then protect it with the new column';
  end if;
  if exists (select 1 from pg_catalog.pg_inherits i where i.inhrelid = tbl) then
    if v_protected then
      raise notice '% is already protected, as a member of the protected tree of %; nothing to do', tbl, v_existing.root;
      return;
    end if;
    select string_agg(r::text, ', ') into v_roots from fence.tree_roots(tbl) r;
    raise exception 'cannot protect %: it is a partition or inheritance child of %, and protection covers a whole tree', tbl, v_roots
      using errcode = '42809',
            detail = 'writes naming the root would reach its rows without firing its statement triggers',
            hint = format('protect the root instead: fence.protect(%L) protects every table below it, now and later', v_roots);
  end if;
  if fence.sync_tree(tbl, job_key_column, true) then
    perform pg_notify('pgfence_protected', format('%I.%I', v_schema, v_name));
  else
    raise notice '% is already protected; nothing to do', tbl;
  end if;
end
$$;

-- unprotect removes the backstop from a root and its whole tree. It needs
-- an administrator (pgfence_bypass or a superuser, by session_user): it
-- switches the fence off. A member of a tree is refused with the root's
-- name; a table that is not protected is a no-op (NOTICE), with any stray
-- pgfence trigger removed.
create or replace function fence.unprotect(tbl regclass) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  v fence.protected_tables;
  v_protected boolean;
  m record;
  v_mine boolean;
begin
  if tbl is null then
    raise exception 'fence.unprotect needs a table' using errcode = '22023';
  end if;
  if not fence.is_admin() then
    raise exception 'unprotecting % needs pgfence_bypass: role "%" is not a member', tbl, session_user
      using errcode = 'FN010',
            hint = 'ask a member of pgfence_bypass (a DBA) to unprotect it';
  end if;
  select * into v from fence.protected_tables p where p.relid = tbl for update;
  v_protected := found;
  if v_protected and v.root <> tbl then
    raise exception 'cannot unprotect %: it is a member of the protected tree of %', tbl, v.root
      using errcode = '42809',
            hint = format('unprotect the root %s (its whole tree), or detach %s from it first (it then stays protected on its own)', v.root, tbl);
  end if;
  v_mine := fence.own_ddl_begin();
  if not v_protected then
    raise notice '% is not protected; nothing to do', tbl;
    perform fence.uninstall_backstop(tbl);
  else
    for m in delete from fence.protected_tables p where p.root = tbl returning p.relid loop
      perform fence.uninstall_backstop(m.relid);
    end loop;
    perform pg_notify('pgfence_protected', tbl::text);
  end if;
  perform fence.own_ddl_end(v_mine);
end
$$;

-- Adopt the trees of tables protected before this migration: a partition
-- or inheritance child protected alone had its rows reachable, unfenced,
-- through its root; an inheritance parent's children were unprotected.
-- Each such tree is protected from its root, with the job-key column of
-- its protected members (which must agree: else this fails with the
-- tables to fix, and nothing of this migration is applied).
do $$
declare
  r record;
begin
  for r in select distinct rt.root, p.job_key_column
             from fence.protected_tables p
             cross join lateral fence.tree_roots(p.relid) as rt(root)
            where rt.root <> p.relid
               or exists (select 1 from pg_catalog.pg_inherits i where i.inhparent = p.relid) loop
    raise notice 'pgfence: protecting the whole tree of % (a member was protected alone before)', r.root;
    perform fence.protect(r.root, r.job_key_column);
  end loop;
end
$$;

revoke all on all functions in schema fence from public;
grant execute on function fence.protect(regclass, text), fence.unprotect(regclass) to pgfence_bypass;
-- Trigger functions and what they call in the writer's rights.
grant execute on function fence.is_bypass(name), fence.member_of(name, name), fence.session_bypass(),
  fence.backstop(), fence.backstop_nometa(), fence.backstop_row(), fence.replay_skip(),
  fence.write_mark_fire(), fence.has_generation(text, bigint) to public;
