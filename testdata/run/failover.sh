#!/bin/sh
# failover.sh: a worker that pgfence run may start more than once. Each
# start appends its token ($PGFENCE_TOKEN) to $OUT/tokens and writes
# "run-N" under it, N being its line in $OUT/tokens. Start number $LAST
# (default: none) then exits $EXIT (default 0). Earlier starts touch
# $OUT/ready.N and wait for $OUT/go.N, then write "late-N" (psql's output
# in $OUT/late.N.out) and exit with psql's status; SIGTERM ends the wait
# with 143.
#
# Each write names its step (fence.step, the payload), as zombie.sh's do.
set -u
echo "$PGFENCE_TOKEN" >>"$OUT/tokens"
n=$(wc -l <"$OUT/tokens" | tr -d ' ')
write() {
  PGOPTIONS="$PGOPTIONS -c fence.step=$1" psql -X -q -v ON_ERROR_STOP=1 -v VERBOSITY=verbose -v payload="$1" "$DATABASE_URL" <<'SQL'
INSERT INTO results (job_key, payload, token)
VALUES (current_setting('fence.job_key'), :'payload', current_setting('fence.token')::bigint)
ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token;
SQL
}
write "run-$n" || exit 10
if [ "$n" -ge "${LAST:-1000000}" ]; then
  exit "${EXIT:-0}"
fi
trap 'exit 143' TERM
touch "$OUT/ready.$n"
while [ ! -f "$OUT/go.$n" ]; do sleep 0.05; done
write "late-$n" >"$OUT/late.$n.out" 2>&1
exit $?
