-- Attack round 13 (Y-H1, Y-H2, Y-H3; HIGH in failover_mode sync): a
-- failover under failover_mode sync is lossless on the assumption that
-- every acknowledged takeover reached the synchronous standby, and
-- fence.durable (026) made that so with LOCAL settings
-- (synchronous_commit at least on, client_min_messages at most warning)
-- while the lease function runs. Code that runs later in the same
-- transaction can set them back before the commit: the table owner's
-- deferred trigger on another table the transaction writes
-- (set_config('synchronous_commit', 'off', true): the commit does not
-- wait; client_min_messages = error: a cancelled wait sends no WARNING),
-- or the SET clause of a function that wraps the lease call (it restores
-- the session's value, a role default the previous holder chose, when it
-- returns). The takeover was acknowledged without the standby, a failover
-- lost it while counting itself lossless, and the previous holder
-- committed on the new primary.
--
-- No setting of the takeover's transaction can be trusted, so its commit
-- is no longer relied on. In failover_mode sync a generation's first
-- write is refused until the takeover that issued it is confirmed on
-- enough synchronous standbys: a fact read at the write from
-- pg_stat_replication, which no worker can steer
-- (fence.confirm_takeover, called by fence.gate_slow, where fence.gate,
-- fence.enter and the backstop go when the generation is not yet
-- confirmed). If a failover loses the takeover, the new holder never
-- wrote (its first write was refused or waited): only the previous
-- holder's writes exist, in fencing order. Once the new generation has
-- been admitted to write, the standbys had its takeover, so the takeover
-- survives a failover to them and the previous holder is refused.
--
-- The confirmation (fence.confirm_takeover):
--
-- * Target: the primary's WAL insert position, read in a statement whose
--   snapshot shows the generation current and its issuing transaction
--   committed (visible, not this transaction's), so at or after the end
--   of the takeover's commit record even when that commit ran with
--   synchronous_commit = off; at an empty new page (a segment start +40,
--   a page start +24) the boundary, where the last record ended (as
--   proxy/lsn.go's insertLSNQuery).
-- * Confirmed when at least num_sync standbys of pg_stat_replication
--   (pg_stat_get_wal_senders, read afresh at each poll) in sync_state
--   'sync' or 'quorum' report flush_lsn >= target; num_sync
--   from synchronous_standby_names (fence.sync_standby_count: FIRST n
--   (...), ANY n (...), n (...); a plain list or '*' is 1). Empty: FN017
--   at once, there is nothing to confirm on.
-- * The target may lie past WAL that nobody flushes soon: this
--   transaction's own earlier records (a write before its first fenced
--   write), or another session's on the last, partial page of a quiet
--   server. The WAL writer flushes whole pages and asynchronous commits
--   only, and a walsender sends only flushed WAL. So when the primary's
--   flush position is still below the target after the first poll, the
--   wait writes one non-transactional logical message (prefix
--   'pgfence.confirm') up to the next page boundary: the page holding
--   the target is then whole, and the WAL writer flushes it within
--   wal_writer_delay (up to 25 times that while it hibernates on an idle
--   server; the rollback of a refused transaction that wrote wakes it,
--   so its retry is quick).
-- * Polls every 10 ms until the standbys have made no progress towards
--   the target for fence.settings 'confirm_timeout' (an interval; 2
--   seconds when unset, at most a minute), or for a minute in all, then
--   FN017: a standby catching up through WAL others wrote is waited for
--   as a synchronous commit waits (round 16, attacker AD's M1). Progress
--   is a higher flush_lsn or a higher sent_lsn: a standby receiving a
--   stream without pause reports no flush until the stream pauses.
--   gate_slow waits before it locks the fence row FOR UPDATE (the lock's
--   WAL record would lie below the target); a transaction that locked
--   the row before (a renewal in the same transaction) holds it while it
--   waits, and the previous holder and renewals of the job wait as long:
--   the wait is bounded for that reason too.
-- * Recorded in fence.confirmed_takeovers (one row per job, the latest
--   confirmed generation; only these functions write it), in the write's
--   transaction, so a generation waits once; if the transaction rolls
--   back, the next write confirms again (at once, the standbys have it).
-- * A takeover made in the same transaction as the write (the issuance
--   row's transaction is this one) cannot be confirmed before it
--   commits: FN017 at once; take the lease in a transaction of its own.
-- * A generation issued in an earlier era (token below the era's
--   token_floor), carried across a lossless promotion, is on this server
--   by definition, and every synchronous standby of this server streams
--   this server's history: confirmed without a wait. A generation issued
--   while failover_mode was async confirms on its first write after the
--   switch (set_failover_mode('sync') itself committed through the
--   standby, so the wait is one round trip).
--
-- Cost: in failover_mode async, one probe of fence.settings (primary key)
-- in the fast path's statement of fence.gate, and of fence.enter and the
-- backstop when they enter a transaction; nothing else. In sync mode, a
-- probe of fence.confirmed_takeovers more, and a generation's first write
-- waits for the standbys' flush (one round trip on a healthy standby).

create table fence.confirmed_takeovers (
  job_key      text primary key,
  epoch        bigint not null,
  token        bigint not null,
  lsn          pg_lsn,             -- the WAL position the standbys confirmed; null: carried from an earlier era
  confirmed_at timestamptz not null default clock_timestamp()
);
comment on table fence.confirmed_takeovers is 'per job, the latest generation whose takeover the synchronous standbys confirmed (failover_mode sync): its writes need no wait';
revoke all on fence.confirmed_takeovers from public;
grant select on fence.confirmed_takeovers to pgfence_bypass;

-- num_sync of synchronous_standby_names: FIRST n (...), ANY n (...),
-- n (...) give n; a plain list (or '*') is 1; empty is 0.
create function fence.sync_standby_count(p_names text) returns integer
language plpgsql
immutable
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  m text[];
begin
  if p_names is null or pg_catalog.btrim(p_names) operator(pg_catalog.=) '' then
    return 0;
  end if;
  m := pg_catalog.regexp_match(p_names, '^[[:space:]]*(?:(?:first|any)[[:space:]]+)?([0-9]+)[[:space:]]*[(]', 'i');
  if m is not null then
    return m[1]::integer;
  end if;
  return 1;
end
$$;
revoke all on function fence.sync_standby_count(text) from public;

-- The primary's WAL insert position, at an empty new page the boundary
-- (proxy/lsn.go's insertLSNQuery).
create function fence.confirm_target() returns pg_lsn
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_lsn pg_lsn := pg_catalog.pg_current_wal_insert_lsn();
  v_off numeric := v_lsn operator(pg_catalog.-) '0/0'::pg_lsn;
begin
  if v_off % pg_catalog.pg_size_bytes(pg_catalog.current_setting('wal_segment_size')) = 40 then
    return v_lsn operator(pg_catalog.-) 40::numeric;
  elsif v_off % pg_catalog.current_setting('wal_block_size')::numeric = 24 then
    return v_lsn operator(pg_catalog.-) 24::numeric;
  end if;
  return v_lsn;
end
$$;
revoke all on function fence.confirm_target() from public;

create function fence.confirm_takeover(p_job_key text, p_epoch bigint, p_token bigint) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_key text collate pg_catalog."default" := p_job_key;
  v_floor bigint;
  v_names text;
  v_need integer;
  v_got integer;
  v_target pg_lsn;
  v_timeout interval;
  v_start timestamptz;
  v_since timestamptz;
  v_pos pg_lsn;
  v_best pg_lsn;
  v_best_sent pg_lsn;
  v_sent pg_lsn;
  v_padded boolean := false;
  v_pad integer;
begin
  if not exists (select 1 from fence.settings s where s.name = 'failover_mode' and s.value = 'sync') then
    return;
  end if;
  if exists (select 1 from fence.confirmed_takeovers c
              where c.job_key = v_key and c.epoch = p_epoch and c.token = p_token) then
    return;
  end if;
  -- The takeover in this very transaction, in any of its subtransactions
  -- (a savepoint, a PL/pgSQL block with an EXCEPTION clause): the issuance
  -- row's xid is the top-level transaction's (pg_current_xact_id, its
  -- default), whichever subtransaction inserted it. (Round 16, attacker
  -- AD's H1: the row's xmin, a subtransaction's id, was taken for
  -- another transaction's, and the wait then confirmed a position before
  -- the takeover's commit.) Another transaction's takeover is visible
  -- only once committed.
  if exists (select 1 from fence.issuance i
              where i.token = p_token and i.job_key = v_key and i.epoch = p_epoch
                and i.xid = pg_catalog.pg_current_xact_id_if_assigned()) then
    raise exception 'job "%": token % was issued in this transaction: its first write must wait until the synchronous standby confirms the takeover, which it cannot before the takeover commits', v_key, p_token
      using errcode = 'FN017',
            detail = 'failover_mode is sync: a generation writes only once its takeover is on the synchronous standbys, so that a failover cannot lose a takeover whose generation wrote',
            hint = 'take the lease in a transaction of its own (commit fence.acquire), then write';
  end if;
  -- Issued in an earlier era and carried across a lossless promotion: on
  -- this server by definition, and on every standby streaming from it.
  select e.token_floor into v_floor
    from fence.era_checks c join fence.eras e on e.era = c.era
   where c.timeline = fence.timeline() and c.started_at = pg_catalog.pg_postmaster_start_time();
  if found and p_token < v_floor then
    insert into fence.confirmed_takeovers as c (job_key, epoch, token, lsn)
    values (v_key, p_epoch, p_token, null)
    on conflict (job_key) do update
       set epoch = excluded.epoch, token = excluded.token, lsn = excluded.lsn, confirmed_at = excluded.confirmed_at
     where c.token < excluded.token;
    return;
  end if;
  v_names := pg_catalog.current_setting('synchronous_standby_names');
  v_need := fence.sync_standby_count(v_names);
  if v_need < 1 then
    raise exception 'job "%": the takeover that issued token % cannot be confirmed: failover_mode is sync but no synchronous standby is configured (synchronous_standby_names is empty)', v_key, p_token
      using errcode = 'FN017',
            detail = 'a generation writes only once its takeover is on the synchronous standbys, so that a failover cannot lose a takeover whose generation wrote',
            hint = 'configure a synchronous standby (or fence.set_failover_mode(''async'')), then retry the write';
  end if;
  v_timeout := least(coalesce((select s.value::interval from fence.settings s where s.name = 'confirm_timeout'),
                               interval '2 seconds'), interval '1 minute');
  -- The target, read in the statement whose snapshot shows the generation
  -- current: the takeover committed (not in this transaction: above)
  -- before that snapshot, so its commit record ended before the insert
  -- position read after it. A generation no longer current is left to
  -- the caller, which refuses it under the fence row's lock.
  select fence.confirm_target() into v_target from fence.fences fe
   where fe.job_key = v_key and fe.epoch = p_epoch and fe.max_issued_token = p_token and fe.retired_at is null;
  if not found then
    return;
  end if;
  v_start := pg_catalog.clock_timestamp();
  v_since := v_start;
  -- Bounded: FN017 once the standbys have made no progress towards the
  -- target for v_timeout, and after a minute whatever they do. A standby
  -- that is still catching up (WAL written before the target by anyone:
  -- any role may write WAL, pg_logical_emit_message; round 16, attacker
  -- AD's M1) is waited for as a synchronous commit waits for it, not
  -- refused after v_timeout. gate_slow waits here before it locks the
  -- fence row; a transaction that locked it earlier holds it while it
  -- waits (the previous holder and renewals of the job wait as long).
  loop
    -- pg_stat_get_wal_senders, not the view pg_stat_replication: the view
    -- joins pg_stat_get_activity, whose snapshot is kept for the rest of
    -- the transaction, so a standby that connects during the wait would
    -- never show in it. v_pos: the position v_need of them have flushed.
    -- v_sent: the furthest any of them has been sent. A standby reports
    -- its flush position only when its receive socket runs dry: while WAL
    -- streams without a pause its flush_lsn stands still, but the
    -- walsender's sent_lsn moves (it cannot move far past what the
    -- standby takes: the socket's buffers fill).
    select pg_catalog.count(*) filter (where r.flush_lsn >= v_target)::integer,
           (select f.flush_lsn from pg_catalog.pg_stat_get_wal_senders() f
             where f.sync_state in ('sync', 'quorum') and f.flush_lsn is not null
             order by f.flush_lsn desc offset v_need - 1 limit 1),
           pg_catalog.max(r.sent_lsn)
      into v_got, v_pos, v_sent
      from pg_catalog.pg_stat_get_wal_senders() r
     where r.sync_state in ('sync', 'quorum');
    exit when v_got >= v_need;
    if v_pos is not null and (v_best is null or v_pos > v_best) then
      v_best := v_pos;
      v_since := pg_catalog.clock_timestamp();
    end if;
    if v_sent is not null and (v_best_sent is null or v_sent > v_best_sent) then
      v_best_sent := v_sent;
      v_since := pg_catalog.clock_timestamp();
    end if;
    if pg_catalog.clock_timestamp() - v_since >= v_timeout
       or pg_catalog.clock_timestamp() - v_start >= greatest(v_timeout, interval '1 minute') then
      raise exception 'job "%": the takeover that issued token % is not yet confirmed by the synchronous standby (% of % at WAL position % within %): a failover could lose it', v_key, p_token, v_got, v_need, v_target, pg_catalog.clock_timestamp() - v_start
        using errcode = 'FN017',
              detail = 'failover_mode is sync: a generation writes only once its takeover is on the synchronous standbys (pg_stat_replication), so that a failover cannot lose a takeover whose generation wrote; nothing was written',
              hint = 'retry the write, or acquire again; if it persists, check the synchronous standby (pg_stat_replication on the primary)';
    end if;
    -- WAL below the target that nobody flushes soon: make its page whole.
    if not v_padded and pg_catalog.pg_current_wal_flush_lsn() < v_target then
      v_pad := (pg_catalog.current_setting('wal_block_size')::numeric
                - (pg_catalog.pg_current_wal_insert_lsn() operator(pg_catalog.-) '0/0'::pg_lsn)
                  % pg_catalog.current_setting('wal_block_size')::numeric)::integer;
      perform pg_catalog.pg_logical_emit_message(false, 'pgfence.confirm', pg_catalog.repeat('0', v_pad));
      v_padded := true;
    end if;
    perform pg_catalog.pg_sleep(0.01);
  end loop;
  insert into fence.confirmed_takeovers as c (job_key, epoch, token, lsn)
  values (v_key, p_epoch, p_token, v_target)
  on conflict (job_key) do update
     set epoch = excluded.epoch, token = excluded.token, lsn = excluded.lsn, confirmed_at = excluded.confirmed_at
   where c.token < excluded.token;
end
$$;
revoke all on function fence.confirm_takeover(text, bigint, bigint) from public;

-- fence.gate_slow (023's), fence.gate, fence.enter and the backstop
-- (025's): the only change is the confirmation above.

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
  -- (027) In failover_mode sync, a write that enters this generation
  -- waits until its takeover is on the synchronous standbys (bounded;
  -- FN017), before this transaction locks the fence row: the lock's WAL
  -- record would lie below the target, and nothing flushes it before
  -- this transaction commits.
  if not v_ours then
    perform fence.confirm_takeover(v_key, p_epoch, p_token);
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
     -- (027) In failover_mode sync, a generation not yet confirmed goes to
     -- gate_slow, which waits for its takeover to be on the standbys.
     and (not exists (select 1 from fence.settings s where s.name = 'failover_mode' and s.value = 'sync')
          or exists (select 1 from fence.confirmed_takeovers c
                      where c.job_key = v_key and c.epoch = gate.epoch and c.token = gate.token))
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
     -- (027) Entering in failover_mode sync: only a confirmed generation
     -- (else gate_slow, which waits for its takeover to be on the standbys).
     and (r.job_key is not null
          or fe.era_start = pg_catalog.pg_postmaster_start_time()
             and (not exists (select 1 from fence.settings s where s.name = 'failover_mode' and s.value = 'sync')
                  or exists (select 1 from fence.confirmed_takeovers c
                              where c.job_key = v_key and c.epoch = p_epoch and c.token = p_token)))
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
     -- (027) Entering in failover_mode sync: only a confirmed generation
     -- (else gate_slow, which waits for its takeover to be on the standbys).
     and (r.job_key is not null
          or fe.era_start = pg_catalog.pg_postmaster_start_time()
             and (not exists (select 1 from fence.settings s where s.name = 'failover_mode' and s.value = 'sync')
                  or exists (select 1 from fence.confirmed_takeovers c
                              where c.job_key = v_key and c.epoch = v_epoch and c.token = v_token)))
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

-- fence.commit_slow (023's, unchanged but for the confirmation): every
-- receipt of a generation is written after its takeover is confirmed,
-- whichever function writes it (round 15, attacker AB's H1: fence.commit
-- called before the first write wrote the transaction's receipt without
-- waiting, and the write paths then took it as this generation's entry).
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
  -- (027, round 15 AB-H1) A receipt this function writes is one the
  -- write paths trust as this generation's entry (an own receipt: no
  -- confirmation again), so in failover_mode sync it is written only
  -- once the takeover is on the synchronous standbys, as gate_slow's:
  -- fence.commit before the first write skipped the wait.
  if not v_ours then
    perform fence.confirm_takeover(v_key, p_epoch, p_token);
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
