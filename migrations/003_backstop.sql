-- The backstop trigger: protecting a table installs a statement-level
-- trigger that performs the fence check itself from the session GUCs
-- (fence.job_key, fence.epoch, fence.token, fence.step). It closes every path
-- the proxy cannot see: functions, DO blocks, updatable views, rules, FK
-- cascades and direct connections.
--
-- The trigger functions run with the writer's rights (they must see the
-- writer's current_user to honour pgfence_bypass), so every role needs USAGE
-- on schema fence; the tables stay private, and the check itself runs in the
-- SECURITY DEFINER fence.backstop_check.

-- is_bypass: explicit (direct or indirect) membership of pgfence_bypass.
-- Superusers are not exempt unless they are members: pg_has_role would say
-- yes for them, so the membership graph is walked instead.
create function fence.is_bypass(p_role name) returns boolean
language sql stable
set search_path = pg_catalog
as $$
  with recursive up(oid) as (
    select r.oid from pg_catalog.pg_roles r where r.rolname = p_role
    union
    select m.roleid from pg_catalog.pg_auth_members m join up on m.member = up.oid
  )
  select exists (
    select 1 from up join pg_catalog.pg_roles b on b.oid = up.oid where b.rolname = 'pgfence_bypass'
  )
$$;

-- backstop_check is the trigger's only SECURITY DEFINER hop: it validates
-- the settings and runs fence.gate_core directly (not through fence.gate,
-- which would be a second definer call with its own search_path switch).
-- Its text parameters are text, not name: a name argument would give the
-- call the "C" input collation (see gate_core).
create function fence.backstop_check(p_job_key text, p_epoch text, p_token text, p_step text,
                                     p_schema text, p_table text, p_op text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fence
set plan_cache_mode = force_generic_plan
as $$
begin
  if pg_trigger_depth() < 1 then
    raise exception 'fence.backstop_check may only be called by the backstop trigger'
      using errcode = '42501';
  end if;
  if p_epoch is null or p_epoch !~ '^\s*-?[0-9]{1,18}\s*$' then
    raise exception 'fencing required: % on protected table %.% with fence.job_key "%" but fence.epoch is %',
        p_op, quote_ident(p_schema), quote_ident(p_table), p_job_key,
        case when p_epoch is null or p_epoch = '' then 'not set' else format('not an integer (%L)', p_epoch) end
      using errcode = 'FN008',
            hint = 'set fence.epoch and fence.token to the values returned by fence.acquire';
  end if;
  if p_token is null or p_token !~ '^\s*-?[0-9]{1,18}\s*$' then
    raise exception 'fencing required: % on protected table %.% with fence.job_key "%" but fence.token is %',
        p_op, quote_ident(p_schema), quote_ident(p_table), p_job_key,
        case when p_token is null or p_token = '' then 'not set' else format('not an integer (%L)', p_token) end
      using errcode = 'FN008',
            hint = 'set fence.epoch and fence.token to the values returned by fence.acquire';
  end if;
  -- An assignment, not PERFORM: a simple expression skips the executor.
  return fence.gate_core(p_job_key, trim(p_epoch)::bigint, trim(p_token)::bigint, p_step);
end
$$;

-- backstop is the statement-level trigger. It runs in the writer's rights
-- (it must see the writer's current_user to honour pgfence_bypass) and is
-- on every protected write, so it has no SET search_path (a SET clause
-- saves and restores the setting and invalidates the cached search path on
-- every call). It is safe without one because every name in it is
-- schema-qualified, types and operators included (operator(pg_catalog.=)),
-- so nothing a writer or another role puts on the search path can be
-- resolved in its place; the fence check itself runs in the SECURITY DEFINER
-- fence.backstop_check, which pins search_path.
create function fence.backstop() returns trigger
language plpgsql
as $$
declare
  v_key pg_catalog.text := pg_catalog.current_setting('fence.job_key', true);
  v_res pg_catalog.text;
begin
  if v_key is null or v_key operator(pg_catalog.=) '' then
    if fence.is_bypass(current_user) then
      raise log 'pgfence: role % bypassed the fence backstop: % on %.%',
        current_user, tg_op, pg_catalog.quote_ident(tg_table_schema), pg_catalog.quote_ident(tg_table_name);
      return null;
    end if;
    raise exception 'fencing required: % on protected table %.% without fence metadata (role %)',
        tg_op, pg_catalog.quote_ident(tg_table_schema), pg_catalog.quote_ident(tg_table_name), current_user
      using errcode = 'FN008',
            hint = 'set fence.job_key, fence.epoch and fence.token to a generation from fence.acquire (or connect through pgfence); DBAs repairing data need membership in pgfence_bypass';
  end if;
  -- An assignment, not PERFORM: a simple expression skips the executor.
  v_res := fence.backstop_check(v_key, pg_catalog.current_setting('fence.epoch', true),
                               pg_catalog.current_setting('fence.token', true),
                               pg_catalog.current_setting('fence.step', true),
                               tg_table_schema::pg_catalog.text, tg_table_name::pg_catalog.text, tg_op);
  return null;
end
$$;

-- replay_skip is the pgfence_replay row trigger (see fence.protect): a
-- BEFORE ROW trigger that returns NULL skips the row.
create function fence.replay_skip() returns trigger
language plpgsql
as $$
begin
  return null;
end
$$;

-- backstop_row scopes rows to the session's job: the row's job-key column
-- (trigger argument) must equal fence.job_key, for the new row and the old.
create function fence.backstop_row() returns trigger
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v_key text := nullif(current_setting('fence.job_key', true), '');
  v_col text := tg_argv[0];
  v_row text;
begin
  if v_key is null then
    if fence.is_bypass(current_user) then
      return case when tg_op = 'DELETE' then old else new end;
    end if;
    raise exception 'fencing required: % on protected table %.% without fence metadata (role %)',
        tg_op, quote_ident(tg_table_schema), quote_ident(tg_table_name), current_user
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

-- protect installs the backstop. Protecting an already protected table with
-- the same job-key column is a no-op (NOTICE); with a different column it is
-- an error (unprotect first). Everything happens in one transaction, so a
-- failure leaves nothing half-applied.
create function fence.protect(tbl regclass, job_key_column text default null) returns void
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
begin
  if tbl is null then
    raise exception 'fence.protect needs a table' using errcode = '22023';
  end if;
  select c.relkind, n.nspname, c.relname into v_kind, v_schema, v_name
    from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
   where c.oid = tbl;
  if v_kind = 'p' then
    raise exception 'cannot protect %: it is a partitioned table', tbl
      using errcode = '42809', hint = 'protect each partition: writes straight to a partition do not fire the parent''s statement triggers';
  end if;
  if v_kind is distinct from 'r' then
    raise exception 'cannot protect %: only ordinary tables can be protected', tbl
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
  if found then
    if v_existing.job_key_column is not distinct from job_key_column then
      raise notice '% is already protected; nothing to do', tbl;
      return;
    end if;
    raise exception 'cannot protect %: it is already protected with job key column %', tbl,
        coalesce(quote_ident(v_existing.job_key_column), 'none')
      using errcode = '55000', hint = 'unprotect it first (fence.unprotect), then protect it with the new column';
  end if;

  execute format('create trigger pgfence_backstop before insert or update or delete or truncate on %s '
                 'for each statement execute function fence.backstop()', tbl);
  -- Replay mode (DESIGN.md §4 step 2): when fence.gate answers 'replay' the
  -- transaction can never commit (its fence.replay_guards row fails at
  -- commit), so its writes are pointless; worse, a retried plain INSERT
  -- would fail with unique_violation before the client reaches COMMIT and
  -- get an error instead of the replay answer. gate_core sets
  -- pgfence.replay to the transaction's id, and this trigger then skips
  -- every row (returns NULL). The WHEN clause is a plain expression, so an
  -- ordinary write pays no PL/pgSQL call per row, only a comparison (kept
  -- small: PostgreSQL rebuilds a trigger's WHEN expression for every
  -- statement). pg_current_xact_id() assigns no id that the row write would
  -- not assign anyway.
  --
  -- The marker is a setting, which any client can set, and that is safe:
  -- forging it only suppresses the forger's own writes in its own
  -- transaction (a setting is per session, and the value must equal the
  -- current transaction id). It grants nothing: the statement-level
  -- backstop still checks the fence on every write, and a genuine replay
  -- still cannot commit, because that is decided by the replay guard row,
  -- which only the definer functions can write. Clearing the setting in a
  -- replaying transaction only lets its writes run again (as they did
  -- before this trigger existed), and they still cannot commit.
  --
  -- Note: for UPDATE and DELETE, PostgreSQL locks each target row before a
  -- BEFORE ROW trigger runs, so a replayed UPDATE still takes (and may wait
  -- for) row locks. A newer holder of the same job cannot be holding them:
  -- its gated transaction holds the fence row, which the replay's gate
  -- waited for.
  execute format('create trigger pgfence_replay before insert or update or delete on %s for each row '
                 'when (pg_catalog.current_setting(''pgfence.replay'', true) operator(pg_catalog.=) '
                 'pg_catalog.pg_current_xact_id()::pg_catalog.text) '
                 'execute function fence.replay_skip()', tbl);
  if job_key_column is not null then
    execute format('create trigger pgfence_job_key before insert or update or delete on %s '
                   'for each row execute function fence.backstop_row(%L)', tbl, job_key_column);
  end if;
  insert into fence.protected_tables (relid, schema_name, table_name, job_key_column)
  values (tbl, v_schema, v_name, job_key_column);
  perform pg_notify('pgfence_protected', format('%I.%I', v_schema, v_name));
end
$$;

-- unprotect removes the backstop; unprotecting a table that is not protected
-- is a no-op (NOTICE).
create function fence.unprotect(tbl regclass) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  v fence.protected_tables;
  v_schema name;
  v_name name;
begin
  if tbl is null then
    raise exception 'fence.unprotect needs a table' using errcode = '22023';
  end if;
  select n.nspname, c.relname into v_schema, v_name
    from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
   where c.oid = tbl;
  delete from fence.protected_tables p where p.relid = tbl returning p.* into v;
  if not found then
    raise notice '% is not protected; nothing to do', tbl;
  end if;
  execute format('drop trigger if exists pgfence_backstop on %s', tbl);
  execute format('drop trigger if exists pgfence_job_key on %s', tbl);
  execute format('drop trigger if exists pgfence_replay on %s', tbl);
  if v.relid is not null then
    perform pg_notify('pgfence_protected', format('%I.%I', v_schema, v_name));
  end if;
end
$$;

-- Privileges. Workers get EXECUTE on the protocol, SELECT on three tables,
-- nothing else. protect/unprotect/gc are administrative: not granted (the
-- migrating role owns them; grant them to an admin role if needed).
revoke all on all functions in schema fence from public;
grant usage on schema fence to public;
grant usage on schema fence to pgfence_worker;
grant execute on function
  fence.acquire(text, text, interval),
  fence.renew(text, bigint, interval),
  fence.release(text, bigint),
  fence.retire(text),
  fence.gate(text, bigint, bigint, text),
  fence.commit(text, bigint, bigint, text, bytea, text),
  fence.accept_event(text, text, bigint, bigint)
  to pgfence_worker;
grant select on fence.fences, fence.leases, fence.protected_tables to pgfence_worker;
-- Called by the backstop trigger in the writer's rights.
grant execute on function fence.is_bypass(name), fence.backstop_check(text, text, text, text, text, text, text),
  fence.backstop(), fence.backstop_row(), fence.replay_skip() to public;
