#!/bin/sh
# ignore_term.sh: ignores SIGTERM, so only SIGKILL stops it.
trap '' TERM
touch "$OUT/ready"
while :; do sleep 0.05; done
