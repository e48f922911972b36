-- Issue 30 (attack round 1): a table joining a protected tree, consumer
-- watermarks, the replay skip, and locks a non-owner could take.
-- docs/security.md describes each defence and its cost.
--
-- 1. A table joins a protected tree bringing nothing of its owner's (A-H10).
--    ALTER TABLE … INHERIT, ATTACH PARTITION and CREATE TABLE … PARTITION
--    OF / INHERITS (at any depth) let an owner bring an empty table with a
--    trigger that rewrites rows, a rule, row-level security, or a
--    default, constraint, index or statistics object that runs its own
--    code in every write. fence.sync_tree now refuses (FN010), to a role
--    that is not an administrator, a member that joins with any trigger
--    or rule of its own, row-level security or a policy, or a default,
--    generation expression, constraint, index or statistics object of
--    its own (not inherited from the tree) that depends on a function,
--    operator, type, collation or operator class no superuser owns, or a
--    column of its own whose type or collation no superuser owns (enums
--    aside: they run no code). What the tree's members already have
--    (inherited constraints and defaults, cloned triggers, attached
--    indexes) was judged when they got it. The job-key check (011, AFTER
--    … FOR EACH STATEMENT on the member named) already judges the rows
--    such a trigger rewrote; this keeps the owner's code out altogether.
--
-- 2. A consumer is its role's (A-M1). fence.accept_event let any role
--    advance any consumer's watermark (and hold its row locked). A
--    consumer name now belongs to the role that first accepted an event
--    under it (fence.consumers; an administrator may reassign it with
--    fence.assign_consumer); another role gets 42501 before anything is
--    locked. Consumers that existed before this migration are claimed by
--    the first role that accepts an event under them afterwards.
--
-- 3. The replay skip rests on a row (A-M3). The pgfence_replay row
--    trigger skipped a row whenever pgfence.replay equalled the
--    transaction's id, and any code in the statement (an owner's index
--    expression, a default) could set it: a worker's three-row INSERT
--    stored one row and its receipt said committed. fence.replay_skip now
--    skips a row only when this transaction has a replay guard
--    (fence.replay_guards, written only by the protocol's definer
--    functions), and lets it through otherwise; the setting stays as the
--    trigger's WHEN, a cheap filter that costs nothing when it is unset.
--
-- 4. A non-owner neither waits for nor holds a fence row (fence.renew,
--    fence.release, fence.retire). They locked the row before checking who
--    asked, so a role that may not act on a job waited for it while the
--    owner held it (an error releases what the call locked, so that was
--    the cost), and fence.retire of a job already retired returned
--    holding the row the next fence.acquire of the key needs, for as long
--    as its caller kept the transaction open. They now check the caller
--    on an unlocked read first (the same answers), then lock, then check
--    again; retiring a retired job locks nothing.

-- superuser_made: was the object (a row of catalog p_class) made by a
-- superuser, or is it one that runs no code (an enum type)? Objects of
-- other catalogs (columns, sequences, …) run no code of their own.
create function fence.superuser_made(p_class oid, p_oid oid) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
  select coalesce(case p_class
    when 'pg_catalog.pg_proc'::pg_catalog.regclass then
      (select r.rolsuper from pg_catalog.pg_proc x join pg_catalog.pg_roles r on r.oid = x.proowner where x.oid = p_oid)
    when 'pg_catalog.pg_operator'::pg_catalog.regclass then
      (select r.rolsuper from pg_catalog.pg_operator x join pg_catalog.pg_roles r on r.oid = x.oprowner where x.oid = p_oid)
    when 'pg_catalog.pg_type'::pg_catalog.regclass then
      (select r.rolsuper or x.typtype operator(pg_catalog.=) 'e'
         from pg_catalog.pg_type x join pg_catalog.pg_roles r on r.oid = x.typowner where x.oid = p_oid)
    when 'pg_catalog.pg_collation'::pg_catalog.regclass then
      (select r.rolsuper from pg_catalog.pg_collation x join pg_catalog.pg_roles r on r.oid = x.collowner where x.oid = p_oid)
    when 'pg_catalog.pg_opclass'::pg_catalog.regclass then
      (select r.rolsuper from pg_catalog.pg_opclass x join pg_catalog.pg_roles r on r.oid = x.opcowner where x.oid = p_oid)
    when 'pg_catalog.pg_opfamily'::pg_catalog.regclass then
      (select r.rolsuper from pg_catalog.pg_opfamily x join pg_catalog.pg_roles r on r.oid = x.opfowner where x.oid = p_oid)
    else true end, false)
$$;

-- join_problem: what p_rel, joining the protected tree of p_root, would
-- bring of its owner's (a phrase for the error), or NULL.
create function fence.join_problem(p_rel regclass, p_root regclass) returns text
language plpgsql stable
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v text;
begin
  -- Triggers: any of its own (not a clone of a trigger of the tree's
  -- members, which only an administrator can have made); pgfence's own are
  -- installed after this check.
  select format('its trigger %I', t.tgname) into v
    from pg_catalog.pg_trigger t
   where t.tgrelid = p_rel and not t.tgisinternal
     and not exists (select 1 from pg_catalog.pg_trigger pt join fence.protected_tables q on q.relid = pt.tgrelid
                      where pt.oid = t.tgparentid and q.root = p_root)
   limit 1;
  if v is not null then
    return v;
  end if;
  select format('its rule %I', w.rulename) into v from pg_catalog.pg_rewrite w where w.ev_class = p_rel limit 1;
  if v is not null then
    return v;
  end if;
  if exists (select 1 from pg_catalog.pg_class c where c.oid = p_rel and (c.relrowsecurity or c.relforcerowsecurity))
     or exists (select 1 from pg_catalog.pg_policy p where p.polrelid = p_rel) then
    return 'row-level security';
  end if;
  -- Code its own defaults, generation expressions, constraints, indexes
  -- and statistics objects run (pg_depend records what an expression
  -- calls, by OID, so no search_path or name can hide it).
  with objs(classid, objid, what) as (
    select 'pg_catalog.pg_attrdef'::pg_catalog.regclass, d.oid, format('the default or generation expression of its column %I', a.attname)
      from pg_catalog.pg_attrdef d join pg_catalog.pg_attribute a on a.attrelid = d.adrelid and a.attnum = d.adnum
     where d.adrelid = p_rel
       and not exists (select 1 from pg_catalog.pg_inherits i
                         join fence.protected_tables q on q.relid = i.inhparent and q.root = p_root
                         join pg_catalog.pg_attribute pa on pa.attrelid = i.inhparent and pa.attname = a.attname
                         join pg_catalog.pg_attrdef pd on pd.adrelid = pa.attrelid and pd.adnum = pa.attnum
                        where i.inhrelid = p_rel
                          and pg_catalog.pg_get_expr(pd.adbin, pd.adrelid) operator(pg_catalog.=) pg_catalog.pg_get_expr(d.adbin, d.adrelid))
    union all
    select 'pg_catalog.pg_constraint'::pg_catalog.regclass, c.oid, format('its constraint %I', c.conname)
      from pg_catalog.pg_constraint c where c.conrelid = p_rel and c.coninhcount = 0
    union all
    select 'pg_catalog.pg_class'::pg_catalog.regclass, i.indexrelid, format('its index %s', i.indexrelid::pg_catalog.regclass)
      from pg_catalog.pg_index i
     where i.indrelid = p_rel
       and not exists (select 1 from pg_catalog.pg_inherits h
                         join pg_catalog.pg_index pi on pi.indexrelid = h.inhparent
                         join fence.protected_tables q on q.relid = pi.indrelid and q.root = p_root
                        where h.inhrelid = i.indexrelid)
    union all
    select 'pg_catalog.pg_statistic_ext'::pg_catalog.regclass, s.oid, format('its statistics object %I', s.stxname)
      from pg_catalog.pg_statistic_ext s where s.stxrelid = p_rel)
  select format('%s, which depends on %s', o.what, pg_catalog.pg_describe_object(d.refclassid, d.refobjid, d.refobjsubid)) into v
    from objs o join pg_catalog.pg_depend d on d.classid = o.classid and d.objid = o.objid
   where not fence.superuser_made(d.refclassid, d.refobjid)
   limit 1;
  if v is not null then
    return v;
  end if;
  -- Its own columns (the tree's have the tree's types and collations).
  select format('its column %I of type %s', a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod)) into v
    from pg_catalog.pg_attribute a
   where a.attrelid = p_rel and a.attnum > 0 and not a.attisdropped and a.attinhcount = 0
     and (not fence.superuser_made('pg_catalog.pg_type'::pg_catalog.regclass, a.atttypid)
          or a.attcollation <> 0 and not fence.superuser_made('pg_catalog.pg_collation'::pg_catalog.regclass, a.attcollation))
   limit 1;
  return v;
end
$$;

create or replace function fence.sync_tree(p_root regclass, p_column text, p_allowed boolean) returns boolean
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  m record;
  p fence.protected_tables;
  v_members regclass[];
  v_changed boolean := false;
  v_mine boolean;
  v_what text;
  v_found boolean;
begin
  -- A protected root that now has a parent: adopted by the parent's tree
  -- (when the parent is protected; its own sync does it), or reachable
  -- from an unprotected table, which is refused for everyone.
  select string_agg(i.inhparent::regclass::text, ', ') into v_what
    from pg_catalog.pg_inherits i
   where i.inhrelid = p_root and not exists (select 1 from fence.protected_tables q where q.relid = i.inhparent);
  if v_what is not null then
    raise exception 'protected table % would become a partition or child of %, which is not protected', p_root, v_what
      using errcode = '55000',
            detail = 'writes naming the parent reach the child''s rows without firing the child''s statement triggers, so they would not be fenced',
            hint = format('protect the parent''s tree first (fence.protect on its root), then attach %s', p_root);
  end if;
  if exists (select 1 from pg_catalog.pg_inherits i where i.inhrelid = p_root) then
    return false;
  end if;

  select array_agg(t.relid) into v_members from fence.tree_members(p_root) t;
  v_mine := fence.own_ddl_begin();
  for m in select t.relid, t.relkind, c.relname, n.nspname, c.relowner
             from fence.tree_members(p_root) t
             join pg_catalog.pg_class c on c.oid = t.relid
             join pg_catalog.pg_namespace n on n.oid = c.relnamespace loop
    -- Multiple inheritance out of the tree: writes naming the other parent
    -- would reach this member's rows unfenced.
    select string_agg(i.inhparent::regclass::text, ', ') into v_what
      from pg_catalog.pg_inherits i
     where i.inhrelid = m.relid and i.inhparent <> all (v_members);
    if v_what is not null then
      raise exception '% would inherit from % as well as from the protected tree of %', m.relid, v_what, p_root
        using errcode = '55000',
              detail = 'writes naming the other parent would reach its rows unfenced',
              hint = 'a member of a protected tree may have parents only inside that tree';
    end if;
    select * into p from fence.protected_tables q where q.relid = m.relid for update;
    v_found := found;
    if v_found and p.root = p_root then
      continue;
    end if;
    if m.relkind not in ('r', 'p') then
      raise exception '% cannot join the protected tree of %: it is a foreign table', m.relid, p_root
        using errcode = '42809',
              detail = 'its rows live on another server, where no backstop runs',
              hint = 'keep foreign tables out of protected trees';
    end if;
    if p_column is not null and not exists (
        select 1 from pg_catalog.pg_attribute a
         where a.attrelid = m.relid and a.attname = p_column and a.attnum > 0 and not a.attisdropped) then
      raise exception '% cannot join the protected tree of %: it has no job-key column "%"', m.relid, p_root, p_column
        using errcode = '42703';
    end if;
    if v_found then
      -- A protected tree joins this one (it was attached or made a child).
      if p.job_key_column is distinct from p_column then
        raise exception '% is protected with job key column %, the tree of % with %', m.relid,
            coalesce(quote_ident(p.job_key_column), 'none'), p_root, coalesce(quote_ident(p_column), 'none')
          using errcode = '55000', hint = 'unprotect one of them and protect it with the other''s column';
      end if;
    end if;
    if not p_allowed and not v_found then
      -- (015) A table joining the tree brings nothing of its owner's
      -- that would run in, or decide, the writes and reads of its rows.
      v_what := fence.join_problem(m.relid, p_root);
      if v_what is not null then
        raise exception 'adding % to the protected tree of % needs pgfence_bypass: it would bring %, and role "%" is not a member',
            m.relid, p_root, v_what, session_user
          using errcode = 'FN010',
                detail = 'a table joins a protected tree only with what its members already have: no trigger, rule, row-level security, or default, constraint, index, statistics, column type or collation of its own that runs code no superuser wrote',
                hint = format('drop it from %s first, or ask a member of pgfence_bypass (a DBA) to attach the table', m.relid);
      end if;
    end if;
    if not p_allowed and not fence.tree_is_empty(m.relid) then
      raise exception 'adding % to the protected tree of % needs pgfence_bypass: it has rows, which would join the tree without a fenced write, and role "%" is not a member',
          m.relid, p_root, session_user
        using errcode = 'FN010',
              hint = format('empty %s first (TRUNCATE), or ask a member of pgfence_bypass (a DBA) to attach it', m.relid);
    end if;
    if v_found then
      update fence.protected_tables q set root = p_root where q.relid = m.relid;
    else
      perform fence.install_backstop(m.relid, m.relkind, p_column);
      insert into fence.protected_tables (relid, schema_name, table_name, job_key_column, root, owner)
      values (m.relid, m.nspname, m.relname, p_column, p_root, m.relowner);
    end if;
    v_changed := true;
  end loop;
  perform fence.own_ddl_end(v_mine);

  -- Members that left: each top one becomes the root of what is below it.
  for m in select q.relid from fence.protected_tables q
            where q.root = p_root and q.relid <> all (v_members)
              and not exists (select 1 from pg_catalog.pg_inherits i
                               join fence.protected_tables o on o.relid = i.inhparent
                              where i.inhrelid = q.relid and o.root = p_root and o.relid <> all (v_members)) loop
    if not p_allowed then
      raise exception 'removing % from the protected tree of % needs pgfence_bypass; role "%" is not a member', m.relid, p_root, session_user
        using errcode = 'FN010',
              hint = format('ask a member of pgfence_bypass (a DBA) to detach it; %s then stays protected on its own', m.relid);
    end if;
    update fence.protected_tables q set root = m.relid
     where q.root = p_root and q.relid in (select t.relid from fence.tree_members(m.relid) t);
    v_changed := true;
  end loop;
  return v_changed;
end
$$;


-- 2. Consumers.
create table fence.consumers (
  consumer   text primary key,
  role       name not null,
  claimed_at timestamptz not null default clock_timestamp()
);
comment on table fence.consumers is 'the role each event consumer name belongs to: only it (or an administrator) advances that consumer''s watermarks (fence.accept_event)';
revoke all on fence.consumers from public;
grant select on fence.consumers to pgfence_bypass;

-- check_consumer raises 42501 unless the session's role may advance the
-- watermarks of p_consumer: the role it belongs to, or an administrator.
-- A name nobody has used yet is claimed for the session's role. Nothing is
-- locked before the answer (the claim of a new name waits only for another
-- claim of the same name in flight).
create function fence.check_consumer(p_consumer text) returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_role name;
begin
  select c.role into v_role from fence.consumers c where c.consumer = p_consumer;
  if not found then
    insert into fence.consumers (consumer, role) values (p_consumer, session_user)
    on conflict (consumer) do nothing;
    if found then
      return;
    end if;
    select c.role into v_role from fence.consumers c where c.consumer = p_consumer;
  end if;
  if v_role <> session_user and not fence.is_admin() then
    raise exception 'consumer "%" belongs to role "%"; role "%" may not accept events for it', p_consumer, v_role, session_user
      using errcode = '42501',
            detail = 'a consumer''s watermarks are advanced only by the role that first accepted an event under its name',
            hint = 'use a consumer name of this role''s own, or ask a member of pgfence_bypass to reassign the consumer (fence.assign_consumer)';
  end if;
end
$$;

-- assign_consumer gives consumer p_consumer to role p_role
-- (administrators).
create function fence.assign_consumer(consumer text, role name) returns void
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
#variable_conflict use_column
begin
  perform fence.check_admin('reassigning an event consumer');
  if assign_consumer.consumer is null or assign_consumer.consumer = '' or assign_consumer.role is null then
    raise exception 'fence.assign_consumer needs a consumer and a role' using errcode = '22023';
  end if;
  insert into fence.consumers as c (consumer, role) values (assign_consumer.consumer, assign_consumer.role)
  on conflict (consumer) do update set role = excluded.role, claimed_at = clock_timestamp();
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
begin
  if accept_event.consumer is null or accept_event.consumer = '' then
    raise exception 'consumer must not be empty' using errcode = '22023';
  end if;
  perform fence.validate_job_key(accept_event.job_key);
  if accept_event.epoch is null or accept_event.token is null then
    raise exception 'job "%": an event needs an epoch and a token', accept_event.job_key using errcode = '22023';
  end if;
  -- (015) The consumer is its role's: checked before anything is locked.
  perform fence.check_consumer(accept_event.consumer);
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


-- 3. The replay skip: only in a transaction that has a replay guard.
create or replace function fence.replay_skip() returns trigger
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
begin
  -- (The trigger's WHEN read pgfence.replay, which any code can set: it
  -- is only a filter.)
  if exists (select 1 from fence.replay_guards g where g.xid = pg_catalog.pg_current_xact_id()) then
    return null;
  end if;
  if tg_op = 'DELETE' then
    return old;
  end if;
  return new;
end
$$;

-- 4. Who may act on a lease, before its row is locked.
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


revoke all on function fence.superuser_made(oid, oid), fence.join_problem(regclass, regclass),
  fence.check_consumer(text), fence.assign_consumer(text, name) from public;
grant execute on function fence.assign_consumer(text, name) to pgfence_bypass;
