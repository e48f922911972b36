-- Attack round 19 (attacker AJ's H1): the DDL guard decides what is
-- protected by reading fence.protected_tables (and the backstop's
-- triggers, the read shapes) in the DDL's transaction. In REPEATABLE READ
-- or SERIALIZABLE that read uses the transaction's first snapshot, while
-- PostgreSQL finds and locks the table the DDL changes with current
-- catalog data. So a table owner's session that took its snapshot before
-- a table was protected (a partition it created in another session,
-- protected at once; a fence.protect by a DBA) saw the table unprotected:
-- ALTER TABLE ... DISABLE TRIGGER ALL switched the backstop off, CREATE
-- TRIGGER put the owner's trigger into the workers' writes, a rename let
-- an unprotected table take the protected one's name, DROP TABLE dropped
-- a member with the workers' committed rows, ATTACH PARTITION brought rows
-- in with no backstop, ALTER COLUMN ... TYPE ... USING rewrote every row.
-- Migration 030 had refused only a tree's new members in such a
-- transaction.
--
-- The class: every decision of the guard rests on a snapshot, and only a
-- READ COMMITTED transaction reads one taken after the DDL's locks. Now
-- DDL by a non-administrator that touches anything but its own temporary
-- objects (a temporary table with a permanent parent changes the parent's
-- tree: round 20, attacker AM's M1) runs only READ COMMITTED, in every database with pgfence,
-- whatever the guard would read (a stale snapshot may show nothing
-- protected at all). Two event triggers of their own, on ddl_command_end
-- and sql_drop (every command the guard judges ends in one of them; a
-- table_rewrite's rewrite is undone with the command), so that none of
-- the guard's functions is replaced.

create function fence.guard_snapshot() returns event_trigger
language plpgsql
security definer
set search_path = pg_catalog, fence, pg_temp
as $$
begin
  if pg_catalog.current_setting('transaction_isolation') = 'read committed' then
    return;
  end if;
  -- pgfence's own DDL (fence.protect, the backstop's installation).
  if exists (select 1 from fence.own_ddl o where o.xid = pg_catalog.pg_current_xact_id_if_assigned()) then
    return;
  end if;
  -- A session's own temporary objects (CREATE TEMP TABLE in a REPEATABLE
  -- READ report, their DROP): nothing protected is among them (030:
  -- temporary tables join no protected tree).
  -- Not a temporary table with a permanent parent (CREATE TEMP TABLE ...
  -- INHERITS, ALTER TABLE ... INHERIT: round 20, attacker AM's M1): that
  -- changes the parent's tree.
  if tg_event = 'ddl_command_end' then
    if not exists (select 1 from pg_catalog.pg_event_trigger_ddl_commands() c
                    where c.schema_name is distinct from 'pg_temp'
                       or (c.classid = 'pg_catalog.pg_class'::regclass
                           and exists (select 1 from pg_catalog.pg_inherits i
                                         join pg_catalog.pg_class pc on pc.oid = i.inhparent
                                        where i.inhrelid = c.objid and pc.relpersistence <> 't'))) then
      return;
    end if;
  elsif not exists (select 1 from pg_catalog.pg_event_trigger_dropped_objects() d where not d.is_temporary) then
    return;
  end if;
  if fence.is_admin() then
    return;
  end if;
  raise exception '% by role "%" in a % transaction: in a database with pgfence, DDL by a role not in pgfence_bypass runs READ COMMITTED',
      tg_tag, session_user, pg_catalog.upper(pg_catalog.current_setting('transaction_isolation'))
    using errcode = 'FN010',
          detail = 'the DDL guard decides what is protected from what its transaction reads; a snapshot taken before a table was protected shows it unprotected',
          hint = 'run the DDL in a READ COMMITTED transaction (the default), or ask a member of pgfence_bypass (a DBA)';
end
$$;
revoke all on function fence.guard_snapshot() from public;

create event trigger pgfence_guard_snapshot_ddl on ddl_command_end execute function fence.guard_snapshot();
create event trigger pgfence_guard_snapshot_drop on sql_drop execute function fence.guard_snapshot();
