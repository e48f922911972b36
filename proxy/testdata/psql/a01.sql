-- A01 as a legacy client runs it: the generation comes from PGOPTIONS
-- (fence.job_key, fence.epoch, fence.token); :token is the same token for
-- the result row. Run with -v ON_ERROR_STOP=0 -v token=N.
\set VERBOSITY verbose
BEGIN;
INSERT INTO audit (note) VALUES ('from psql');
\set payload 'from psql'
\ir write_commit.sql
