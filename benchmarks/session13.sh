#!/usr/bin/env bash
# Session 13's single-GPU call (nvidia-h100-x1): L2 bulk prefetch plans for the decode step
# (decode_prefetch.py: products asking for the next weights at their end or start, attention asking
# while the memory idles), then the decode GPU lane with the code's defaults.
#   bash benchmarks/session13.sh      (carry .whl)
set -uo pipefail
part=${part:-prefetch}
source benchmarks/lib_session.sh
session_setup
(cd benchmarks && timeout 300 python3 decode_prefetch.py) > $L/prefetch.txt 2>&1
echo "prefetch rc $?" >> $L/prefetch.txt; pack; grep -v Warn $L/prefetch.txt | tail -14 | cut -c1-400
if [ "${LANE:-1}" = 1 ]; then
  timeout 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=5 tests/test_row_decode.py \
    tests/test_fast_decode.py tests/test_gpu_kernels.py > $L/gpu_lane.txt 2>&1
  echo "lane rc $?" >> $L/gpu_lane.txt; pack; tail -4 $L/gpu_lane.txt
fi
