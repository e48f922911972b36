-- SET / RESET / set_config / DISCARD / PREPARE / EXECUTE / LISTEN.
SET fence.token = 18
SET fence.token TO '18'
set Fence.Token = 18
SET LOCAL fence.token = 19
SET SESSION fence.job_key = 'nightly-report'
SET fence.epoch = 99999999999
SET fence.token = -1
SET fence.token TO DEFAULT
SET LOCAL fence.step TO DEFAULT
SET fence.token FROM CURRENT
RESET fence.token
RESET ALL
SET search_path = "$user", public
SET search_path TO app, "My Schema", 'Quoted', "select"
SET search_path = ''
SET fence.token = 'a', 'b'
SHOW fence.token
SELECT set_config('fence.token', '18', false)
SELECT set_config('fence.token', '19', true), 1
SELECT set_config($1, $2, $3)
SELECT set_config('fence.token', $1::text, false)
SELECT set_config('fence.token', NULL, false)
SELECT set_config('fence.token', x, false) FROM t
SELECT set_config(name, '1', false) FROM names
SELECT CASE WHEN $1 THEN set_config('fence.token', '5', false) END
SELECT current_setting('fence.token', true)
DISCARD ALL
DISCARD PLANS
DISCARD TEMP
DISCARD SEQUENCES
PREPARE ins (int, text) AS INSERT INTO results VALUES ($1, $2)
PREPARE q AS SELECT * FROM results WHERE id = $1
EXECUTE ins(1, 'a')
EXECUTE q(lower('X'))
DEALLOCATE ins
DEALLOCATE PREPARE ALL
LISTEN fence_takeover
UNLISTEN *
UNLISTEN fence_takeover
NOTIFY fence_takeover, 'job-1'
