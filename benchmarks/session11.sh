#!/usr/bin/env bash
# Session 11's final single-GPU call (nvidia-h100-x1): the decode GPU lane (fused kernels, prompt
# graphs, captured loops, batch invariance), decode speed of the 345M (fused with prompt graphs,
# CUDA-graph loop, eager, transformers) with --profile, then the 345M served under serve_load.py.
#   bash benchmarks/session11.sh      (carry .whl: pytest, fastapi, uvicorn, tokenizer, zstandard)
set -uo pipefail
part=final
source benchmarks/lib_session.sh
session_setup
timeout 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=5 tests/test_row_decode.py \
  tests/test_fast_decode.py tests/test_gpu_kernels.py > $L/gpu_lane.txt 2>&1
echo "lane rc $?" >> $L/gpu_lane.txt; pack; tail -6 $L/gpu_lane.txt
timeout 200 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --prompt-tokens 32 --new-tokens 256 --profile \
  > $L/decode.txt 2>&1; echo "decode rc $?" >> $L/decode.txt; pack
grep -E "^batch|fused profile|rc " $L/decode.txt | cut -c1-300
serve_345m_load
