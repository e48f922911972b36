-- Issue 17: the protocol functions, now with owners (§5), receipts for
-- writes no parser can see (§4) and consumers that refuse what was never
-- issued (§6). Signatures are those of 002 and 004 except fence.retire,
-- which takes the caller's token and a force flag. docs/security.md has
-- the trust model; docs/protocol.md the functions.

-- member_of: is p_role p_group, or a direct or indirect member of it? The
-- membership graph is walked rather than asking pg_has_role, which says yes
-- for every superuser.
create function fence.member_of(p_role name, p_group name) returns boolean
language sql stable
set search_path = pg_catalog
as $$
  with recursive up(oid) as (
    select r.oid from pg_catalog.pg_roles r where r.rolname = p_role
    union
    select m.roleid from pg_catalog.pg_auth_members m join up on m.member = up.oid
  )
  select exists (select 1 from up join pg_catalog.pg_roles g on g.oid = up.oid where g.rolname = p_group)
$$;

create or replace function fence.is_bypass(p_role name) returns boolean
language sql stable
set search_path = pg_catalog
as $$
  select fence.member_of(p_role, 'pgfence_bypass')
$$;

-- session_bypass: may this session write protected tables without fence
-- metadata (a DBA repairing data)? It asks about session_user, the role
-- that authenticated (through the proxy: the client's user), never about
-- current_user, which a SECURITY DEFINER function or a view's owner
-- changes: such a function does not lend its owner's exemption (§3). A
-- superuser session may also SET ROLE to a bypass member: a superuser can
-- switch every trigger off anyway, and this keeps that an explicit step.
create function fence.session_bypass() returns boolean
language sql stable
set search_path = pg_catalog
as $$
  select fence.is_bypass(session_user)
      or (current_user <> session_user
          and coalesce((select r.rolsuper from pg_catalog.pg_roles r where r.rolname = session_user), false)
          and fence.is_bypass(current_user))
$$;

-- is_admin: may this session administer pgfence: DDL on protected tables,
-- fence.unprotect, leases and generations of other roles? Superusers and
-- members of pgfence_bypass, by session_user.
create function fence.is_admin() returns boolean
language sql stable
set search_path = pg_catalog
as $$
  select coalesce((select r.rolsuper from pg_catalog.pg_roles r where r.rolname = session_user), false)
      or fence.is_bypass(session_user)
$$;

-- check_owner raises FN011 unless the session may use the current
-- generation of f: its owner, an administrator, or anyone for a
-- generation acquired before owners were recorded (owner_role NULL).
create function fence.check_owner(f fence.fences, p_job_key text, p_token bigint, p_what text) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  if f.owner_role is not null and f.owner_role <> session_user and not fence.is_admin() then
    raise exception 'job "%": token % belongs to role "%", not to "%"; % needs the role that acquired the lease',
        p_job_key, p_token, f.owner_role, session_user, p_what
      using errcode = 'FN011',
            hint = 'connect as the role that acquired this lease (fence.acquire records session_user), or acquire a lease of your own';
  end if;
end
$$;

-- check_job_grant raises FN011 when job authorization is on and no
-- pattern granted to the session's role (or a role it belongs to) matches.
create function fence.check_job_grant(p_job_key text) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  if not exists (select 1 from fence.settings s where s.name = 'job_authorization' and s.value = 'on') then
    return;
  end if;
  if fence.is_admin() or exists (
      select 1 from fence.job_grants g
       where p_job_key like g.pattern and fence.member_of(session_user, g.role)) then
    return;
  end if;
  raise exception 'job "%": role "%" may not acquire this job: no job pattern granted to it matches', p_job_key, session_user
    using errcode = 'FN011',
          hint = 'an administrator grants patterns with fence.grant_job(role, pattern), in LIKE syntax; fence.job_grants lists them';
end
$$;

create or replace function fence.acquire(job_key text, holder text, ttl interval)
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
    -- holder does not get it.
    select * into l from fence.leases le where le.job_key = acquire.job_key;
    if found and l.expires_at > v_now and l.token = f.max_issued_token
       and (l.holder <> acquire.holder or (f.owner_role is not null and f.owner_role <> session_user)) then
      raise exception 'job "%": lease is held by "%" (role %) with token % (epoch %) until %; "%" (role %) cannot take it over',
          acquire.job_key, l.holder, coalesce(f.owner_role::text, 'unrecorded'), l.token, f.epoch, l.expires_at,
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
  perform pg_notify('pgfence_takeover',
    json_build_object('job_key', acquire.job_key, 'epoch', v_epoch, 'token', v_token)::text);
  return query select v_epoch, v_token, v_expires;
end
$$;

create or replace function fence.renew(job_key text, token bigint, ttl interval) returns timestamptz
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
  perform fence.check_owner(f, renew.job_key, renew.token, 'renewing its lease');
  v_expires := clock_timestamp() + renew.ttl;
  update fence.leases le set expires_at = v_expires where le.job_key = renew.job_key;
  return v_expires;
end
$$;

create or replace function fence.release(job_key text, token bigint) returns void
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
  perform fence.check_owner(f, release.job_key, release.token, 'releasing its lease');
  delete from fence.leases le where le.job_key = release.job_key and le.token = release.token;
end
$$;

-- retire closes the job's current epoch. With a token, the caller ends its
-- own generation: the token must be current and the caller its owner (or
-- an administrator); the caller's own live lease ends with it. Without a
-- token (NULL), only an administrator may retire, and a live lease needs
-- force: nobody ends a running job's lease by accident.
drop function fence.retire(text);
create function fence.retire(job_key text, token bigint default null, force boolean default false) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
declare
  f fence.fences;
  l fence.leases;
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
  if retire.token is null then
    if not fence.is_admin() then
      raise exception 'job "%": retiring without a token needs pgfence_bypass; role "%" is not a member', retire.job_key, session_user
        using errcode = 'FN011',
              hint = 'pass the current token of your own lease (fence.retire(job_key, token)), or ask a member of pgfence_bypass';
    end if;
    select * into l from fence.leases le where le.job_key = retire.job_key;
    if found and l.token = f.max_issued_token and l.expires_at > v_now and not coalesce(retire.force, false) then
      raise exception 'job "%": lease is held by "%" with token % (epoch %) until %; retiring would end it',
          retire.job_key, l.holder, l.token, f.epoch, l.expires_at
        using errcode = 'FN002',
              hint = 'wait until the lease ends, or retire it anyway with force => true (pgfence lease retire --force)';
    end if;
  else
    if retire.token is distinct from f.max_issued_token then
      raise exception 'job "%": cannot retire with token % (epoch %; current token %)',
          retire.job_key, retire.token, f.epoch, f.max_issued_token
        using errcode = 'FN001',
              hint = 'another holder took over; the job is not yours to retire';
    end if;
    perform fence.check_owner(f, retire.job_key, retire.token, 'retiring the job');
  end if;
  update fence.fences fe set retired_at = v_now where fe.job_key = retire.job_key;
  update fence.epochs e set closed_at = v_now, last_token = f.max_issued_token where e.epoch = f.epoch;
  delete from fence.leases le where le.job_key = retire.job_key;
  perform pg_notify('pgfence_takeover',
    json_build_object('job_key', retire.job_key, 'epoch', f.epoch, 'token', f.max_issued_token, 'retired', true)::text);
end
$$;

-- gate_slow (see 002): the owner check comes last, once the generation is
-- known to be current; a replay needs none (it can never commit).
create or replace function fence.gate_slow(p_job_key text, p_epoch bigint, p_token bigint, p_step text) returns text
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
    insert into fence.replay_guards (job_key, epoch, token, step)
    values (v_key, p_epoch, p_token, v_step);
    perform set_config('pgfence.replay', pg_current_xact_id()::text, true);
    return 'replay';
  end if;
  perform fence.check_generation(f, v_key, p_epoch, p_token);
  perform fence.check_owner(f, v_key, p_token, 'writing under it');
  return 'ok';
end
$$;

create or replace function fence.gate(job_key text, epoch bigint, token bigint, step text default '') returns text
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
  -- One statement locks the row and probes the receipt (keep in step with
  -- fence.backstop).
  select fe.epoch, fe.max_issued_token, fe.retired_at, fe.owner_role,
         exists (select 1 from fence.receipts r
                  where r.job_key = v_key and r.epoch = gate.epoch and r.token = gate.token and r.step = v_step)
    into f.epoch, f.max_issued_token, f.retired_at, f.owner_role, v_replay
    from fence.fences fe where fe.job_key = v_key
     for update of fe;
  if (not v_replay and f.epoch = gate.epoch and f.retired_at is null and f.max_issued_token = gate.token
      and f.owner_role = session_user) is not true then
    if fence.gate_slow(v_key, gate.epoch, gate.token, v_step) = 'replay' then
      return 'replay';
    end if;
  end if;
  -- A transaction that gates a generation writes its receipt with
  -- fence.commit (the proxy and fence.RunTx always do), so the backstop
  -- need not mark it (§4): the setting is the backstop's own "already
  -- marked" (keep the value in step with fence.backstop). A caller that
  -- gates and then commits without fence.commit loses only its own
  -- receipt, as if it had forged the setting.
  perform set_config('pgfence.marked', format('%s %s %s %L %L', pg_current_xact_id(), gate.epoch, gate.token, v_key, v_step), true);
  return 'ok';
end
$$;

-- commit_slow is the rest of fence.commit when its one-statement insert
-- wrote nothing: a receipt exists (this transaction's own, written early by
-- the backstop; a replay; a conflict — answered first: L3), or the
-- generation does not hold the fence, or the caller is not its owner.
-- Plain function, run only inside fence.commit.
create function fence.commit_slow(p_job_key text, p_epoch bigint, p_token bigint, p_step text, p_digest bytea, p_version text)
returns text
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v_key text collate pg_catalog."default" := p_job_key;
  v_step text collate pg_catalog."default" := p_step;
  f fence.fences;
  rc fence.receipts;
begin
  select * into f from fence.fences fe where fe.job_key = v_key for update;
  select * into rc from fence.receipts r
   where r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step;
  if found then
    if rc.backstop_xid = pg_current_xact_id() then
      -- Written by this transaction's own mark, fired before COMMIT by SET
      -- CONSTRAINTS ALL IMMEDIATE: it is this commit's receipt, so it takes
      -- the digest presented now.
      update fence.receipts r
         set payload_digest = p_digest, digest_version = p_version, backstop_xid = null
       where r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step;
      return 'committed';
    end if;
    if rc.payload_digest = p_digest and rc.digest_version = p_version then
      raise exception 'job "%": epoch % token % step "%" already committed at % with the same payload: idempotent replay',
          v_key, p_epoch, p_token, v_step, rc.committed_at
        using errcode = 'FN00R',
              detail = 'the first commit stands; this transaction is rolled back so nothing is applied twice',
              hint = 'treat this as success';
    end if;
    raise exception 'job "%": epoch % token % step "%" already committed at % with a different payload (stored digest %/%, presented %/%)',
        v_key, p_epoch, p_token, v_step, rc.committed_at,
        rc.digest_version, encode(rc.payload_digest, 'hex'), p_version, encode(p_digest, 'hex')
      using errcode = 'FN003',
            hint = 'the first result stands and this one was rolled back; a changed result needs a new token (or a different step)';
  end if;
  -- Raises the precise error: unknown, retired, pruned, stale, not owner.
  perform fence.check_generation(f, v_key, p_epoch, p_token);
  perform fence.check_owner(f, v_key, p_token, 'committing under it');
  -- Current, and the caller may use it: an administrator, or a generation
  -- from before owners were recorded. The row lock keeps it so.
  insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version)
  values (v_key, p_epoch, p_token, v_step, p_digest, p_version);
  delete from fence.write_marks m
   where m.xid = pg_current_xact_id() and m.job_key = v_key and m.epoch = p_epoch and m.token = p_token and m.step = v_step;
  return 'committed';
end
$$;

-- commit: as in 002, plus the owner in the fast path's condition and the
-- removal of this generation's backstop mark (the receipt is written, so
-- the deferred trigger has nothing to do).
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
  insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version)
  select v_key, commit.epoch, commit.token, v_step, commit.digest, commit.digest_version
    from fence.fences fe
   where fe.job_key = v_key and fe.epoch = commit.epoch and fe.retired_at is null
     and fe.max_issued_token = commit.token and fe.owner_role = session_user
     for update of fe
  on conflict (job_key, epoch, token, step) do nothing;
  if not found then
    return fence.commit_slow(v_key, commit.epoch, commit.token, v_step, commit.digest, commit.digest_version);
  end if;
  delete from fence.write_marks m
   where m.xid = pg_current_xact_id() and m.job_key = v_key and m.epoch = commit.epoch
     and m.token = commit.token and m.step = v_step;
  return 'committed';
end
$$;

-- commit_if_written is fence.commit for a transaction the caller could not
-- see into (the proxy, at the COMMIT of a transaction it did not gate): it
-- writes the receipt, with fence.commit's checks and errors, when this
-- transaction changed a protected table under the generation (the
-- backstop's mark, or the receipt the mark already wrote), raises
-- fence.commit's replay or conflict when this transaction entered replay
-- mode for it, and otherwise returns 'none' and writes nothing.
create function fence.commit_if_written(job_key text, epoch bigint, token bigint, step text, digest bytea, digest_version text)
returns text
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
declare
  v_key text collate pg_catalog."default" := commit_if_written.job_key;
  v_step text collate pg_catalog."default" := coalesce(commit_if_written.step, '');
  v_xid xid8 := pg_current_xact_id_if_assigned();
begin
  -- A transaction without an id has written nothing, and has no replay
  -- guard (inserting one assigns an id).
  if v_xid is null then
    return 'none';
  end if;
  if exists (select 1 from fence.write_marks m
              where m.xid = v_xid and m.job_key = v_key and m.epoch = commit_if_written.epoch
                and m.token = commit_if_written.token and m.step = v_step)
     or exists (select 1 from fence.replay_guards g
                 where g.xid = v_xid and g.job_key = v_key and g.epoch = commit_if_written.epoch
                   and g.token = commit_if_written.token and g.step = v_step)
     or exists (select 1 from fence.receipts r
                 where r.job_key = v_key and r.epoch = commit_if_written.epoch
                   and r.token = commit_if_written.token and r.step = v_step and r.backstop_xid = v_xid) then
    return fence.commit(v_key, commit_if_written.epoch, commit_if_written.token, v_step,
                        commit_if_written.digest, commit_if_written.digest_version);
  end if;
  return 'none';
end
$$;

-- write_mark is the deferred constraint trigger on fence.write_marks: at
-- COMMIT (and at PREPARE TRANSACTION, and at SET CONSTRAINTS ALL
-- IMMEDIATE) it writes the receipt of a mark nobody receipted, digest
-- version backstop-v1: SHA-256 of the text of the statement that first
-- wrote a protected table under the generation (current_query()).
--
-- PREPARE TRANSACTION after such a write is refused (FN009): the prepared
-- transaction would keep the fence row locked after its client has gone.
-- A deferred trigger cannot tell PREPARE from COMMIT but by the text of the
-- statement being run, so the statement's text decides: a statement of
-- the query string (at its start, or after a semicolon) that reads PREPARE
-- TRANSACTION, with blanks and non-nested comments between the words.
create function fence.write_mark_fire() returns trigger
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  f fence.fences;
begin
  if not exists (select 1 from fence.write_marks m
                  where m.xid = new.xid and m.job_key = new.job_key and m.epoch = new.epoch
                    and m.token = new.token and m.step = new.step) then
    return null; -- fence.commit or fence.commit_if_written wrote the receipt
  end if;
  if coalesce(current_query(), '') ~* '(^|;)(\s|--[^\n]*(\n|$)|/\*([^*]|\*+[^*/])*\*+/)*prepare(\s|--[^\n]*(\n|$)|/\*([^*]|\*+[^*/])*\*+/)+transaction\M' then
    raise exception 'PREPARE TRANSACTION after a write to a protected table (job "%", epoch %, token %) is not supported',
        new.job_key, new.epoch, new.token
      using errcode = 'FN009',
            detail = 'a prepared transaction keeps the job''s fence row locked after its client has gone, so no takeover could happen',
            hint = 'COMMIT the transaction instead';
  end if;
  insert into fence.receipts (job_key, epoch, token, step, payload_digest, digest_version, backstop_xid)
  select new.job_key, new.epoch, new.token, new.step, new.digest, 'backstop-v1', new.xid
    from fence.fences fe
   where fe.job_key = new.job_key and fe.epoch = new.epoch and fe.retired_at is null
     and fe.max_issued_token = new.token
     for update of fe
  on conflict (job_key, epoch, token, step) do nothing;
  if not found and not exists (select 1 from fence.receipts r
                                where r.job_key = new.job_key and r.epoch = new.epoch
                                  and r.token = new.token and r.step = new.step) then
    -- The fence moved under the transaction's own hands (it retired the
    -- job or acquired it again after writing): as fence.commit would.
    select * into f from fence.fences fe where fe.job_key = new.job_key for update;
    perform fence.check_generation(f, new.job_key, new.epoch, new.token);
    raise exception 'job "%": could not record the receipt of epoch % token % step "%"', new.job_key, new.epoch, new.token, new.step
      using errcode = 'XX000';
  end if;
  -- A receipt that was there already is this transaction's own (a second
  -- mark) or, in replay mode, the first commit's: then the replay guard
  -- refuses this commit.
  delete from fence.write_marks m
   where m.xid = new.xid and m.job_key = new.job_key and m.epoch = new.epoch
     and m.token = new.token and m.step = new.step;
  return null;
end
$$;

create constraint trigger write_mark
  after insert on fence.write_marks
  deferrable initially deferred
  for each row execute function fence.write_mark_fire();

-- accept_event (see 004): also refuses, with FN005, an epoch and token that
-- fence.acquire never issued for the key, so a forged or corrupted event
-- cannot raise the consumer's watermark above the real generation.
create or replace function fence.accept_event(consumer text, job_key text, epoch bigint, token bigint) returns boolean
language plpgsql
security definer
set search_path = pg_catalog, fence
set plan_cache_mode = force_generic_plan
as $$
#variable_conflict use_column
declare
  w fence.consumer_watermarks;
  v_ok boolean;
begin
  if accept_event.consumer is null or accept_event.consumer = '' then
    raise exception 'consumer must not be empty' using errcode = '22023';
  end if;
  perform fence.validate_job_key(accept_event.job_key);
  if accept_event.epoch is null or accept_event.token is null then
    raise exception 'job "%": an event needs an epoch and a token', accept_event.job_key using errcode = '22023';
  end if;
  if not exists (select 1 from fence.issuance i
                  where i.token = accept_event.token and i.job_key = accept_event.job_key
                    and i.epoch = accept_event.epoch) then
    raise exception 'job "%": event of epoch % token % refused: that generation was never issued for this job',
        accept_event.job_key, accept_event.epoch, accept_event.token
      using errcode = 'FN005',
            detail = 'fence.acquire issued no such token in that epoch for this key, so the event is forged, corrupted or meant for another job',
            hint = 'drop the event (the watermark is unchanged) and check its producer';
  end if;
  if exists (select 1 from fence.epochs e
              where e.epoch = accept_event.epoch and e.job_key = accept_event.job_key
                and e.closed_at is not null) then
    insert into fence.consumer_log (consumer, job_key, epoch, token, accepted)
    values (accept_event.consumer, accept_event.job_key, accept_event.epoch, accept_event.token, false);
    return false;
  end if;
  insert into fence.consumer_watermarks as cw (consumer, job_key, epoch, token)
  values (accept_event.consumer, accept_event.job_key, accept_event.epoch, accept_event.token)
  on conflict (consumer, job_key) do nothing
  returning cw.* into w;
  if found then
    insert into fence.consumer_log (consumer, job_key, epoch, token, accepted)
    values (accept_event.consumer, accept_event.job_key, accept_event.epoch, accept_event.token, true);
    return true;
  end if;
  select * into w from fence.consumer_watermarks cw
   where cw.consumer = accept_event.consumer and cw.job_key = accept_event.job_key
     for update;
  v_ok := accept_event.epoch > w.epoch or (accept_event.epoch = w.epoch and accept_event.token >= w.token);
  if v_ok then
    update fence.consumer_watermarks cw
       set epoch = accept_event.epoch, token = accept_event.token
     where cw.consumer = accept_event.consumer and cw.job_key = accept_event.job_key;
  end if;
  insert into fence.consumer_log (consumer, job_key, epoch, token, accepted)
  values (accept_event.consumer, accept_event.job_key, accept_event.epoch, accept_event.token, v_ok);
  return v_ok;
end
$$;

-- has_generation answers read routing's question on a replica (the
-- proxy's fence-row check, DESIGN §6) without showing a token: has this
-- server's fence row of job_key reached token? Only for the caller's own
-- generations (issued to session_user, or before roles were recorded) or an
-- administrator: for any other token the answer is false ("not known"),
-- so the answer cannot be used to find another holder's token by bisection.
create function fence.has_generation(job_key text, token bigint) returns boolean
language sql
stable
security definer
set search_path = pg_catalog, fence
as $$
  select coalesce((select f.max_issued_token >= has_generation.token
                     from fence.fences f where f.job_key = has_generation.job_key), false)
     and (exists (select 1 from fence.issuance i
                   where i.token = has_generation.token and i.job_key = has_generation.job_key
                     and (i.role is null or i.role = session_user))
          or fence.is_admin())
$$;

-- Job authorization, for administrators (EXECUTE granted to
-- pgfence_bypass; superusers have it).
create function fence.check_admin(p_what text) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  if not fence.is_admin() then
    raise exception '% needs pgfence_bypass: role "%" is not a member', p_what, session_user
      using errcode = '42501', hint = 'ask a member of pgfence_bypass (or a superuser)';
  end if;
end
$$;

create function fence.set_job_authorization(enabled boolean) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
begin
  perform fence.check_admin('switching job authorization');
  if enabled is null then
    raise exception 'fence.set_job_authorization needs true or false' using errcode = '22023';
  end if;
  insert into fence.settings as s (name, value) values ('job_authorization', case when enabled then 'on' else 'off' end)
  on conflict (name) do update set value = excluded.value;
end
$$;

create function fence.grant_job(role name, pattern text) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
begin
  perform fence.check_admin('granting job patterns');
  if not exists (select 1 from pg_catalog.pg_roles r where r.rolname = grant_job.role) then
    raise exception 'role "%" does not exist', grant_job.role using errcode = '42704';
  end if;
  if grant_job.pattern is null or grant_job.pattern = '' then
    raise exception 'a job pattern must not be empty' using errcode = '22023',
      hint = 'LIKE syntax: ''report-%'' matches every key starting with report-; ''%'' matches every key';
  end if;
  insert into fence.job_grants (role, pattern) values (grant_job.role, grant_job.pattern)
  on conflict do nothing;
end
$$;

create function fence.revoke_job(role name, pattern text) returns boolean
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
#variable_conflict use_column
begin
  perform fence.check_admin('revoking job patterns');
  delete from fence.job_grants g where g.role = revoke_job.role and g.pattern = revoke_job.pattern;
  return found;
end
$$;

revoke all on all functions in schema fence from public;
grant execute on function
  fence.retire(text, bigint, boolean),
  fence.commit_if_written(text, bigint, bigint, text, bytea, text)
  to pgfence_worker;
grant execute on function fence.has_generation(text, bigint) to public;
-- Administrators (pgfence_bypass) retire, release and collect without being
-- workers; the functions check the rest.
grant execute on function
  fence.set_job_authorization(boolean),
  fence.grant_job(name, text),
  fence.revoke_job(name, text),
  fence.retire(text, bigint, boolean),
  fence.release(text, bigint),
  fence.gc(interval)
  to pgfence_bypass;
-- Administrators see everything (workers see fence.jobs).
grant select on fence.fences, fence.leases, fence.epochs, fence.issuance, fence.receipts,
  fence.gc_watermarks, fence.protected_tables, fence.consumer_watermarks, fence.consumer_log,
  fence.settings, fence.job_grants
  to pgfence_bypass;
-- Trigger functions and the predicates the backstop calls in the writer's
-- rights (003's grants, which the revoke above took back, and the new ones).
grant execute on function fence.is_bypass(name), fence.member_of(name, name), fence.session_bypass(),
  fence.backstop(), fence.backstop_nometa(), fence.backstop_row(), fence.replay_skip(),
  fence.write_mark_fire() to public;
