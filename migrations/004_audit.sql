-- History that pgfence audit reads (issue 7).
--
-- fence.consumer_log: fence.consumer_watermarks keeps only the current
-- high-water mark per (consumer, job_key), which cannot show that it never
-- went backwards. accept_event now also appends every decision to this log,
-- in the consumer's own transaction (a rolled-back consumer transaction
-- leaves neither the watermark change nor the log row). Accepted rows are
-- appended while the watermark row is locked, so for one (consumer, job_key)
-- the order of id is the order in which the watermark was advanced.
-- Nothing prunes the log yet.
--
-- issuance_job_key_token_idx: the audit looks up, for a receipt, the next
-- token issued to the same job (and for a token, the previous one); the
-- primary key is on token alone.

create table fence.consumer_log (
  id       bigint generated always as identity primary key,
  consumer text not null,
  job_key  text not null,
  epoch    bigint not null,
  token    bigint not null,
  accepted boolean not null,
  at       timestamptz not null default clock_timestamp()
);
comment on table fence.consumer_log is 'append-only log of fence.accept_event decisions; read by pgfence audit';
create index consumer_log_accepted_idx on fence.consumer_log (consumer, job_key, id) where accepted;
create index consumer_log_at_idx on fence.consumer_log (at);
revoke all on fence.consumer_log from public;

create index issuance_job_key_token_idx on fence.issuance (job_key, token);

-- Same signature, same decisions as in 002; each decision is logged.
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
  -- Events of a closed lifecycle are rejected outright.
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
    -- the new watermark row is ours (and locked) until we commit
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
