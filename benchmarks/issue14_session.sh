#!/usr/bin/env bash
# Issue 14's correctness runs side by side on one H200 x4 host (curves and resume: not timings):
# the remaining 300-iteration curves (part c4b) and TP2 x PP2 -> 4DP resume (part r).
# Logs in $OUT/issue14.tgz; a summary on stdout.
set -uo pipefail
FINAL=${OUT:-/tmp/out}; export OUT=/tmp/logs; mkdir -p "$OUT" "$FINAL"
bash benchmarks/parallel_session.sh d > "$OUT/d.txt" 2>&1
(CT=200 bash benchmarks/parallel_session.sh c4b > "$OUT/c4b_stdout.txt" 2>&1) &
(CT=200 bash benchmarks/parallel_session.sh r > "$OUT/r_stdout.txt" 2>&1) &
wait
tar czf "$FINAL/issue14.tgz" -C "$OUT" .
cat "$OUT/c4b_stdout.txt" "$OUT/r_stdout.txt" | grep -v "^GPU\|^torch" | cut -c1-230
