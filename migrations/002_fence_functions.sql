-- pgfence server-side protocol: acquire, renew, release, retire, gate,
-- commit, gc, accept_event. All SECURITY DEFINER with a pinned search_path;
-- workers get EXECUTE (role pgfence_worker), never table privileges.
--
-- SQLSTATEs (class FN): FN001 stale token, FN002 lease held, FN003 receipt
-- conflict, FN004 epoch retired, FN005 unknown job, FN006 receipt expired
-- (pruned: cannot confirm), FN007 generation pending on replica (proxy),
-- FN008 fencing required, FN009 unsupported in a gated transaction (proxy),
-- FN00R replay (internal).

create function fence.validate_job_key(p_job_key text) returns void
language plpgsql immutable
set search_path = pg_catalog, fence
as $$
begin
  if p_job_key is null or p_job_key = '' then
    raise exception 'job key must not be empty'
      using errcode = '22023', hint = 'pass the job key the lease is for, 1 to 200 characters';
  end if;
  if length(p_job_key) > 200 then
    raise exception 'job key is % characters long, the limit is 200', length(p_job_key)
      using errcode = '22023', hint = 'use a shorter job key, for example a hash of the business key';
  end if;
end
$$;

-- check_generation raises the fence error for (job, epoch, token) against
-- the locked fence row f (all fields null when the job is unknown). The
-- order matters: unknown, retired/foreign epoch, pruned, stale.
create function fence.check_generation(f fence.fences, p_job_key text, p_epoch bigint, p_token bigint)
returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v_pruned bigint;
begin
  if f.job_key is null then
    raise exception 'job "%" is unknown: no lease was ever acquired for it (presented epoch %, token %)',
        p_job_key, p_epoch, p_token
      using errcode = 'FN005',
            hint = 'acquire a lease with fence.acquire (pgfence lease acquire) and use the epoch and token it returns';
  end if;
  if p_epoch is distinct from f.epoch then
    if exists (select 1 from fence.epochs e where e.epoch = p_epoch and e.job_key = p_job_key) then
      raise exception 'job "%": epoch % is retired (presented token %; current epoch %, token %)',
          p_job_key, p_epoch, p_token, f.epoch, f.max_issued_token
        using errcode = 'FN004',
              hint = 'the request belongs to a finished lifecycle of this job: drop it; new work needs a new lease';
    end if;
    raise exception 'job "%": epoch % was never issued for this job (presented token %; current epoch %, token %)',
        p_job_key, p_epoch, p_token, f.epoch, f.max_issued_token
      using errcode = 'FN005',
            hint = 'use the epoch and token returned by fence.acquire for this job';
  end if;
  if f.retired_at is not null then
    raise exception 'job "%": epoch % is retired (presented token %; retired at %, last token %)',
        p_job_key, p_epoch, p_token, f.retired_at, f.max_issued_token
      using errcode = 'FN004',
            hint = 'the job was retired: drop this request; new work needs a new lease (fence.acquire opens a new epoch)';
  end if;
  select w.pruned_through_token into v_pruned
    from fence.gc_watermarks w where w.job_key = p_job_key and w.epoch = p_epoch;
  if found and p_token <= v_pruned then
    raise exception 'job "%": cannot confirm epoch % token %: its commit receipts were pruned by gc (pruned through token %; current token %)',
        p_job_key, p_epoch, p_token, v_pruned, f.max_issued_token
      using errcode = 'FN006',
            hint = 'the outcome of this generation is no longer recorded; check the business result directly and do not retry it as a first commit';
  end if;
  if p_token is distinct from f.max_issued_token then
    if p_token > f.max_issued_token then
      raise exception 'job "%": token % was never issued (epoch %; current token %)',
          p_job_key, p_token, p_epoch, f.max_issued_token
        using errcode = 'FN001',
              hint = 'use the token returned by fence.acquire';
    end if;
    raise exception 'job "%": token % is stale (epoch %; current token %)',
        p_job_key, p_token, p_epoch, f.max_issued_token
      using errcode = 'FN001',
            hint = 'another holder took over this job: stop, roll back and do not retry with this token';
  end if;
end
$$;

create function fence.acquire(job_key text, holder text, ttl interval)
returns table (epoch bigint, token bigint, expires_at timestamptz)
language plpgsql
security definer
set search_path = pg_catalog, fence
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
  if acquire.holder is null or acquire.holder = '' then
    raise exception 'job "%": holder must not be empty', acquire.job_key
      using errcode = '22023', hint = 'name the worker that takes the lease, for example host:pid';
  end if;
  if acquire.ttl is null or acquire.ttl <= interval '0' then
    raise exception 'job "%": lease ttl must be positive, got %', acquire.job_key, coalesce(acquire.ttl::text, 'null')
      using errcode = '22023', hint = 'pass a positive interval such as ''30 seconds''';
  end if;

  select * into f from fence.fences fe where fe.job_key = acquire.job_key for update;
  if not found then
    insert into fence.fences as fe (job_key, epoch, max_issued_token)
    values (acquire.job_key, nextval('fence.epoch_seq'), 0)
    on conflict (job_key) do nothing
    returning fe.* into f;
    if found then
      insert into fence.epochs (epoch, job_key) values (f.epoch, f.job_key);
    else
      -- a concurrent acquire created it first; we now wait for its lock
      select * into f from fence.fences fe where fe.job_key = acquire.job_key for update;
    end if;
  end if;

  v_now := clock_timestamp();
  if f.retired_at is null then
    select * into l from fence.leases le where le.job_key = acquire.job_key;
    if found and l.holder <> acquire.holder and l.expires_at > v_now and l.token = f.max_issued_token then
      raise exception 'job "%": lease is held by "%" with token % (epoch %) until %; "%" cannot take it over',
          acquire.job_key, l.holder, l.token, f.epoch, l.expires_at, acquire.holder
        using errcode = 'FN002',
              hint = 'wait until the lease expires or the holder releases it, then acquire again';
    end if;
    v_epoch := f.epoch;
  else
    -- retired (or brand new above): open a new lifecycle
    v_epoch := nextval('fence.epoch_seq');
    insert into fence.epochs (epoch, job_key, opened_at) values (v_epoch, acquire.job_key, v_now);
  end if;

  v_token := nextval('fence.token_seq');
  v_expires := v_now + acquire.ttl;
  update fence.fences fe
     set epoch = v_epoch, max_issued_token = v_token, retired_at = null
   where fe.job_key = acquire.job_key;
  update fence.epochs e set last_token = v_token where e.epoch = v_epoch;
  insert into fence.leases as le (job_key, holder, token, expires_at)
  values (acquire.job_key, acquire.holder, v_token, v_expires)
  on conflict (job_key) do update
     set holder = excluded.holder, token = excluded.token, expires_at = excluded.expires_at;
  insert into fence.issuance (token, job_key, epoch, holder)
  values (v_token, acquire.job_key, v_epoch, acquire.holder);
  perform pg_notify('pgfence_takeover',
    json_build_object('job_key', acquire.job_key, 'epoch', v_epoch, 'token', v_token)::text);
  return query select v_epoch, v_token, v_expires;
end
$$;

create function fence.renew(job_key text, token bigint, ttl interval) returns timestamptz
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
declare
  f fence.fences;
  l fence.leases;
  v_expires timestamptz;
begin
  perform fence.validate_job_key(renew.job_key);
  if renew.ttl is null or renew.ttl <= interval '0' then
    raise exception 'job "%": lease ttl must be positive, got %', renew.job_key, coalesce(renew.ttl::text, 'null')
      using errcode = '22023', hint = 'pass a positive interval such as ''30 seconds''';
  end if;
  select * into f from fence.fences fe where fe.job_key = renew.job_key for update;
  if not found then
    raise exception 'job "%" is unknown: no lease was ever acquired for it (presented token %)', renew.job_key, renew.token
      using errcode = 'FN005', hint = 'acquire a lease with fence.acquire first';
  end if;
  if f.retired_at is not null then
    raise exception 'job "%": epoch % is retired (presented token %; last token %)',
        renew.job_key, f.epoch, renew.token, f.max_issued_token
      using errcode = 'FN004', hint = 'the job was retired: stop; new work needs a new lease';
  end if;
  select * into l from fence.leases le where le.job_key = renew.job_key;
  if not found or l.token <> renew.token or renew.token is distinct from f.max_issued_token then
    raise exception 'job "%": cannot renew with token % (epoch %): %',
        renew.job_key, renew.token, f.epoch,
        case when not found then format('the lease was released; current token %s', f.max_issued_token)
             else format('current token %s held by "%s"', f.max_issued_token, l.holder) end
      using errcode = 'FN001',
            hint = 'this worker no longer holds the lease: stop, and acquire again if there is work left';
  end if;
  v_expires := clock_timestamp() + renew.ttl;
  update fence.leases le set expires_at = v_expires where le.job_key = renew.job_key;
  return v_expires;
end
$$;

create function fence.release(job_key text, token bigint) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
declare
  f fence.fences;
begin
  perform fence.validate_job_key(release.job_key);
  select * into f from fence.fences fe where fe.job_key = release.job_key for update;
  if not found then
    raise exception 'job "%" is unknown: no lease was ever acquired for it (presented token %)', release.job_key, release.token
      using errcode = 'FN005', hint = 'check the job key';
  end if;
  if release.token is distinct from f.max_issued_token then
    raise exception 'job "%": cannot release with token % (epoch %; current token %)',
        release.job_key, release.token, f.epoch, f.max_issued_token
      using errcode = 'FN001',
            hint = 'another holder took over; the lease is not yours to release';
  end if;
  -- The token stays the fence's maximum: a later acquire issues a new one.
  delete from fence.leases le where le.job_key = release.job_key and le.token = release.token;
end
$$;

create function fence.retire(job_key text) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
declare
  f fence.fences;
  v_now timestamptz := clock_timestamp();
begin
  perform fence.validate_job_key(retire.job_key);
  select * into f from fence.fences fe where fe.job_key = retire.job_key for update;
  if not found then
    raise exception 'job "%" is unknown: nothing to retire', retire.job_key
      using errcode = 'FN005', hint = 'check the job key';
  end if;
  if f.retired_at is not null then
    return; -- already retired: idempotent
  end if;
  update fence.fences fe set retired_at = v_now where fe.job_key = retire.job_key;
  update fence.epochs e set closed_at = v_now, last_token = f.max_issued_token where e.epoch = f.epoch;
  delete from fence.leases le where le.job_key = retire.job_key;
  perform pg_notify('pgfence_takeover',
    json_build_object('job_key', retire.job_key, 'epoch', f.epoch, 'token', f.max_issued_token, 'retired', true)::text);
end
$$;

-- Cost. A gated write runs fence.gate once, the backstop trigger once per
-- statement (twice for INSERT ... ON CONFLICT DO UPDATE, which fires both
-- the INSERT and the UPDATE statement triggers) and fence.commit once, so
-- their happy paths are kept to one statement each and one PL/pgSQL call
-- (no nested SECURITY DEFINER functions; the error paths are in helpers).
--
-- Collation. A PL/pgSQL function's text parameters take the collation of
-- the call's arguments: called with a name (say tg_table_schema) or with an
-- explicit COLLATE, job_key would compare as "C" and no index on the
-- default-collation key columns could be used (this once made every
-- protected write a sequential scan of fence.receipts). The hot functions
-- copy their keys into locals declared COLLATE "default", so their lookups
-- are index scans whatever the caller passes.

-- gate_slow is the rest of the gate when the one-statement fast check (in
-- fence.gate and fence.backstop) did not say 'ok': lock the fence row,
-- consult the receipt before the fence (L3): a retry of a committed
-- generation is a replay even after a takeover; otherwise raise the precise
-- fence error. It is a plain function (not SECURITY DEFINER): it runs only
-- inside those definer functions, which pin search_path, and it is not
-- executable by PUBLIC.
create function fence.gate_slow(p_job_key text, p_epoch bigint, p_token bigint, p_step text) returns text
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v_key text collate pg_catalog."default" := p_job_key;
  v_step text collate pg_catalog."default" := coalesce(p_step, '');
  f fence.fences;
begin
  select * into f from fence.fences fe where fe.job_key = v_key for update;
  if exists (select 1 from fence.receipts r
              where r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step) then
    -- The guard row makes the transaction impossible to commit; the
    -- setting lets the pgfence_replay row triggers skip its writes (see
    -- fence.protect). The guard is inserted every time, never skipped on
    -- the strength of the setting: a client can forge the setting.
    insert into fence.replay_guards (job_key, epoch, token, step)
    values (v_key, p_epoch, p_token, v_step);
    perform set_config('pgfence.replay', pg_current_xact_id()::text, true);
    return 'replay';
  end if;
  -- Raises unless (p_epoch, p_token) is the current generation.
  perform fence.check_generation(f, v_key, p_epoch, p_token);
  return 'ok';
end
$$;

create function fence.gate(job_key text, epoch bigint, token bigint, step text default '') returns text
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
declare
  v_key text collate pg_catalog."default" := gate.job_key;
  v_step text collate pg_catalog."default" := coalesce(gate.step, '');
  f fence.fences;
  v_replay boolean;
begin
  if gate.job_key is null or gate.epoch is null or gate.token is null then
    raise exception 'fence.gate needs a job key, an epoch and a token (got %, %, %)',
        coalesce(gate.job_key, 'null'), coalesce(gate.epoch::text, 'null'), coalesce(gate.token::text, 'null')
      using errcode = '22023';
  end if;
  -- Serialise with takeovers and other commits of this job: the row lock is
  -- held until the transaction (or the savepoint that took it) ends. One
  -- statement locks the row and probes the receipt. (Keep in step with
  -- fence.backstop.)
  select fe.epoch, fe.max_issued_token, fe.retired_at,
         exists (select 1 from fence.receipts r
                  where r.job_key = v_key and r.epoch = gate.epoch and r.token = gate.token and r.step = v_step)
    into f.epoch, f.max_issued_token, f.retired_at, v_replay
    from fence.fences fe where fe.job_key = v_key
     for update of fe;
  if not v_replay and f.epoch = gate.epoch and f.retired_at is null and f.max_issued_token = gate.token then
    return 'ok';
  end if;
  return fence.gate_slow(v_key, gate.epoch, gate.token, v_step);
end
$$;

create function fence.commit(job_key text, epoch bigint, token bigint, step text, digest bytea, digest_version text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
declare
  f fence.fences;
  rc fence.receipts;
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
  -- Fast path, one statement: the receipt is inserted only if the fence row
  -- (locked here, free when fence.gate already holds it) says this is the
  -- current generation. In READ COMMITTED a concurrent takeover is waited
  -- for and the condition rechecked on the new row version.
  insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version)
  select v_key, commit.epoch, commit.token, v_step, commit.digest, commit.digest_version
    from fence.fences fe
   where fe.job_key = v_key and fe.epoch = commit.epoch and fe.retired_at is null
     and fe.max_issued_token = commit.token
     for update of fe
  on conflict (job_key, epoch, token, step) do nothing;
  if found then
    return 'committed';
  end if;
  -- Nothing inserted: a receipt exists (replay or conflict, answered first:
  -- L3) or the generation does not hold the fence.
  select * into f from fence.fences fe where fe.job_key = v_key for update;
  select * into rc from fence.receipts r
   where r.job_key = v_key and r.epoch = commit.epoch and r.token = commit.token and r.step = v_step;
  if not found then
    -- Raises the precise error: unknown, retired, pruned or stale.
    perform fence.check_generation(f, v_key, commit.epoch, commit.token);
    raise exception 'job "%": fence.commit could not record epoch % token % step "%"', v_key, commit.epoch, commit.token, v_step
      using errcode = 'XX000';
  end if;
  if rc.payload_digest = commit.digest and rc.digest_version = commit.digest_version then
    raise exception 'job "%": epoch % token % step "%" already committed at % with the same payload: idempotent replay',
        commit.job_key, commit.epoch, commit.token, v_step, rc.committed_at
      using errcode = 'FN00R',
            detail = 'the first commit stands; this transaction is rolled back so nothing is applied twice',
            hint = 'treat this as success';
  end if;
  raise exception 'job "%": epoch % token % step "%" already committed at % with a different payload (stored digest %/%, presented %/%)',
      commit.job_key, commit.epoch, commit.token, v_step, rc.committed_at,
      rc.digest_version, encode(rc.payload_digest, 'hex'), commit.digest_version, encode(commit.digest, 'hex')
    using errcode = 'FN003',
          hint = 'the first result stands and this one was rolled back; a changed result needs a new token (or a different step)';
end
$$;

create function fence.gc(keep interval) returns bigint
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  v_cutoff timestamptz;
  v_n bigint;
begin
  if keep is null or keep < interval '0' then
    raise exception 'gc retention must not be negative, got %', coalesce(keep::text, 'null')
      using errcode = '22023', hint = 'pass the retry window plus the longest message delay, for example ''7 days''';
  end if;
  v_cutoff := clock_timestamp() - keep;
  -- Jobs busy in a gated transaction are skipped (their fence row is
  -- locked) and pruned by a later run. Only closed generations are pruned:
  -- an older epoch, a retired one, or a token below the current one.
  with locked as (
    select fe.job_key, fe.epoch, fe.max_issued_token, fe.retired_at
      from fence.fences fe
     where exists (select 1 from fence.receipts r where r.job_key = fe.job_key and r.committed_at < v_cutoff)
       for update skip locked
  ), del as (
    delete from fence.receipts r
     using locked l
     where r.job_key = l.job_key
       and r.committed_at < v_cutoff
       and (r.epoch <> l.epoch or l.retired_at is not null or r.token < l.max_issued_token)
    returning r.job_key, r.epoch, r.token
  ), agg as (
    select d.job_key, d.epoch, max(d.token) as through, count(*) as n from del d group by d.job_key, d.epoch
  ), wm as (
    insert into fence.gc_watermarks as w (job_key, epoch, pruned_through_token)
    select a.job_key, a.epoch, a.through from agg a
    on conflict (job_key, epoch) do update
       set pruned_through_token = greatest(w.pruned_through_token, excluded.pruned_through_token)
  )
  select coalesce(sum(a.n), 0)::bigint into v_n from agg a;
  return v_n;
end
$$;

create function fence.accept_event(consumer text, job_key text, epoch bigint, token bigint) returns boolean
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
declare
  w fence.consumer_watermarks;
begin
  if accept_event.consumer is null or accept_event.consumer = '' then
    raise exception 'consumer must not be empty' using errcode = '22023';
  end if;
  perform fence.validate_job_key(accept_event.job_key);
  if accept_event.epoch is null or accept_event.token is null then
    raise exception 'job "%": an event needs an epoch and a token', accept_event.job_key using errcode = '22023';
  end if;
  -- Events of a closed lifecycle are rejected outright.
  if exists (select 1 from fence.epochs e
              where e.epoch = accept_event.epoch and e.job_key = accept_event.job_key
                and e.closed_at is not null) then
    return false;
  end if;
  insert into fence.consumer_watermarks as cw (consumer, job_key, epoch, token)
  values (accept_event.consumer, accept_event.job_key, accept_event.epoch, accept_event.token)
  on conflict (consumer, job_key) do nothing
  returning cw.* into w;
  if found then
    return true;
  end if;
  select * into w from fence.consumer_watermarks cw
   where cw.consumer = accept_event.consumer and cw.job_key = accept_event.job_key
     for update;
  if accept_event.epoch > w.epoch or (accept_event.epoch = w.epoch and accept_event.token >= w.token) then
    update fence.consumer_watermarks cw
       set epoch = accept_event.epoch, token = accept_event.token
     where cw.consumer = accept_event.consumer and cw.job_key = accept_event.job_key;
    return true;
  end if;
  return false;
end
$$;
