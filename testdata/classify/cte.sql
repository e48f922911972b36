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
