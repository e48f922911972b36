-- Issue 30 (attack round 5, K-M1): a lease function's transaction cannot
-- be prepared. docs/security.md ("PREPARE TRANSACTION") describes the
-- defence.
--
-- fence.renew, fence.release, fence.retire and fence.acquire lock the
-- job's fence row (acquire may insert it). Followed by PREPARE
-- TRANSACTION, the lock outlived the session: the next holder's takeover
-- (another role's included) waited on the row until an administrator's
-- ROLLBACK PREPARED, whatever the lease's TTL. Only fence.gate and the
-- backstop made their transaction unpreparable (fence.refuse_prepare,
-- after a fenced write). Every function of the schema that locks a fence
-- row for a worker now does, before it takes the lock: its transaction
-- touches a temporary relation, and PostgreSQL refuses to PREPARE it
-- (with max_prepared_transactions = 0 it refuses every PREPARE, and this
-- does nothing). fence.gc is left as it is: only an administrator runs
-- it, and it skips rows that are locked.
--
-- The functions are 012's acquire and 015's renew, release and retire,
-- with that one line added (and 013's search_path, pg_temp last).

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
    if found and l.expires_at > v_now and l.token = f.max_issued_token
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
     set epoch = v_epoch, max_issued_token = v_token, retired_at = null, owner_role = session_user
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
  -- (015) Whose lease it is, before the lock: a role that may not renew
  -- it never waits on, or holds, the fence row.
  select * into f from fence.fences fe where fe.job_key = renew.job_key;
  if found and f.retired_at is null then
    perform fence.not_holder(f, renew.job_key, renew.token, 'renew');
  end if;
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
  -- (015) Whose lease it is, before the lock.
  select * into f from fence.fences fe where fe.job_key = release.job_key;
  if found then
    perform fence.not_holder(f, release.job_key, release.token, 'release');
  end if;
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
