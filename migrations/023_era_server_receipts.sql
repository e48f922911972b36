-- Issue 30 (attack round 10, S-H1, S-H2, S-M1): an era's floor is never
-- one another server may have seen, and a receipt is this transaction's
-- only if this postmaster wrote it. docs/security.md ("Failover and
-- eras") describes the defence.
--
-- 1. (S-H1) setval is not transactional: a settling transaction or an
--    administrator's fence.new_era that rolls back leaves its floor in
--    fence.era_pending_seq and fence.token_seq, and the WAL of both
--    streams to the standbys. 022's era_begin reused the pending floor
--    on any server that had no era with it, so a standby promoted later
--    took exactly the floor the old primary, its token_seq moved there,
--    was issuing from: one generation on both branches. Now the pending
--    floor is reused only by the server that drew it: fence.era_pending_key_seq
--    holds a key of the drawing server (system identifier, timeline and
--    postmaster start), set before the floor, and era_begin reuses the
--    pending floor only when the key is its own, nothing was drawn above
--    it, and no era has it. Otherwise every era's floors (automatic ones
--    too) are above token_seq's and epoch_seq's last_value, what this
--    history's WAL shows was drawn, plus a fresh random offset. The
--    climb stays bounded on one server: its rolled-back settles reuse one
--    floor (a standby never drew one: it is read-only).
--
-- 2. (S-H2, S-M1) A receipt was recognised as the transaction's own by
--    backstop_xid alone. A logical copy (pg_dump, pg_restore) into
--    another cluster carries the receipts, and the new cluster's xid
--    counter passes their ids again: a void holder whose transaction got
--    one of its old receipts' ids skipped the era check and committed,
--    and another job's transaction on such an id was refused FN009.
--    fence.receipts.backstop_started now records the postmaster start of
--    the writing server (a column default; every receipt is inserted by
--    the fence's functions, which name no value for it), and every
--    own-receipt test compares it with pg_postmaster_start_time() as well
--    as the xid: a transaction never outlives its postmaster, and a copy
--    restored into another cluster runs under another postmaster (xid8's
--    epoch alone would not do: a new cluster starts at epoch 0). Receipts
--    written before this migration have none and are nobody's own (their
--    transactions have ended: the column's ACCESS EXCLUSIVE lock waits
--    for them). A promoted standby's xids continue the primary's, so no
--    receipt there has a later transaction's id.
--
-- Cost: one comparison of a column of the row the fast paths already
-- read (fence.enter, the backstop, fence.commit); 8 bytes a receipt; the
-- default's call at each receipt insert.

set local lock_timeout = '2s';
alter table fence.receipts add column backstop_started timestamptz;
alter table fence.receipts alter column backstop_started set default pg_catalog.pg_postmaster_start_time();
set local lock_timeout = 0;
comment on column fence.receipts.backstop_started is 'the postmaster start of the server that wrote the receipt: with backstop_xid, the writing transaction (a copy restored into another cluster reuses xids, never a postmaster)';

-- era_pending_key_seq: the server that drew fence.era_pending_seq's
-- floor (a hash of system identifier, timeline and postmaster start,
-- below 2^63; 0: none).
create sequence fence.era_pending_key_seq minvalue 0 start with 0;
revoke all on sequence fence.era_pending_key_seq from public;

create function fence.era_server_key() returns bigint
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  select pg_catalog.hashtextextended(pg_catalog.format('%s/%s/%s', s.system_identifier, fence.timeline(),
                                                        pg_catalog.pg_postmaster_start_time()), 23)
         operator(pg_catalog.&) 9223372036854775807::bigint operator(pg_catalog.|) 1::bigint
    from pg_catalog.pg_control_system() s
$$;
revoke all on function fence.era_server_key() from public;

-- era_begin, 022's with the floors above every number drawn (last_value)
-- for every era, and the pending floor reused only by the server that
-- drew it (above).
create or replace function fence.era_begin(p_sysid bigint, p_tl integer, p_reason text) returns fence.eras
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  prev fence.eras;
  e fence.eras;
  v_era integer;
  v_tokens bigint;
  v_epochs bigint;
  v_pending bigint;
  v_drawn bigint;
  v_key bigint := fence.era_server_key();
  v_reuse boolean;
  v_lossless boolean;
begin
  select * into prev from fence.eras x order by x.era desc limit 1;
  v_era := greatest(prev.era + 1, p_tl);
  v_tokens := greatest(v_era::bigint << 40, (select max(f.max_issued_token) from fence.fences f));
  v_drawn := (select s.last_value from fence.token_seq s);
  v_pending := (select s.last_value from fence.era_pending_seq s);
  v_reuse := p_reason is null and (select k.last_value from fence.era_pending_key_seq k) = v_key
             and v_pending > v_tokens and v_pending >= v_drawn and v_pending - v_tokens <= (1::bigint << 39)
             and not exists (select 1 from fence.eras x where x.token_floor = v_pending);
  if v_reuse then
    v_tokens := v_pending; -- drawn by an attempt at this era on this server that rolled back
  else
    v_tokens := greatest(v_tokens, v_drawn) + 1 + fence.era_offset();
    perform pg_catalog.setval('fence.era_pending_key_seq', v_key);
    perform pg_catalog.setval('fence.era_pending_seq', v_tokens);
  end if;
  -- The epochs: above every epoch drawn too, unless the tokens' floor is
  -- reused (then the attempt that rolled back drew this server's epochs:
  -- the token floor alone keeps the generations apart, and the epochs
  -- do not climb by a draw at each rollback).
  v_epochs := greatest(v_era::bigint << 40, (select max(x.epoch) from fence.epochs x),
                       case when not v_reuse then (select s.last_value from fence.epoch_seq s) end)
              + fence.era_offset();
  v_lossless := p_reason is null and prev.system_identifier = p_sysid and p_tl > prev.timeline
                and exists (select 1 from fence.settings s where s.name = 'failover_mode' and s.value = 'sync');
  begin
    insert into fence.eras (era, system_identifier, timeline, token_floor, valid_floor, lossless, reason)
    values (v_era, p_sysid, p_tl, v_tokens, case when v_lossless then prev.valid_floor else v_tokens end, v_lossless,
            case when p_reason is not null
                   then p_reason
                 when prev.system_identifier <> p_sysid
                   then format('another cluster (system identifier %s, was %s): a restored or copied database may lack the latest takeovers', p_sysid, prev.system_identifier)
                 when p_tl <= prev.timeline
                   then format('timeline %s after %s: an older history', p_tl, prev.timeline)
                 when v_lossless
                   then format('promotion (timeline %s to %s) with failover_mode sync: every acknowledged takeover is here', prev.timeline, p_tl)
                 else format('promotion (timeline %s to %s) with failover_mode async: a takeover may have been lost', prev.timeline, p_tl)
            end)
    on conflict do nothing
    returning * into e;
  exception when serialization_failure then
    e := null;
  end;
  if e.era is null then
    raise exception 'era % was made by another transaction after this transaction''s snapshot was taken', v_era
      using errcode = '40001',
            detail = 'the first transaction on a new server history makes its era; at REPEATABLE READ or SERIALIZABLE a transaction that began before cannot see it',
            hint = 'retry the transaction';
  end if;
  perform pg_catalog.setval('fence.token_seq', greatest(v_tokens, (select s.last_value from fence.token_seq s)));
  perform pg_catalog.setval('fence.epoch_seq', greatest(v_epochs, (select s.last_value from fence.epoch_seq s)));
  return e;
end
$$;

-- The functions that recognise this transaction's receipt, as 020 (and
-- 011 for fence.commit) left them, with backstop_started compared as
-- well as backstop_xid wherever a receipt is taken as this
-- transaction's: fence.refuse_switch, gate_slow, fence.enter, the
-- backstop, fence.gate, commit_slow, commit_if_written and fence.commit.

create or replace function fence.refuse_switch(p_job_key text, p_epoch bigint, p_token bigint, p_step text, p_xid xid8) returns void
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
   where r.backstop_xid = p_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time()
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
               where r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time()
                 and not (r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step))
      or exists (select 1 from fence.replay_guards g
                  where g.xid = v_xid
                    and not (g.job_key = v_key and g.epoch = p_epoch and g.token = p_token and g.step = v_step))) then
    perform fence.refuse_switch(v_key, p_epoch, p_token, v_step, v_xid);
  end if;
  select case when r.backstop_started = pg_catalog.pg_postmaster_start_time() then r.backstop_xid end into v_rx from fence.receipts r
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
    if v_entered and (exists (select 1 from fence.receipts r
                 where r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time()
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
    if v_entered and (exists (select 1 from fence.receipts r
                 where r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time()
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
               where r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time()
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
               where r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time()
                 and not (r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step))
      or exists (select 1 from fence.replay_guards g
                  where g.xid = v_xid
                    and not (g.job_key = v_key and g.epoch = p_epoch and g.token = p_token and g.step = v_step))) then
    perform fence.refuse_switch(v_key, p_epoch, p_token, v_step, v_xid);
  end if;
  select * into rc from fence.receipts r
   where r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step;
  v_ours := found;
  if v_ours and (rc.backstop_xid is distinct from v_xid or rc.backstop_started is distinct from pg_catalog.pg_postmaster_start_time()) then
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
                and r.token = commit_if_written.token and r.step = v_step and r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time())
     or exists (select 1 from fence.replay_guards g
                 where g.xid = v_xid and g.job_key = v_key and g.epoch = commit_if_written.epoch
                   and g.token = commit_if_written.token and g.step = v_step) then
    return fence.commit(v_key, commit_if_written.epoch, commit_if_written.token, v_step,
                        commit_if_written.digest, commit_if_written.digest_version);
  end if;
  -- (O-H1) Written, or in replay mode, under another generation or step.
  if (exists (select 1 from fence.receipts r
               where r.backstop_xid = v_xid and r.backstop_started = pg_catalog.pg_postmaster_start_time()
                 and not (r.job_key = v_key and r.epoch = commit_if_written.epoch and r.token = commit_if_written.token and r.step = v_step))
      or exists (select 1 from fence.replay_guards g
                  where g.xid = v_xid
                    and not (g.job_key = v_key and g.epoch = commit_if_written.epoch and g.token = commit_if_written.token and g.step = v_step))) then
    perform fence.refuse_switch(v_key, commit_if_written.epoch, commit_if_written.token, v_step, v_xid);
  end if;
  return 'none';
end
$$;


create or replace function fence.commit(job_key text, epoch bigint, token bigint, step text, digest bytea, digest_version text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
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
     and r.backstop_xid = pg_catalog.pg_current_xact_id_if_assigned() and r.backstop_started = pg_catalog.pg_postmaster_start_time()
     and exists (select 1 from fence.fences fe
                  where fe.job_key = v_key and fe.epoch = commit.epoch and fe.max_issued_token = commit.token
                    and fe.retired_at is null and fe.owner_role = session_user);
  if found then
    return 'committed';
  end if;
  return fence.commit_slow(v_key, commit.epoch, commit.token, v_step, commit.digest, commit.digest_version);
end
$$;

revoke all on function fence.refuse_switch(text, bigint, bigint, text, xid8) from public;

-- The job-key triggers (fence.job_key_function's template, migration 011,
-- and every function it generated, fence.backstop_rows_<md5>) take this
-- transaction's receipt of the settings they read as proof the
-- generation was checked, and skip fence.enter: the same own-receipt
-- test, so it compares backstop_started too. The one line is rewritten in
-- each definition (pg_get_functiondef keeps owner, grants, SECURITY
-- DEFINER and SET clauses under CREATE OR REPLACE); a definition without
-- the line is an error, not skipped.
do $$
declare
  v_old constant text := 'and r.backstop_xid = pg_catalog.pg_current_xact_id();';
  v_new constant text := 'and r.backstop_xid = pg_catalog.pg_current_xact_id() and r.backstop_started = pg_catalog.pg_postmaster_start_time();';
  f regprocedure;
  v_def text;
begin
  for f in select p.oid::regprocedure from pg_catalog.pg_proc p
            where p.pronamespace = 'fence'::regnamespace
              and (p.proname = 'job_key_function' or p.proname ~ '^backstop_rows_[0-9a-f]{32}$')
  loop
    v_def := pg_catalog.pg_get_functiondef(f);
    if pg_catalog.strpos(v_def, v_old) = 0 then
      raise exception 'migration 023: % has no own-receipt test to extend', f;
    end if;
    execute pg_catalog.replace(v_def, v_old, v_new);
  end loop;
end
$$;
