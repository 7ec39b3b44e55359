#!/usr/bin/env bash
# Session 12's tile refit (nvidia-h100-x1): the matrix-vector kernel's tiles swept again now that
# the LayerNorm is folded (decode_kernels.py --quick, attention chunks 32/64/128), then decode speed
# with the best tiles at batch 1 and 32 (no transformers: its numbers are in session12.sh's call).
#   bash benchmarks/session12_tiles.sh      (carry .whl)
set -uo pipefail
part=tiles
source benchmarks/lib_session.sh
session_setup
(cd benchmarks && timeout 330 python3 decode_kernels.py --quick --json /tmp/tiles.json) > $L/sweep.txt 2>&1
echo "sweep rc $?" >> $L/sweep.txt; cp /tmp/tiles.json $L/ 2>/dev/null; pack
grep -vE "^  \{" $L/sweep.txt | cut -c1-200
timeout 150 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --skip-hf --tiles /tmp/tiles.json > $L/decode_tiles.txt 2>&1
echo "decode rc $?" >> $L/decode_tiles.txt; pack; grep -E "^batch.*fused|tiles|rc " $L/decode_tiles.txt | cut -c1-220
