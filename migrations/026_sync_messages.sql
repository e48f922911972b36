-- Issue 30 (attack round 12, W-H1): a cancelled wait for the synchronous
-- standby is reported only by a WARNING ("canceling wait for synchronous
-- replication"), raised inside the commit (SyncRepWaitForLSN), and
-- client_min_messages decides whether it is sent at all. At 'error' (a
-- session SET, a startup option, or a role default, which any worker can
-- give its own role: ALTER ROLE app SET client_min_messages = error
-- reaches every job of the role) nothing reached the client, so the
-- proxy, the CLI, pgfence run and the Go package, which all turn that
-- WARNING into FN016, acknowledged a takeover the standby never had, and
-- a lossless failover let the previous holder commit (round 11's U-H1
-- again).
--
-- Now fence.durable, which every lease function, fence.new_era,
-- fence.set_failover_mode and an era's settling call before their commit,
-- also makes the transaction's client_min_messages at most 'warning'
-- (a LOCAL setting: it holds through the commit, whose wait ends after
-- every function has returned, and then reverts). So the WARNING is sent
-- whatever the session, its role or its database chose. A later
-- SET LOCAL client_min_messages in the same transaction is the client's
-- own code silencing its own acknowledgement (docs/failover.md).
--
-- Cost: one current_setting per durable call.

create or replace function fence.durable() returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_sc text := pg_catalog.current_setting('synchronous_commit');
begin
  -- 'error' is the only level above warning (fatal and panic are
  -- accepted as aliases of it in old releases; compare lower-cased).
  if pg_catalog.lower(pg_catalog.current_setting('client_min_messages')) in ('error', 'fatal', 'panic') then
    perform pg_catalog.set_config('client_min_messages', 'warning', true);
  end if;
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
