-- pgfence schema: leases, fencing tokens, epochs, commit receipts.
-- See DESIGN.md §2. Rows of fence.fences and fence.epochs are never deleted:
-- they are the tombstones that keep lifecycle safety (L5).

create schema if not exists fence;

-- Roles are cluster-wide; two databases migrating at once may race to create
-- them, so both duplicate_object and unique_violation mean "already there".
do $$
begin
  begin
    create role pgfence_worker nologin;
  exception when duplicate_object or unique_violation then null;
  end;
  begin
    create role pgfence_bypass nologin;
  exception when duplicate_object or unique_violation then null;
  end;
end
$$;

comment on schema fence is 'pgfence: leases, fencing tokens and commit receipts (managed by pgfence migrate)';

create sequence fence.token_seq as bigint no cycle;
create sequence fence.epoch_seq as bigint no cycle;
comment on sequence fence.token_seq is 'global fencing tokens; never reset';
comment on sequence fence.epoch_seq is 'global lifecycle ids; never reset';

create table fence.fences (
  job_key          text primary key check (length(job_key) between 1 and 200),
  epoch            bigint not null,
  max_issued_token bigint not null,
  retired_at       timestamptz
);
comment on table fence.fences is 'one row per job key: the current epoch and the largest token issued; never deleted';

create table fence.epochs (
  epoch      bigint primary key,
  job_key    text not null,
  opened_at  timestamptz not null default clock_timestamp(),
  closed_at  timestamptz,
  last_token bigint
);
create index epochs_job_key_idx on fence.epochs (job_key);
comment on table fence.epochs is 'every lifecycle ever opened for a key; kept forever so old epochs are recognised as retired';

create table fence.leases (
  job_key    text primary key,
  holder     text not null,
  token      bigint not null,
  expires_at timestamptz not null
);

create table fence.issuance (
  token     bigint primary key,
  job_key   text not null,
  epoch     bigint not null,
  holder    text not null,
  issued_at timestamptz not null default clock_timestamp(),
  xid       xid8 not null default pg_current_xact_id()
);
comment on table fence.issuance is 'append-only log of every token issued by fence.acquire';

create table fence.receipts (
  job_key        text not null,
  epoch          bigint not null,
  token          bigint not null,
  step           text not null default '',
  payload_digest bytea not null,
  digest_version text not null,
  committed_at   timestamptz not null default clock_timestamp(),
  primary key (job_key, epoch, token, step)
);
create index receipts_committed_at_idx on fence.receipts (committed_at);

create table fence.gc_watermarks (
  job_key              text not null,
  epoch                bigint not null,
  pruned_through_token bigint not null,
  primary key (job_key, epoch)
);
comment on table fence.gc_watermarks is 'receipts of (job_key, epoch) with token <= pruned_through_token may have been pruned: retries get FN006';

create table fence.protected_tables (
  relid          regclass primary key,
  schema_name    text not null,
  table_name     text not null,
  job_key_column text,
  protected_at   timestamptz not null default clock_timestamp()
);

create table fence.consumer_watermarks (
  consumer text not null,
  job_key  text not null,
  epoch    bigint not null,
  token    bigint not null,
  primary key (consumer, job_key)
);

-- A row here marks the inserting transaction as a replay: the deferred
-- constraint trigger makes it impossible to commit, even on a direct
-- connection that never calls fence.commit. No row ever commits.
create table fence.replay_guards (
  job_key    text not null,
  epoch      bigint not null,
  token      bigint not null,
  step       text not null,
  guarded_at timestamptz not null default clock_timestamp()
);

create function fence.replay_guard_fire() returns trigger
language plpgsql
set search_path = pg_catalog, fence
as $$
begin
  raise exception 'job "%": this transaction replays epoch % token % step "%", which already committed; it cannot commit',
      new.job_key, new.epoch, new.token, new.step
    using errcode = 'FN00R',
          detail = 'a commit receipt for this generation and step exists, so the first commit stands',
          hint = 'treat the first commit as the result: roll back, nothing is applied twice';
end
$$;

create constraint trigger replay_guard
  after insert on fence.replay_guards
  deferrable initially deferred
  for each row execute function fence.replay_guard_fire();

revoke all on all tables in schema fence from public;
revoke all on all sequences in schema fence from public;
