-- Attack round 14 (attacker Z): pgfence's functions took settings from the
-- caller's session that a worker may set.
--
-- Z-H1. fence.check_lease_ttl compared the interval a worker passed with
-- max_lease_ttl (a month counting 30 days, a day 24 hours), and
-- fence.acquire and fence.renew then stored now() + ttl, which adds
-- calendar months, and calendar days in the session's TimeZone. So
-- interval '120000 mons -3599999 days' compared as at most 1 day and gave
-- a lease until 2170, and interval '1 day' under a made-up POSIX zone
-- whose daylight saving time ends within the day (offsets up to 167
-- hours) gave ~8 days. Now a lease's length is its number of seconds
-- (extract(epoch from ttl): a month 30 days, a year 365.25 days, a day
-- 86400 seconds, whatever the session), checked against the cap's number
-- of seconds and added as exactly that many seconds (fence.lease_ttl), so
-- the expiry is now() plus what was checked. fence.gc cuts receipts off
-- by seconds the same way, and fence.set_max_lease_ttl and fence.gc refuse
-- an interval whose seconds are not positive (not negative) even when it
-- compares as positive ('-1 year +361 days').
--
-- Z-M1, Z-L1. PL/pgSQL reads a function's string literals under the
-- session's standard_conforming_strings when it first runs the function
-- there. With it off, '\s' in a regular expression is 's': the timeline
-- history line of a lossless promotion no longer matched
-- fence.era_lossless_evidence's pattern, and a worker that settled the era
-- with fence.current_era() made it lossy (every generation void, FN015);
-- the token check of fence.backstop, fence.metadata and the job-key
-- triggers took 's2s' for a number (22P02 instead of FN008). No function
-- of schema fence has a backslash in a string literal any more:
-- [[:space:]] for \s, LIKE ... ESCAPE '#' for pgfence\_%;
-- fence.write_mark_fire (no longer fired since migration 011) pins
-- standard_conforming_strings instead. The job-key template and every
-- function it generated (fence.backstop_rows_<md5>) are rewritten in
-- place as migration 023 did. migrations.TestFunctionsReadNoSessionSyntax
-- refuses a plain literal with a backslash in any function that does not
-- pin the setting.
--
-- The DDL guard's record of what a protected table's rows read
-- (fence.read_facts: row-level security policies' expressions deparsed
-- by pg_get_expr, type names by format_type) is text whose constants
-- PostgreSQL prints under DateStyle, TimeZone, IntervalStyle,
-- extra_float_digits, bytea_output, lc_monetary, xmlbinary,
-- standard_conforming_strings and quote_all_identifiers: a table owner
-- could change a policy into one that prints the same under other
-- settings (date '2026-01-02' under 'SQL, MDY' reads as date
-- '2026-02-01' under 'SQL, DMY'; 0.12 as 0.1 with extra_float_digits
-- = -15), and the guard saw no change. fence.read_facts and
-- fence.join_problem (which compares a child's and its parent's default
-- expressions) now pin those settings; every recorded shape is recorded
-- again under them.
--
-- Z-L2. fence.receipt_answer answered a retry whose digest is of another
-- kind than the first commit's (the backstop's 'backstop-v1' against the
-- proxy's 'v1') "with the same payload" although nothing was compared.
-- It is still a replay (FN00R), and now says that the payloads could not
-- be compared.
--
-- Everything else that reads a session setting was checked and reads
-- none that changes an answer: comparisons of timestamptz values, tokens
-- and epochs; bigint casts of the fence settings (trim(x)::bigint);
-- digests of the statement's text (by design: the text, not what it
-- means under the session's settings); the era key (integers); the cap's
-- text (interval output read back as interval input is the same interval
-- under every IntervalStyle; fence.set_max_lease_ttl now writes it in
-- 'postgres' style all the same).

create function fence.lease_ttl(p_job_key text, p_ttl interval) returns interval
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_secs numeric := extract(epoch from p_ttl);
begin
  if v_secs is null or v_secs <= 0 then
    raise exception 'job "%": lease ttl must be positive, got %', p_job_key, coalesce(p_ttl::text, 'null')
      using errcode = '22023', hint = 'pass a positive interval such as ''30 seconds''';
  end if;
  perform fence.check_lease_ttl(p_job_key, p_ttl);
  -- What was checked, in seconds only: no month or day for a session's
  -- calendar or TimeZone to stretch.
  return pg_catalog.make_interval(secs => v_secs);
end
$$;

create or replace function fence.check_lease_ttl(p_job_key text, p_ttl interval) returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
declare
  v_cap interval;
begin
  select s.value::interval into v_cap from fence.settings s where s.name = 'max_lease_ttl';
  if v_cap is not null and extract(epoch from p_ttl) > extract(epoch from v_cap) and not fence.is_admin() then
    raise exception 'job "%": lease ttl % is longer than the limit of % (max_lease_ttl)', p_job_key, p_ttl, v_cap
      using errcode = '22023',
            hint = 'take a shorter lease and renew it while the work runs (pgfence run renews for you); an administrator moves the limit with fence.set_max_lease_ttl(interval)';
  end if;
end
$$;

revoke all on function fence.lease_ttl(text, interval), fence.check_lease_ttl(text, interval) from public;

alter function fence.set_max_lease_ttl(interval) set intervalstyle = 'postgres';

alter function fence.read_facts(regclass)
  set datestyle = 'ISO, MDY' set intervalstyle = 'postgres' set timezone = 'UTC' set extra_float_digits = 1
  set bytea_output = 'hex' set lc_monetary = 'C' set xmlbinary = 'base64' set standard_conforming_strings = on
  set quote_all_identifiers = off;
alter function fence.join_problem(regclass, regclass)
  set datestyle = 'ISO, MDY' set intervalstyle = 'postgres' set timezone = 'UTC' set extra_float_digits = 1
  set bytea_output = 'hex' set lc_monetary = 'C' set xmlbinary = 'base64' set standard_conforming_strings = on
  set quote_all_identifiers = off;
alter function fence.write_mark_fire() set standard_conforming_strings = on;

-- receipt_answer raises fence.commit's answer for a receipt rc that is
-- not this transaction's: the same payload is a replay (FN00R); a digest
-- of another kind (009) too, saying it could not be compared; another
-- payload a conflict (FN003).
create or replace function fence.receipt_answer(rc fence.receipts, p_digest bytea, p_version text) returns void
language plpgsql
set search_path = pg_catalog, fence, pg_temp
as $$
begin
  if rc.payload_digest = p_digest and rc.digest_version = p_version then
    raise exception 'job "%": epoch % token % step "%" already committed at % with the same payload: idempotent replay',
        rc.job_key, rc.epoch, rc.token, rc.step, rc.committed_at
      using errcode = 'FN00R',
            detail = 'the first commit stands; this transaction is rolled back so nothing is applied twice',
            hint = 'treat this as success';
  end if;
  if (rc.digest_version = 'backstop-v1') <> (p_version = 'backstop-v1') then
    raise exception 'job "%": epoch % token % step "%" already committed at %; its payload could not be compared with this one (digest % against %): idempotent replay',
        rc.job_key, rc.epoch, rc.token, rc.step, rc.committed_at, rc.digest_version, p_version
      using errcode = 'FN00R',
            detail = 'the first commit stands; this transaction is rolled back so nothing is applied twice',
            hint = 'treat this as success only if this is a retry of that commit; a different result needs a new step';
  end if;
  raise exception 'job "%": epoch % token % step "%" already committed at % with a different payload (stored digest %/%, presented %/%)',
      rc.job_key, rc.epoch, rc.token, rc.step, rc.committed_at,
      rc.digest_version, encode(rc.payload_digest, 'hex'), p_version, encode(p_digest, 'hex')
    using errcode = 'FN003',
          hint = 'the first result stands and this one was rolled back; a changed result needs a new token (or a different step)';
end
$$;

-- One line (or a few) rewritten in each definition, as migration 023 did
-- (pg_get_functiondef keeps owner, grants, SECURITY DEFINER and SET
-- clauses under CREATE OR REPLACE); a definition without the line is an
-- error, not skipped. The old texts are written as E'' literals, so that
-- this migration reads them the same under any setting.
do $$
declare
  v_ws_old constant text := E'''^\\s*-?[0-9]{1,18}\\s*$''';
  v_ws_new constant text := '''^[[:space:]]*-?[0-9]{1,18}[[:space:]]*$''';
  v_like_old constant text := E'like ''pgfence\\_%''';
  v_like_new constant text := 'like ''pgfence#_%'' escape ''#''';
  r record;
  v_def text;
begin
  for r in
    select v.f, v.v_old, v.v_new from (values
      ('fence.acquire(text, text, interval)'::regprocedure,
          'perform fence.check_lease_ttl(acquire.job_key, acquire.ttl);',
          'acquire.ttl := fence.lease_ttl(acquire.job_key, acquire.ttl); -- in seconds, as checked (round 14)'),
      ('fence.renew(text, bigint, interval)'::regprocedure,
          'perform fence.check_lease_ttl(renew.job_key, renew.ttl);',
          'renew.ttl := fence.lease_ttl(renew.job_key, renew.ttl); -- in seconds, as checked (round 14)'),
      ('fence.gc(interval)'::regprocedure,
          'if keep is null or keep < interval ''0'' then',
          'if keep is null or keep < interval ''0'' or extract(epoch from keep) < 0 then'),
      ('fence.gc(interval)'::regprocedure,
          'v_cutoff := clock_timestamp() - keep;',
          'v_cutoff := clock_timestamp() - make_interval(secs => extract(epoch from keep)); -- seconds: no calendar, no session TimeZone'),
      ('fence.set_max_lease_ttl(interval)'::regprocedure,
          'if ttl <= interval ''0'' then',
          'if ttl <= interval ''0'' or extract(epoch from ttl) <= 0 then'),
      ('fence.backstop()'::regprocedure, v_ws_old, v_ws_new),
      ('fence.metadata(text)'::regprocedure, v_ws_old, v_ws_new),
      ('fence.era_lossless_evidence(integer, integer)'::regprocedure,
          E'''^([0-9]{1,10})\\s+[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}\\s+(.*)$''',
          '''^([0-9]{1,10})[[:space:]]+[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}[[:space:]]+(.*)$'''),
      ('fence.guard_sql_drop()'::regprocedure, v_like_old, v_like_new),
      ('fence.set_added()'::regprocedure, v_like_old, v_like_new)
    ) v(f, v_old, v_new)
    union all
    select p.oid::regprocedure, v_ws_old, v_ws_new
      from pg_catalog.pg_proc p
     where p.pronamespace = 'fence'::regnamespace
       and (p.proname = 'job_key_function' or p.proname ~ '^backstop_rows_[0-9a-f]{32}$')
  loop
    v_def := pg_catalog.pg_get_functiondef(r.f);
    if pg_catalog.strpos(v_def, r.v_old) = 0 then
      raise exception 'session settings migration: % has no %', r.f, r.v_old;
    end if;
    execute pg_catalog.replace(v_def, r.v_old, r.v_new);
  end loop;
end
$$;

-- Every shape recorded again under read_facts' pinned settings (a live
-- upgrade: what the tables read has not changed, only how it is written).
update fence.read_shapes s set facts = fence.read_facts(s.relid), recorded_at = clock_timestamp()
 where exists (select 1 from pg_catalog.pg_class c where c.oid = s.relid);
