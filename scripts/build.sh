#!/usr/bin/env bash
# Builds the pgfence binary (default bin/pgfence) with the version and
# commit of this checkout, printing progress while it runs: the first build
# compiles pg_query's C parser through cgo, about a minute on a cold cache,
# and go build prints nothing meanwhile.
#   scripts/build.sh [OUTPUT]      GO=go, GO_LDFLAGS="-X ..." from the Makefile
set -euo pipefail
out=${1:-bin/pgfence}
go=${GO:-go}
ldflags=${GO_LDFLAGS:-}
if [ -z "$ldflags" ]; then
  version=$(git describe --tags --dirty 2>/dev/null || echo devel)
  commit=$(git rev-parse HEAD 2>/dev/null || true)
  if [ -n "$commit" ] && ! git diff --quiet HEAD 2>/dev/null; then commit=$commit-dirty; fi
  ldflags="-X main.version=$version -X main.commit=$commit"
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$SECONDS
echo "building $out ..."
"$go" build -ldflags "$ldflags" -o "$out" ./cmd/pgfence >"$log" 2>&1 &
pid=$!
next=5
while kill -0 "$pid" 2>/dev/null; do
  sleep 1
  elapsed=$((SECONDS - start))
  if [ "$elapsed" -ge "$next" ]; then
    if [ "$next" = 5 ]; then
      echo "  still building (${elapsed}s): the first build compiles pg_query's C parser (cgo), about a minute on a cold cache; later builds take seconds"
    else
      echo "  still building (${elapsed}s) ..."
    fi
    next=$((elapsed + 10))
  fi
done
if ! wait "$pid"; then
  cat "$log" >&2
  echo "build of $out failed" >&2
  exit 1
fi
cat "$log"
echo "built $out in $((SECONDS - start))s: $("./$out" --version 2>/dev/null || echo "$out")"
