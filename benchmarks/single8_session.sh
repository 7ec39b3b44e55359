#!/usr/bin/env bash
# Session 8's single-GPU calls (nvidia-h100-x1; issue 16 asks for an H100). Part a: decode speed of
# the 345M next to transformers' generate (with --profile and --compile), the GPU test lane, and
# the 345M checkpoint save/load times (sync and async). Part b: `gptrain demo` as a user runs it,
# then the 345M served on the GPU under benchmarks/serve_load.py. Logs go to $OUT/<part>.tgz.
#   bash benchmarks/single8_session.sh a|b      (carry .whl: tokenizer, zstandard, fastapi, uvicorn)
set -uo pipefail
part=${1:?a or b}
source benchmarks/lib_session.sh
session_setup
if [ "$part" = a ]; then
  timeout 250 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --prompt-tokens 32 --new-tokens 256 --profile --compile \
    > $L/decode.txt 2>&1; echo "decode rc $?" >> $L/decode.txt; pack
  timeout 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 tests/ > $L/gpu_lane.txt 2>&1
  echo "lane rc $?" >> $L/gpu_lane.txt; pack
  timeout 130 python3 benchmarks/ckpt_save.py --dir /tmp/ckpt_bench --repeats 3 > $L/ckpt_save.txt 2>&1
  echo "ckpt rc $?" >> $L/ckpt_save.txt; pack
  grep -E "tokens/s|tok/s|batch|agree|rc " $L/decode.txt | tail -30; tail -15 $L/gpu_lane.txt; cat $L/ckpt_save.txt
else
  { time timeout 240 python3 -m gptrain demo --out /tmp/demo_out; } > $L/demo.txt 2>&1
  echo "demo rc $?" >> $L/demo.txt
  cp /tmp/demo_out/loss_curve.png $L/ 2>/dev/null; ls -la /tmp/demo_out >> $L/demo.txt 2>&1; pack
  grep -E "^real|iteration|sample|FAILED|OK|rc " $L/demo.txt | tail -25
  serve_345m_load
fi
