-- Issue 30 (attack round 2, E-M3): who may claim a consumer name.
-- docs/security.md ("Consumers refuse what was never issued, and are
-- their role's") describes the defence and its cost.
--
-- 015's fence.check_consumer claimed an unknown consumer name for
-- session_user before fence.accept_event looked at the event, so one
-- event nobody ever issued (fence.accept_event('billing', 'job-never',
-- 1, 1), answered false) made 'billing' the caller's for good, and the
-- real consumer's role got 42501. Two things change:
--
-- 1. A rejected event claims nothing. The name is claimed (for the
--    caller) only when the event is accepted, i.e. after the issuance
--    check, in the same transaction as the watermark it sets. Rejected,
--    fence.accept_event changes nothing but fence.consumer_log.
--
-- 2. Consumer authorization (optional, off by default, like job
--    authorization and for the same reason): with
--    fence.set_consumer_authorization(true), a role that is not an
--    administrator accepts events only under consumer names matching a
--    LIKE pattern granted to it or to a role it belongs to
--    (fence.grant_consumer, fence.revoke_consumer, fence.consumer_grants);
--    others get 42501 whatever the event (so the answer tells nothing
--    about it) and before anything is claimed or locked. A claim whose
--    role is no longer granted the name (a squatter's from while the
--    switch was off, or one whose grant was revoked) lapses: the next
--    granted role whose event under the name is accepted takes it over.
--    Claims of administrators do not lapse. Off, the first role whose
--    event is accepted under a new name keeps it (an administrator
--    reassigns it with fence.assign_consumer).
--
--    Claims 015 made with rejected events alone lapse now: a name under
--    which no event was ever accepted has no watermark row (watermarks
--    are never deleted), and its claim is dropped; the name's next
--    accepted event claims it.
--
--    Consumer names get grants of their own, not fence.job_grants: a
--    consumer is usually a different role from the workers whose events
--    it reads, and a job pattern granted to it would let it acquire those
--    jobs (and a worker's job pattern would let it take consumers). The
--    switch is its own too: a database that has job authorization on
--    would otherwise refuse, after this upgrade, every new consumer name
--    (no consumer patterns are granted yet), which is what job
--    authorization's default avoided.

create table fence.consumer_grants (
  role       name not null,
  pattern    text not null check (pattern <> ''),
  granted_at timestamptz not null default clock_timestamp(),
  primary key (role, pattern)
);
comment on table fence.consumer_grants is 'LIKE patterns of consumer names each role may accept events under while consumer_authorization is on';
revoke all on fence.consumer_grants from public;
grant select on fence.consumer_grants to pgfence_bypass;
comment on table fence.settings is 'pgfence switches: job_authorization (on/off), consumer_authorization (on/off), max_lease_ttl (an interval; no row: no cap)';

-- Claims made by rejected events alone (under 015).
delete from fence.consumers c
 where not exists (select 1 from fence.consumer_watermarks w where w.consumer = c.consumer);

-- consumer_granted: does a pattern granted to p_role (or a role it
-- belongs to) match consumer name p_consumer? (PL/pgSQL, so that its plan
-- is kept for the session: a SQL function with a SET clause is planned
-- again at every call, which cost 250 µs per accept_event here.)
create function fence.consumer_granted(p_role name, p_consumer text) returns boolean
language plpgsql stable
set search_path = pg_catalog, fence, pg_temp
as $$
begin
  return exists (
    with recursive up(oid) as (
      select r.oid from pg_catalog.pg_roles r where r.rolname = p_role
      union
      select m.roleid from pg_catalog.pg_auth_members m join up on m.member = up.oid
    )
    select 1 from fence.consumer_grants g
      join pg_catalog.pg_roles gr on gr.rolname = g.role
      join up on up.oid = gr.oid
     where p_consumer operator(pg_catalog.~~) g.pattern);
end
$$;

-- consumer_authorization: is the switch on?
create function fence.consumer_authorization() returns boolean
language plpgsql stable
set search_path = pg_catalog, fence, pg_temp
as $$
begin
  return exists (select 1 from fence.settings s where s.name = 'consumer_authorization' and s.value = 'on');
end
$$;

-- claim_lapsed: with consumer authorization on, a claim of p_role on
-- p_consumer stands only while p_role is granted the name or is an
-- administrator.
create function fence.claim_lapsed(p_role name, p_consumer text) returns boolean
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  select fence.consumer_authorization()
     and not coalesce((select r.rolsuper from pg_catalog.pg_roles r where r.rolname = p_role), false)
     and not fence.is_bypass(p_role)
     and not fence.consumer_granted(p_role, p_consumer)
$$;

-- check_consumer (replacing 015's, which claimed the name) raises 42501
-- unless the session's role may accept events under p_consumer, and says
-- whether the name is to be claimed for it should its event be accepted
-- (the name is unclaimed, or its claim lapsed). It claims and locks
-- nothing.
drop function fence.check_consumer(text);
create function fence.check_consumer(p_consumer text) returns boolean
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_role name;
begin
  -- (The switch first: off, the common path reads one settings row and
  -- the consumer's.)
  if fence.consumer_authorization() and not fence.consumer_granted(session_user, p_consumer) and not fence.is_admin() then
    raise exception 'role "%" may not accept events for consumer "%": no consumer pattern granted to it matches', session_user, p_consumer
      using errcode = '42501',
            detail = 'consumer authorization is on: a role accepts events only under consumer names granted to it or to a role it belongs to',
            hint = 'an administrator grants patterns with fence.grant_consumer(role, pattern), in LIKE syntax; fence.consumer_grants lists them';
  end if;
  select c.role into v_role from fence.consumers c where c.consumer = p_consumer;
  if not found then
    return true;
  end if;
  if v_role = session_user or fence.is_admin() then
    return false;
  end if;
  if fence.claim_lapsed(v_role, p_consumer) then
    return true;
  end if;
  perform fence.consumer_refused(p_consumer, v_role);
  return false;
end
$$;

-- consumer_refused raises the 42501 of a consumer another role has.
create function fence.consumer_refused(p_consumer text, p_role name) returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
begin
  raise exception 'consumer "%" belongs to role "%"; role "%" may not accept events for it', p_consumer, p_role, session_user
    using errcode = '42501',
          detail = 'a consumer''s watermarks are advanced only by the role whose event first was accepted under its name',
          hint = 'use a consumer name of this role''s own, or ask a member of pgfence_bypass to reassign the consumer (fence.assign_consumer)';
end
$$;

-- claim_consumer makes p_consumer the session's role's: called by
-- fence.accept_event for an accepted event when check_consumer said so.
-- It takes a lapsed claim over; a claim another role made in the meantime
-- (and that has not lapsed) is refused.
create function fence.claim_consumer(p_consumer text) returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_role name;
begin
  insert into fence.consumers as c (consumer, role) values (p_consumer, session_user)
  on conflict (consumer) do update set role = excluded.role, claimed_at = clock_timestamp()
   where c.role <> excluded.role and fence.claim_lapsed(c.role, c.consumer);
  if found then
    return;
  end if;
  select c.role into v_role from fence.consumers c where c.consumer = p_consumer;
  if v_role <> session_user and not fence.is_admin() then
    perform fence.consumer_refused(p_consumer, v_role);
  end if;
end
$$;

create or replace function fence.accept_event(consumer text, job_key text, epoch bigint, token bigint) returns boolean
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
set plan_cache_mode = force_generic_plan
as $$
#variable_conflict use_column
declare
  w fence.consumer_watermarks;
  v_ok boolean;
  v_claim boolean;
begin
  if accept_event.consumer is null or accept_event.consumer = '' then
    raise exception 'consumer must not be empty' using errcode = '22023';
  end if;
  perform fence.validate_job_key(accept_event.job_key);
  if accept_event.epoch is null or accept_event.token is null then
    raise exception 'job "%": an event needs an epoch and a token', accept_event.job_key using errcode = '22023';
  end if;
  -- (015, 016) May this role use the consumer? Checked before anything is
  -- claimed or locked.
  v_claim := fence.check_consumer(accept_event.consumer);
  if not exists (select 1 from fence.issuance i
                  where i.token = accept_event.token and i.job_key = accept_event.job_key
                    and i.epoch = accept_event.epoch)
     or exists (select 1 from fence.epochs e
                 where e.epoch = accept_event.epoch and e.job_key = accept_event.job_key
                   and e.closed_at is not null) then
    -- (016) Rejected: no claim.
    insert into fence.consumer_log (consumer, job_key, epoch, token, accepted)
    values (accept_event.consumer, accept_event.job_key, accept_event.epoch, accept_event.token, false);
    return false;
  end if;
  -- (016) An issued event: a new (or lapsed) name becomes this role's.
  if v_claim then
    perform fence.claim_consumer(accept_event.consumer);
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

create function fence.set_consumer_authorization(enabled boolean) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
begin
  perform fence.check_admin('switching consumer authorization');
  if enabled is null then
    raise exception 'fence.set_consumer_authorization needs true or false' using errcode = '22023';
  end if;
  insert into fence.settings as s (name, value) values ('consumer_authorization', case when enabled then 'on' else 'off' end)
  on conflict (name) do update set value = excluded.value;
end
$$;

create function fence.grant_consumer(role name, pattern text) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
#variable_conflict use_column
begin
  perform fence.check_admin('granting consumer patterns');
  if not exists (select 1 from pg_catalog.pg_roles r where r.rolname = grant_consumer.role) then
    raise exception 'role "%" does not exist', grant_consumer.role using errcode = '42704';
  end if;
  if grant_consumer.pattern is null or grant_consumer.pattern = '' then
    raise exception 'a consumer pattern must not be empty' using errcode = '22023',
      hint = 'LIKE syntax: ''billing-%'' matches every consumer name starting with billing-; ''%'' matches every name';
  end if;
  insert into fence.consumer_grants (role, pattern) values (grant_consumer.role, grant_consumer.pattern)
  on conflict do nothing;
end
$$;

create function fence.revoke_consumer(role name, pattern text) returns boolean
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
#variable_conflict use_column
begin
  perform fence.check_admin('revoking consumer patterns');
  delete from fence.consumer_grants g where g.role = revoke_consumer.role and g.pattern = revoke_consumer.pattern;
  return found;
end
$$;

revoke all on function fence.consumer_granted(name, text), fence.consumer_authorization(),
  fence.claim_lapsed(name, text), fence.check_consumer(text), fence.consumer_refused(text, name),
  fence.claim_consumer(text), fence.set_consumer_authorization(boolean),
  fence.grant_consumer(name, text), fence.revoke_consumer(name, text) from public;
grant execute on function fence.set_consumer_authorization(boolean), fence.grant_consumer(name, text),
  fence.revoke_consumer(name, text) to pgfence_bypass;
