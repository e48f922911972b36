-- Writable CTEs at any depth, CTE names that are not tables.
WITH x AS (DELETE FROM results WHERE token < 5 RETURNING *) SELECT count(*) FROM x
WITH x AS (SELECT * FROM results) SELECT * FROM x
WITH results AS (SELECT 1 AS id) SELECT * FROM results
WITH results AS (SELECT 1 AS id) INSERT INTO results SELECT * FROM results
WITH a AS (UPDATE jobs SET n = n + 1 RETURNING id) INSERT INTO results SELECT id FROM a
INSERT INTO results WITH m AS (DELETE FROM queue RETURNING *) SELECT * FROM m
WITH outer_cte AS (WITH inner_cte AS (INSERT INTO audit VALUES (1) RETURNING *) SELECT * FROM inner_cte) SELECT * FROM outer_cte
SELECT * FROM (WITH d AS (UPDATE deep.t SET x = 1 RETURNING *) SELECT * FROM d) s
WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 10) SELECT * FROM r
WITH m AS (MERGE INTO results t USING src s ON t.id = s.id WHEN MATCHED THEN DELETE RETURNING t.*) SELECT * FROM m
-- CTE scope: a CTE does not see itself or later siblings without RECURSIVE.
WITH results AS (SELECT * FROM results) SELECT * FROM results
WITH a AS (SELECT * FROM b), b AS (SELECT * FROM results) SELECT * FROM a
WITH a AS (SELECT 1), b AS (SELECT * FROM a) SELECT * FROM b
WITH RECURSIVE a AS (SELECT * FROM b), b AS (SELECT 1) SELECT * FROM a
WITH v AS (SELECT 1) SELECT * FROM (WITH v AS (SELECT * FROM v) SELECT * FROM v) s, public.v
SELECT * FROM (WITH results AS (SELECT 1) SELECT * FROM results) s, results
SELECT (WITH x AS (SELECT * FROM results) SELECT count(*) FROM x), (SELECT max(token) FROM (SELECT * FROM deep.t WHERE id IN (SELECT id FROM deeper.u)) q)
SELECT * FROM audit WHERE EXISTS (WITH y AS (SELECT job_key FROM results) SELECT 1 FROM y)
WITH x AS (SELECT * FROM results) SELECT * FROM x UNION ALL (WITH y AS (SELECT * FROM v_results) SELECT * FROM y)
-- Every statement form that reads through a CTE or subquery.
COPY (WITH x AS (SELECT * FROM results) SELECT * FROM x) TO STDOUT
COPY (SELECT * FROM (SELECT * FROM v_results) s) TO STDOUT
COPY v_results TO STDOUT
DECLARE c CURSOR FOR WITH x AS (SELECT * FROM results) SELECT * FROM x
EXPLAIN ANALYZE WITH x AS (SELECT * FROM results) SELECT * FROM x
EXPLAIN WITH x AS (SELECT * FROM results) SELECT * FROM x
PREPARE p AS WITH x AS (SELECT * FROM results WHERE token > $1) SELECT * FROM x
CREATE VIEW v2 AS WITH x AS (SELECT * FROM results) SELECT * FROM x
WITH x AS (SELECT * FROM results) UPDATE audit SET note = x.payload FROM x
WITH x AS (SELECT * FROM results) DELETE FROM audit WHERE note IN (SELECT payload FROM x)
WITH x AS (SELECT * FROM results) MERGE INTO audit a USING x ON a.note = x.payload WHEN MATCHED THEN DELETE
-- Temporary objects.
CREATE TEMP TABLE tt AS SELECT * FROM results
SELECT * INTO TEMPORARY tt2 FROM audit
CREATE TEMP VIEW tv AS SELECT 1
SELECT * FROM pg_temp.tt
CREATE TABLE pg_temp.tt3 (id int)
