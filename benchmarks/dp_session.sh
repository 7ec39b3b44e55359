#!/usr/bin/env bash
# Issue 10 on nvidia-h200-x2, in one device call: the 345M model (seq 1024, bf16, compile, no dropout)
# on 1 GPU, at DP2 and at ZeRO-3 DP2, each beside the in-process baseline (nanoGPT's recipe; under
# DDP at DP2); CPU offload against ZeRO-3 on a tiny model; micro-batch 64 on one GPU. Logs in $OUT.
# Usage on the device: bash benchmarks/dp_session.sh [PARTS] (default: all, in order a b c d e)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M345="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
COMMON="$M345 --hidden-dropout 0 --attention-dropout 0 --bf16 --compile --warmup ${WARMUP:-8} --iters ${ITERS:-20}"
RUN2="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
show() { grep -v -i "warn" | tee -a "$OUT/$1.txt" | grep -E "^device|^\| gptrain|^\| baseline|baseline tokens|levers|Error|error" ; }
nvidia-smi -L | tee "$OUT/device.txt"; python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/device.txt"
MBS=${MBS:-16}
for part in ${1:-a b c d e}; do
  case $part in
  a) echo "== a: 1 GPU, micro-batch $MBS" | tee "$OUT/a_1gpu.txt"
     timeout 170 python3 -m gptrain bench $COMMON --micro-batch-size $MBS 2>&1 | show a_1gpu ;;
  b) echo "== b: DP2, micro-batch $MBS, global batch $((2 * MBS))" | tee "$OUT/b_dp2.txt"
     timeout 200 $RUN2 -m gptrain bench $COMMON --micro-batch-size $MBS --global-batch-size $((2 * MBS)) 2>&1 | show b_dp2 ;;
  c) echo "== c: ZeRO-3 at DP2, micro-batch $MBS" | tee "$OUT/c_zero3.txt"
     timeout 150 $RUN2 -m gptrain bench $COMMON --micro-batch-size $MBS --global-batch-size $((2 * MBS)) \
       --zero-stage 3 --no-baseline 2>&1 | show c_zero3 ;;
  d) echo "== d: tiny model, 5 iterations: ZeRO-3 vs ZeRO-3 + CPU offload at DP2 (fp32)" | tee "$OUT/d_offload.txt"
     T="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64
        --micro-batch-size 2 --global-batch-size 8 --train-iters 5 --lr 3e-3 --log-interval 1 --mock-data
        --hidden-dropout 0 --attention-dropout 0 --eval-iters 0"
     for extra in "" "--cpu-offload"; do
       timeout 90 $RUN2 -m gptrain train $T --zero-stage 3 $extra 2>&1 | grep -E "lm loss:|parameters:|rror" | tee -a "$OUT/d_offload.txt"
     done ;;
  f) echo "== f: ZeRO-3 and DP2 with torch's linear layers; ZeRO-3 at micro-batch 32" | tee "$OUT/f_variants.txt"
     for v in "--zero-stage 3 --linear-impl torch" "--linear-impl torch" "--zero-stage 3 --micro-batch-size 32 --global-batch-size 64"; do
       echo "-- $v" | tee -a "$OUT/f_variants.txt"
       timeout 120 $RUN2 -m gptrain bench $COMMON --micro-batch-size $MBS --global-batch-size $((2 * MBS)) --no-baseline $v 2>&1 | show f_variants
     done ;;
  e) echo "== e: 1 GPU, micro-batch 64" | tee "$OUT/e_1gpu_mbs64.txt"
     timeout 150 python3 -m gptrain bench $COMMON --micro-batch-size 64 2>&1 | show e_1gpu_mbs64 ;;
  esac
done
