#!/usr/bin/env bash
# make dev: checks that the proxy's port is free (before the build, which
# can take a minute), builds bin/pgfence, and runs pgfence dev on it.
#   scripts/dev.sh [PORT]     PORT 0 picks a free port
set -euo pipefail
port=${1:-6432}
case "$port" in
  ''|*[!0-9]*) echo "make dev: PORT must be a number, got '$port'" >&2; exit 64 ;;
esac
if [ "$port" != 0 ] && (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  echo "make dev: port $port on 127.0.0.1 is in use by another process (another make dev? a PgBouncer? ss -ltnp shows it)." >&2
  echo "make dev: pick another port: make dev PORT=$((port + 1))   (PORT=0 picks a free one)" >&2
  exit 69
fi
"$(dirname "$0")/build.sh" bin/pgfence
exec ./bin/pgfence dev --listen "127.0.0.1:$port"
