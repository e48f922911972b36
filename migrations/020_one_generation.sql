-- Issue 30 (attack round 8, O-H1): one transaction, one generation and
-- one step. docs/security.md ("Every fenced write ends with a receipt")
-- describes the defence.
--
-- Code the proxy cannot see into (a function called in a query, a
-- trigger, a column default, a view, an operator, a cast) may call
-- set_config and change fence.step, fence.job_key, fence.epoch or
-- fence.token. The proxy's gate and receipt ran under the settings it
-- believed, the backstop under the server's: two receipts for one
-- transaction, and a later genuine write under the believed step was
-- refused FN003. Code that sets the settings transaction-locally, writes
-- and puts them back within one statement did the same with the backstop
-- alone, and so did a worker that called fence.gate by hand and then
-- changed a setting. Comparing settings at COMMIT catches none of the
-- put-back cases, and the proxy cannot see into the code.
--
-- So the database keeps what the transaction was entered under: the
-- first gate, backstop write, fence.enter or commit of a transaction
-- writes its receipt (or, for a replay, its replay guard) with the
-- transaction's id, backstop_xid (xid), which no client code can write.
-- Every later gate, backstop write, fence.enter, fence.commit or
-- fence.commit_if_written of the same transaction under another job,
-- epoch, token or step is refused with FN009 (fence.refuse_switch), so
-- the transaction rolls back and never has two receipts. A subtransaction
-- rolled back takes its receipt with it, and the transaction may enter
-- again; a new transaction may use a new step.
--
-- Cost: the lookup runs only where a transaction enters (writes its
-- receipt) and already had an id before: a transaction whose first write
-- is the gate or a protected write (a lone write, BEGIN then the write)
-- has none, and pays one call of pg_current_xact_id_if_assigned. A
-- transaction that wrote something else first pays two index probes, on
-- fence.receipts (backstop_xid), the index added here, and on
-- fence.replay_guards (xid), in the caller's own IF (a call of a function
-- with a pinned search_path cost about twice the probes, so
-- fence.refuse_switch only raises). Every receipt adds one entry to the
-- new index.
--
-- (Written as 021 for issue 30; numbered 020 on its branch, where 020 is
-- free: tern wants no gap.)
--
-- The index needs fence.receipts' SHARE lock, which waits for every
-- transaction that wrote a receipt and makes every later one wait behind
-- it: give up after a moment instead (55P03), and Apply tries again
-- (migrations.go, lockRetries), as 019 does.
set local lock_timeout = '2s';
create index receipts_backstop_xid_idx on fence.receipts (backstop_xid);
set local lock_timeout = 0;

-- refuse_switch raises FN009 when transaction p_xid has a receipt or a
-- replay guard under another generation or step than the one presented.
create function fence.refuse_switch(p_job_key text, p_epoch bigint, p_token bigint, p_step text, p_xid xid8) returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_key text collate pg_catalog."default" := p_job_key;
  v_step text collate pg_catalog."default" := coalesce(p_step, '');
  e record;
begin
  select r.job_key, r.epoch, r.token, r.step into e
    from fence.receipts r
   where r.backstop_xid = p_xid
     and not (r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step)
   limit 1;
  if not found then
    select g.job_key, g.epoch, g.token, g.step into e
      from fence.replay_guards g
     where g.xid = p_xid
       and not (g.job_key = v_key and g.epoch = p_epoch and g.token = p_token and g.step = v_step)
     limit 1;
    if not found then
      return;
    end if;
  end if;
  raise exception 'job "%": a fenced write or commit under epoch % token % step "%" in a transaction that already wrote under job "%" epoch % token % step "%": fence settings changed inside the transaction by code pgfence could not see',
      v_key, p_epoch, p_token, v_step, e.job_key, e.epoch, e.token, e.step
    using errcode = 'FN009',
          detail = 'a transaction that writes protected tables has one generation and one step, and one receipt; a function, trigger, column default, view, operator or cast that calls set_config changed fence.job_key, fence.epoch, fence.token or fence.step after its first fenced write, and a write or commit under the new settings would give it a second receipt. The transaction is rolled back.',
          hint = 'set fence.step and the generation with SET (or SET LOCAL, or a set_config pgfence sees) before the transaction''s first write, not inside functions; use a new transaction for a new step or job';
end
$$;

-- The functions that enter a transaction or commit it, as 019 (and 011
-- for commit_if_written) left them, with the check: gate_slow and
-- commit_slow before the receipt lookup (after whose generation it is,
-- so a non-owner still learns nothing else); fence.gate before its
-- insert; fence.enter and the backstop (its inlined copy) before they
-- insert a receipt; commit_if_written before it answers 'none'.
-- fence.commit's fast path updates this transaction's receipt of the
-- presented generation and step, which exists only if it entered under
-- them. The job-key triggers (fence.job_key_function) call fence.enter
-- when the settings they read have no receipt of this transaction.

create or replace function fence.gate_slow(p_job_key text, p_epoch bigint, p_token bigint, p_step text) returns text
language plpgsql
set search_path = pg_catalog, fence, pg_temp
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
  -- (O-H1) One generation and one step per transaction.
  if (exists (select 1 from fence.receipts r
               where r.backstop_xid = v_xid
                 and not (r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step))
      or exists (select 1 from fence.replay_guards g
                  where g.xid = v_xid
                    and not (g.job_key = v_key and g.epoch = p_epoch and g.token = p_token and g.step = v_step))) then
    perform fence.refuse_switch(v_key, p_epoch, p_token, v_step, v_xid);
  end if;
  select r.backstop_xid into v_rx from fence.receipts r
   where r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step;
  v_ours := found;
  if v_ours and v_rx is distinct from v_xid then
    return fence.replay_mode(v_key, p_epoch, p_token, v_step);
  end if;
  perform fence.era_refuse(v_key, p_token);
  perform 1 from fence.fences fe
   where fe.job_key = v_key and fe.epoch = p_epoch and fe.max_issued_token = p_token and fe.retired_at is null
     and (fe.owner_role is null or fe.owner_role = session_user or v_admin)
     for update of fe;
  if not found then
    perform fence.refuse_generation(v_key, p_epoch, p_token, v_admin);
    raise exception 'job "%": token % belongs to another role; writing under it needs the role that acquired the lease', v_key, p_token
      using errcode = 'FN011';
  end if;
  -- The token is the fence row's and above the era's floor: record that
  -- this postmaster verified it, so the fast paths need no era lookup.
  update fence.fences fe set era_start = pg_catalog.pg_postmaster_start_time()
   where fe.job_key = v_key and fe.era_start is distinct from pg_catalog.pg_postmaster_start_time();
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

create or replace function fence.enter(p_job_key text, p_epoch bigint, p_token bigint, p_step text) returns text
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_key text collate pg_catalog."default" := p_job_key;
  v_step text collate pg_catalog."default" := p_step;
  v_xid xid8 := pg_catalog.pg_current_xact_id_if_assigned();
  v_entered boolean;
  v_ours boolean;
begin
  -- (O-H1) A transaction that had no id before this call has entered
  -- nothing (a receipt or a replay guard gives it one).
  v_entered := v_xid is not null;
  if not v_entered then
    v_xid := pg_catalog.pg_current_xact_id();
  end if;
  select r.job_key is not null into v_ours
    from fence.fences fe
    left join fence.receipts r
      on r.job_key = fe.job_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step
   where fe.job_key = v_key and fe.epoch = p_epoch and fe.max_issued_token = p_token
     and fe.retired_at is null and fe.owner_role = session_user
     and (r.job_key is null or r.backstop_xid = v_xid)
     -- The era: checked before this transaction's receipt was written, so
     -- not again once it is (an upsert fires the backstop twice).
     and (r.job_key is not null
          or fe.era_start = pg_catalog.pg_postmaster_start_time())
     for update of fe;
  if found then
    if v_ours then
      return 'ok';
    end if;
    -- (O-H1) Entered under another generation or step: FN009.
    if v_entered and (exists (select 1 from fence.receipts r
                 where r.backstop_xid = v_xid
                   and not (r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step))
        or exists (select 1 from fence.replay_guards g
                    where g.xid = v_xid
                      and not (g.job_key = v_key and g.epoch = p_epoch and g.token = p_token and g.step = v_step))) then
      perform fence.refuse_switch(v_key, p_epoch, p_token, v_step, v_xid);
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

create or replace function fence.backstop() returns trigger
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_key text collate pg_catalog."default" := pg_catalog.current_setting('fence.job_key', true);
  v_epoch_s text := pg_catalog.current_setting('fence.epoch', true);
  v_token_s text := pg_catalog.current_setting('fence.token', true);
  v_step text collate pg_catalog."default" := coalesce(pg_catalog.current_setting('fence.step', true), '');
  v_epoch bigint;
  v_token bigint;
  v_xid xid8;
  v_entered boolean;
  v_ours boolean;
  v_rel regclass;
begin
  if v_key is null or v_key = '' or v_epoch_s !~ '^\s*-?[0-9]{1,18}\s*$' or v_token_s !~ '^\s*-?[0-9]{1,18}\s*$'
     or v_epoch_s is null or v_token_s is null then
    perform fence.metadata(format('%s on protected table %I.%I', tg_op, tg_table_schema, tg_table_name)); -- raises FN008
  end if;
  v_epoch := trim(v_epoch_s)::bigint;
  v_token := trim(v_token_s)::bigint;
  -- (018) a step nobody set after a replayed COMMIT
  if pg_catalog.starts_with(v_step, 'pgfence:') then
    raise exception 'fencing required: % on protected table %.% under step "%": the step is not known after a replayed COMMIT', tg_op, tg_table_schema, tg_table_name, v_step
      using errcode = 'FN008',
            detail = 'pgfence answered a retried transaction as the replay of one that had committed, and rolled it back; what that transaction left for the session''s fence.step (a SET, or code that set it) is not known, so a write under an inherited step could be applied a second time',
            hint = 'set fence.step for this write (SET fence.step, SET LOCAL fence.step, or set_config), as the first attempt did';
  end if;
  if tg_op = 'TRUNCATE' then
    perform fence.refuse_truncate(tg_relid, v_key);
  end if;
  -- fence.enter, inlined (keep the two in step): the statement trigger
  -- runs for every write, twice for an upsert.
  -- (O-H1) A transaction that had no id before this write has entered
  -- nothing (a receipt or a replay guard gives it one).
  v_xid := pg_catalog.pg_current_xact_id_if_assigned();
  v_entered := v_xid is not null;
  if not v_entered then
    v_xid := pg_catalog.pg_current_xact_id();
  end if;
  select r.job_key is not null into v_ours
    from fence.fences fe
    left join fence.receipts r
      on r.job_key = fe.job_key and r.epoch = v_epoch and r.token = v_token and r.step = v_step
   where fe.job_key = v_key and fe.epoch = v_epoch and fe.max_issued_token = v_token
     and fe.retired_at is null and fe.owner_role = session_user
     and (r.job_key is null or r.backstop_xid = v_xid)
     -- The era: checked before this transaction's receipt was written, so
     -- not again once it is (an upsert fires the backstop twice).
     and (r.job_key is not null
          or fe.era_start = pg_catalog.pg_postmaster_start_time())
     for update of fe;
  if found then
    if v_ours then
      return null;
    end if;
    -- (O-H1) Entered under another generation or step: FN009.
    if v_entered and (exists (select 1 from fence.receipts r
                 where r.backstop_xid = v_xid
                   and not (r.job_key = v_key and r.epoch = v_epoch and r.token = v_token and r.step = v_step))
        or exists (select 1 from fence.replay_guards g
                    where g.xid = v_xid
                      and not (g.job_key = v_key and g.epoch = v_epoch and g.token = v_token and g.step = v_step))) then
      perform fence.refuse_switch(v_key, v_epoch, v_token, v_step, v_xid);
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

create or replace function fence.gate(job_key text, epoch bigint, token bigint, step text default '') returns text
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
#variable_conflict use_column
declare
  v_key text collate pg_catalog."default" := gate.job_key;
  v_step text collate pg_catalog."default" := coalesce(gate.step, '');
  v_rel regclass;
  v_xid xid8 := pg_catalog.pg_current_xact_id_if_assigned();
begin
  if gate.job_key is null or gate.epoch is null or gate.token is null then
    raise exception 'fence.gate needs a job key, an epoch and a token (got %, %, %)',
        coalesce(gate.job_key, 'null'), coalesce(gate.epoch::text, 'null'), coalesce(gate.token::text, 'null')
      using errcode = '22023';
  end if;
  -- (O-H1) A transaction that had no id before the gate has entered
  -- nothing (a receipt or a replay guard gives it one): no lookup.
  if v_xid is not null and (exists (select 1 from fence.receipts r
               where r.backstop_xid = v_xid
                 and not (r.job_key = v_key and r.epoch = gate.epoch and r.token = gate.token and r.step = v_step))
      or exists (select 1 from fence.replay_guards g
                  where g.xid = v_xid
                    and not (g.job_key = v_key and g.epoch = gate.epoch and g.token = gate.token and g.step = v_step))) then
    perform fence.refuse_switch(v_key, gate.epoch, gate.token, v_step, v_xid);
  end if;
  insert into fence.receipts as rc (job_key, epoch, token, step, payload_digest, digest_version, backstop_xid)
  select v_key, gate.epoch, gate.token, v_step, sha256(convert_to(coalesce(current_query(), ''), 'UTF8')),
         'backstop-v1', pg_catalog.pg_current_xact_id()
    from fence.fences fe
   where fe.job_key = v_key and fe.epoch = gate.epoch and fe.max_issued_token = gate.token
     and fe.retired_at is null and fe.owner_role = session_user
     and fe.era_start = pg_catalog.pg_postmaster_start_time()
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

create or replace function fence.commit_slow(p_job_key text, p_epoch bigint, p_token bigint, p_step text, p_digest bytea, p_version text)
returns text
language plpgsql
set search_path = pg_catalog, fence, pg_temp
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
  -- (O-H1) One generation and one step per transaction.
  if (exists (select 1 from fence.receipts r
               where r.backstop_xid = v_xid
                 and not (r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step))
      or exists (select 1 from fence.replay_guards g
                  where g.xid = v_xid
                    and not (g.job_key = v_key and g.epoch = p_epoch and g.token = p_token and g.step = v_step))) then
    perform fence.refuse_switch(v_key, p_epoch, p_token, v_step, v_xid);
  end if;
  select * into rc from fence.receipts r
   where r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step;
  v_ours := found;
  if v_ours and rc.backstop_xid is distinct from v_xid then
    perform fence.receipt_answer(rc, p_digest, p_version);
  end if;
  perform fence.era_refuse(v_key, p_token);
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

create or replace function fence.commit_if_written(job_key text, epoch bigint, token bigint, step text, digest bytea, digest_version text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
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
  -- (O-H1) Written, or in replay mode, under another generation or step.
  if (exists (select 1 from fence.receipts r
               where r.backstop_xid = v_xid
                 and not (r.job_key = v_key and r.epoch = commit_if_written.epoch and r.token = commit_if_written.token and r.step = v_step))
      or exists (select 1 from fence.replay_guards g
                  where g.xid = v_xid
                    and not (g.job_key = v_key and g.epoch = commit_if_written.epoch and g.token = commit_if_written.token and g.step = v_step))) then
    perform fence.refuse_switch(v_key, commit_if_written.epoch, commit_if_written.token, v_step, v_xid);
  end if;
  return 'none';
end
$$;

revoke all on function fence.refuse_switch(text, bigint, bigint, text, xid8) from public;
