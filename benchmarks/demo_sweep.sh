#!/usr/bin/env bash
# Choosing the demo's GPU setting: a few model sizes / regularisations on the demo's corpus, each on
# its own GPU, validation every 50 iterations, then samples from the final checkpoint.
# Usage on the device: GPUS="2 3" bash benchmarks/demo_sweep.sh; logs in $OUT/sweep_*.txt
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
D=/tmp/sweep_data
python3 -c "
from pathlib import Path
from gptrain.demo import write_demo_corpus
from gptrain.data.preprocess import PreprocessConfig, preprocess
print(write_demo_corpus(Path('$D/c.jsonl')) if Path('$D').mkdir(parents=True, exist_ok=True) is None else 0)
" > "$OUT/sweep_data.txt" 2>&1
python3 -m gptrain preprocess --input $D/c.jsonl --output-prefix $D/demo --append-eod --no-progress >> "$OUT/sweep_data.txt" 2>&1
COMMON="--seq-length 256 --max-position-embeddings 256 --micro-batch-size 32 --global-batch-size 32 --min-lr 1e-4 \
  --lr-warmup-iters 60 --weight-decay 0.1 --attention-dropout 0.0 --log-interval 50 --eval-interval 50 --eval-iters 4 \
  --bf16 --compile --data-path $D/demo_text_document --split 90,5,5 --seed 1234 --lr-decay-style cosine --clip-grad 1.0"
configs=(
  "A|--num-layers 8 --hidden-size 512 --num-attention-heads 8 --lr 1e-3 --hidden-dropout 0.1 --train-iters 400"
  "B|--num-layers 12 --hidden-size 768 --num-attention-heads 12 --lr 6e-4 --hidden-dropout 0.2 --train-iters 400"
  "C|--num-layers 8 --hidden-size 512 --num-attention-heads 8 --lr 1e-3 --hidden-dropout 0.3 --train-iters 400"
  "D|--num-layers 12 --hidden-size 768 --num-attention-heads 12 --lr 3e-4 --hidden-dropout 0.1 --train-iters 300")
i=0; gpus=(${GPUS:-0 1})
for c in "${configs[@]}"; do
  name=${c%%|*}; flags=${c#*|}; gpu=${gpus[$((i % ${#gpus[@]}))]}; i=$((i + 1))
  ( export CUDA_VISIBLE_DEVICES=$gpu
    { time timeout 150 python3 -m gptrain train $COMMON $flags --save /tmp/sweep_$name; } > "/tmp/sweep_$name.log" 2>&1
    { echo "== $name: $flags"; grep -E "^ iteration|validation loss|parameters on|^real" "/tmp/sweep_$name.log" | cut -c1-200
      for p in "This module provides" "The list" "If the argument is"; do
        echo "-- sample: $p"; timeout 60 python3 -m gptrain generate --load /tmp/sweep_$name --prompt "$p" --tokens-to-generate 48 \
          --temperature 0.9 --top-k 40 --seed 1 2>&1 | tail -4
      done; } > "$OUT/sweep_$name.txt" 2>&1 ) &
  [ $((i % ${#gpus[@]})) = 0 ] && wait
done
wait
