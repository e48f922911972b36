-- Issue 30, attack round 9 (attacker Q): what migration 019 took for a
-- server history's identity, (system identifier, timeline), is not one:
-- two histories can share it. docs/security.md ("A failover starts a new
-- era") describes the defence; docs/failover.md the runbook.
--
-- 1. Two promotions from one history onto the same timeline number (A's
--    standbys B and C; B promoted, then lost; C promoted, never having
--    received B's WAL) made the same era number and so the same token
--    floor (era << 40) on both branches: C issued again the generations B
--    had issued, and B's holder committed on C. Nothing in PostgreSQL
--    tells the two branches apart (they may fork at the same LSN), so the
--    floors are made to differ instead: a new era's token floor, and its
--    epoch floor, are the era's base (era << 40, or every number issued
--    before if that is higher) plus a random offset below 2^39, drawn
--    from the strong random source (gen_random_uuid()). Two branches'
--    ranges overlap only when their offsets are closer than the numbers
--    they issue; B's generation on C is then below C's floor (FN015) or a
--    number C never issued (refused). Every era still has at least 2^39
--    numbers before the next era's base.
--
-- 2. A takeover committed with synchronous_commit = off was lost by a
--    crash-restart (any backend killed: the postmaster reinitialises with
--    its start time unchanged), and the previous holder wrote again.
--    fence.durable raises synchronous_commit from off to local for the
--    transaction; acquire, renew, release, retire, new_era and
--    set_failover_mode call it, so their commit is flushed before it is
--    acknowledged (sync_acquire still raises it to on in sync mode).
--
-- 3. A physical backup restored as the primary on the same timeline
--    (crash recovery, the same system identifier) cannot be told from a
--    crash restart by the database. fence.new_era(reason), an
--    administrator's, starts a new era at once: every generation issued
--    before is void (the fast paths' era_start is cleared, the era checks
--    are dropped), the numbers move past a new random floor. The runbook
--    makes it a step after restoring any copy as a primary. Eras are no
--    longer unique per (system identifier, timeline): the latest era of
--    the server's pair is its current one.
--
-- 4. The first transaction of a server's era writes the era check (and
--    may make the era) and holds the era lock to its end; PREPARE of it
--    kept every acquire waiting across restarts, and fence.current_era
--    let any login start one. era_settle refuses PREPARE when it writes
--    (fence.refuse_prepare), and current_era is for the fence's roles.
--
-- 5. fence.release and fence.retire refuse a voided generation (FN015),
--    as renew does; renew checks the era before the holder's role, so a
--    holder whose takeover a failover lost is told FN015 (pgfence run
--    acquires again) rather than FN001.
--
-- 6. At REPEATABLE READ, an era made by another session after the
--    transaction's snapshot is a serialization failure (40001, retry),
--    found by the era row's insert before any sequence moves (setval is
--    not transactional).

-- Adding no column: only fence.eras' unique (system identifier, timeline)
-- goes, under its ACCESS EXCLUSIVE lock, which waits for a settling
-- transaction: give up after a moment (55P03), and Apply tries again.
set local lock_timeout = '2s';
alter table fence.eras drop constraint eras_system_identifier_timeline_key;
set local lock_timeout = 0;
comment on table fence.eras is 'every era the fence has run in: a server history (system identifier, timeline), or a new era an administrator started on it (fence.new_era); the latest of the server''s pair is current; a token not above its valid_floor is void (FN015)';

-- era_offset: a random offset below 2^39, from the strong random source
-- (39 of the first 40 bits of a version 4 UUID, all random: its version
-- and variant bits come later).
create function fence.era_offset() returns bigint
language sql volatile
set search_path = pg_catalog, fence, pg_temp
as $$
  select (('x' operator(pg_catalog.||) pg_catalog.substr(r.u, 1, 8) operator(pg_catalog.||) pg_catalog.substr(r.u, 10, 2))::pg_catalog.bit(40)::pg_catalog.int8)
         operator(pg_catalog.>>) 1
    from (select pg_catalog.gen_random_uuid()::pg_catalog.text as u) r
$$;

-- era_pending_seq: the token floor the last attempt at a new era on this
-- server drew. A sequence, so that it survives the attempt's rollback:
-- the next attempt at the same era reuses it instead of drawing again,
-- and the floor a server settles on is one random draw however many
-- settling transactions roll back before one commits (each draw would
-- otherwise be another chance for two branches' ranges to meet).
create sequence fence.era_pending_seq minvalue 0 start with 0;
revoke all on sequence fence.era_pending_seq from public;

-- durable: this transaction's commit is flushed before it is acknowledged
-- (synchronous_commit at least local), so a crash-restart cannot lose it.
-- A LOCAL setting: it outlives the calling function (whose SET clause
-- names search_path only) to the transaction's end.
create function fence.durable() returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
begin
  if pg_catalog.current_setting('synchronous_commit') = 'off' then
    perform pg_catalog.set_config('synchronous_commit', 'local', true);
  end if;
end
$$;

-- era_begin makes a new era of (p_sysid, p_tl), the caller holding
-- fence.eras' EXCLUSIVE lock: its number above every earlier era's (and at
-- least the timeline), random token and epoch floors above every number
-- issued before, and valid_floor (every earlier generation void unless the
-- transition is a lossless promotion; p_reason, an administrator's new
-- era, is never lossless). The row is inserted before the sequences move:
-- at REPEATABLE READ a row made after this transaction's snapshot makes
-- the insert fail (40001) before any setval, which is not transactional.
-- Every setval is a greatest() that includes the sequence's last_value,
-- read at the moment (not from the snapshot), so no sequence goes back:
-- a number drawn before (by a rolled-back acquire, or an earlier attempt
-- at this era that rolled back) is never drawn again, and every number
-- drawn from now on is above valid_floor.
create function fence.era_begin(p_sysid bigint, p_tl integer, p_reason text) returns fence.eras
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
  v_lossless boolean;
begin
  select * into prev from fence.eras x order by x.era desc limit 1;
  v_era := greatest(prev.era + 1, p_tl);
  -- The floors: the base is above every number issued before (each job's
  -- latest token is its fence row's; every epoch has its row), and, for
  -- an administrator's era, above every number drawn (last_value). A
  -- settling transaction that rolls back has moved the sequences (setval
  -- is not undone), but not the base of the next attempt: refused writes
  -- on a new primary do not push the numbers up by 2^38 each.
  v_tokens := greatest(v_era::bigint << 40, (select max(f.max_issued_token) from fence.fences f),
                       case when p_reason is not null then (select s.last_value from fence.token_seq s) end);
  v_pending := (select s.last_value from fence.era_pending_seq s);
  if p_reason is null and v_pending > v_tokens and v_pending - v_tokens <= (1::bigint << 39)
     and not exists (select 1 from fence.eras x where x.token_floor = v_pending) then
    v_tokens := v_pending; -- drawn by an attempt at this era here that rolled back
  else
    v_tokens := v_tokens + 1 + fence.era_offset();
    perform pg_catalog.setval('fence.era_pending_seq', v_tokens);
  end if;
  v_epochs := greatest(v_era::bigint << 40, (select max(x.epoch) from fence.epochs x),
                       case when p_reason is not null then (select s.last_value from fence.epoch_seq s) end)
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

-- era_settle returns the current era's valid_floor, making the era first
-- when this server's history has none, and records the check for the fast
-- path. 019's, with the era made by era_begin, the latest era of the pair
-- taken as current (fence.new_era), and PREPARE refused once it writes:
-- the check's row, and the era's lock, would otherwise outlive the
-- session and hold every acquire and every job's first write.
create or replace function fence.era_settle() returns bigint
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_tl integer := fence.timeline();
  v_start timestamptz := pg_catalog.pg_postmaster_start_time();
  v_sysid bigint;
  v_floor bigint;
  e fence.eras;
begin
  select c.valid_floor into v_floor from fence.era_checks c where c.timeline = v_tl and c.started_at = v_start;
  if found then
    return v_floor;
  end if;
  select s.system_identifier into v_sysid from pg_catalog.pg_control_system() s;
  select * into e from fence.eras x where x.system_identifier = v_sysid and x.timeline = v_tl order by x.era desc limit 1;
  if not found then
    perform fence.refuse_prepare();
    lock table fence.eras in exclusive mode;
    select * into e from fence.eras x where x.system_identifier = v_sysid and x.timeline = v_tl order by x.era desc limit 1;
    if not found then
      e := fence.era_begin(v_sysid, v_tl, null);
    end if;
  end if;
  if not pg_catalog.current_setting('transaction_read_only')::boolean then
    perform fence.refuse_prepare();
    insert into fence.era_checks (timeline, started_at, era, valid_floor) values (v_tl, v_start, e.era, e.valid_floor)
    on conflict do nothing;
  end if;
  return e.valid_floor;
end
$$;

-- current_era: the era this server is in (made first if needed), for
-- operators, the proxy and pgfence audit. No tokens. The fence's roles
-- only: its first call on a server writes (era_settle).
create or replace function fence.current_era(out era integer, out timeline integer, out began_at timestamptz, out lossless boolean, out reason text)
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_floor bigint := fence.era_settle();
begin
  select x.era, x.timeline, x.began_at, x.lossless, x.reason into era, timeline, began_at, lossless, reason
    from fence.eras x
   where x.system_identifier = (select s.system_identifier from pg_catalog.pg_control_system() s)
     and x.timeline = fence.timeline()
   order by x.era desc
   limit 1;
end
$$;

-- new_era: an administrator starts a new era now (after restoring a
-- backup or any copy as a primary, which the database cannot tell from a
-- crash restart). Every generation issued before is void (FN015), every
-- lease free, and the numbers move past a new random floor. It waits for
-- every transaction that holds or changes a fence row (a gated one, an
-- acquire) and holds the next off until it commits; the fast paths'
-- era_start is cleared, so each job's next transaction checks the new era.
create function fence.new_era(reason text) returns integer
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_tl integer;
  v_sysid bigint;
  e fence.eras;
begin
  perform fence.check_admin('starting a new era');
  if new_era.reason is null or pg_catalog.btrim(new_era.reason) = '' then
    raise exception 'a new era needs a reason (what was restored or copied, and when)'
      using errcode = '22023';
  end if;
  -- At READ COMMITTED each statement below reads what committed before
  -- the locks were granted; an older snapshot would miss fence rows
  -- written meanwhile, which would keep their era_start.
  if pg_catalog.current_setting('transaction_isolation') <> 'read committed' then
    raise exception 'fence.new_era runs at READ COMMITTED, not %', pg_catalog.current_setting('transaction_isolation')
      using errcode = '25000',
            hint = 'run it in a transaction of its own (the default isolation level)';
  end if;
  perform fence.refuse_prepare();
  perform fence.durable();
  v_tl := fence.timeline();
  lock table fence.fences in exclusive mode;
  lock table fence.eras in exclusive mode;
  select s.system_identifier into v_sysid from pg_catalog.pg_control_system() s;
  e := fence.era_begin(v_sysid, v_tl, format('new era started by %s (fence.new_era): %s', session_user, new_era.reason));
  delete from fence.era_checks;
  update fence.fences fe set era_start = null where fe.era_start is not null;
  insert into fence.era_checks (timeline, started_at, era, valid_floor)
  values (v_tl, pg_catalog.pg_postmaster_start_time(), e.era, e.valid_floor);
  return e.era;
end
$$;

-- set_failover_mode: 019's, its commit made durable.
create or replace function fence.set_failover_mode(mode text) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
begin
  perform fence.check_admin('setting the failover mode');
  if mode is null or mode not in ('async', 'sync') then
    raise exception 'failover mode must be ''async'' or ''sync'', got %', coalesce(quote_literal(mode), 'null')
      using errcode = '22023',
            hint = 'sync only where a failover promotes a synchronous standby (Patroni synchronous_mode); see docs/failover.md';
  end if;
  if mode = 'sync' and pg_catalog.current_setting('synchronous_standby_names') = '' then
    raise exception 'failover mode sync needs a synchronous standby, and synchronous_standby_names is empty'
      using errcode = '55000',
            hint = 'configure synchronous replication first (Patroni: synchronous_mode: true)';
  end if;
  perform fence.durable();
  insert into fence.settings as s (name, value) values ('failover_mode', mode)
  on conflict (name) do update set value = excluded.value;
end
$$;

revoke all on function fence.era_offset(), fence.durable(), fence.era_begin(bigint, integer, text),
  fence.new_era(text) from public;
grant execute on function fence.new_era(text) to pgfence_bypass;
revoke all on function fence.current_era() from public;
grant execute on function fence.current_era() to pgfence_worker, pgfence_bypass, pgfence_control;

-- The lease functions with the era and durability (019's acquire and
-- renew, 017's release and retire): acquire and every function that
-- changes a lease commit durably (fence.durable); renew checks the era
-- first; release and retire refuse a voided generation.
create or replace function fence.acquire(job_key text, holder text, ttl interval)
returns table (epoch bigint, token bigint, expires_at timestamptz)
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
#variable_conflict use_column
declare
  f fence.fences;
  l fence.leases;
  v_now timestamptz;
  v_epoch bigint;
  v_token bigint;
  v_expires timestamptz;
  v_floor bigint;
begin
  perform fence.validate_job_key(acquire.job_key);
  perform fence.refuse_prepare(); -- (017) a prepared transaction would keep the fence row locked
  if acquire.holder is null or acquire.holder = '' then
    raise exception 'job "%": holder must not be empty', acquire.job_key
      using errcode = '22023', hint = 'name the worker that takes the lease, for example host:pid';
  end if;
  if acquire.ttl is null or acquire.ttl <= interval '0' then
    raise exception 'job "%": lease ttl must be positive, got %', acquire.job_key, coalesce(acquire.ttl::text, 'null')
      using errcode = '22023', hint = 'pass a positive interval such as ''30 seconds''';
  end if;
  perform fence.check_lease_ttl(acquire.job_key, acquire.ttl);
  perform fence.check_job_grant(acquire.job_key);
  perform fence.durable(); -- (022) the takeover survives a crash-restart
  perform fence.sync_acquire(acquire.job_key);
  v_floor := fence.era_settle();

  select * into f from fence.fences fe where fe.job_key = acquire.job_key for update;
  if not found then
    insert into fence.fences as fe (job_key, epoch, max_issued_token)
    values (acquire.job_key, nextval('fence.epoch_seq'), 0)
    on conflict (job_key) do nothing
    returning fe.* into f;
    if found then
      insert into fence.epochs (epoch, job_key) values (f.epoch, f.job_key);
    else
      select * into f from fence.fences fe where fe.job_key = acquire.job_key for update;
    end if;
  end if;

  v_now := clock_timestamp();
  if f.retired_at is null then
    -- A live lease is taken over by nobody but its own holder, and the
    -- holder is the name and the role: another role naming the same
    -- holder does not get it. The error names the holder and its role
    -- (fence.jobs shows both), not its token.
    select * into l from fence.leases le where le.job_key = acquire.job_key;
    if found and l.expires_at > v_now and l.token = f.max_issued_token and l.token > v_floor
       and (l.holder <> acquire.holder or (f.owner_role is not null and f.owner_role <> session_user)) then
      raise exception 'job "%": lease is held by "%" (role %) in epoch % until %; "%" (role %) cannot take it over',
          acquire.job_key, l.holder, coalesce(f.owner_role::text, 'unrecorded'), f.epoch, l.expires_at,
          acquire.holder, session_user
        using errcode = 'FN002',
              hint = 'wait until the lease expires or the holder releases it, then acquire again';
    end if;
    v_epoch := f.epoch;
  else
    v_epoch := nextval('fence.epoch_seq');
    insert into fence.epochs (epoch, job_key, opened_at) values (v_epoch, acquire.job_key, v_now);
  end if;

  v_token := nextval('fence.token_seq');
  v_expires := v_now + acquire.ttl;
  update fence.fences fe
     set epoch = v_epoch, max_issued_token = v_token, retired_at = null, owner_role = session_user,
         era_start = pg_catalog.pg_postmaster_start_time()
   where fe.job_key = acquire.job_key;
  update fence.epochs e set last_token = v_token where e.epoch = v_epoch;
  insert into fence.leases as le (job_key, holder, token, expires_at)
  values (acquire.job_key, acquire.holder, v_token, v_expires)
  on conflict (job_key) do update
     set holder = excluded.holder, token = excluded.token, expires_at = excluded.expires_at;
  insert into fence.issuance (token, job_key, epoch, holder, role)
  values (v_token, acquire.job_key, v_epoch, acquire.holder, session_user);
  -- Any login may LISTEN: the notification names the job (and its epoch,
  -- which fence.jobs shows to everyone), never the token.
  perform pg_notify('pgfence_takeover', json_build_object('job_key', acquire.job_key, 'epoch', v_epoch)::text);
  return query select v_epoch, v_token, v_expires;
end
$$;

create or replace function fence.renew(job_key text, token bigint, ttl interval) returns timestamptz
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
#variable_conflict use_column
declare
  f fence.fences;
  l fence.leases;
  v_expires timestamptz;
begin
  perform fence.validate_job_key(renew.job_key);
  perform fence.refuse_prepare(); -- (017) a prepared transaction would keep the fence row locked
  if renew.ttl is null or renew.ttl <= interval '0' then
    raise exception 'job "%": lease ttl must be positive, got %', renew.job_key, coalesce(renew.ttl::text, 'null')
      using errcode = '22023', hint = 'pass a positive interval such as ''30 seconds''';
  end if;
  perform fence.check_lease_ttl(renew.job_key, renew.ttl);
  -- (022) The era first: a token a failover voided is FN015 whoever
  -- presents it (the answer depends on the number and the era's floor
  -- only), so a holder whose takeover the failover lost, and whose role
  -- the fence row no longer names, learns that the job is free and
  -- acquires it again. era_refuse locks no fence row.
  perform fence.era_refuse(renew.job_key, renew.token);
  -- (015) Whose lease it is, before the lock: a role that may not renew
  -- it never waits on, or holds, the fence row.
  select * into f from fence.fences fe where fe.job_key = renew.job_key;
  if found and f.retired_at is null then
    perform fence.not_holder(f, renew.job_key, renew.token, 'renew');
  end if;
  perform fence.durable(); -- (022) a renewal survives a crash-restart
  select * into f from fence.fences fe where fe.job_key = renew.job_key for update;
  if not found then
    raise exception 'job "%" is unknown: no lease was ever acquired for it (presented token %)', renew.job_key, renew.token
      using errcode = 'FN005', hint = 'acquire a lease with fence.acquire first';
  end if;
  if f.retired_at is not null then
    raise exception 'job "%": epoch % is retired (presented token %)', renew.job_key, f.epoch, renew.token
      using errcode = 'FN004', hint = 'the job was retired: stop; new work needs a new lease';
  end if;
  perform fence.not_holder(f, renew.job_key, renew.token, 'renew');
  select * into l from fence.leases le where le.job_key = renew.job_key;
  if not found or l.token <> renew.token or renew.token is distinct from f.max_issued_token then
    raise exception 'job "%": cannot renew with token % (epoch %): %',
        renew.job_key, renew.token, f.epoch,
        case when not found then 'the lease was released'
             else format('it is not the current lease''s token (held by "%s")', l.holder) end
      using errcode = 'FN001',
            hint = 'this worker no longer holds the lease: stop, and acquire again if there is work left';
  end if;
  perform fence.check_owner(f, renew.job_key, renew.token, 'renewing its lease');
  v_expires := clock_timestamp() + renew.ttl;
  update fence.leases le set expires_at = v_expires where le.job_key = renew.job_key;
  return v_expires;
end
$$;

create or replace function fence.release(job_key text, token bigint) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
#variable_conflict use_column
declare
  f fence.fences;
begin
  perform fence.validate_job_key(release.job_key);
  perform fence.refuse_prepare(); -- (017) a prepared transaction would keep the fence row locked
  -- (022) A generation a failover voided: FN015, as for renew.
  perform fence.era_refuse(release.job_key, release.token);
  -- (015) Whose lease it is, before the lock.
  select * into f from fence.fences fe where fe.job_key = release.job_key;
  if found then
    perform fence.not_holder(f, release.job_key, release.token, 'release');
  end if;
  perform fence.durable(); -- (022) a release survives a crash-restart
  select * into f from fence.fences fe where fe.job_key = release.job_key for update;
  if not found then
    raise exception 'job "%" is unknown: no lease was ever acquired for it (presented token %)', release.job_key, release.token
      using errcode = 'FN005', hint = 'check the job key';
  end if;
  perform fence.not_holder(f, release.job_key, release.token, 'release');
  if release.token is distinct from f.max_issued_token then
    raise exception 'job "%": cannot release with token % (epoch %): it is not the current token',
        release.job_key, release.token, f.epoch
      using errcode = 'FN001',
            hint = 'another holder took over; the lease is not yours to release';
  end if;
  perform fence.check_owner(f, release.job_key, release.token, 'releasing its lease');
  delete from fence.leases le where le.job_key = release.job_key and le.token = release.token;
end
$$;

create or replace function fence.retire(job_key text, token bigint default null, force boolean default false) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
#variable_conflict use_column
declare
  f fence.fences;
  l fence.leases;
  v_now timestamptz := clock_timestamp();
begin
  perform fence.validate_job_key(retire.job_key);
  perform fence.refuse_prepare(); -- (017) a prepared transaction would keep the fence row locked
  -- (015) Who may retire it, before the lock: without a token only an
  -- administrator; with one, the role that holds the current generation.
  -- (The same answers as below, given without waiting for the row.)
  -- (022) A generation a failover voided: FN015, as for renew.
  if retire.token is not null then
    perform fence.era_refuse(retire.job_key, retire.token);
  end if;
  select * into f from fence.fences fe where fe.job_key = retire.job_key;
  if found and f.retired_at is not null then
    return; -- already retired: idempotent, and nothing to lock
  end if;
  if found then
    if retire.token is null then
      if not fence.is_admin() then
        raise exception 'job "%": retiring without a token needs pgfence_bypass; role "%" is not a member', retire.job_key, session_user
          using errcode = 'FN011',
                hint = 'pass the current token of your own lease (fence.retire(job_key, token)), or ask a member of pgfence_bypass';
      end if;
    else
      perform fence.not_holder(f, retire.job_key, retire.token, 'retire');
    end if;
  end if;
  perform fence.durable(); -- (022) a retirement survives a crash-restart
  select * into f from fence.fences fe where fe.job_key = retire.job_key for update;
  if not found then
    raise exception 'job "%" is unknown: nothing to retire', retire.job_key
      using errcode = 'FN005', hint = 'check the job key';
  end if;
  if f.retired_at is not null then
    return; -- already retired: idempotent
  end if;
  if retire.token is null then
    if not fence.is_admin() then
      raise exception 'job "%": retiring without a token needs pgfence_bypass; role "%" is not a member', retire.job_key, session_user
        using errcode = 'FN011',
              hint = 'pass the current token of your own lease (fence.retire(job_key, token)), or ask a member of pgfence_bypass';
    end if;
    select * into l from fence.leases le where le.job_key = retire.job_key;
    if found and l.token = f.max_issued_token and l.expires_at > v_now and not coalesce(retire.force, false) then
      raise exception 'job "%": lease is held by "%" in epoch % until %; retiring would end it',
          retire.job_key, l.holder, f.epoch, l.expires_at
        using errcode = 'FN002',
              hint = 'wait until the lease ends, or retire it anyway with force => true (pgfence lease retire --force)';
    end if;
  else
    perform fence.not_holder(f, retire.job_key, retire.token, 'retire');
    if retire.token is distinct from f.max_issued_token then
      raise exception 'job "%": cannot retire with token % (epoch %): it is not the current token',
          retire.job_key, retire.token, f.epoch
        using errcode = 'FN001',
              hint = 'another holder took over; the job is not yours to retire';
    end if;
    perform fence.check_owner(f, retire.job_key, retire.token, 'retiring the job');
  end if;
  update fence.fences fe set retired_at = v_now where fe.job_key = retire.job_key;
  update fence.epochs e set closed_at = v_now, last_token = f.max_issued_token where e.epoch = f.epoch;
  delete from fence.leases le where le.job_key = retire.job_key;
  perform pg_notify('pgfence_takeover',
    json_build_object('job_key', retire.job_key, 'epoch', f.epoch, 'retired', true)::text);
end
$$;
