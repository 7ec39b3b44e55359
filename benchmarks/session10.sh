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
source benchmarks/lib_session.sh
session_setup
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
  serve_345m_load
fi
