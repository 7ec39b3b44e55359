#!/usr/bin/env bash
# Session 8's single-GPU calls (nvidia-h100-x1; issue 16 asks for an H100). Part a: decode speed of
# the 345M next to transformers' generate (with --profile and --compile), the GPU test lane, and
# the 345M checkpoint save/load times (sync and async). Part b: `gptrain demo` as a user runs it,
# then the 345M served on the GPU under benchmarks/serve_load.py. Logs go to $OUT/<part>.tgz.
#   bash benchmarks/single8_session.sh a|b      (carry .whl: tokenizer, zstandard, fastapi, uvicorn)
set -uo pipefail
part=${1:?a or b}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
FINAL=${OUT:-/tmp/out}; L=/tmp/logs; mkdir -p "$FINAL" $L
pack() { tar czf "$FINAL/$part.tgz" -C $L .; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } > $L/device.txt 2>&1
cat $L/device.txt
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
  M345="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
  timeout 120 python3 -m gptrain train $M345 --mock-data --micro-batch-size 4 --global-batch-size 4 --train-iters 2 \
    --lr 1e-4 --bf16 --eval-iters 2 --save /tmp/ck345 --save-interval 2 > $L/ck345.txt 2>&1; echo "train rc $?" >> $L/ck345.txt
  python3 -m gptrain serve --load /tmp/ck345 --port 5055 > $L/serve.txt 2>&1 &
  for i in $(seq 90); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:5055/health', timeout=2)" 2>/dev/null && break; sleep 1; done
  timeout 100 python3 benchmarks/serve_load.py --url http://127.0.0.1:5055 --clients 32 --seconds 30 --tokens 64 > $L/load32.txt 2>&1
  echo "load rc $?" >> $L/load32.txt
  timeout 60 python3 benchmarks/serve_load.py --url http://127.0.0.1:5055 --clients 1 --seconds 15 --tokens 64 > $L/load1.txt 2>&1
  echo "load rc $?" >> $L/load1.txt
  kill %1 2>/dev/null; pack
  grep -E "^real|iteration|sample|FAILED|OK|rc " $L/demo.txt | tail -25; tail -3 $L/ck345.txt; cat $L/load32.txt $L/load1.txt; tail -5 $L/serve.txt
fi
