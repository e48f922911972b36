-- COPY, EXPLAIN, CALL/DO, functions, DDL, errors.
COPY results FROM STDIN
COPY public."Results" (id, v) FROM STDIN WITH (FORMAT csv)
COPY results TO STDOUT
COPY (SELECT * FROM results WHERE token > 1) TO STDOUT
COPY (DELETE FROM results RETURNING *) TO STDOUT
EXPLAIN INSERT INTO results VALUES (1)
EXPLAIN ANALYZE INSERT INTO results VALUES (1)
EXPLAIN (ANALYZE, BUFFERS) UPDATE results SET v = 1
EXPLAIN (ANALYZE false) DELETE FROM results
EXPLAIN ANALYZE SELECT * FROM results
EXPLAIN ANALYZE EXECUTE ins(1, 'a')
CREATE TABLE copy_of AS EXECUTE q(1)
CALL app.rebuild_results(18)
DO $$ BEGIN INSERT INTO results VALUES (1); END $$
SELECT app.compute(id) FROM results
SELECT lower(name), count(*) FROM results GROUP BY 1
SELECT nextval('results_id_seq')
SELECT pg_advisory_xact_lock(42)
SELECT pg_try_advisory_lock(1, 2)
SELECT txid_current()
SELECT pg_notify('ch', 'x')
SELECT fence.acquire('job', 'worker', '30s')
SELECT * FROM fence.gate($1, $2, $3, $4)
CREATE TABLE results (id int PRIMARY KEY, v text)
ALTER TABLE results ADD COLUMN token bigint
CREATE FUNCTION f() RETURNS void LANGUAGE sql BEGIN ATOMIC INSERT INTO results VALUES (1); END
CREATE RULE r AS ON INSERT TO a DO ALSO INSERT INTO results VALUES (1)
LOCK TABLE results IN EXCLUSIVE MODE
VACUUM results

-- comment only
SELECT FROM WHERE
INSERT INTO results VALUES (1)); DELETE FROM results
EXPLAIN VERBOSE SELECT my_immutable('x')
EXPLAIN SELECT lower('x') FROM t WHERE a = 1
SELECT version('x'), pg_catalog.version(), public.version('y')
SELECT 1 OPERATOR(public.#@#) 2, 'x'::mydomain
SELECT CASE x WHEN 1 THEN 'a' END, CASE WHEN true THEN 1 END FROM t
SELECT 1 WHERE 2 = ANY (ARRAY[1, 2])
