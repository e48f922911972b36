#!/usr/bin/env bash
# Installs the PostgreSQL server binaries when none can be found, the way
# internal/pgtest looks for them: PGFENCE_PG_BINDIR, postgres on PATH,
# pg_config --bindir, /usr/lib/postgresql/*/bin.
set -euo pipefail

have_server() {
  local d
  for d in "${PGFENCE_PG_BINDIR:-}" "$(dirname "$(command -v postgres 2>/dev/null || echo /nonexistent/x)")" \
           "$(pg_config --bindir 2>/dev/null || true)" /usr/lib/postgresql/*/bin; do
    [ -n "$d" ] && [ -x "$d/postgres" ] && [ -x "$d/initdb" ] && [ -x "$d/pg_basebackup" ] && return 0
  done
  return 1
}

if have_server && command -v psql >/dev/null && command -v pgbench >/dev/null; then
  exit 0
fi

if command -v apt-get >/dev/null; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "PostgreSQL server binaries not found: installing them with apt-get" >&2
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y postgresql postgresql-contrib
  # The Debian package starts a cluster of its own; pgfence never uses it.
  exit 0
fi

echo "PostgreSQL server binaries (postgres, initdb, pg_basebackup) not found, and this is not a Debian/Ubuntu system." >&2
echo "Install PostgreSQL 13 or newer with your package manager, or set PGFENCE_PG_BINDIR to its bin directory." >&2
exit 1
