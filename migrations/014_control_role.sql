-- Issue 30 (HIGH 1): a least-privilege role for the proxy's control
-- connections. The catalog watcher, the replica pollers and the console's
-- SHOW FENCES connect as the primary DSN's user into every database
-- clients name; run as a superuser, anything in such a database that
-- their SQL could be steered to run would run as a superuser. pgfence's
-- own SQL is pinned and qualified so that nothing can be (docs/security.md,
-- "pgfence's own SQL"); this role is the second wall: give the DSN a LOGIN
-- role that is a member of pgfence_control and no superuser, and the proxy
-- holds exactly what it needs:
--
--   * SELECT on fence.protected_tables (the watcher), fence.fences and
--     fence.leases (SHOW FENCES shows every job's tokens to the console's
--     admins);
--   * everything else it reads is public: pg_catalog's tables and views,
--     pg_current_wal_insert_lsn(), pg_current_wal_lsn(),
--     pg_last_wal_replay_lsn(), pg_is_in_recovery(); LISTEN needs no
--     privilege.
--
-- The auth lookup (auth = postgres) reads pg_shadow, which needs a
-- superuser or a SECURITY DEFINER lookup function (docs/proxy.md, "Who may
-- connect"). The role is cluster-wide; the grants are per database, so
-- every migrated database has them.
do $$
begin
  begin
    create role pgfence_control nologin;
  exception when duplicate_object or unique_violation then null;
  end;
end
$$;

grant usage on schema fence to pgfence_control;
grant select on fence.protected_tables, fence.fences, fence.leases to pgfence_control;
