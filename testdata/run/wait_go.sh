#!/bin/sh
# wait_go.sh: signals readiness in $OUT/ready and exits 0 once $OUT/go exists.
touch "$OUT/ready"
while [ ! -f "$OUT/go" ]; do sleep 0.05; done
exit 0
