-- Issue 30 (attack round 11, U-H3, U-H2, U-L1): in failover_mode sync,
-- what a failover must keep is on the synchronous standby before it is
-- acknowledged, and a new era keeps the previous era's generations only
-- on evidence that its history ended as a streaming standby's promotion.
-- docs/security.md ("A failover starts a new era") describes the
-- defence; docs/failover.md the runbook.
--
-- 1. (U-H3) fence.durable raised synchronous_commit from off to local
--    only: in sync mode an administrator's fence.new_era committed with
--    synchronous_commit = off was acknowledged before the standby had it,
--    a failover to that standby lost it, and the lossless era made every
--    generation it had voided valid again (renew, release, retire and
--    set_failover_mode likewise, each for its own job). Now, in sync mode,
--    fence.durable raises off, local and remote_write to on (the
--    standby's flush; remote_apply is kept), so every caller's commit
--    waits for the synchronous standby: fence.acquire, renew, release,
--    retire, new_era, set_failover_mode (for the mode it leaves and the
--    mode it sets), and the era's settling transaction, which now calls
--    it whenever it writes (the era's row, the server's era check).
--
-- 2. (U-H2) The era was lossless whenever the system identifier was the
--    same, the timeline higher and the mode sync. A point-in-time restore
--    of a base backup (recovery.signal, a new timeline) is all three, and
--    the holders superseded after the backup committed on the restored
--    copy. Now a lossless era needs evidence as well, read by
--    fence.era_lossless_evidence (SECURITY DEFINER, a superuser's: the
--    history file and primary_conninfo are a superuser's to read):
--    - every timeline switch since the previous era's timeline, in the
--      new timeline's history file (pg_wal/<TLI>.history, which
--      PostgreSQL writes at the end of recovery), gives the reason
--      PostgreSQL writes when recovery had no target: "no recovery target
--      specified", that is, recovery replayed all the WAL it had (a
--      promotion replays everything the standby received). A recovery
--      target (recovery_target = 'immediate', _time, _xid, _lsn, _name)
--      gives another reason ("reached consistency", "before ...", "at
--      restore point ...") whether or not it was reached;
--    - the previous era's timeline is in that history (an ancestor);
--    - the server is configured as a streaming standby (primary_conninfo
--      not empty), which a restore by archive recovery to the end of its
--      WAL usually is not.
--    Without all of it the era voids every earlier generation, as in
--    async mode, and its reason says what was missing. Residual: archive
--    recovery to the end of the WAL (no target) of a backup that carries
--    a standby's primary_conninfo (pg_basebackup -R, a standby's data
--    directory) looks like a promotion (docs/failover.md).
--
-- 3. (U-L1) fence.era_server_key formatted pg_postmaster_start_time()
--    with %s, which depends on the session's TimeZone and DateStyle: two
--    sessions of one server had two keys. Now the start is the epoch in
--    microseconds (an integer). And a pending floor this server drew (its
--    key) is reused even when rolled-back acquires drew tokens above it:
--    no transaction on this server can have committed a token of this era
--    without first committing the era's row (which has that floor), and
--    nothing streams into a primary, so every number above the floor was
--    drawn here in a transaction that rolled back. The floor is set before
--    the key, so a settle interrupted between the two leaves a key that
--    is not this server's (a fresh draw next time) or this server's own
--    floor.
--
-- Cost: none with synchronous_commit on (the default) or remote_apply;
-- otherwise one fence.settings lookup in each durable call (acquire,
-- renew, release, retire, new_era, set_failover_mode, and a server's
-- first settling transaction), and in sync mode the wait for the standby
-- that synchronous_commit = on makes. Reading the evidence: once per era,
-- only in sync mode.

-- durable: this transaction's commit is flushed before it is acknowledged
-- (synchronous_commit at least local), and in failover_mode sync it is on
-- the synchronous standby as well (at least on; remote_apply is kept). A
-- LOCAL setting: it outlives the calling function to the transaction's end.
create or replace function fence.durable() returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_sc text := pg_catalog.current_setting('synchronous_commit');
begin
  if v_sc in ('on', 'remote_apply') then
    return;
  end if;
  if exists (select 1 from fence.settings s where s.name = 'failover_mode' and s.value = 'sync') then
    perform pg_catalog.set_config('synchronous_commit', 'on', true);
  elsif v_sc = 'off' then
    perform pg_catalog.set_config('synchronous_commit', 'local', true);
  end if;
end
$$;

-- era_server_key: 023's, with the postmaster's start as an integer
-- (microseconds since the epoch), which no session setting changes.
create or replace function fence.era_server_key() returns bigint
language sql stable
set search_path = pg_catalog, fence, pg_temp
as $$
  select pg_catalog.hashtextextended(pg_catalog.format('%s/%s/%s', s.system_identifier, fence.timeline(),
                                                        (extract(epoch from pg_catalog.pg_postmaster_start_time())
                                                         operator(pg_catalog.*) 1000000)::pg_catalog.int8), 23)
         operator(pg_catalog.&) 9223372036854775807::bigint operator(pg_catalog.|) 1::bigint
    from pg_catalog.pg_control_system() s
$$;

-- era_lossless_evidence: null when this server's history from timeline
-- p_prev_tl to p_tl ended as a streaming standby's promotion at the end
-- of the WAL it received (see the head of this file); otherwise why not.
create function fence.era_lossless_evidence(p_prev_tl integer, p_tl integer) returns text
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_file text := pg_catalog.format('pg_wal/%s.history', pg_catalog.lpad(pg_catalog.upper(pg_catalog.to_hex(p_tl)), 8, '0'));
  v_text text;
  v_line text;
  v_m text[];
  v_ancestor boolean := false;
begin
  if coalesce(pg_catalog.current_setting('primary_conninfo', true), '') = '' then
    return 'primary_conninfo is empty: this server was not configured as a streaming standby (a restored backup, or archive recovery)';
  end if;
  begin
    v_text := pg_catalog.pg_read_file(v_file, 0, 1048576, true);
  exception when others then
    return pg_catalog.format('the timeline history file %s could not be read: %s', v_file, sqlerrm);
  end;
  if v_text is null then
    return pg_catalog.format('the timeline history file %s is missing', v_file);
  end if;
  foreach v_line in array pg_catalog.string_to_array(v_text, E'\n') loop
    v_line := pg_catalog.btrim(v_line, E' \t\r');
    continue when v_line = '' or pg_catalog.starts_with(v_line, '#');
    v_m := pg_catalog.regexp_match(v_line, '^([0-9]{1,10})\s+[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}\s+(.*)$');
    if v_m is null then
      return pg_catalog.format('the timeline history file %s has a line that is not a timeline switch: %s', v_file, pg_catalog.quote_literal(v_line));
    end if;
    if v_m[1]::bigint >= p_prev_tl then
      if v_m[1]::bigint = p_prev_tl then
        v_ancestor := true;
      end if;
      if v_m[2] <> 'no recovery target specified' then
        return pg_catalog.format('timeline %s ended with a recovery target (%s): a point-in-time recovery, not a promotion at the end of the WAL received',
                                 v_m[1], pg_catalog.quote_literal(v_m[2]));
      end if;
    end if;
  end loop;
  if not v_ancestor then
    return pg_catalog.format('timeline %s is not in the history of timeline %s', p_prev_tl, p_tl);
  end if;
  return null;
end
$$;
revoke all on function fence.era_lossless_evidence(integer, integer) from public;

-- era_begin: 023's, with a lossless era only on evidence (above), and the
-- pending floor reused by the server that drew it whatever was drawn
-- since (U-L1), set before its key.
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
  v_sync boolean;
  v_why text;
  v_lossless boolean;
begin
  select * into prev from fence.eras x order by x.era desc limit 1;
  v_era := greatest(prev.era + 1, p_tl);
  v_tokens := greatest(v_era::bigint << 40, (select max(f.max_issued_token) from fence.fences f));
  v_drawn := (select s.last_value from fence.token_seq s);
  v_pending := (select s.last_value from fence.era_pending_seq s);
  -- The key is this server's: the pending floor was drawn here by an
  -- attempt at this era that rolled back (an era of this server committed
  -- would have its row, and this function is called only when the
  -- server's pair has none), and every number drawn since was drawn here
  -- and rolled back with it.
  v_reuse := p_reason is null and (select k.last_value from fence.era_pending_key_seq k) = v_key
             and v_pending > v_tokens
             and not exists (select 1 from fence.eras x where x.token_floor = v_pending);
  if v_reuse then
    v_tokens := v_pending;
  else
    v_tokens := greatest(v_tokens, v_drawn) + 1 + fence.era_offset();
    perform pg_catalog.setval('fence.era_pending_seq', v_tokens);
    perform pg_catalog.setval('fence.era_pending_key_seq', v_key);
  end if;
  v_epochs := greatest(v_era::bigint << 40, (select max(x.epoch) from fence.epochs x),
                       case when not v_reuse then (select s.last_value from fence.epoch_seq s) end)
              + fence.era_offset();
  v_sync := p_reason is null and prev.system_identifier = p_sysid and p_tl > prev.timeline
            and exists (select 1 from fence.settings s where s.name = 'failover_mode' and s.value = 'sync');
  if v_sync then
    v_why := fence.era_lossless_evidence(prev.timeline, p_tl);
  end if;
  v_lossless := v_sync and v_why is null;
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
                 when v_sync
                   then format('timeline %s after %s with failover_mode sync, but not a streaming standby''s promotion: %s; a takeover may have been lost', p_tl, prev.timeline, v_why)
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

-- era_settle: 022's, its writes (the era's row, the server's era check)
-- made durable: in sync mode the standby has them before the transaction
-- is acknowledged.
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
      perform fence.durable();
      e := fence.era_begin(v_sysid, v_tl, null);
    end if;
  end if;
  if not pg_catalog.current_setting('transaction_read_only')::boolean then
    perform fence.refuse_prepare();
    perform fence.durable();
    insert into fence.era_checks (timeline, started_at, era, valid_floor) values (v_tl, v_start, e.era, e.valid_floor)
    on conflict do nothing;
  end if;
  return e.valid_floor;
end
$$;

-- set_failover_mode: 022's, its commit durable under the mode it leaves
-- (from sync: the standby has the change before any acquire that no
-- longer waits for it) and the mode it sets.
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
  perform fence.durable();
end
$$;
