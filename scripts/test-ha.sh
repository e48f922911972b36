#!/usr/bin/env bash
# make test-ha: the failover scenario on a real Patroni cluster
# (internal/hatest): one etcd, two PostgreSQL nodes under Patroni, two
# pgfence serve instances, asynchronous then synchronous replication.
# Installs Debian's patroni and etcd packages when they are missing, as
# ensure-postgres.sh does for PostgreSQL. Ports 61000-61099.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/ensure-postgres.sh

if ! command -v patroni >/dev/null || ! command -v patronictl >/dev/null || ! command -v etcd >/dev/null; then
  if command -v apt-get >/dev/null; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    echo "patroni or etcd not found: installing them with apt-get" >&2
    $sudo apt-get update
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends patroni etcd-server etcd-client
    # The packages' own services (if a service manager started them) are not used.
  else
    echo "patroni and etcd not found, and this is not a Debian/Ubuntu system: install Patroni 3 (with etcd3 support) and etcd 3.4+ and put them on PATH." >&2
    exit 1
  fi
fi

PGFENCE_HA=1 exec ${GO:-go} test -count=1 -timeout 10m -run '^TestPatroni' ./internal/hatest/ -v "$@"
