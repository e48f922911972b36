#!/bin/sh
# write.sh PAYLOAD [EXIT_CODE]: writes PAYLOAD as the result of $PGFENCE_JOB_KEY
# into the protected table "results" with psql (fenced by the PGOPTIONS
# pgfence run set), records what it saw in $OUT, then exits with EXIT_CODE.
set -eu
payload=$1
code=${2:-0}
printf '%s' "$PGOPTIONS" >"$OUT/pgoptions"
printf '%s %s %s %s' "$PGFENCE_JOB_KEY" "$PGFENCE_EPOCH" "$PGFENCE_TOKEN" "$PGFENCE_LEASE_EXPIRES_AT" >"$OUT/env"
psql -X -At -v ON_ERROR_STOP=1 "$DATABASE_URL" >"$OUT/settings" <<'SQL'
SELECT current_setting('fence.job_key') || '|' || current_setting('fence.epoch') || '|' ||
       current_setting('fence.token') || '|' || current_setting('legacy.note', true);
SQL
psql -X -q -v ON_ERROR_STOP=1 -v VERBOSITY=verbose -v payload="$payload" "$DATABASE_URL" <<'SQL'
INSERT INTO results (job_key, payload, token)
VALUES (current_setting('fence.job_key'), :'payload', current_setting('fence.token')::bigint)
ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token;
SQL
exit "$code"
