-- Plain reads and writes, quoting and schema qualification.
SELECT * FROM results WHERE job = 'a'
select  *  from   RESULTS /* comment */ where job='a'
SELECT * FROM "Results"
SELECT * FROM "results"
SELECT * FROM public.results r JOIN app."Jobs" j ON j.id = r.job_id
INSERT INTO results (job, token) VALUES ('a', 18)
insert into Results(job,token) values($1,$2)
INSERT INTO "Results" VALUES (1)
INSERT INTO public.results VALUES (1) ON CONFLICT (job) DO UPDATE SET token = excluded.token WHERE results.token < excluded.token
INSERT INTO results SELECT * FROM staging WHERE ok
INSERT INTO archive.results SELECT * FROM public.results RETURNING *
UPDATE results SET token = $1 WHERE job = $2
UPDATE results r SET v = s.v FROM staging s WHERE s.id = r.id
DELETE FROM results WHERE token < 10
DELETE FROM ONLY results USING jobs WHERE jobs.id = results.job_id
TRUNCATE results, "Other", app.log
TRUNCATE TABLE results RESTART IDENTITY CASCADE
MERGE INTO results t USING staging s ON t.id = s.id WHEN MATCHED THEN UPDATE SET v = s.v WHEN NOT MATCHED THEN INSERT VALUES (s.id, s.v)
MERGE INTO app.results t USING (SELECT * FROM src) s ON t.id = s.id WHEN MATCHED THEN DELETE
VALUES (1), (2)
TABLE results
SELECT 1; INSERT INTO results VALUES (1); SELECT 2
SELECT * INTO TEMP newtab FROM results
CREATE TABLE snapshot AS SELECT * FROM results
CREATE TABLE IF NOT EXISTS app.snap AS TABLE results WITH NO DATA
SELECT * FROM results WHERE id = $1 FOR UPDATE
SELECT * FROM results FOR NO KEY UPDATE SKIP LOCKED
SELECT * FROM (SELECT * FROM results FOR KEY SHARE) s
SELECT * FROM results, jobs FOR SHARE OF jobs
SELECT id FROM results WHERE id IN (SELECT id FROM other WHERE x = $3)
REFRESH MATERIALIZED VIEW CONCURRENTLY stats
DECLARE c CURSOR FOR SELECT * FROM results FOR UPDATE
FETCH 10 FROM c
