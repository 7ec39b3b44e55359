#!/usr/bin/env bash
# Session 10's single-GPU calls (nvidia-h100-x1; issue 16 asks for an H100): the fused decode loop.
#   a: the GPU lane (fused kernels, batch invariance, captured loops), the tile sweep of the fused
#      matrix-vector kernel, decode speed (fused, graph, eager, transformers) with --profile.
#   b: decode speed with --compile beside the fused rows, then the 345M served (fused decode) under
#      benchmarks/serve_load.py: 32 clients, then the same seeds alone.
#   c: the GPU lane's fused tests, decode speed (fused with and without PDL) with --profile, and b's
#      serving run.
#   d: the whole GPU lane, decode speed with --profile, and `gptrain generate` (the fused loop) on a
#      small checkpoint.
#   bash benchmarks/session10.sh a|b|c|d      (carry .whl: pytest, fastapi, uvicorn, tokenizer, zstandard)
set -uo pipefail
part=${1:?a, b, c or d}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
FINAL=${OUT:-/tmp/out}; L=/tmp/logs; mkdir -p "$FINAL" $L
pack() { tar czf "$FINAL/$part.tgz" -C $L .; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"; } > $L/device.txt 2>&1
cat $L/device.txt
if [ "$part" = d ]; then
  timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=5 tests/test_row_decode.py \
    tests/test_fast_decode.py tests/test_gpu_kernels.py > $L/gpu_lane.txt 2>&1
  echo "lane rc $?" >> $L/gpu_lane.txt; pack; tail -12 $L/gpu_lane.txt
  timeout 200 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --prompt-tokens 32 --new-tokens 256 --profile \
    > $L/decode.txt 2>&1; echo "decode rc $?" >> $L/decode.txt; pack
  grep -E "^batch|profile|graph|rc |^    " $L/decode.txt | cut -c1-300
  TINY="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128"
  timeout 100 python3 -m gptrain train $TINY --mock-data --micro-batch-size 2 --global-batch-size 2 --train-iters 2 \
    --lr 1e-4 --bf16 --eval-iters 1 --save /tmp/tiny --save-interval 2 > $L/tiny.txt 2>&1; echo "train rc $?" >> $L/tiny.txt
  timeout 100 python3 -m gptrain generate --load /tmp/tiny --prompt "The GPU says" --tokens-to-generate 24 --greedy \
    > $L/generate.txt 2>&1; echo "generate rc $?" >> $L/generate.txt; pack
  tail -2 $L/tiny.txt; cat $L/generate.txt
elif [ "$part" = a ]; then
  timeout 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=8 tests/test_row_decode.py \
    ${LANE_MORE:-} > $L/gpu_lane.txt 2>&1
  echo "lane rc $?" >> $L/gpu_lane.txt; pack; tail -25 $L/gpu_lane.txt
  timeout 200 python3 benchmarks/decode_kernels.py --quick --json $L/tiles.json > $L/kernels.txt 2>&1
  echo "kernels rc $?" >> $L/kernels.txt; pack; grep -v "^  {'BLOCK" $L/kernels.txt | head -40; grep -A2 "^qkv\|^proj\|^fc1\|^fc2\|^head" $L/kernels.txt
  timeout 200 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --prompt-tokens 32 --new-tokens 256 --profile \
    $( [ -s $L/tiles.json ] && echo --tiles $L/tiles.json ) > $L/decode.txt 2>&1; echo "decode rc $?" >> $L/decode.txt; pack
  grep -E "^batch|profile|graph|rc " $L/decode.txt | cut -c1-400
else
  if [ "$part" = b ]; then
    timeout 260 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --prompt-tokens 32 --new-tokens 256 --compile \
      --skip-hf > $L/decode_compile.txt 2>&1; echo "decode rc $?" >> $L/decode_compile.txt; pack
    grep -E "^batch|rc " $L/decode_compile.txt | cut -c1-300
  else
    timeout 100 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_row_decode.py > $L/gpu_lane.txt 2>&1
    echo "lane rc $?" >> $L/gpu_lane.txt; pack; tail -4 $L/gpu_lane.txt
    timeout 200 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --prompt-tokens 32 --new-tokens 256 --profile \
      > $L/decode.txt 2>&1; echo "decode rc $?" >> $L/decode.txt; pack
    grep -E "^batch|profile|graph|rc |^    " $L/decode.txt | cut -c1-300
  fi
  M345="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
  timeout 100 python3 -m gptrain train $M345 --mock-data --micro-batch-size 4 --global-batch-size 4 --train-iters 2 \
    --lr 1e-4 --bf16 --eval-iters 2 --save /tmp/ck345 --save-interval 2 > $L/ck345.txt 2>&1; echo "train rc $?" >> $L/ck345.txt
  python3 -m gptrain serve --load /tmp/ck345 --port 5055 > $L/serve.txt 2>&1 &
  for i in $(seq 90); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:5055/health', timeout=2)" 2>/dev/null && break; sleep 1; done
  timeout 100 python3 benchmarks/serve_load.py --url http://127.0.0.1:5055 --clients 32 --seconds 30 --tokens 64 > $L/load32.txt 2>&1
  echo "load rc $?" >> $L/load32.txt
  timeout 50 python3 benchmarks/serve_load.py --url http://127.0.0.1:5055 --clients 1 --seconds 15 --tokens 64 > $L/load1.txt 2>&1
  echo "load rc $?" >> $L/load1.txt
  kill %1 2>/dev/null; pack
  tail -3 $L/ck345.txt; cat $L/load32.txt $L/load1.txt; tail -5 $L/serve.txt
fi
