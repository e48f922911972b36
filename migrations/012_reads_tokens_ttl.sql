-- Issue 30 (medium and low findings). docs/security.md has the trust model.
--
-- 1. Tokens stay with the role they were issued to.
--    * pgfence_takeover notifications carry the job key and epoch (both
--      in fence.jobs, which PUBLIC reads), never the token: any login may
--      LISTEN. The proxy reads the token itself, from fence.fences, on its
--      own connection (proxy/lsn.go): a notification is only a hint.
--    * No error names a token the caller did not present.
--    * fence.renew, fence.release and fence.retire answer a role that does
--      not own the job's current generation with FN001, whatever token it
--      presents: before, FN011 for the current token and FN001 for any
--      other told the current one from the rest.
--    * fence.accept_event answers an event whose generation was never
--      issued as it answers an older one: false, the watermark unchanged.
--      Before, FN005 told issued tokens from the others.
-- 2. Lease squatting: fence.acquire and fence.renew refuse (22023) a TTL
--    longer than fence.settings' max_lease_ttl (1 day) to a role that is
--    not an administrator; fence.set_max_lease_ttl moves or removes the
--    cap (administrators). Job authorization stays off by default
--    (turning it on would stop every existing worker's acquire).
-- 3. Only a gated write changes what a protected row reads. The DDL guard
--    (008) records each protected member's read shape (fence.read_shapes:
--    its columns, the types they use, recursively, and its row-level
--    security) and refuses, for non-administrators, DDL that changes it:
--    dropping or renaming a column, a new column whose existing rows read
--    a value (a default), a type or collation change that changes what a
--    column reads (even without a rewrite), renaming an enum value or
--    changing a composite's attributes, row-level security and policies;
--    also the drops that take a column or a policy with them (CASCADE).

-- 2. The lease TTL cap.
insert into fence.settings (name, value) values ('max_lease_ttl', '1 day') on conflict (name) do nothing;
comment on table fence.settings is 'pgfence switches: job_authorization (on/off), max_lease_ttl (an interval; no row: no cap)';

-- check_lease_ttl raises 22023 when p_ttl is over the cap and the session
-- is not an administrator.
create function fence.check_lease_ttl(p_job_key text, p_ttl interval) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v_cap interval;
begin
  select s.value::interval into v_cap from fence.settings s where s.name = 'max_lease_ttl';
  if v_cap is not null and p_ttl > v_cap and not fence.is_admin() then
    raise exception 'job "%": lease ttl % is longer than the limit of % (max_lease_ttl)', p_job_key, p_ttl, v_cap
      using errcode = '22023',
            hint = 'take a shorter lease and renew it while the work runs (pgfence run renews for you); an administrator moves the limit with fence.set_max_lease_ttl(interval)';
  end if;
end
$$;

create function fence.set_max_lease_ttl(ttl interval) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
begin
  perform fence.check_admin('setting the lease ttl limit');
  if ttl is null then
    delete from fence.settings s where s.name = 'max_lease_ttl';
    return;
  end if;
  if ttl <= interval '0' then
    raise exception 'the lease ttl limit must be positive, got %', ttl using errcode = '22023',
      hint = 'pass an interval such as ''1 day'', or null for no limit';
  end if;
  insert into fence.settings as s (name, value) values ('max_lease_ttl', ttl::text)
  on conflict (name) do update set value = excluded.value;
end
$$;

-- 1 and 2: the lease functions (006), without tokens in their notifications
-- and errors, with the TTL cap.
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

-- not_holder raises FN001 for a session whose role does not own f's
-- current generation (and is no administrator): the same answer whatever
-- token it presented, so that it cannot tell the current token from the
-- others. (A generation from before owners were recorded has none.)
create function fence.not_holder(f fence.fences, p_job_key text, p_token bigint, p_what text) returns void
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  if f.owner_role is not null and f.owner_role <> session_user and not fence.is_admin() then
    raise exception 'job "%": cannot % with token %: role "%" does not hold this job''s lease (role "%" does)',
        p_job_key, p_what, p_token, session_user, f.owner_role
      using errcode = 'FN001',
            hint = 'this worker does not hold the lease: stop, and acquire one of your own if there is work left';
  end if;
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
  perform fence.check_lease_ttl(renew.job_key, renew.ttl);
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

-- accept_event (006): an event whose generation fence.acquire never issued
-- for the key is rejected like an older one (false, the watermark
-- unchanged, logged as not accepted), so that the answer does not tell
-- issued tokens from the others. It still can never raise a watermark.
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
                    and i.epoch = accept_event.epoch)
     or exists (select 1 from fence.epochs e
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

-- 3. Read shapes. A member's shape is a set of facts (jsonb objects), by
-- name and position rather than by OID so that a dump restores it as it
-- was:
--   col:  every column, by its position among the live columns: name,
--         type (format_type), typmod, collation;
--   rls:  row-level security enabled, forced;
--   pol:  every policy: name, command, permissive, roles, expressions;
--   enum: every label of every enum a column uses;
--   attr: every attribute of every composite a column uses;
-- where "uses" follows domains to their base types, arrays to their
-- elements, composites to their attributes' types and ranges to their
-- subtypes. A shape belongs to the protection it was recorded under
-- (protected_at): a table protected again, or a new table that got a
-- dropped one's OID, is recorded afresh. (No foreign key: it would change
-- the answer to TRUNCATE fence.protected_tables, which 010 refuses.)
create table fence.read_shapes (
  relid        regclass primary key,
  protected_at timestamptz not null,
  facts        jsonb not null,
  recorded_at  timestamptz not null default clock_timestamp()
);
comment on table fence.read_shapes is 'what the rows of each protected member read, as the DDL guard last let it change: only an administrator''s DDL changes it in ways that change what existing rows read';
revoke all on fence.read_shapes from public;
grant select on fence.read_shapes to pgfence_bypass;

create function fence.collation_name(p_coll oid) returns text
language sql stable
set search_path = pg_catalog
as $$
  select coalesce((select format('%I.%I', n.nspname, c.collname)
                     from pg_catalog.pg_collation c join pg_catalog.pg_namespace n on n.oid = c.collnamespace
                    where c.oid = p_coll), '')
$$;

create function fence.read_facts(rel regclass) returns jsonb
language plpgsql stable
set search_path = pg_catalog, fence
as $$
-- (PL/pgSQL so that the plan is cached; the laterals with OFFSET 0 make
-- it follow the few types in use by index rather than join the catalogs.)
begin
  return (
  with recursive
  cols as (
    select row_number() over (order by a.attnum) as i, a.attname, a.atttypid, a.atttypmod, a.attcollation
      from pg_catalog.pg_attribute a
     where a.attrelid = rel and a.attnum > 0 and not a.attisdropped),
  used(oid) as (
    select c.atttypid from cols c
    union
    select n.oid
      from used u
     cross join lateral (select t.oid, t.typtype, t.typbasetype, t.typelem, t.typlen, t.typrelid
                           from pg_catalog.pg_type t where t.oid = u.oid offset 0) t
     cross join lateral (
       select t.typbasetype where t.typtype = 'd'
       union all
       select t.typelem where t.typelem <> 0 and t.typlen = -1
       union all
       select a.atttypid from pg_catalog.pg_attribute a
        where t.typtype = 'c' and a.attrelid = t.typrelid and a.attnum > 0 and not a.attisdropped
       union all
       select r.rngsubtype from pg_catalog.pg_range r where t.typtype = 'r' and r.rngtypid = t.oid
       union all
       -- a multirange (PostgreSQL 14 on) depends internally on its range
       select d.refobjid from pg_catalog.pg_depend d
        where t.typtype = 'm' and d.classid = 'pg_catalog.pg_type'::pg_catalog.regclass and d.objid = t.oid
          and d.refclassid = 'pg_catalog.pg_type'::pg_catalog.regclass and d.deptype = 'i') n(oid)),
  facts(f) as (
    select jsonb_build_object('k', 'col', 'i', c.i, 'n', c.attname, 't', pg_catalog.format_type(c.atttypid, null),
                              'm', c.atttypmod, 'c', fence.collation_name(c.attcollation))
      from cols c
    union all
    select jsonb_build_object('k', 'rls', 'on', c.relrowsecurity, 'force', c.relforcerowsecurity)
      from pg_catalog.pg_class c where c.oid = rel
    union all
    select jsonb_build_object('k', 'pol', 'n', p.polname, 'cmd', p.polcmd, 'perm', p.polpermissive,
                              'roles', array_to_string(array(select case when r = 0 then 'public' else quote_ident(pg_catalog.pg_get_userbyid(r)) end
                                                               from unnest(p.polroles) r order by 1), ','),
                              'q', coalesce(pg_catalog.pg_get_expr(p.polqual, p.polrelid), ''),
                              'w', coalesce(pg_catalog.pg_get_expr(p.polwithcheck, p.polrelid), ''))
      from pg_catalog.pg_policy p where p.polrelid = rel
    union all
    select jsonb_build_object('k', 'enum', 't', pg_catalog.format_type(e.enumtypid, null), 'l', e.enumlabel)
      from used u cross join lateral (select e.enumtypid, e.enumlabel from pg_catalog.pg_enum e
                                       where e.enumtypid = u.oid offset 0) e
    union all
    select jsonb_build_object('k', 'attr', 't', pg_catalog.format_type(t.oid, null),
                              'i', row_number() over (partition by t.oid order by a.attnum), 'n', a.attname,
                              'ty', pg_catalog.format_type(a.atttypid, null), 'm', a.atttypmod,
                              'c', fence.collation_name(a.attcollation))
      from used u
     cross join lateral (select t.oid, t.typrelid from pg_catalog.pg_type t
                          where t.oid = u.oid and t.typtype = 'c' offset 0) t
     cross join lateral (select a.attnum, a.attname, a.atttypid, a.atttypmod, a.attcollation from pg_catalog.pg_attribute a
                          where a.attrelid = t.typrelid and a.attnum > 0 and not a.attisdropped offset 0) a)
  select coalesce(jsonb_agg(f order by f::text), '[]'::jsonb) from facts);
end
$$;

-- same_reading_type: does a column that was of type p_old (typmod p_oldmod)
-- read the same as of type p_new (p_newmod)? Only for the changes
-- PostgreSQL makes without a rewrite and whose output stays the same:
-- wider varchar, varbit, numeric (same scale) and time types, varchar and
-- text into each other. Everything else (cidr to inet, oid to regclass, a
-- domain, …) may read otherwise.
create function fence.same_reading_type(p_old text, p_oldmod int, p_new text, p_newmod int) returns boolean
language sql immutable
set search_path = pg_catalog
as $$
  select p_old = p_new and p_oldmod = p_newmod
      or p_old in ('character varying', 'text') and p_new = 'text'
      or p_old in ('character varying', 'text') and p_new = 'character varying' and p_newmod = -1
      or p_old = p_new and p_old in ('character varying', 'bit varying', 'timestamp without time zone',
                                     'timestamp with time zone', 'time without time zone', 'time with time zone')
         and (p_newmod = -1 or p_oldmod <> -1 and p_newmod >= p_oldmod)
      or p_old = p_new and p_old = 'numeric'
         and (p_newmod = -1 or p_oldmod <> -1 and ((p_newmod - 4) & 2047) = ((p_oldmod - 4) & 2047)
                               and ((p_newmod - 4) >> 16) >= ((p_oldmod - 4) >> 16))
$$;

-- read_change says how p_new changes what the rows of rel read compared
-- with p_old, or NULL when they read the same: every recorded fact must
-- stay (a column's type may change only as same_reading_type allows); a
-- new column must read NULL in existing rows (no missing value, not
-- generated); new enum labels are harmless, as are the facts of a type a
-- new column brought; new policies, new attributes of a composite in use
-- and any other change are not.
create function fence.read_change(rel regclass, p_old jsonb, p_new jsonb) returns text
language plpgsql stable
set search_path = pg_catalog, fence
as $$
declare
  f jsonb;
begin
  for f in select e from jsonb_array_elements(p_old) e except select e from jsonb_array_elements(p_new) e loop
    case f->>'k'
    when 'col' then
      if exists (select 1 from jsonb_array_elements(p_new) g
                  where g->>'k' = 'col' and g->'i' = f->'i' and g->>'n' = f->>'n' and g->>'c' = f->>'c'
                    and fence.same_reading_type(f->>'t', (f->>'m')::int, g->>'t', (g->>'m')::int)) then
        continue;
      end if;
      if exists (select 1 from jsonb_array_elements(p_new) g where g->>'k' = 'col' and g->'i' = f->'i' and g->>'n' = f->>'n') then
        return format('change the type or collation of its column %I (%s) so that it reads otherwise', f->>'n', f->>'t');
      end if;
      return format('drop or rename its column %I', f->>'n');
    when 'rls' then
      return 'change its row-level security';
    when 'pol' then
      return format('drop or change its row-level security policy %I', f->>'n');
    when 'enum' then
      return format('rename value %L of enum type %s, which it uses', f->>'l', f->>'t');
    when 'attr' then
      return format('change attribute %I of composite type %s, which it uses (or rename that type)', f->>'n', f->>'t');
    else
      return format('change what it reads (%s)', f::text);
    end case;
  end loop;
  for f in select e from jsonb_array_elements(p_new) e except select e from jsonb_array_elements(p_old) e loop
    case f->>'k'
    when 'col' then
      if exists (select 1 from jsonb_array_elements(p_old) g where g->>'k' = 'col' and g->'i' = f->'i') then
        continue; -- a changed column, judged above
      end if;
      if exists (select 1 from pg_catalog.pg_attribute a
                  where a.attrelid = rel and a.attname = f->>'n' and not a.attisdropped
                    and (a.atthasmissing or a.attgenerated <> '')) then
        return format('add column %I with a value for its existing rows (a default)', f->>'n');
      end if;
    when 'pol' then
      return format('add row-level security policy %I', f->>'n');
    when 'enum' then
      null; -- a new label, or a type a new column brought
    when 'attr' then
      if exists (select 1 from jsonb_array_elements(p_old) g where g->>'k' = 'attr' and g->>'t' = f->>'t') then
        return format('add an attribute to composite type %s, which it uses', f->>'t');
      end if;
    else
      return format('change what it reads (%s)', f::text);
    end case;
  end loop;
  return null;
end
$$;

-- read_check compares rel's shape now with the recorded one. It returns
-- what changed when the change is one only an administrator may make and
-- p_allowed is false; otherwise it records the shape now and returns NULL.
-- A member without a recorded shape joined the tree in this command (the
-- ddl_command_start guard records every other one before any DDL): its
-- shape is recorded.
create function fence.read_check(rel regclass, p_allowed boolean) returns text
language plpgsql
set search_path = pg_catalog, fence
as $$
declare
  v_old jsonb;
  v_new jsonb := fence.read_facts(rel);
  v_problem text;
begin
  select s.facts into v_old
    from fence.read_shapes s join fence.protected_tables q on q.relid = s.relid and q.protected_at = s.protected_at
   where s.relid = rel
     for update of s;
  if not found then
    insert into fence.read_shapes as s (relid, protected_at, facts)
    select q.relid, q.protected_at, v_new from fence.protected_tables q where q.relid = rel
    on conflict (relid) do update set protected_at = excluded.protected_at, facts = excluded.facts, recorded_at = clock_timestamp();
    return null;
  end if;
  if v_old = v_new then
    return null;
  end if;
  if not p_allowed then
    v_problem := fence.read_change(rel, v_old, v_new);
    if v_problem is not null then
      return v_problem;
    end if;
  end if;
  update fence.read_shapes s set facts = v_new, recorded_at = clock_timestamp() where s.relid = rel;
  return null;
end
$$;

-- tables_using_types: the protected members whose rows read a value of one
-- of p_types, through domains, arrays, composites (and typed tables) and
-- ranges: the dependents of those types in pg_depend, walked up.
create function fence.tables_using_types(p_types oid[]) returns setof regclass
language sql stable
set search_path = pg_catalog, fence
as $$
  with recursive up(classid, objid) as (
    select 'pg_catalog.pg_type'::pg_catalog.regclass::oid, t from unnest(p_types) t
    union
    select n.classid, n.objid
      from up cross join lateral (
        select d.classid, d.objid from pg_catalog.pg_depend d
         where d.refclassid = up.classid and d.refobjid = up.objid and d.refobjsubid = 0
           and d.classid in ('pg_catalog.pg_type'::pg_catalog.regclass, 'pg_catalog.pg_class'::pg_catalog.regclass)
        union all
        select 'pg_catalog.pg_type'::pg_catalog.regclass::oid, c.reltype from pg_catalog.pg_class c
         where up.classid = 'pg_catalog.pg_class'::pg_catalog.regclass and c.oid = up.objid and c.relkind = 'c') n)
  select q.relid from fence.protected_tables q
   where exists (select 1 from up where up.classid = 'pg_catalog.pg_class'::pg_catalog.regclass and up.objid = q.relid)
$$;

-- guard_ddl_start runs at ddl_command_start: before any DDL, every
-- protected member has a recorded shape (one protected since the last DDL,
-- by fence.protect or a row added to fence.protected_tables, gets it now),
-- so ddl_command_end compares with what was there before the command.
create function fence.guard_ddl_start() returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
begin
  if fence.guard_idle() then
    return;
  end if;
  insert into fence.read_shapes as s (relid, protected_at, facts)
  select q.relid, q.protected_at, fence.read_facts(q.relid) from fence.protected_tables q
   where not exists (select 1 from fence.read_shapes s where s.relid = q.relid and s.protected_at = q.protected_at)
     and exists (select 1 from pg_catalog.pg_class c where c.oid = q.relid)
  on conflict (relid) do update set protected_at = excluded.protected_at, facts = excluded.facts, recorded_at = clock_timestamp();
end
$$;

-- guard_ddl_end (008), now also refusing changes of what protected rows
-- read: every member of the trees of the tables a command touched is
-- checked as before (backstop_problem, membership) and then against its
-- read shape (read_check); so is every protected table whose policy the
-- command created or altered, or that uses a type it changed (an enum, a
-- domain, a composite, a table's row type): those commands cannot change
-- a tree's membership or its triggers, so only their shapes are read.
create or replace function fence.guard_ddl_end() returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  r record;
  p fence.protected_tables;
  v_roots regclass[] := '{}';
  v_types oid[] := '{}';
  v_shapes regclass[] := '{}';
  v_checked regclass[] := '{}';
  v_root regclass;
  v_rel regclass;
  v_column text;
  v_tag text;
  v_problem text;
  v_read text;
  v_allowed boolean;
  v_changed boolean := false;
begin
  if fence.guard_idle() then
    return;
  end if;
  for r in select c.command_tag, c.classid, c.objid from pg_catalog.pg_event_trigger_ddl_commands() c loop
    if r.classid = 'pg_catalog.pg_class'::regclass then
      if r.command_tag in ('CREATE TABLE', 'ALTER TABLE', 'CREATE FOREIGN TABLE', 'ALTER FOREIGN TABLE') then
        -- The table's own tree, the tree of a protected parent it joined,
        -- and the tree of a protected child it took in.
        v_roots := v_roots || array(
          select q.root from fence.protected_tables q where q.relid = r.objid::regclass
          union
          select q.root from pg_catalog.pg_inherits i join fence.protected_tables q on q.relid = i.inhparent
           where i.inhrelid = r.objid
          union
          select q.root from pg_catalog.pg_inherits i join fence.protected_tables q on q.relid = i.inhrelid
           where i.inhparent = r.objid);
        v_tag := coalesce(v_tag, r.command_tag);
      end if;
      -- A relation's row type (a composite type's, a table's, a view's)
      -- may be what a protected column holds.
      v_types := v_types || array(select c.reltype from pg_catalog.pg_class c where c.oid = r.objid and c.reltype <> 0);
    elsif r.classid = 'pg_catalog.pg_type'::regclass then
      -- ALTER TYPE (an enum's values, a composite's attributes), ALTER
      -- DOMAIN, and their renames.
      v_types := v_types || r.objid;
    elsif r.classid = 'pg_catalog.pg_policy'::regclass then
      -- CREATE POLICY, ALTER POLICY (DROP POLICY: sql_drop).
      v_shapes := v_shapes || array(
        select q.relid from pg_catalog.pg_policy pol join fence.protected_tables q on q.relid = pol.polrelid
         where pol.oid = r.objid);
    elsif r.classid in ('pg_catalog.pg_trigger'::regclass, 'pg_catalog.pg_rewrite'::regclass) then
      -- CREATE [OR REPLACE] TRIGGER, ALTER TRIGGER, CREATE [OR REPLACE]
      -- RULE on a protected table. Any trigger: one that fires before the
      -- backstop's can change the settings it reads, or a row's job key
      -- after pgfence_job_key checked it; a rule can redirect the writes.
      if r.classid = 'pg_catalog.pg_trigger'::regclass then
        -- (Not the triggers PostgreSQL makes for a foreign key.)
        select t.tgrelid into v_rel from pg_catalog.pg_trigger t where t.oid = r.objid and not t.tgisinternal;
      else
        select w.ev_class into v_rel from pg_catalog.pg_rewrite w where w.oid = r.objid;
      end if;
      if exists (select 1 from fence.protected_tables q where q.relid = v_rel) then
        v_allowed := coalesce(v_allowed, fence.is_admin());
        if not v_allowed then
          raise exception '% on protected table % needs pgfence_bypass, and role "%" is not a member', r.command_tag, v_rel, session_user
            using errcode = 'FN010',
                  detail = 'triggers and rules on a protected table decide what its backstop sees',
                  hint = 'ask a member of pgfence_bypass (a DBA) to make this change';
        end if;
      end if;
    elsif r.classid = 'pg_catalog.pg_namespace'::regclass then
      -- ALTER SCHEMA … RENAME renames every protected table in it.
      v_roots := v_roots || array(
        select q.root from fence.protected_tables q join pg_catalog.pg_class c on c.oid = q.relid
         where c.relnamespace = r.objid);
      v_tag := coalesce(v_tag, r.command_tag);
    end if;
  end loop;
  if cardinality(v_types) > 0 then
    v_shapes := v_shapes || array(select u from fence.tables_using_types(v_types) u);
  end if;
  if cardinality(v_roots) = 0 and cardinality(v_shapes) = 0 then
    return;
  end if;
  v_tag := coalesce(v_tag, tg_tag);
  v_allowed := coalesce(v_allowed, fence.is_admin());
  for v_root in select distinct u.root from unnest(v_roots) as u(root) loop
    select q.job_key_column into v_column from fence.protected_tables q where q.relid = v_root and q.root = v_root;
    if not found then
      continue; -- adopted by another tree earlier in this loop
    end if;
    for p in select q.* from fence.protected_tables q
              where q.root = v_root and exists (select 1 from pg_catalog.pg_class c where c.oid = q.relid) loop
      v_problem := fence.backstop_problem(p);
      if v_problem is not null and not v_allowed then
        raise exception '% on protected table % would %: that needs pgfence_bypass, and role "%" is not a member',
            v_tag, p.relid, v_problem, session_user
          using errcode = 'FN010',
                detail = 'protection follows the table (its OID), not its name, and only an administrator may change what guards it',
                hint = 'ask a member of pgfence_bypass (a DBA) to make this change';
      end if;
      v_read := fence.read_check(p.relid, v_allowed);
      v_checked := v_checked || p.relid;
      if v_read is not null then
        raise exception '% on protected table % would %: that needs pgfence_bypass, and role "%" is not a member',
            v_tag, p.relid, v_read, session_user
          using errcode = 'FN010',
                detail = 'only a fenced write may change what a protected table''s existing rows read',
                hint = 'make the change with a gated write, or ask a member of pgfence_bypass (a DBA) to make it';
      end if;
      if v_problem is null then
        continue;
      end if;
      -- An administrator's change. Names and owner follow the table; a
      -- trigger an administrator disabled stays as they left it.
      update fence.protected_tables q
         set schema_name = n.nspname, table_name = c.relname, owner = c.relowner
        from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace
       where q.relid = p.relid and c.oid = p.relid
         and (q.schema_name <> n.nspname or q.table_name <> c.relname or q.owner <> c.relowner);
      if found then
        v_changed := true;
      end if;
    end loop;
    if fence.sync_tree(v_root, v_column, v_allowed) then
      v_changed := true;
    end if;
  end loop;
  for v_rel in select distinct u.rel from unnest(v_shapes) as u(rel)
                where u.rel <> all (v_checked)
                  and exists (select 1 from pg_catalog.pg_class c where c.oid = u.rel) loop
    v_read := fence.read_check(v_rel, v_allowed);
    if v_read is not null then
      raise exception '% on protected table % would %: that needs pgfence_bypass, and role "%" is not a member',
          v_tag, v_rel, v_read, session_user
        using errcode = 'FN010',
              detail = 'only a fenced write may change what a protected table''s existing rows read',
              hint = 'make the change with a gated write, or ask a member of pgfence_bypass (a DBA) to make it';
    end if;
  end loop;
  if v_changed then
    perform pg_notify('pgfence_protected', v_tag);
  end if;
end
$$;

-- guard_sql_drop (008), now also refusing, for non-administrators, the
-- drop of a protected table's column or policy, or of an attribute of a
-- composite (or a column of a table) whose row type a protected column
-- holds, however it comes: ALTER TABLE … DROP COLUMN, DROP POLICY, and
-- DROP TYPE, DROP DOMAIN, DROP COLLATION, DROP FUNCTION … CASCADE (a DROP
-- reaches ddl_command_end with no command to look at). An administrator's
-- such drop records the tables' new shapes.
create or replace function fence.guard_sql_drop() returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, fence
as $$
declare
  r record;
  v_rel regclass;
  v_allowed boolean;
  v_changed boolean := false;
  v_reshape regclass[] := '{}';
  v_types oid[] := '{}';
begin
  if fence.guard_idle() then
    return;
  end if;
  for r in select d.classid, d.objid, d.objsubid, d.object_type, d.object_identity, d.address_names
             from pg_catalog.pg_event_trigger_dropped_objects() d loop
    if r.classid = 'pg_catalog.pg_class'::regclass and r.objsubid = 0
       and exists (select 1 from fence.protected_tables q where q.relid = r.objid::regclass) then
      v_allowed := coalesce(v_allowed, fence.is_admin());
      if not v_allowed then
        raise exception 'dropping protected table % needs pgfence_bypass, and role "%" is not a member', r.object_identity, session_user
          using errcode = 'FN010',
                hint = 'ask a member of pgfence_bypass (a DBA) to drop it, or to unprotect it first';
      end if;
      delete from fence.protected_tables q where q.relid = r.objid::regclass;
      delete from fence.read_shapes s where s.relid = r.objid::regclass;
      v_changed := true;
    elsif r.classid = 'pg_catalog.pg_class'::regclass and r.objsubid > 0
       and exists (select 1 from fence.protected_tables q where q.relid = r.objid::regclass) then
      -- A column of a protected table (the job-key column's case is also
      -- ddl_command_end's): its values disappear from the rows.
      v_allowed := coalesce(v_allowed, fence.is_admin());
      if not v_allowed then
        raise exception 'dropping column % of protected table % needs pgfence_bypass, and role "%" is not a member',
            r.object_identity, r.objid::regclass, session_user
          using errcode = 'FN010',
                detail = 'only a fenced write may change what a protected table''s existing rows read',
                hint = 'ask a member of pgfence_bypass (a DBA) to make this change';
      end if;
      v_reshape := v_reshape || r.objid::regclass;
    elsif r.classid = 'pg_catalog.pg_class'::regclass and r.objsubid > 0 then
      -- An attribute of a composite type, or a column of another table:
      -- its row type may be what a protected column holds.
      v_types := v_types || array(select c.reltype from pg_catalog.pg_class c where c.oid = r.objid and c.reltype <> 0);
    elsif r.classid = 'pg_catalog.pg_policy'::regclass then
      v_rel := to_regclass(format('%I.%I', r.address_names[1], r.address_names[2]));
      if v_rel is not null and exists (select 1 from fence.protected_tables q where q.relid = v_rel) then
        v_allowed := coalesce(v_allowed, fence.is_admin());
        if not v_allowed then
          raise exception 'dropping row-level security policy % needs pgfence_bypass, and role "%" is not a member',
              r.object_identity, session_user
            using errcode = 'FN010',
                  detail = 'a policy of a protected table decides which of its rows a read sees',
                  hint = 'ask a member of pgfence_bypass (a DBA) to make this change';
        end if;
        v_reshape := v_reshape || v_rel;
      end if;
    elsif r.object_type = 'trigger' and r.address_names[3] like 'pgfence\_%' then
      v_rel := to_regclass(format('%I.%I', r.address_names[1], r.address_names[2]));
      if v_rel is not null and exists (select 1 from fence.protected_tables q where q.relid = v_rel) then
        v_allowed := coalesce(v_allowed, fence.is_admin());
        if not v_allowed then
          raise exception 'dropping trigger % of protected table % needs pgfence_bypass, and role "%" is not a member',
              r.address_names[3], v_rel, session_user
            using errcode = 'FN010',
                  detail = 'the trigger is the backstop that fences every write to the table',
                  hint = 'ask a member of pgfence_bypass (a DBA); to remove the protection, fence.unprotect';
        end if;
      end if;
    end if;
  end loop;
  if cardinality(v_types) > 0 then
    for v_rel in select u from fence.tables_using_types(v_types) u loop
      v_allowed := coalesce(v_allowed, fence.is_admin());
      if not v_allowed then
        raise exception '% would change what the rows of protected table % read (an attribute of a type its columns hold goes): that needs pgfence_bypass, and role "%" is not a member',
            tg_tag, v_rel, session_user
          using errcode = 'FN010',
                detail = 'only a fenced write may change what a protected table''s existing rows read',
                hint = 'ask a member of pgfence_bypass (a DBA) to make this change';
      end if;
      v_reshape := v_reshape || v_rel;
    end loop;
  end if;
  -- An administrator's drop: the recorded shape follows.
  perform fence.read_check(u.rel, true)
     from (select distinct x.rel from unnest(v_reshape) x(rel)) u
    where exists (select 1 from fence.protected_tables q where q.relid = u.rel);
  if v_changed then
    perform pg_notify('pgfence_protected', 'DROP');
  end if;
end
$$;

create event trigger pgfence_guard_ddl_start on ddl_command_start execute function fence.guard_ddl_start();

-- Every member protected now gets its shape as it is (the upgrade of a
-- live database: leases, receipts and rows are untouched).
insert into fence.read_shapes (relid, protected_at, facts)
select q.relid, q.protected_at, fence.read_facts(q.relid) from fence.protected_tables q
 where exists (select 1 from pg_catalog.pg_class c where c.oid = q.relid)
on conflict (relid) do nothing;

revoke all on function fence.check_lease_ttl(text, interval), fence.set_max_lease_ttl(interval),
  fence.not_holder(fence.fences, text, bigint, text), fence.collation_name(oid), fence.read_facts(regclass),
  fence.same_reading_type(text, int, text, int), fence.read_change(regclass, jsonb, jsonb),
  fence.read_check(regclass, boolean), fence.tables_using_types(oid[]), fence.guard_ddl_start()
  from public;
grant execute on function fence.set_max_lease_ttl(interval) to pgfence_bypass;
