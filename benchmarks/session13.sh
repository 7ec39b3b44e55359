#!/usr/bin/env bash
# Session 13's decode call (nvidia-h100-x1): the block products on the CUDA cores (gemv_kernel)
# against the tensor-core kernel (decode_gemv.py), the decode GPU lane, decode speed at batch 1
# and 32 (fused loop; --profile), and the 345M served under load.
#   bash benchmarks/session13.sh      (carry .whl)
set -uo pipefail
part=${part:-gemv}
source benchmarks/lib_session.sh
session_setup
(cd benchmarks && timeout 240 python3 decode_gemv.py) > $L/gemv.txt 2>&1; echo "gemv rc $?" >> $L/gemv.txt; pack
grep -v Warn $L/gemv.txt
timeout 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=5 tests/test_row_decode.py \
  tests/test_fast_decode.py tests/test_gpu_kernels.py > $L/gpu_lane.txt 2>&1
echo "lane rc $?" >> $L/gpu_lane.txt; pack; tail -4 $L/gpu_lane.txt
grep -E "^(FAILED|E  )" $L/gpu_lane.txt | head -20 | cut -c1-300
if [ "${SPEED:-1}" = 1 ]; then
  timeout 240 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --prompt-tokens 32 --new-tokens 256 --profile \
    > $L/decode.txt 2>&1; echo "decode rc $?" >> $L/decode.txt; pack
  grep -E "^batch|fused profile|ln_linear|gemv|argmax|attention_kernel|rc " $L/decode.txt | cut -c1-300
fi
if [ "${SERVE:-0}" = 1 ]; then serve_345m_load; grep -E "warm" $L/serve.txt; fi
