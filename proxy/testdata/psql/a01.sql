-- A01 as a legacy client runs it: the generation comes from PGOPTIONS
-- (fence.job_key, fence.epoch, fence.token); :token is the same token for
-- the result row. Run with -v ON_ERROR_STOP=0 -v token=N.
\set VERBOSITY verbose
BEGIN;
INSERT INTO audit (note) VALUES ('from psql');
INSERT INTO results (job_key, payload, token) VALUES ('job', 'from psql', :token)
  ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token
  WHERE results.token < excluded.token;
\echo write :SQLSTATE
COMMIT;
\echo commit :SQLSTATE
SELECT 1 AS alive;
\echo state :SQLSTATE
