#!/usr/bin/env bash
# One step of a make target, with one summary line and its wall time:
#   scripts/step.sh NAME [--log FILE] -- CMD...
# With --log, the command's output goes to FILE and is shown only if the step fails (setup's pip
# prints many lines about the machine's package-index configuration that say nothing about the
# project); without it, the output is shown as it comes (test failures must be readable).
set -uo pipefail
name=$1; shift
log=""
if [ "${1:-}" = "--log" ]; then log=$2; shift 2; fi
[ "${1:-}" = "--" ] && shift
start=$(date +%s.%N)
if [ -n "$log" ]; then
  mkdir -p "$(dirname "$log")"
  "$@" >"$log" 2>&1
else
  "$@"
fi
rc=$?
secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
if [ $rc -eq 0 ]; then
  echo "== $name: ok ($secs s)"
else
  if [ -n "$log" ]; then
    echo "-- last lines of $log:"
    tail -n 40 "$log"
  fi
  echo "== $name: FAILED (exit $rc, $secs s)"
fi
exit $rc
