-- Issue 31: generations do not outlive a failover that may have lost a
-- takeover. docs/security.md ("A failover starts a new era") describes the
-- defence, what holds per replication mode, and its cost.
--
-- All of pgfence's state is in PostgreSQL. With asynchronous replication a
-- promoted standby may lack the tail of the old primary's history: a
-- committed takeover (so the zombie it fenced out is current again), and
-- the token and epoch numbers issued in it (so fence.token_seq goes back
-- and numbers would be issued twice). This migration makes every server
-- history an era:
--
-- 1. fence.eras: one row per (system identifier, timeline) the fence has
--    run on. A server whose pair has no row is a new era: the first
--    transaction that checks a generation or acquires a lease there makes
--    its row (fence.era_settle), under a lock so eras are made one at a
--    time. The era's number is greater than every earlier era's and at
--    least its timeline, and fence.token_seq and fence.epoch_seq are moved
--    to at least era << 40, so a number issued in a lost tail of an
--    earlier era (fewer than 2^40 of them) is never issued again (L5).
--
-- 2. valid_floor: a generation whose token is not above the current era's
--    valid_floor is void: refused with FN015 everywhere a generation is
--    checked (the proxy's gate, the backstop on direct connections, a
--    commit, a renewal), and its lease counts as expired, so the job can be
--    acquired again at once. After a promotion the floor is the new era's
--    token floor (every earlier generation is void) unless the transition
--    is lossless: the same system, a later timeline, and failover_mode =
--    'sync' (fence.set_failover_mode), under which fence.acquire commits
--    only with a synchronous standby configured and synchronous_commit at
--    least on, so every acknowledged takeover is on the standby that
--    Patroni's synchronous_mode promotes. Then the floor stays, live
--    holders keep their leases, and only zombies (already fenced out by a
--    takeover the new primary has) are refused.
--
-- 3. A retry of a commit made before the failover is answered from the
--    receipts: a receipt on the new primary is a replay (the commit
--    survived); none is FN015 (it did not, or never happened).
--
-- Cost: the fast paths (fence.gate, fence.enter, fence.backstop) compare
-- the fence row's era_start with pg_postmaster_start_time(): a column of
-- the row they already lock, no lookup. A job's first transaction after
-- a restart or a promotion goes the slow way, which settles the era
-- (reading the system identifier, pg_control_system, once per server,
-- recorded in fence.era_checks) and stamps the row.

create table fence.eras (
  era               integer primary key,
  system_identifier bigint not null,
  timeline          integer not null,
  began_at          timestamptz not null default clock_timestamp(),
  began_xid         xid8 not null default pg_catalog.pg_current_xact_id(), -- the settling transaction: every transaction of the era has a larger one (pgfence audit)
  token_floor       bigint not null,
  valid_floor       bigint not null,
  lossless          boolean not null,
  reason            text not null,
  unique (system_identifier, timeline)
);
comment on table fence.eras is 'every server history (system identifier, timeline) the fence has run on; a token not above the current era''s valid_floor is void (FN015)';

create table fence.era_checks (
  timeline    integer not null,
  started_at  timestamptz not null,
  era         integer not null references fence.eras,
  valid_floor bigint not null,
  primary key (timeline, started_at)
);
comment on table fence.era_checks is 'servers (timeline, postmaster start) whose era was verified: the fast path of the era check';

revoke all on fence.eras, fence.era_checks from public;

-- era_start: the start time of the postmaster that issued this fence row's
-- token or verified it above its era's valid_floor (fence.gate_slow).
-- The fast paths (fence.gate, fence.enter, fence.backstop) pass a token
-- only when it equals the row's and era_start is this postmaster's start:
-- a postmaster never changes era while it runs (a primary is not
-- promoted, and a standby that is promoted never wrote a row before), and
-- no other server has its start time, so every other server (a promoted
-- standby, a restored copy, the old primary restarted) checks the era
-- once per job, the slow way. A comparison with a column of a row the
-- fast path already reads: no lookup, no cost to measure.
-- Adding the column needs fence.fences' ACCESS EXCLUSIVE lock, which waits
-- for every transaction holding a fence row (a gated transaction does) and
-- makes every later one wait behind it: give up after a moment instead
-- (55P03), and Apply tries again (migrations.go, lockRetries).
set local lock_timeout = '2s';
alter table fence.fences add column era_start timestamptz;
set local lock_timeout = 0;
comment on column fence.fences.era_start is 'postmaster start time of the primary that issued or era-verified max_issued_token (the fast path of the era check)';
grant select on fence.eras to pgfence_bypass;

-- timeline: the server's current WAL insertion timeline (a primary only;
-- on a standby pg_current_wal_lsn fails, as every write there does).
-- Schema-qualified throughout: it runs under its callers' search_path.
create function fence.timeline() returns integer
language sql volatile
as $$
  select ('x' operator(pg_catalog.||) pg_catalog.substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8))::pg_catalog.bit(32)::pg_catalog.int4
$$;

-- The era this database was migrated in: the current one, with nothing
-- void.
insert into fence.eras (era, system_identifier, timeline, token_floor, valid_floor, lossless, reason)
select fence.timeline(), s.system_identifier, fence.timeline(), 0, 0, true, 'installed (pgfence migrate)'
  from pg_catalog.pg_control_system() s;

-- era_settle returns the current era's valid_floor, making the era first
-- when this server's history has none (see the head of this file), and
-- records the check for the fast path.
create function fence.era_settle() returns bigint
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_tl integer := fence.timeline();
  v_start timestamptz := pg_catalog.pg_postmaster_start_time();
  v_sysid bigint;
  v_floor bigint;
  e fence.eras;
  prev fence.eras;
  v_era integer;
  v_tokens bigint;
  v_epochs bigint;
  v_lossless boolean;
begin
  select c.valid_floor into v_floor from fence.era_checks c where c.timeline = v_tl and c.started_at = v_start;
  if found then
    return v_floor;
  end if;
  select s.system_identifier into v_sysid from pg_catalog.pg_control_system() s;
  select * into e from fence.eras x where x.system_identifier = v_sysid and x.timeline = v_tl;
  if not found then
    lock table fence.eras in exclusive mode;
    select * into e from fence.eras x where x.system_identifier = v_sysid and x.timeline = v_tl;
    if not found then
      select * into prev from fence.eras x order by x.era desc limit 1;
      v_era := greatest(prev.era + 1, v_tl);
      v_tokens := greatest(v_era::bigint << 40, (select s.last_value from fence.token_seq s),
                           (select max(f.max_issued_token) from fence.fences f));
      v_epochs := greatest(v_era::bigint << 40, (select s.last_value from fence.epoch_seq s),
                           (select max(x.epoch) from fence.epochs x));
      perform pg_catalog.setval('fence.token_seq', v_tokens);
      perform pg_catalog.setval('fence.epoch_seq', v_epochs);
      v_lossless := prev.system_identifier = v_sysid and v_tl > prev.timeline
                    and exists (select 1 from fence.settings s where s.name = 'failover_mode' and s.value = 'sync');
      insert into fence.eras (era, system_identifier, timeline, token_floor, valid_floor, lossless, reason)
      values (v_era, v_sysid, v_tl, v_tokens, case when v_lossless then prev.valid_floor else v_tokens end, v_lossless,
              case when prev.system_identifier <> v_sysid
                     then format('another cluster (system identifier %s, was %s): a restored or copied database may lack the latest takeovers', v_sysid, prev.system_identifier)
                   when v_tl <= prev.timeline
                     then format('timeline %s after %s: an older history', v_tl, prev.timeline)
                   when v_lossless
                     then format('promotion (timeline %s to %s) with failover_mode sync: every acknowledged takeover is here', prev.timeline, v_tl)
                   else format('promotion (timeline %s to %s) with failover_mode async: a takeover may have been lost', prev.timeline, v_tl)
              end)
      returning * into e;
    end if;
  end if;
  if not pg_catalog.current_setting('transaction_read_only')::boolean then
    insert into fence.era_checks (timeline, started_at, era, valid_floor) values (v_tl, v_start, e.era, e.valid_floor)
    on conflict do nothing;
  end if;
  return e.valid_floor;
end
$$;

-- era_refuse raises FN015 when p_token is void in the current era.
create function fence.era_refuse(p_job_key text, p_token bigint) returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  e fence.eras;
begin
  if p_token > fence.era_settle() then
    return;
  end if;
  select * into e from fence.eras x where x.valid_floor >= p_token order by x.era limit 1;
  raise exception 'job "%": token % was issued before a failover that may have lost a later takeover of this job (era %, timeline %, since %): it is void',
      p_job_key, p_token, e.era, e.timeline, e.began_at
    using errcode = 'FN015',
          detail = e.reason,
          hint = 'acquire the lease again and redo the work under the new generation (pgfence run does so by itself, --failover-restarts); a commit made before the failover stands only where its receipt reached this primary, and a retry of it is answered as a replay';
end
$$;

-- current_era: the era this server is in (made first if needed), for
-- operators, the proxy and pgfence audit. No tokens.
create function fence.current_era(out era integer, out timeline integer, out began_at timestamptz, out lossless boolean, out reason text)
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
     and x.timeline = fence.timeline();
end
$$;

-- failover_mode: 'async' (the default: every promotion voids every
-- generation) or 'sync' (promotions keep live leases; fence.acquire
-- commits only with a synchronous standby). Administrators only.
create function fence.set_failover_mode(mode text) returns void
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
  insert into fence.settings as s (name, value) values ('failover_mode', mode)
  on conflict (name) do update set value = excluded.value;
end
$$;

-- sync_acquire: under failover_mode sync, a takeover commits only where
-- a synchronous standby will have it before it is acknowledged.
create function fence.sync_acquire(p_job_key text) returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
begin
  if not exists (select 1 from fence.settings s where s.name = 'failover_mode' and s.value = 'sync') then
    return;
  end if;
  if pg_catalog.current_setting('synchronous_standby_names') = '' then
    raise exception 'job "%": failover_mode is sync but no synchronous standby is configured: a takeover now could be lost in a failover', p_job_key
      using errcode = '55000',
            hint = 'restore synchronous replication (synchronous_standby_names), or have an administrator run fence.set_failover_mode(''async'')';
  end if;
  if pg_catalog.current_setting('synchronous_commit') in ('off', 'local') then
    perform pg_catalog.set_config('synchronous_commit', 'on', true);
  end if;
end
$$;

revoke all on function fence.timeline(), fence.era_settle(), fence.era_refuse(text, bigint),
  fence.set_failover_mode(text), fence.sync_acquire(text) from public;
grant execute on function fence.set_failover_mode(text) to pgfence_bypass;
grant execute on function fence.current_era() to public;

-- The functions that check a generation, with the era (018's backstop,
-- 017's acquire and renew, with what they added): the fast paths
-- (fence.gate, fence.enter, fence.backstop) compare the token with the
-- checked floor; the slow paths, renew and refuse_generation call
-- fence.era_refuse after the receipt answer (a surviving commit is a
-- replay) and before the fence row's lock; fence.acquire settles the era
-- before drawing a number, and a void lease is not live.

create or replace function fence.refuse_generation(p_job_key text, p_epoch bigint, p_token bigint, p_admin boolean) returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  f fence.fences;
  v_pruned bigint;
begin
  select * into f from fence.fences fe where fe.job_key = p_job_key;
  if not found then
    raise exception 'job "%" is unknown: no lease was ever acquired for it (presented epoch %, token %)',
        p_job_key, p_epoch, p_token
      using errcode = 'FN005',
            hint = 'acquire a lease with fence.acquire (pgfence lease acquire) and use the epoch and token it returns';
  end if;
  perform fence.era_refuse(p_job_key, p_token);
  if p_admin then
    perform fence.check_generation(f, p_job_key, p_epoch, p_token);
    return;
  end if;
  if not exists (select 1 from fence.issuance i
                  where i.token = p_token and i.job_key = p_job_key and i.epoch = p_epoch
                    and (i.role is null or i.role = session_user)) then
    raise exception 'job "%": epoch % token % is not a generation of role "%"', p_job_key, p_epoch, p_token, session_user
      using errcode = 'FN011',
            detail = 'a generation is usable only by the role that acquired it; this answer is the same for every generation that is not this role''s',
            hint = 'use the epoch and token fence.acquire returned to this role (fence.acquire records session_user), or connect as the role that acquired the lease';
  end if;
  if p_epoch <> f.epoch or f.retired_at is not null then
    raise exception 'job "%": epoch % is retired (presented token %)', p_job_key, p_epoch, p_token
      using errcode = 'FN004',
            hint = 'the request belongs to a finished lifecycle of this job: drop it; new work needs a new lease';
  end if;
  select w.pruned_through_token into v_pruned
    from fence.gc_watermarks w where w.job_key = p_job_key and w.epoch = p_epoch;
  if found and p_token <= v_pruned then
    raise exception 'job "%": cannot confirm epoch % token %: its commit receipts were pruned by gc', p_job_key, p_epoch, p_token
      using errcode = 'FN006',
            hint = 'the outcome of this generation is no longer recorded; check the business result directly and do not retry it as a first commit';
  end if;
  if p_token <> f.max_issued_token then
    raise exception 'job "%": token % is stale (epoch %): a newer generation holds the job', p_job_key, p_token, p_epoch
      using errcode = 'FN001',
            hint = 'another holder took over this job: stop, roll back and do not retry with this token';
  end if;
end
$$;

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
  select r.backstop_xid into v_rx from fence.receipts r
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
  v_xid xid8 := pg_catalog.pg_current_xact_id();
  v_ours boolean;
begin
  select r.job_key is not null into v_ours
    from fence.fences fe
    left join fence.receipts r
      on r.job_key = fe.job_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step
   where fe.job_key = v_key and fe.epoch = p_epoch and fe.max_issued_token = p_token
     and fe.retired_at is null and fe.owner_role = session_user
     and (r.job_key is null or r.backstop_xid = v_xid)
     -- The era: checked before this transaction's receipt was written, so
     -- not again once it is (an upsert fires the backstop twice).
     and (r.job_key is not null
          or fe.era_start = pg_catalog.pg_postmaster_start_time())
     for update of fe;
  if found then
    if v_ours then
      return 'ok';
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
  v_xid := pg_catalog.pg_current_xact_id();
  select r.job_key is not null into v_ours
    from fence.fences fe
    left join fence.receipts r
      on r.job_key = fe.job_key and r.epoch = v_epoch and r.token = v_token and r.step = v_step
   where fe.job_key = v_key and fe.epoch = v_epoch and fe.max_issued_token = v_token
     and fe.retired_at is null and fe.owner_role = session_user
     and (r.job_key is null or r.backstop_xid = v_xid)
     -- The era: checked before this transaction's receipt was written, so
     -- not again once it is (an upsert fires the backstop twice).
     and (r.job_key is not null
          or fe.era_start = pg_catalog.pg_postmaster_start_time())
     for update of fe;
  if found then
    if v_ours then
      return null;
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
begin
  if gate.job_key is null or gate.epoch is null or gate.token is null then
    raise exception 'fence.gate needs a job key, an epoch and a token (got %, %, %)',
        coalesce(gate.job_key, 'null'), coalesce(gate.epoch::text, 'null'), coalesce(gate.token::text, 'null')
      using errcode = '22023';
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
  select * into rc from fence.receipts r
   where r.job_key = v_key and r.epoch = p_epoch and r.token = p_token and r.step = v_step;
  v_ours := found;
  if v_ours and rc.backstop_xid is distinct from v_xid then
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
  perform fence.era_refuse(renew.job_key, renew.token);
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
