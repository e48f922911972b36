-- Issue 30: the database writes the receipt, judges a statement's rows
-- against one verified generation, refuses PREPARE TRANSACTION by
-- PostgreSQL's own rule, and answers nobody about another role's
-- generation. docs/security.md describes each defence and its cost.
--
-- 1. Exactly one receipt, whatever the client's code does (HIGH 3). The
--    first fenced write of a transaction under a generation and step —
--    fence.gate, or the backstop's statement trigger — writes a
--    provisional receipt (digest version backstop-v1: SHA-256 of
--    current_query(); backstop_xid: this transaction) in the same
--    statement that checks the generation. It commits with the
--    transaction however the transaction commits (COMMIT inside a
--    procedure, a hidden COMMIT, a commit step that client code
--    replaced), so a retry always finds it and is a replay. fence.commit
--    puts the presented digest into it (one UPDATE). Receipts keep the
--    writing transaction in backstop_xid, so "a receipt of this
--    transaction" and "another's" (a replay) are told apart by the row,
--    never by a setting: pgfence.marked is no longer read by anyone, and
--    fence.write_marks is no longer written (its table and deferred
--    trigger stay for transactions in flight across this migration).
--
-- 2. Rows judged against one verified generation (HIGH 2). The job-key
--    row trigger read fence.job_key per row, so a function called in the
--    statement could switch jobs half-way. It is replaced by AFTER ...
--    FOR EACH STATEMENT triggers with transition tables, one per event,
--    on every member of a keyed tree (fence.backstop_rows_*): they read the
--    settings once, verify that generation (current, the caller's, the
--    fence row locked, its receipt this transaction's) and check every
--    old and new row of the statement in one query, comparing bytes
--    (COLLATE "C" on the value cast to text). TRUNCATE of a keyed table
--    by a fenced session that is not a bypass member is refused (FN008):
--    it removes every job's rows.
--
-- 3. PREPARE TRANSACTION refused by PostgreSQL (no regular expression).
--    With max_prepared_transactions > 0, the first fenced write of a
--    transaction opens a temporary relation of the session
--    (fence.refuse_prepare), and PostgreSQL refuses to PREPARE a
--    transaction that touched a temporary object (0A000), after deferred
--    triggers, whatever the statement's text; nothing a client does
--    clears that.
--
-- 4. Replays lock nothing and answer only the owner (fence.gate,
--    fence.commit and the backstop): the fence row is locked only for a
--    current generation by its owner (or an administrator); a replay is
--    decided from the receipt alone; a role asking about a generation
--    that fence.acquire did not issue to it gets FN011 whether that
--    generation is current, stale, receipted or was never issued (FN005
--    only for a job key nobody ever acquired, which fence.jobs shows
--    anyone). The owner keeps its precise answers; messages to
--    non-administrators no longer carry the current token.

-- definer_bypass is fence.session_bypass for code that runs as a
-- SECURITY DEFINER function, where current_user is the definer: a session
-- that authenticated as a bypass member, or as a superuser that SET ROLE
-- to one (the role setting; only a superuser session reaches that test,
-- and a superuser can switch every trigger off anyway).
create function fence.definer_bypass() returns boolean
language sql stable
set search_path = pg_catalog
as $$
  select fence.is_bypass(session_user)
      or (coalesce((select r.rolsuper from pg_catalog.pg_roles r where r.rolname = session_user), false)
          and fence.is_bypass(pg_catalog.current_setting('role')))
$$;

-- refuse_prepare makes this transaction one PostgreSQL will not PREPARE:
-- it opens a temporary relation of the session, creating it when there
-- is none. pg_get_replica_identity_index opens the relation by OID (the
-- cheapest function that does: 5 µs; pg_relation_size also stats its
-- files, 23 µs; to_regclass alone opens nothing) and runs none of its
-- code. The name is looked up in the session's own temporary schema, where
-- only the session itself creates objects: a table a client put there
-- first serves as well (any relation but an index or a composite type,
-- which make this raise, stopping only that client's own writes). With
-- max_prepared_transactions = 0 (a setting only a restart changes)
-- PostgreSQL refuses every PREPARE, and this does nothing. fence.gate and
-- fence.backstop inline the common case (the table exists).
create function fence.refuse_prepare() returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v regclass;
begin
  if pg_catalog.current_setting('max_prepared_transactions') = '0' then
    return;
  end if;
  v := pg_catalog.to_regclass('pg_temp.pgfence_no_prepare');
  if v is null then
    create temporary table pgfence_no_prepare () using heap;
  else
    perform pg_catalog.pg_get_replica_identity_index(v);
  end if;
end
$$;

-- refuse_generation raises the answer to the session about generation
-- (p_job_key, p_epoch, p_token) that it may not write under now, and
-- returns only when the generation is current. It reads the fence row
-- without locking it. A non-administrator asking about a generation that
-- fence.acquire did not issue to it (another role's, or none at all) gets
-- FN011 whatever that generation's state; about its own (or one issued
-- before roles were recorded), the precise answer, without the current
-- token (it may be another role's). An administrator gets
-- fence.check_generation's answers.
create function fence.refuse_generation(p_job_key text, p_epoch bigint, p_token bigint, p_admin boolean) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  f fence.fences;
  v_pruned bigint;
begin
  select * into f from fence.fences fe where fe.job_key = p_job_key;
  if not found then
    raise exception 'job "%" is unknown: no lease was ever acquired for it (presented epoch %, token %)',
        p_job_key, p_epoch, p_token
      using errcode = 'FN005',
            hint = 'acquire a lease with fence.acquire (pgfence lease acquire) and use the epoch and token it returns';
  end if;
  if p_admin then
    perform fence.check_generation(f, p_job_key, p_epoch, p_token);
    return;
  end if;
  if not exists (select 1 from fence.issuance i
                  where i.token = p_token and i.job_key = p_job_key and i.epoch = p_epoch
                    and (i.role is null or i.role = session_user)) then
    raise exception 'job "%": epoch % token % is not a generation of role "%"', p_job_key, p_epoch, p_token, session_user
      using errcode = 'FN011',
            detail = 'a generation is usable only by the role that acquired it; this answer is the same for every generation that is not this role''s',
            hint = 'use the epoch and token fence.acquire returned to this role (fence.acquire records session_user), or connect as the role that acquired the lease';
  end if;
  if p_epoch <> f.epoch or f.retired_at is not null then
    raise exception 'job "%": epoch % is retired (presented token %)', p_job_key, p_epoch, p_token
      using errcode = 'FN004',
            hint = 'the request belongs to a finished lifecycle of this job: drop it; new work needs a new lease';
  end if;
  select w.pruned_through_token into v_pruned
    from fence.gc_watermarks w where w.job_key = p_job_key and w.epoch = p_epoch;
  if found and p_token <= v_pruned then
    raise exception 'job "%": cannot confirm epoch % token %: its commit receipts were pruned by gc', p_job_key, p_epoch, p_token
      using errcode = 'FN006',
            hint = 'the outcome of this generation is no longer recorded; check the business result directly and do not retry it as a first commit';
  end if;
  if p_token <> f.max_issued_token then
    raise exception 'job "%": token % is stale (epoch %): a newer generation holds the job', p_job_key, p_token, p_epoch
      using errcode = 'FN001',
            hint = 'another holder took over this job: stop, roll back and do not retry with this token';
  end if;
end
$$;

-- replay_mode puts this transaction into replay mode for a generation
-- and step that already has a receipt: a replay guard (its deferred
-- trigger fails the COMMIT with FN00R) and pgfence.replay, which makes
-- the pgfence_replay row trigger skip the transaction's rows.
create function fence.replay_mode(p_job_key text, p_epoch bigint, p_token bigint, p_step text) returns text
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  insert into fence.replay_guards (job_key, epoch, token, step) values (p_job_key, p_epoch, p_token, p_step);
  perform pg_catalog.set_config('pgfence.replay', pg_catalog.pg_current_xact_id()::text, true);
  return 'replay';
end
$$;

-- gate_slow: the whole check of a write under a generation, when the fast
-- path (in fence.gate and fence.enter) did not settle it: 'ok' (the
-- transaction may write; its provisional receipt exists), 'replay', or the
-- error. Order: whose generation it is (a non-owner learns nothing else),
-- the receipt (L3: a retry is a replay even after a takeover; no lock),
-- then the generation, locked only when current and the caller's.
create or replace function fence.gate_slow(p_job_key text, p_epoch bigint, p_token bigint, p_step text) returns text
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v_key text collate pg_catalog."default" := p_job_key;
  v_step text collate pg_catalog."default" := coalesce(p_step, '');
  v_xid xid8 := pg_catalog.pg_current_xact_id();
  v_admin boolean := fence.is_admin();
  v_rx xid8;
  v_ours boolean;
begin
  if not v_admin and not exists (select 1 from fence.issuance i
                                  where i.token = p_token and i.job_key = v_key and i.epoch = p_epoch
                                    and (i.role is null or i.role = session_user)) then
    perform fence.refuse_generation(v_key, p_epoch, p_token, false);
  end if;
  select r.backstop_xid into v_rx from fence.receipts r
   where r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step;
  v_ours := found;
  if v_ours and v_rx is distinct from v_xid then
    return fence.replay_mode(v_key, p_epoch, p_token, v_step);
  end if;
  perform 1 from fence.fences fe
   where fe.job_key = v_key and fe.epoch = p_epoch and fe.max_issued_token = p_token and fe.retired_at is null
     and (fe.owner_role is null or fe.owner_role = session_user or v_admin)
     for update of fe;
  if not found then
    perform fence.refuse_generation(v_key, p_epoch, p_token, v_admin);
    raise exception 'job "%": token % belongs to another role; writing under it needs the role that acquired the lease', v_key, p_token
      using errcode = 'FN011';
  end if;
  if not v_ours then
    insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version, backstop_xid)
    values (v_key, p_epoch, p_token, v_step, sha256(convert_to(coalesce(current_query(), ''), 'UTF8')), 'backstop-v1', v_xid)
    on conflict (job_key, epoch, token, step) do nothing;
    if not found then
      -- Another transaction of this generation committed its receipt
      -- while this one waited for the fence row (READ COMMITTED; at
      -- REPEATABLE READ the insert failed with 40001).
      return fence.replay_mode(v_key, p_epoch, p_token, v_step);
    end if;
    perform fence.refuse_prepare();
  end if;
  return 'ok';
end
$$;

-- enter is the backstop's check of a write under a generation: one
-- statement locks the fence row when the generation is current, the
-- caller's and has no receipt but this transaction's, and says whether
-- that receipt exists; the first write inserts it; everything else is
-- gate_slow's. Plain function: it runs inside the definer triggers.
create function fence.enter(p_job_key text, p_epoch bigint, p_token bigint, p_step text) returns text
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v_key text collate pg_catalog."default" := p_job_key;
  v_step text collate pg_catalog."default" := p_step;
  v_xid xid8 := pg_catalog.pg_current_xact_id();
  v_ours boolean;
begin
  select r.job_key is not null into v_ours
    from fence.fences fe
    left join fence.receipts r
      on r.job_key = fe.job_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step
   where fe.job_key = v_key and fe.epoch = p_epoch and fe.max_issued_token = p_token
     and fe.retired_at is null and fe.owner_role = session_user
     and (r.job_key is null or r.backstop_xid = v_xid)
     for update of fe;
  if found then
    if v_ours then
      return 'ok';
    end if;
    insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version, backstop_xid)
    values (v_key, p_epoch, p_token, v_step, sha256(convert_to(coalesce(current_query(), ''), 'UTF8')), 'backstop-v1', v_xid)
    on conflict (job_key, epoch, token, step) do nothing;
    if found then
      if pg_catalog.current_setting('max_prepared_transactions') <> '0' then
        perform fence.refuse_prepare();
      end if;
      return 'ok';
    end if;
  end if;
  return fence.gate_slow(v_key, p_epoch, p_token, v_step);
end
$$;

-- metadata reads the session's fence settings, once each, and returns
-- them parsed, or raises FN008 naming what is missing. p_what names the
-- write ("INSERT on protected table s.t").
create function fence.metadata(p_what text, out job_key text, out epoch bigint, out token bigint, out step text)
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v_epoch_s text := pg_catalog.current_setting('fence.epoch', true);
  v_token_s text := pg_catalog.current_setting('fence.token', true);
begin
  job_key := pg_catalog.current_setting('fence.job_key', true);
  step := coalesce(pg_catalog.current_setting('fence.step', true), '');
  if job_key is null or job_key = '' then
    raise exception 'fencing required: % without fence metadata', p_what
      using errcode = 'FN008',
            hint = 'set fence.job_key, fence.epoch and fence.token to a generation from fence.acquire (or connect through pgfence)';
  end if;
  if v_epoch_s is null or v_epoch_s !~ '^\s*-?[0-9]{1,18}\s*$' then
    raise exception 'fencing required: % with fence.job_key "%" but fence.epoch is %', p_what, job_key,
        case when v_epoch_s is null or v_epoch_s = '' then 'not set' else format('not an integer (%L)', v_epoch_s) end
      using errcode = 'FN008',
            hint = 'set fence.epoch and fence.token to the values returned by fence.acquire';
  end if;
  if v_token_s is null or v_token_s !~ '^\s*-?[0-9]{1,18}\s*$' then
    raise exception 'fencing required: % with fence.job_key "%" but fence.token is %', p_what, job_key,
        case when v_token_s is null or v_token_s = '' then 'not set' else format('not an integer (%L)', v_token_s) end
      using errcode = 'FN008',
            hint = 'set fence.epoch and fence.token to the values returned by fence.acquire';
  end if;
  epoch := trim(v_epoch_s)::bigint;
  token := trim(v_token_s)::bigint;
end
$$;

-- refuse_truncate: TRUNCATE of a keyed member by a fenced session that is
-- not a bypass member removes every job's rows, and no row trigger sees
-- them go: FN008.
create function fence.refuse_truncate(p_rel regclass, p_job_key text) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  if exists (select 1 from fence.protected_tables q where q.relid = p_rel and q.job_key_column is not null)
     and not fence.definer_bypass() then
    raise exception 'fencing required: TRUNCATE of protected table % would remove the rows of every job, and this session is fenced for job "%"',
        p_rel, p_job_key
      using errcode = 'FN008',
            hint = 'delete this job''s own rows with DELETE … WHERE on the job-key column; emptying the whole table needs a member of pgfence_bypass';
  end if;
end
$$;

-- backstop: the BEFORE statement trigger for writers with fence metadata
-- (its WHEN clause). The settings are read once, the generation checked
-- and the provisional receipt written (fence.enter, inlined).
-- TRUNCATE of a keyed table is refused to every fenced session that is
-- not a bypass member: it removes every job's rows, and no row trigger
-- sees them go.
create or replace function fence.backstop() returns trigger
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  v_key text collate pg_catalog."default" := pg_catalog.current_setting('fence.job_key', true);
  v_epoch_s text := pg_catalog.current_setting('fence.epoch', true);
  v_token_s text := pg_catalog.current_setting('fence.token', true);
  v_step text collate pg_catalog."default" := coalesce(pg_catalog.current_setting('fence.step', true), '');
  v_epoch bigint;
  v_token bigint;
  v_xid xid8;
  v_ours boolean;
  v_rel regclass;
begin
  if v_key is null or v_key = '' or v_epoch_s !~ '^\s*-?[0-9]{1,18}\s*$' or v_token_s !~ '^\s*-?[0-9]{1,18}\s*$'
     or v_epoch_s is null or v_token_s is null then
    perform fence.metadata(format('%s on protected table %I.%I', tg_op, tg_table_schema, tg_table_name)); -- raises FN008
  end if;
  v_epoch := trim(v_epoch_s)::bigint;
  v_token := trim(v_token_s)::bigint;
  if tg_op = 'TRUNCATE' then
    perform fence.refuse_truncate(tg_relid, v_key);
  end if;
  -- fence.enter, inlined (keep the two in step): the statement trigger
  -- runs for every write, twice for an upsert.
  v_xid := pg_catalog.pg_current_xact_id();
  select r.job_key is not null into v_ours
    from fence.fences fe
    left join fence.receipts r
      on r.job_key = fe.job_key and r.epoch = v_epoch and r.token = v_token and r.step = v_step
   where fe.job_key = v_key and fe.epoch = v_epoch and fe.max_issued_token = v_token
     and fe.retired_at is null and fe.owner_role = session_user
     and (r.job_key is null or r.backstop_xid = v_xid)
     for update of fe;
  if found then
    if v_ours then
      return null;
    end if;
    insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version, backstop_xid)
    values (v_key, v_epoch, v_token, v_step, sha256(convert_to(coalesce(current_query(), ''), 'UTF8')), 'backstop-v1', v_xid)
    on conflict (job_key, epoch, token, step) do nothing;
    if found then
      if pg_catalog.current_setting('max_prepared_transactions') <> '0' then
        v_rel := pg_catalog.to_regclass('pg_temp.pgfence_no_prepare');
        if v_rel is null then
          perform fence.refuse_prepare();
        else
          perform pg_catalog.pg_get_replica_identity_index(v_rel);
        end if;
      end if;
      return null;
    end if;
  end if;
  perform fence.gate_slow(v_key, v_epoch, v_token, v_step);
  return null;
end
$$;

-- backstop_rows: the AFTER statement triggers pgfence_job_key_insert,
-- _update and _delete of a keyed member (argument: the job-key column),
-- with the statement's rows in the transition tables pgfence_new and
-- pgfence_old. The settings are read once; that generation is verified
-- here (this transaction's receipt of it, which only a check of the
-- generation under the fence row's lock writes, or fence.enter's check
-- now) and every row of the
-- statement, old and new, must carry its job key, compared as bytes: the
-- value cast to text (a domain's or varchar's base, char's without
-- padding) under COLLATE "C", so no collation of the column makes two
-- keys equal. Whatever code ran during the statement, its rows are judged
-- against one read verified in this function. A session without metadata
-- is exempt only as a bypass member (the BEFORE trigger refused everyone
-- else already; code that cleared the settings during the statement is
-- refused here).
--
-- The column is part of the query, and a query planned for each statement
-- (EXECUTE) cost more than the rest of the check, so the function is made
-- once per job-key column name, with the column in static SQL whose plan
-- PL/pgSQL keeps (per trigger): fence.backstop_rows_<md5 of the name>.
-- It is a definer function, so it converts no row (to_jsonb would call a
-- cast to json a client made for a composite column's type); it runs only
-- pg_catalog's cast to text and operator.
create function fence.job_key_function_name(p_column text) returns name
language sql immutable
set search_path = pg_catalog
as $$
  select ('backstop_rows_' || md5(p_column))::name
$$;

create function fence.job_key_function(p_column text) returns regprocedure
language plpgsql
set search_path = pg_catalog, fence
as $f$
declare
  v_name name := fence.job_key_function_name(p_column);
  v regprocedure := pg_catalog.to_regprocedure(format('fence.%I()', v_name));
begin
  if v is not null then
    return v;
  end if;
  execute format($body$
create function fence.%1$I() returns trigger
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
-- The job-key check of column %2$I (fence.job_key_function, migration 011).
declare
  v_key text collate pg_catalog."default" := pg_catalog.current_setting('fence.job_key', true);
  v_epoch_s text := pg_catalog.current_setting('fence.epoch', true);
  v_token_s text := pg_catalog.current_setting('fence.token', true);
  v_step text collate pg_catalog."default" := coalesce(pg_catalog.current_setting('fence.step', true), '');
  v_epoch bigint;
  v_token bigint;
  v_rows boolean;
  v_bad boolean;
  v_row text;
begin
  if tg_op = 'INSERT' then
    select true, bool_or(not coalesce((n.%2$I::pg_catalog.text collate pg_catalog."C") operator(pg_catalog.=) v_key, false)),
           min(n.%2$I::pg_catalog.text) filter (where not coalesce((n.%2$I::pg_catalog.text collate pg_catalog."C") operator(pg_catalog.=) v_key, false))
      into v_rows, v_bad, v_row from pgfence_new n;
  elsif tg_op = 'DELETE' then
    select true, bool_or(not coalesce((o.%2$I::pg_catalog.text collate pg_catalog."C") operator(pg_catalog.=) v_key, false)),
           min(o.%2$I::pg_catalog.text) filter (where not coalesce((o.%2$I::pg_catalog.text collate pg_catalog."C") operator(pg_catalog.=) v_key, false))
      into v_rows, v_bad, v_row from pgfence_old o;
  else
    select true, bool_or(not coalesce((x.v collate pg_catalog."C") operator(pg_catalog.=) v_key, false)),
           min(x.v) filter (where not coalesce((x.v collate pg_catalog."C") operator(pg_catalog.=) v_key, false))
      into v_rows, v_bad, v_row
      from (select n.%2$I::pg_catalog.text as v from pgfence_new n
            union all select o.%2$I::pg_catalog.text from pgfence_old o) x;
  end if;
  if v_rows is not true then
    return null; -- no rows (an upsert whose rows all conflicted fires the insert trigger too)
  end if;
  if v_key is null or v_key = '' or v_epoch_s is null or v_token_s is null
     or v_epoch_s !~ '^\s*-?[0-9]{1,18}\s*$' or v_token_s !~ '^\s*-?[0-9]{1,18}\s*$' then
    if coalesce(v_key, '') = '' and fence.definer_bypass() then
      return null;
    end if;
    -- (Reads the settings again only to say which is missing: it raises.)
    perform fence.metadata(format('%%s on protected table %%I.%%I', tg_op, tg_table_schema, tg_table_name));
  end if;
  v_epoch := trim(v_epoch_s)::bigint;
  v_token := trim(v_token_s)::bigint;
  -- The generation read is verified when this transaction has its
  -- receipt: only fence.gate, the backstop or fence.enter wrote that,
  -- after checking the generation current and the caller's, with the
  -- fence row locked, and the lock is held as long as the receipt is (the
  -- same subtransaction wrote both). Else fence.enter checks it now.
  perform from fence.receipts r
   where r.job_key = v_key and r.epoch = v_epoch and r.token = v_token and r.step = v_step
     and r.backstop_xid = pg_catalog.pg_current_xact_id();
  if not found then
    if fence.enter(v_key, v_epoch, v_token, v_step) = 'replay' then
      return null; -- nothing of this transaction can commit
    end if;
  end if;
  if v_bad then
    raise exception 'fencing required: %% of a row with %%.%% = %% on %%.%%, but this session is fenced for job "%%"',
        tg_op, quote_ident(tg_table_name), %3$L, coalesce(quote_literal(v_row), 'NULL'),
        quote_ident(tg_table_schema), quote_ident(tg_table_name), v_key
      using errcode = 'FN008',
            hint = %4$L;
  end if;
  return null;
end
$$
$body$, v_name, p_column, quote_ident(p_column),
    format('a fenced session may only write rows whose %s is its own fence.job_key', p_column));
  execute format('grant execute on function fence.%I() to public', v_name);
  return pg_catalog.to_regprocedure(format('fence.%I()', v_name));
end
$f$;

-- gate: as in 006, and the gate is the transaction's first fenced write:
-- in one statement it locks the fence row (only a current generation of
-- the caller's with no receipt yet) and writes the provisional receipt.
-- Anything else — a receipt (this transaction's, or a replay), another
-- role's or an old generation, an administrator — is gate_slow's.
create or replace function fence.gate(job_key text, epoch bigint, token bigint, step text default '') returns text
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
declare
  v_key text collate pg_catalog."default" := gate.job_key;
  v_step text collate pg_catalog."default" := coalesce(gate.step, '');
  v_rel regclass;
begin
  if gate.job_key is null or gate.epoch is null or gate.token is null then
    raise exception 'fence.gate needs a job key, an epoch and a token (got %, %, %)',
        coalesce(gate.job_key, 'null'), coalesce(gate.epoch::text, 'null'), coalesce(gate.token::text, 'null')
      using errcode = '22023';
  end if;
  insert into fence.receipts as rc (job_key, epoch, token, step, payload_digest, digest_version, backstop_xid)
  select v_key, gate.epoch, gate.token, v_step, sha256(convert_to(coalesce(current_query(), ''), 'UTF8')),
         'backstop-v1', pg_catalog.pg_current_xact_id()
    from fence.fences fe
   where fe.job_key = v_key and fe.epoch = gate.epoch and fe.max_issued_token = gate.token
     and fe.retired_at is null and fe.owner_role = session_user
     and not exists (select 1 from fence.receipts r
                      where r.job_key = v_key and r.epoch = gate.epoch and r.token = gate.token and r.step = v_step)
     for update of fe
  on conflict (job_key, epoch, token, step) do nothing;
  if found then
    -- fence.refuse_prepare, its common case inlined.
    if pg_catalog.current_setting('max_prepared_transactions') <> '0' then
      v_rel := pg_catalog.to_regclass('pg_temp.pgfence_no_prepare');
      if v_rel is null then
        perform fence.refuse_prepare();
      else
        perform pg_catalog.pg_get_replica_identity_index(v_rel);
      end if;
    end if;
    return 'ok';
  end if;
  return fence.gate_slow(v_key, gate.epoch, gate.token, v_step);
end
$$;

-- receipt_answer raises fence.commit's answer for a receipt rc that is
-- not this transaction's: the same payload, or a digest of another kind
-- (009), is a replay (FN00R); another payload a conflict (FN003).
create function fence.receipt_answer(rc fence.receipts, p_digest bytea, p_version text) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  if rc.payload_digest = p_digest and rc.digest_version = p_version
     or (rc.digest_version = 'backstop-v1') <> (p_version = 'backstop-v1') then
    raise exception 'job "%": epoch % token % step "%" already committed at % with the same payload: idempotent replay',
        rc.job_key, rc.epoch, rc.token, rc.step, rc.committed_at
      using errcode = 'FN00R',
            detail = 'the first commit stands; this transaction is rolled back so nothing is applied twice',
            hint = 'treat this as success';
  end if;
  raise exception 'job "%": epoch % token % step "%" already committed at % with a different payload (stored digest %/%, presented %/%)',
      rc.job_key, rc.epoch, rc.token, rc.step, rc.committed_at,
      rc.digest_version, encode(rc.payload_digest, 'hex'), p_version, encode(p_digest, 'hex')
    using errcode = 'FN003',
          hint = 'the first result stands and this one was rolled back; a changed result needs a new token (or a different step)';
end
$$;

-- commit_slow: the rest of fence.commit when its one UPDATE found no
-- receipt of this transaction under a current generation of the caller's.
-- Order as in gate_slow: whose generation (a non-owner learns nothing
-- else), the receipt (this transaction's takes the digest; another's is a
-- replay or a conflict; no lock), then the generation, locked only when
-- current and usable by the caller.
create or replace function fence.commit_slow(p_job_key text, p_epoch bigint, p_token bigint, p_step text, p_digest bytea, p_version text)
returns text
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v_key text collate pg_catalog."default" := p_job_key;
  v_step text collate pg_catalog."default" := p_step;
  v_xid xid8 := pg_catalog.pg_current_xact_id();
  v_admin boolean := fence.is_admin();
  rc fence.receipts;
  v_ours boolean;
begin
  if not v_admin and not exists (select 1 from fence.issuance i
                                  where i.token = p_token and i.job_key = v_key and i.epoch = p_epoch
                                    and (i.role is null or i.role = session_user)) then
    perform fence.refuse_generation(v_key, p_epoch, p_token, false);
  end if;
  select * into rc from fence.receipts r
   where r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step;
  v_ours := found;
  if v_ours and rc.backstop_xid is distinct from v_xid then
    perform fence.receipt_answer(rc, p_digest, p_version);
  end if;
  perform 1 from fence.fences fe
   where fe.job_key = v_key and fe.epoch = p_epoch and fe.max_issued_token = p_token and fe.retired_at is null
     and (fe.owner_role is null or fe.owner_role = session_user or v_admin)
     for update of fe;
  if not found then
    perform fence.refuse_generation(v_key, p_epoch, p_token, v_admin);
    raise exception 'job "%": token % belongs to another role; committing under it needs the role that acquired the lease', v_key, p_token
      using errcode = 'FN011';
  end if;
  if v_ours then
    update fence.receipts r
       set payload_digest = p_digest, digest_version = p_version
     where r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step;
    return 'committed';
  end if;
  insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version, backstop_xid)
  values (v_key, p_epoch, p_token, v_step, p_digest, p_version, v_xid)
  on conflict (job_key, epoch, token, step) do nothing;
  if not found then
    -- Committed by another transaction of this generation while this one
    -- waited for the fence row (READ COMMITTED).
    select * into rc from fence.receipts r
     where r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step;
    perform fence.receipt_answer(rc, p_digest, p_version);
  end if;
  return 'committed';
end
$$;

-- commit: the receipt this transaction wrote at its first fenced write
-- (fence.gate or the backstop) takes the presented digest: one UPDATE,
-- when the generation is still current and the caller's (this
-- transaction holds its fence row since it wrote the receipt). Anything
-- else is commit_slow's.
create or replace function fence.commit(job_key text, epoch bigint, token bigint, step text, digest bytea, digest_version text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
declare
  v_key text collate pg_catalog."default" := commit.job_key;
  v_step text collate pg_catalog."default" := coalesce(commit.step, '');
begin
  if commit.job_key is null or commit.epoch is null or commit.token is null then
    raise exception 'fence.commit needs a job key, an epoch and a token (got %, %, %)',
        coalesce(commit.job_key, 'null'), coalesce(commit.epoch::text, 'null'), coalesce(commit.token::text, 'null')
      using errcode = '22023';
  end if;
  if commit.digest is null or commit.digest_version is null or commit.digest_version = '' then
    raise exception 'job "%": fence.commit needs a payload digest and its version', commit.job_key
      using errcode = '22023';
  end if;
  update fence.receipts r
     set payload_digest = commit.digest, digest_version = commit.digest_version
   where r.job_key = v_key and r.epoch = commit.epoch and r.token = commit.token and r.step = v_step
     and r.backstop_xid = pg_catalog.pg_current_xact_id_if_assigned()
     and exists (select 1 from fence.fences fe
                  where fe.job_key = v_key and fe.epoch = commit.epoch and fe.max_issued_token = commit.token
                    and fe.retired_at is null and fe.owner_role = session_user);
  if found then
    return 'committed';
  end if;
  return fence.commit_slow(v_key, commit.epoch, commit.token, v_step, commit.digest, commit.digest_version);
end
$$;

-- commit_if_written: fence.commit when this transaction wrote under the
-- generation (its own receipt) or entered replay mode for it (its replay
-- guard); 'none' otherwise.
create or replace function fence.commit_if_written(job_key text, epoch bigint, token bigint, step text, digest bytea, digest_version text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
declare
  v_key text collate pg_catalog."default" := commit_if_written.job_key;
  v_step text collate pg_catalog."default" := coalesce(commit_if_written.step, '');
  v_xid xid8 := pg_catalog.pg_current_xact_id_if_assigned();
begin
  -- A transaction without an id has written nothing (a receipt or a
  -- replay guard assigns one).
  if v_xid is null then
    return 'none';
  end if;
  if exists (select 1 from fence.receipts r
              where r.job_key = v_key and r.epoch = commit_if_written.epoch
                and r.token = commit_if_written.token and r.step = v_step and r.backstop_xid = v_xid)
     or exists (select 1 from fence.replay_guards g
                 where g.xid = v_xid and g.job_key = v_key and g.epoch = commit_if_written.epoch
                   and g.token = commit_if_written.token and g.step = v_step) then
    return fence.commit(v_key, commit_if_written.epoch, commit_if_written.token, v_step,
                        commit_if_written.digest, commit_if_written.digest_version);
  end if;
  return 'none';
end
$$;

-- The trigger set. install_backstop puts on one member: the two BEFORE
-- statement triggers (backstop, backstop_nometa), on a member that stores
-- rows the pgfence_replay row trigger, and, with a job-key column, on
-- every member (a statement names any member, and PostgreSQL fires
-- statement triggers only on the table it names) the three AFTER
-- statement triggers with transition tables (a trigger with transition
-- tables may have one event only). Run inside own_ddl_begin/own_ddl_end.
create or replace function fence.install_backstop(rel regclass, p_kind "char", p_column text) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
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
  end if;
  if p_column is not null then
    perform fence.install_job_key(rel, p_column);
  end if;
end
$$;

create function fence.install_job_key(rel regclass, p_column text) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v_fn text;
begin
  perform fence.job_key_function(p_column);
  v_fn := format('fence.%I', fence.job_key_function_name(p_column));
  execute format('create trigger pgfence_job_key_insert after insert on %s referencing new table as pgfence_new '
                 'for each statement execute function %s(%L)', rel, v_fn, p_column);
  execute format('create trigger pgfence_job_key_update after update on %s referencing old table as pgfence_old new table as pgfence_new '
                 'for each statement execute function %s(%L)', rel, v_fn, p_column);
  execute format('create trigger pgfence_job_key_delete after delete on %s referencing old table as pgfence_old '
                 'for each statement execute function %s(%L)', rel, v_fn, p_column);
end
$$;

create or replace function fence.uninstall_backstop(rel regclass) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  execute format('drop trigger if exists pgfence_backstop on %s', rel);
  execute format('drop trigger if exists pgfence_backstop_nometa on %s', rel);
  execute format('drop trigger if exists pgfence_job_key on %s', rel); -- (before 011)
  execute format('drop trigger if exists pgfence_job_key_insert on %s', rel);
  execute format('drop trigger if exists pgfence_job_key_update on %s', rel);
  execute format('drop trigger if exists pgfence_job_key_delete on %s', rel);
  execute format('drop trigger if exists pgfence_replay on %s', rel);
end
$$;

-- backstop_problem (see 007): the job-key triggers are the three AFTER
-- statement triggers, on every member of a keyed tree, each with its
-- event, its transition tables and the job-key column as its argument.
create or replace function fence.backstop_problem(p fence.protected_tables) returns text
language plpgsql stable
set search_path = pg_catalog, fence
as $$
declare
  v_kind "char";
  v_schema name;
  v_name name;
  v_owner oid;
  v text;
  v_keyed boolean := p.job_key_column is not null;
  v_args bytea := convert_to(coalesce(p.job_key_column, ''), pg_catalog.getdatabaseencoding()) || decode('00', 'hex');
  v_rows oid := coalesce(pg_catalog.to_regprocedure(format('fence.%I()', fence.job_key_function_name(coalesce(p.job_key_column, '')))), 0);
begin
  select c.relkind, n.nspname, c.relname, c.relowner into v_kind, v_schema, v_name, v_owner
    from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
   where c.oid = p.relid;
  -- tgtype bits: 1 row, 2 before, 4 insert, 8 delete, 16 update, 32 truncate.
  select string_agg(format('%s its trigger %s', case when t.oid is null then 'drop'
                                                     when t.tgfoid <> e.fn or t.tgtype <> e.typ
                                                          or e.args is not null and (t.tgnargs <> 1 or t.tgargs <> e.args
                                                               or t.tgoldtable is distinct from e.old or t.tgnewtable is distinct from e.new)
                                                          then 'replace'
                                                     when t.tgenabled = 'D' then 'disable'
                                                     else 'change the firing mode of' end, e.name), ', ')
    into v
    from (values ('pgfence_backstop', 'fence.backstop()'::regprocedure::oid, 2|4|8|16|32, true, null::bytea, null::name, null::name),
                 ('pgfence_backstop_nometa', 'fence.backstop_nometa()'::regprocedure, 2|4|8|16|32, true, null, null, null),
                 ('pgfence_replay', 'fence.replay_skip()'::regprocedure, 1|2|4|8|16, v_kind = 'r', null, null, null),
                 ('pgfence_job_key_insert', v_rows, 4, v_keyed, v_args, null, 'pgfence_new'),
                 ('pgfence_job_key_update', v_rows, 16, v_keyed, v_args, 'pgfence_old', 'pgfence_new'),
                 ('pgfence_job_key_delete', v_rows, 8, v_keyed, v_args, 'pgfence_old', null))
           e(name, fn, typ, wanted, args, old, new)
    left join pg_catalog.pg_trigger t on t.tgrelid = p.relid and t.tgname = e.name
   where e.wanted and (t.oid is null or t.tgfoid <> e.fn or t.tgtype <> e.typ or t.tgenabled <> 'O'
                       or e.args is not null and (t.tgnargs <> 1 or t.tgargs <> e.args
                            or t.tgoldtable is distinct from e.old or t.tgnewtable is distinct from e.new));
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

-- The upgrade, in place: every keyed member of every protected tree
-- loses the per-row job-key trigger and gets the three statement
-- triggers (the DDL guard lets pgfence's own DDL pass: fence.own_ddl).
-- The statement triggers, the replay trigger and every receipt stay.
do $$
declare
  p record;
  v_mine boolean := fence.own_ddl_begin();
begin
  for p in select q.relid, q.job_key_column from fence.protected_tables q
            where q.job_key_column is not null
              and exists (select 1 from pg_catalog.pg_class c where c.oid = q.relid) loop
    execute format('drop trigger if exists pgfence_job_key on %s', p.relid);
    perform fence.install_job_key(p.relid, p.job_key_column);
  end loop;
  perform fence.own_ddl_end(v_mine);
end
$$;
drop function fence.backstop_row();

revoke all on function fence.definer_bypass(), fence.refuse_prepare(), fence.refuse_generation(text, bigint, bigint, boolean),
  fence.replay_mode(text, bigint, bigint, text), fence.enter(text, bigint, bigint, text),
  fence.metadata(text), fence.refuse_truncate(regclass, text), fence.job_key_function(text), fence.job_key_function_name(text), fence.receipt_answer(fence.receipts, bytea, text), fence.install_job_key(regclass, text)
  from public;
