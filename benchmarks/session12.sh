#!/usr/bin/env bash
# Session 12's single-GPU call (nvidia-h100-x1): the decode GPU lane (the folded LayerNorm, split
# attention, the argmax and embedding kernels), where a batch-1 request's time goes (decode_gaps.py),
# a matrix-vector kernel against its floor (decode_floor.py), decode speed of the 345M with
# --profile (fused, CUDA-graph loop, eager, transformers), then the 345M served (warmed up) under
# serve_load.py.
#   bash benchmarks/session12.sh      (carry .whl: pytest, fastapi, uvicorn, tokenizer, zstandard)
set -uo pipefail
part=final
source benchmarks/lib_session.sh
session_setup
timeout 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=5 tests/test_row_decode.py \
  tests/test_fast_decode.py tests/test_gpu_kernels.py > $L/gpu_lane.txt 2>&1
echo "lane rc $?" >> $L/gpu_lane.txt; pack; tail -4 $L/gpu_lane.txt
(cd benchmarks && timeout 100 python3 decode_gaps.py) > $L/gaps.txt 2>&1; echo "gaps rc $?" >> $L/gaps.txt; pack
grep -v Warn $L/gaps.txt | cut -c1-160
(cd benchmarks && timeout 100 python3 decode_floor.py) > $L/floor.txt 2>&1; echo "floor rc $?" >> $L/floor.txt; pack
timeout 200 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --prompt-tokens 32 --new-tokens 256 --profile \
  > $L/decode.txt 2>&1; echo "decode rc $?" >> $L/decode.txt; pack
grep -E "^batch|fused profile|ln_linear|argmax|attention_kernel|rc " $L/decode.txt | cut -c1-300
serve_345m_load
grep -E "warm" $L/serve.txt
