-- Issue 30 (attack round 6, L-H1, L-H2): a write under a step nobody
-- set is refused after a replayed COMMIT. docs/security.md ("receipts")
-- describes the defence.
--
-- The proxy answers a retried transaction whose receipt step finds the
-- first attempt's receipt as committed, and rolls it back. What that
-- transaction left for the session's fence.step is whatever its
-- statements set: a SET the proxy saw, but also code it cannot see (a
-- trigger, a column default, a view, an operator, a function) or a value
-- the server converted (a typed parameter). The proxy cannot know it, and
-- a later write under the step it put back instead could be applied a
-- second time. So after a replay the proxy sets fence.step to
-- 'pgfence:replayed', and the backstop refuses every write under a step
-- beginning with 'pgfence:' (FN008) until the client sets a step itself,
-- as its first attempt did. The backstop fires for every write to a
-- protected table, whatever route or code makes it, so this holds for
-- writes the proxy cannot see. Cost: one prefix comparison per
-- statement.
--
-- The function is 011's fence.backstop with that check (and 013's
-- search_path, pg_temp last).

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
