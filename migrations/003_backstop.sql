-- The backstop trigger: protecting a table installs a statement-level
-- trigger that performs the fence check itself from the session GUCs
-- (fence.job_key, fence.epoch, fence.token, fence.step). It closes every path
-- the proxy cannot see: functions, DO blocks, updatable views, rules, FK
-- cascades and direct connections.
--
-- Every role needs USAGE on schema fence to fire the triggers; the tables
-- stay private. The check for writers with fence metadata runs in the
-- SECURITY DEFINER trigger function fence.backstop; writers without it go
-- to fence.backstop_nometa, which runs in the writer's rights (it must see
-- the writer's current_user to honour pgfence_bypass).

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

-- backstop is the statement-level trigger for writers that carry fence
-- metadata (the trigger's WHEN clause: fence.job_key is set). It is the
-- whole check in one SECURITY DEFINER call: validate the settings, then the
-- same one-statement fast check as fence.gate (keep the two in step), and
-- fence.gate_slow for replays and errors. PostgreSQL refuses to call a
-- trigger function other than as a trigger.
create function fence.backstop() returns trigger
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
  select fe.epoch, fe.max_issued_token, fe.retired_at,
         exists (select 1 from fence.receipts r
                  where r.job_key = v_key and r.epoch = v_epoch and r.token = v_token and r.step = v_step)
    into f.epoch, f.max_issued_token, f.retired_at, v_replay
    from fence.fences fe where fe.job_key = v_key
     for update of fe;
  if not v_replay and f.epoch = v_epoch and f.retired_at is null and f.max_issued_token = v_token then
    return null;
  end if;
  perform fence.gate_slow(v_key, v_epoch, v_token, v_step);
  return null;
end
$$;

-- backstop_nometa is the statement-level trigger for writers without fence
-- metadata. It runs in the writer's rights: it must see the writer's
-- current_user to honour pgfence_bypass.
create function fence.backstop_nometa() returns trigger
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  if fence.is_bypass(current_user) then
    raise log 'pgfence: role % bypassed the fence backstop: % on %.%',
      current_user, tg_op, quote_ident(tg_table_schema), quote_ident(tg_table_name);
    return null;
  end if;
  raise exception 'fencing required: % on protected table %.% without fence metadata (role %)',
      tg_op, quote_ident(tg_table_schema), quote_ident(tg_table_name), current_user
    using errcode = 'FN008',
          hint = 'set fence.job_key, fence.epoch and fence.token to a generation from fence.acquire (or connect through pgfence); DBAs repairing data need membership in pgfence_bypass';
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

  -- Exactly one of the two statement triggers fires for a statement: the
  -- WHEN clauses (plain expressions, no function call) split on whether
  -- the session carries fence.job_key.
  execute format('create trigger pgfence_backstop before insert or update or delete or truncate on %s '
                 'for each statement when (pg_catalog.current_setting(''fence.job_key'', true) operator(pg_catalog.<>) '''') '
                 'execute function fence.backstop()', tbl);
  execute format('create trigger pgfence_backstop_nometa before insert or update or delete or truncate on %s '
                 'for each statement when (coalesce(pg_catalog.current_setting(''fence.job_key'', true), '''') operator(pg_catalog.=) '''') '
                 'execute function fence.backstop_nometa()', tbl);
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
  execute format('drop trigger if exists pgfence_backstop_nometa on %s', tbl);
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
grant execute on function fence.is_bypass(name), fence.backstop(), fence.backstop_nometa(),
  fence.backstop_row(), fence.replay_skip() to public;
