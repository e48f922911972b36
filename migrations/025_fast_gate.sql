-- Issue 33: the gated write's server work. docs/performance.md ("What
-- migration 025 changed") gives the measurements; no check is removed,
-- and every check still rests on what it rested on (docs/security.md).
--
-- PL/pgSQL runs each statement of a function through SPI: every call
-- pays the statement's plan lookup, executor start and end (about 5 us
-- here), whatever the statement finds; pg_stat_statements counts only
-- its run. So the fast paths below run fewer statements:
--
-- 1. fence.gate, fence.enter and the backstop asked "did this
--    transaction enter under another generation or step?" (O-H1) in one
--    condition, `v_xid is not null and (exists ... or exists ...)`. For
--    a transaction without an id (fence.gate at BEGIN, the backstop's
--    first write) the answer is known without looking, but the
--    condition was still a statement; and since its plan for a null id
--    folds to false, which is cheaper than any generic plan, the plan
--    cache planned it again at every call (pg_stat_statements: one plan
--    per call). Now the id is tested first, in PL/pgSQL, and the lookup
--    runs only for a transaction that has one, as before.
-- 2. fence.commit_if_written, when the transaction wrote no protected
--    table (every transaction of a session with a generation ends with
--    it through the proxy), ran two statements (this generation's
--    receipt or guard; another's) to answer 'none'. Now one statement
--    reads this transaction's receipts and replay guards, by their
--    transaction-id indexes, and says whether any is of the presented
--    generation and step and whether any is of another; the answers
--    are the same, in the same order (a receipt of this generation and
--    step: fence.commit; another: FN009; none: 'none').
-- 3. The trigger pgfence_backstop had a WHEN (fence.job_key set), and
--    PostgreSQL reads, plans and compiles a trigger's WHEN for every
--    statement that fires it. The backstop now has none: fence.backstop
--    returns at once when fence.job_key is empty, and
--    pgfence_backstop_nometa (unchanged, with its WHEN) refuses such a
--    write or lets a bypass role through, as before. A write without a
--    generation now calls fence.backstop once for nothing; a fenced one
--    no longer compiles the WHEN. Every protected table's trigger is
--    made again without the WHEN below (install_backstop makes new ones
--    so), with its firing mode kept.
--
-- Receipts are written and recognised as before (backstop_xid and
-- backstop_started, migration 023); the generation's checks, the fence
-- row's lock and the era check are the same statements as in 023.

-- 1. fence.gate, fence.enter and the backstop: the O-H1 lookup only for a
-- transaction that has an id (023's functions otherwise unchanged; the
-- backstop also returns at once without fence.job_key, item 3).

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
  -- nothing (a receipt or a replay guard gives it one): no lookup, and
  -- no statement (a condition that folds to false when planned for a
  -- null id was planned again at every call).
  if v_xid is not null then
    if exists (select 1 from fence.receipts r
                where r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time()
                  and not (r.job_key = v_key and r.epoch = gate.epoch and r.token = gate.token and r.step = v_step))
       or exists (select 1 from fence.replay_guards g
                   where g.xid = v_xid
                     and not (g.job_key = v_key and g.epoch = gate.epoch and g.token = gate.token and g.step = v_step)) then
      perform fence.refuse_switch(v_key, gate.epoch, gate.token, v_step, v_xid);
    end if;
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
     and (r.job_key is null or r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time())
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
    if v_entered then
      if exists (select 1 from fence.receipts r
                  where r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time()
                    and not (r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step))
         or exists (select 1 from fence.replay_guards g
                     where g.xid = v_xid
                       and not (g.job_key = v_key and g.epoch = p_epoch and g.token = p_token and g.step = v_step)) then
        perform fence.refuse_switch(v_key, p_epoch, p_token, v_step, v_xid);
      end if;
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
  -- (025) The trigger has no WHEN: without fence.job_key,
  -- pgfence_backstop_nometa refuses the write (or lets a bypass role
  -- through) by the same reading of the setting as its WHEN.
  if v_key is null or v_key = '' then
    return null;
  end if;
  if v_epoch_s !~ '^\s*-?[0-9]{1,18}\s*$' or v_token_s !~ '^\s*-?[0-9]{1,18}\s*$'
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
     and (r.job_key is null or r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time())
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
    if v_entered then
      if exists (select 1 from fence.receipts r
                  where r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time()
                    and not (r.job_key = v_key and r.epoch = v_epoch and r.token = v_token and r.step = v_step))
         or exists (select 1 from fence.replay_guards g
                     where g.xid = v_xid
                       and not (g.job_key = v_key and g.epoch = v_epoch and g.token = v_token and g.step = v_step)) then
        perform fence.refuse_switch(v_key, v_epoch, v_token, v_step, v_xid);
      end if;
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

-- 2. fence.commit_if_written: one statement for this transaction's
-- receipts and replay guards.

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
  v_same boolean;
  v_other boolean;
begin
  -- A transaction without an id has written nothing (a receipt or a
  -- replay guard assigns one).
  if v_xid is null then
    return 'none';
  end if;
  -- This transaction's receipts and replay guards, in one statement: of
  -- the presented generation and step (v_same), of another (v_other).
  select pg_catalog.bool_or(x.same), pg_catalog.bool_or(not x.same) into v_same, v_other
    from (select r.job_key = v_key and r.epoch = commit_if_written.epoch
                 and r.token = commit_if_written.token and r.step = v_step as same
            from fence.receipts r
           where r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time()
          union all
          select g.job_key = v_key and g.epoch = commit_if_written.epoch
                 and g.token = commit_if_written.token and g.step = v_step
            from fence.replay_guards g
           where g.xid = v_xid) x;
  if v_same then
    return fence.commit(v_key, commit_if_written.epoch, commit_if_written.token, v_step,
                        commit_if_written.digest, commit_if_written.digest_version);
  end if;
  -- (O-H1) Written, or in replay mode, under another generation or step.
  if v_other then
    perform fence.refuse_switch(v_key, commit_if_written.epoch, commit_if_written.token, v_step, v_xid);
  end if;
  return 'none';
end
$$;

-- 3. pgfence_backstop without a WHEN: install_backstop (011's otherwise),
-- and every existing one made again, with its firing mode.
create or replace function fence.install_backstop(rel regclass, p_kind "char", p_column text) returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
begin
  execute format('create trigger pgfence_backstop before insert or update or delete or truncate on %s '
                 'for each statement execute function fence.backstop()', rel);
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

-- A table a transaction in flight has written waits for it (DROP TRIGGER
-- takes the table's ACCESS EXCLUSIVE lock); after lock_timeout the
-- migration is rolled back and tried again (migrations.Apply), so that
-- writes queued behind the lock request wait no longer than that.
set local lock_timeout = '2s';
do $$
declare
  t record;
  v_mine boolean := fence.own_ddl_begin();
begin
  for t in select tg.tgrelid::regclass as rel, tg.tgenabled
             from pg_catalog.pg_trigger tg
            where tg.tgname = 'pgfence_backstop' and tg.tgfoid = 'fence.backstop()'::regprocedure
              and tg.tgqual is not null
            order by tg.tgrelid loop
    execute format('drop trigger pgfence_backstop on %s', t.rel);
    execute format('create trigger pgfence_backstop before insert or update or delete or truncate on %s '
                   'for each statement execute function fence.backstop()', t.rel);
    if t.tgenabled <> 'O' then
      execute format('alter table %s %s trigger pgfence_backstop', t.rel,
                     case t.tgenabled when 'D' then 'disable' when 'R' then 'enable replica' else 'enable always' end);
    end if;
  end loop;
  perform fence.own_ddl_end(v_mine);
end
$$;
set local lock_timeout = 0;
