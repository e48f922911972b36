-- Migration 009: a backstop receipt is answered as a replay by any retry
-- that cannot be compared with it; the fence-row check a replica answers for
-- read routing; the DDL notification that keeps the proxy's read set
-- current.
--
-- 1. commit_slow (from 006): a retry whose digest is of another kind than
--    the stored receipt's (the backstop's backstop-v1 against the proxy's
--    or fence.RunTx's v1) is a replay, not a conflict: the two cannot be
--    compared, and straight to PostgreSQL such a retry is a replay (its
--    replay guard fails its COMMIT whatever it wrote).
--
-- 2. fence.replica_reached(job_key, epoch, token): has this server (a
--    replica, for read routing) replayed the generation? Any role may ask
--    it about any token (a reader is often not the role that acquired
--    the generation it depends on). That tells how far a job's tokens
--    have gone, which no longer gives any power: a generation is usable
--    only by the role that acquired it (006).
--
-- 3. The event trigger pgfence_catalog_changed notifies pgfence_protected
--    on every DDL command, enabled ALWAYS, so the proxy knows its list of
--    relations that reach protected data (views, functions, ...) is stale
--    the moment the catalog changes (docs/reads.md).

create or replace function fence.commit_slow(p_job_key text, p_epoch bigint, p_token bigint, p_step text, p_digest bytea, p_version text)
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
    -- A receipt the backstop wrote (backstop-v1: the text of the statement
    -- it saw) cannot be compared with a digest of another kind: the first
    -- commit stands and nothing of this one is applied, which is a replay,
    -- as a retry of it straight to PostgreSQL is answered.
    if rc.payload_digest = p_digest and rc.digest_version = p_version
       or (rc.digest_version = 'backstop-v1') <> (p_version = 'backstop-v1') then
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

create function fence.replica_reached(job_key text, epoch bigint, token bigint) returns boolean
language sql
stable
security definer
set search_path = pg_catalog, fence
as $$
  select exists (select 1 from fence.fences f
                  where f.job_key = replica_reached.job_key
                    and f.max_issued_token >= replica_reached.token
                    and (replica_reached.epoch is null or f.epoch >= replica_reached.epoch))
$$;
revoke all on function fence.replica_reached(text, bigint, bigint) from public;
grant execute on function fence.replica_reached(text, bigint, bigint) to public;

create function fence.catalog_changed() returns event_trigger
language plpgsql
set search_path = pg_catalog
as $$
begin
  perform pg_notify('pgfence_protected', tg_tag);
end
$$;
create event trigger pgfence_catalog_changed on ddl_command_end execute function fence.catalog_changed();
alter event trigger pgfence_catalog_changed enable always;
