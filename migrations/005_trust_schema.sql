-- Issue 17: the schema of the protocol's new functions (006): owners,
-- job authorization, tokens hidden from workers, receipts for writes no
-- parser can see. docs/security.md describes the trust model.

-- 008 creates event triggers, which only a superuser may do. Check first,
-- so that a migration run by another role stops here, with version 4 and
-- nothing of issue 17 half-applied, instead of failing three files later.
do $$
begin
  if not (select r.rolsuper from pg_catalog.pg_roles r where r.rolname = current_user) then
    raise exception 'pgfence migrate must run as a superuser: role "%" is not one', current_user
      using errcode = '42501',
            detail = 'the fence schema installs event triggers (the DDL guard of protected tables), and CREATE EVENT TRIGGER needs a superuser',
            hint = 'run pgfence migrate with a superuser''s connection (for example --database postgres://postgres@host/db); the application keeps its own roles';
  end if;
end
$$;

-- Generations belong to the role that acquired them (§5): session_user at
-- fence.acquire, on the fence row for the current generation (the gate's
-- fast path compares it) and in the issuance log for every generation.
-- NULL on rows from before this migration: those generations stay usable
-- by any role until the job is next acquired.
alter table fence.fences add column owner_role name;
alter table fence.issuance add column role name;
comment on column fence.fences.owner_role is 'session_user of the acquire that issued max_issued_token; only it (or an administrator) may gate, commit, renew, release or retire that generation';
comment on column fence.issuance.role is 'session_user of the acquire that issued the token';

-- Optional per-role job authorization (§5), off by default: when
-- fence.settings has job_authorization = on, a role that is not an
-- administrator may acquire only job keys matching (LIKE) a pattern granted
-- to it or to a role it is a member of.
create table fence.settings (
  name  text primary key,
  value text not null
);
comment on table fence.settings is 'pgfence switches: job_authorization (on/off)';
create table fence.job_grants (
  role       name not null,
  pattern    text not null check (pattern <> ''),
  granted_at timestamptz not null default clock_timestamp(),
  primary key (role, pattern)
);
comment on table fence.job_grants is 'LIKE patterns of job keys each role may acquire while job_authorization is on';

-- Workers do not read tokens (§5): fence.fences and fence.leases are for
-- pgfence's definer functions, administrators and the proxy's control
-- connection. fence.jobs is the same information without tokens.
revoke select on fence.fences, fence.leases from pgfence_worker;
create view fence.jobs as
select f.job_key, f.epoch, f.retired_at, f.owner_role,
       l.holder as lease_holder, l.expires_at as lease_expires_at,
       coalesce(l.token = f.max_issued_token and l.expires_at > now(), false) as lease_live
  from fence.fences f
  left join fence.leases l on l.job_key = f.job_key;
comment on view fence.jobs is 'every job''s epoch, owner and lease, without tokens: a holder learns its token from fence.acquire';
grant select on fence.jobs to public;

-- Receipts for writes no parser can see (§4). The backstop marks, once per
-- transaction and generation, that the transaction changed a protected
-- table; fence.commit and fence.commit_if_written remove their
-- generation's mark when they write the receipt; a mark still present at
-- COMMIT (or PREPARE TRANSACTION) makes the deferred trigger
-- fence.write_mark write the receipt itself (digest version backstop-v1).
-- No row ever commits, so the table is unlogged: its rows need no WAL.
create unlogged table fence.write_marks (
  xid     xid8 not null default pg_current_xact_id(),
  job_key text not null,
  epoch   bigint not null,
  token   bigint not null,
  step    text not null,
  digest  bytea not null
);
create index write_marks_xid_idx on fence.write_marks (xid);
comment on table fence.write_marks is 'in-flight: this transaction changed a protected table under this generation and has no receipt yet; no row commits';

-- The transaction that wrote a receipt by the backstop: fence.commit
-- replaces such a receipt of its own transaction (written early, at SET
-- CONSTRAINTS ALL IMMEDIATE) instead of calling it a conflict.
alter table fence.receipts add column backstop_xid xid8;
comment on column fence.receipts.backstop_xid is 'set when the backstop wrote the receipt (digest_version backstop-v1): the writing transaction';

-- fence.commit_if_written tells a transaction in replay mode from one that
-- wrote nothing by its own replay guard.
alter table fence.replay_guards add column xid xid8 not null default pg_current_xact_id();
create index replay_guards_xid_idx on fence.replay_guards (xid);

revoke all on fence.settings, fence.job_grants, fence.write_marks from public;
