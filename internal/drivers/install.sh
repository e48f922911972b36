#!/usr/bin/env bash
# Installs what the driver matrix (make test-drivers) needs and is missing:
# Debian's psycopg2, psycopg 3 (and its pool) and pgjdbc, a JDK, Node.js,
# and node-postgres from the npm registry (node/package-lock.json).
# Python: Debian's packages are for /usr/bin/python3, which the checks use
# whatever python3 is first on PATH.
set -euo pipefail
cd "$(dirname "$0")"

apt_pkgs=()
/usr/bin/python3 -c 'import psycopg2' 2>/dev/null || apt_pkgs+=(python3-psycopg2)
/usr/bin/python3 -c 'import psycopg' 2>/dev/null || apt_pkgs+=(python3-psycopg)
/usr/bin/python3 -c 'import psycopg_pool' 2>/dev/null || apt_pkgs+=(python3-psycopg-pool)
[ -f /usr/share/java/postgresql.jar ] || apt_pkgs+=(libpostgresql-jdbc-java)
command -v javac >/dev/null || apt_pkgs+=(openjdk-17-jdk-headless)
command -v npm >/dev/null || apt_pkgs+=(nodejs npm)
if [ ${#apt_pkgs[@]} -gt 0 ]; then
	if ! command -v apt-get >/dev/null; then
		echo "install.sh: missing ${apt_pkgs[*]} and no apt-get; install them by hand" >&2
		exit 1
	fi
	echo "installing ${apt_pkgs[*]}" >&2
	sudo=""
	[ "$(id -u)" -eq 0 ] || sudo=sudo
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null
fi

# npm ci installs exactly the lock file's versions (about a second when
# they are cached).
npm ci --prefix node --no-audit --no-fund --loglevel=error
