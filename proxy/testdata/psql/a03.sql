-- A03: the write waits for a takeover in progress (the test holds the
-- fence row in B's acquire, observes this session waiting in pg_locks,
-- then commits the takeover): the gate answers FN001 and the whole
-- transaction, the unprotected audit row included, rolls back.
\set VERBOSITY verbose
BEGIN;
INSERT INTO audit (note) VALUES ('psql was here');
\echo audit :SQLSTATE
\set payload 'from psql'
\ir write_commit.sql
