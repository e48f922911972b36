#!/bin/sh
# signals.sh: records a forwarded SIGHUP in $OUT/hup and exits 42 on SIGTERM.
trap 'touch "$OUT/hup"' HUP
trap 'exit 42' TERM
touch "$OUT/ready"
while :; do sleep 0.05; done
