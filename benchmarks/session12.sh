#!/usr/bin/env bash
# Session 12's single-GPU call (nvidia-h100-x1): the decode GPU lane (LayerNorm folded into the
# products, the argmax and embedding kernels), where a matrix-vector kernel's time goes
# (decode_floor.py: with its LayerNorm against without), decode speed of the 345M with --profile
# (fused, CUDA-graph loop, eager, transformers), then the 345M served (warmed up) under serve_load.py.
#   bash benchmarks/session12.sh      (carry .whl: pytest, fastapi, uvicorn, tokenizer, zstandard)
set -uo pipefail
part=final
source benchmarks/lib_session.sh
session_setup
timeout 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=5 tests/test_row_decode.py \
  tests/test_fast_decode.py tests/test_gpu_kernels.py > $L/gpu_lane.txt 2>&1
echo "lane rc $?" >> $L/gpu_lane.txt; pack; tail -6 $L/gpu_lane.txt
(cd benchmarks && timeout 120 python3 decode_floor.py) > $L/floor.txt 2>&1; echo "floor rc $?" >> $L/floor.txt; pack
cut -c1-200 $L/floor.txt
for mode in 1 2; do
  timeout 150 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --skip-hf --ln-mode $mode > $L/decode_ln$mode.txt 2>&1
  echo "decode rc $?" >> $L/decode_ln$mode.txt; pack; grep -E "^batch.*fused|rc " $L/decode_ln$mode.txt | cut -c1-200
done
timeout 200 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --prompt-tokens 32 --new-tokens 256 --profile \
  > $L/decode.txt 2>&1; echo "decode rc $?" >> $L/decode.txt; pack
grep -E "^batch|fused profile|ln_linear|argmax|embed|rc " $L/decode.txt | cut -c1-300
[ "${1:-}" = serve ] && { serve_345m_load; grep -E "warm" $L/serve.txt; }
