-- A05: one token and step, three commits: the first stands, the same
-- payload again is an idempotent replay (COMMIT succeeds with a NOTICE
-- FN00R), a different payload is refused at COMMIT with FN003.
\set VERBOSITY verbose
BEGIN;
INSERT INTO audit (note) VALUES ('first');
INSERT INTO results (job_key, payload, token) VALUES ('job', 'first', :token)
  ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token
  WHERE results.token < excluded.token;
COMMIT;
\echo first :SQLSTATE
BEGIN;
INSERT INTO audit (note) VALUES ('first');
INSERT INTO results (job_key, payload, token) VALUES ('job', 'first', :token)
  ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token
  WHERE results.token < excluded.token;
COMMIT;
\echo replay :SQLSTATE
BEGIN;
INSERT INTO audit (note) VALUES ('second');
INSERT INTO results (job_key, payload, token) VALUES ('job', 'second', :token)
  ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token
  WHERE results.token < excluded.token;
COMMIT;
\echo second :SQLSTATE
SELECT 1 AS alive;
\echo state :SQLSTATE
