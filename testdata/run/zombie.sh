#!/bin/sh
# zombie.sh: the paused worker. It writes "first", signals readiness in
# $OUT/ready, then waits (for $OUT/go, which the test never creates). When
# told to stop (SIGTERM) it makes one last write, as a worker that does not
# know it lost its lease would, recording psql's output and status in
# $OUT/term.out and $OUT/term.rc, then exits 143.
#
# Each write is its own commit within the one token, so each names its
# step (fence.step, the payload): through the proxy's write gate a second
# commit with the default step would be refused as a conflicting replay
# of the first (FN003), whatever the lease, and hide the stale token.
set -u
write() {
  PGOPTIONS="$PGOPTIONS -c fence.step=$1" psql -X -q -v ON_ERROR_STOP=1 -v VERBOSITY=verbose -v payload="$1" "$DATABASE_URL" <<'SQL'
INSERT INTO results (job_key, payload, token)
VALUES (current_setting('fence.job_key'), :'payload', current_setting('fence.token')::bigint)
ON CONFLICT (job_key) DO UPDATE SET payload = excluded.payload, token = excluded.token;
SQL
}
on_term() {
  write zombie >"$OUT/term.out" 2>&1
  echo $? >"$OUT/term.rc.tmp" && mv "$OUT/term.rc.tmp" "$OUT/term.rc"
  exit 143
}
write first || exit 10
trap on_term TERM
touch "$OUT/ready"
while [ ! -f "$OUT/go" ]; do sleep 0.05; done
write second
