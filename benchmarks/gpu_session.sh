#!/usr/bin/env bash
# One device call: data, the seeds' 345M config in bf16 and fp16, and the throughput benchmark.
# Usage on the GPU machine: bash benchmarks/gpu_session.sh PART   (PART: a | b); logs go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
G="python3 -m gptrain"
SEED_345M="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
if [ "$1" = a ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
  python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/device.txt"
  $G bench $SEED_345M --micro-batch-size 16 --global-batch-size 16 --bf16 --compile --warmup 8 --iters 20 2>&1 | tee "$OUT/bench_mbs16.txt"
  mkdir -p /tmp/d && $G data builtin --output /tmp/d/builtin.jsonl && \
    $G preprocess --input /tmp/d/builtin.jsonl --output-prefix /tmp/d/builtin --append-eod --workers 8 --no-progress
  for prec in bf16 fp16; do
    # seeds/000 flags, with --lr-decay-iters 5000 so the 1% warmup is 50 iterations (320000 would be 3200)
    $G train $SEED_345M --micro-batch-size 8 --global-batch-size 8 --lr 0.00015 --train-iters 300 \
      --lr-decay-iters 5000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 \
      --clip-grad 1.0 --$prec --data-path /tmp/d/builtin_text_document --data-impl mmap --split 949,50,1 \
      --log-interval 25 --eval-interval 100 --eval-iters 5 2>&1 | tee "$OUT/train_345m_$prec.txt" | grep -E "iteration|validation|memory|padded|parameters"
  done
else
  ND="--hidden-dropout 0 --attention-dropout 0"  # the baseline has no dropout: compare like with like
  $G bench $SEED_345M $ND --micro-batch-size 16 --global-batch-size 16 --bf16 --compile --warmup 6 --iters 15 2>&1 | tee "$OUT/bench_mbs16_nodrop.txt"
  $G bench $SEED_345M $ND --micro-batch-size 16 --global-batch-size 16 --bf16 --compile --no-fused-cross-entropy --no-baseline --warmup 6 --iters 15 2>&1 | tee "$OUT/bench_mbs16_nodrop_plain_ce.txt"
  $G bench $SEED_345M $ND --micro-batch-size 32 --global-batch-size 32 --bf16 --compile --warmup 5 --iters 10 2>&1 | tee "$OUT/bench_mbs32_nodrop.txt"
fi
