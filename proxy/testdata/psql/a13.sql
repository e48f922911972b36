-- A13: every path to the protected table results, from a session without
-- valid fence metadata (none, or a stale token in PGOPTIONS), through the
-- proxy or straight to PostgreSQL. Each must be refused (FN008 or FN001)
-- and write nothing. The test creates write_results(), results_view and
-- staging beforehand.
\set VERBOSITY verbose
INSERT INTO results (job_key, payload, token) VALUES ('x', 'plain', 999);
\echo insert :SQLSTATE
UPDATE results SET payload = 'plain';
\echo update :SQLSTATE
DELETE FROM results;
\echo delete :SQLSTATE
INSERT INTO audit (note) VALUES ('multi') \; INSERT INTO results VALUES ('m', 'multi', 999) \; INSERT INTO audit (note) VALUES ('after');
\echo multi :SQLSTATE
WITH w AS (INSERT INTO results VALUES ('cte', 'cte', 999) RETURNING *) SELECT count(*) FROM w;
\echo cte :SQLSTATE
MERGE INTO results r USING staging s ON r.job_key = s.job_key
  WHEN MATCHED THEN UPDATE SET payload = s.payload
  WHEN NOT MATCHED THEN INSERT VALUES (s.job_key, s.payload, s.token);
\echo merge :SQLSTATE
\copy results (job_key, payload, token) FROM 'testdata/psql/a13_copy.tsv'
\echo copy :SQLSTATE
TRUNCATE results;
\echo truncate :SQLSTATE
SELECT write_results('f');
\echo function :SQLSTATE
INSERT INTO results_view VALUES ('v', 'via view', 999);
\echo view :SQLSTATE
DO $$BEGIN DELETE FROM results; END$$;
\echo do :SQLSTATE
\ir alive.sql
