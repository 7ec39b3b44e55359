#!/usr/bin/env bash
# Issues 11 and 14 on one H200 host (nvidia-h200-x4; the 2-GPU parts use GPUs 0 and 1): the 345M
# model (seq 1024, bf16, compile, no dropout unless said) at every tensor/pipeline/data layout.
# Logs in $OUT. Usage on the device: bash benchmarks/parallel_session.sh PARTS
#   t: throughput on 1 and 2 GPUs (1 GPU with the nanoGPT baseline, DP2, TP2, TP2+SP, PP2; GPUs $TGPUS,
#      default 0,1)
#   c2: 300-iteration loss curves on the built-in corpus: 1 GPU, TP2, PP2 (on GPUs $CGPUS, default 2,3)
#   c4: the same for the 4-GPU layouts of seeds/004 (4DP, TP2xDP2, TP2xPP2, TP4, PP4, ZeRO-3 4DP)
#   c4b: the 4-GPU layouts session 6 did not finish (TP2xPP2, TP4 at micro-batch 16, PP4, ZeRO-3 4DP)
#   d: only prepare the built-in corpus (before parts run side by side)
#   f: throughput of the 4-GPU layouts
#   r: save at TP2 x PP2, resume at 4DP
#   s: smoke: 3 iterations of every layout on synthetic data (no compile)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M345="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
BENCH="$M345 --hidden-dropout 0 --attention-dropout 0 --bf16 --compile --warmup ${WARMUP:-6} --iters ${ITERS:-15}"
RUN2="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
RUN4="python3 -m torch.distributed.run --standalone --nproc-per-node 4"
# the seeds' optimizer flags (seeds/000 examples/pretrain_gpt.sh), built-in corpus
OPT="--lr 0.00015 --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 \
     --lr-warmup-fraction .01 --clip-grad 1.0 --split 949,50,1 --log-interval 50 --eval-interval 300 --eval-iters 5"
show() { grep -v -i "warn" | tee -a "$OUT/$1.txt" | grep -E "^device|^\| gptrain|^\| baseline|baseline tokens|levers|Error|error|Traceback" ; }
curve() { grep -v -i "warn" | tee -a "$OUT/$1.txt" | grep -E "iteration +(50|150|300)/|validation loss|parameters on|pipeline:|rror|Traceback" ; }
rcurve() { grep -v -i "warn" | tee -a "$OUT/r_resume.txt" | grep -E "iteration +(20|100|120|200)/|validation loss|loading|saving|rror|Traceback" ; }
nvidia-smi -L | tee "$OUT/device.txt"; python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/device.txt"
builtin_data() {
  [ -f /tmp/data/builtin_text_document.idx ] && return
  mkdir -p /tmp/data
  python3 -m gptrain data builtin --output /tmp/data/corpus.jsonl >/dev/null
  python3 -m gptrain preprocess --input /tmp/data/corpus.jsonl --output-prefix /tmp/data/builtin --append-eod \
    --workers 8 --no-progress >/dev/null
}
for part in ${1:-s}; do
  case $part in
  s) echo "== s: smoke, 3 iterations per layout" | tee "$OUT/s_smoke.txt"
     S="$M345 --micro-batch-size 4 --global-batch-size 16 --train-iters 3 --log-interval 1 --mock-data --eval-iters 1 --eval-interval 3 --lr 1e-4"
     for v in "2:--bf16 --tensor-model-parallel-size 2" "2:--bf16 --pipeline-model-parallel-size 2" \
              "4:--bf16 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel" \
              "4:--bf16 --pipeline-model-parallel-size 4" "4:--bf16 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 6" \
              "4:--fp16 --pipeline-model-parallel-size 2 --use-distributed-optimizer" \
              "4:--bf16 --compile --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2"; do
       n=${v%%:*}; f=${v#*:}; echo "-- $n GPUs: $f" | tee -a "$OUT/s_smoke.txt"
       timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node $n -m gptrain train $S $f 2>&1 \
         | grep -v -i warn | tee -a "$OUT/s_smoke.txt" | grep -E "lm loss:|validation loss|pipeline:|rror|Traceback" | cut -c1-220
     done ;;
  t) echo "== t: throughput on 1 and 2 GPUs" | tee "$OUT/t_throughput.txt"
     export CUDA_VISIBLE_DEVICES=${TGPUS:-0,1}
     for v in "1:16:16:" "2:16:32:" "2:16:16:--tensor-model-parallel-size 2" "2:16:16:--tensor-model-parallel-size 2 --sequence-parallel" \
              "2:8:64:--pipeline-model-parallel-size 2" "2:16:128:--pipeline-model-parallel-size 2" \
              "2:8:128:--pipeline-model-parallel-size 2"; do
       IFS=: read -r n mbs gbs f <<< "$v"
       base="--no-baseline"; [ "$n" = 1 ] && base=""
       echo "-- $n GPUs, micro-batch $mbs, global batch $gbs: $f" | tee -a "$OUT/t_throughput.txt"
       timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node $n -m gptrain bench $BENCH \
         --micro-batch-size $mbs --global-batch-size $gbs $base $f 2>&1 | show t_throughput
     done
     unset CUDA_VISIBLE_DEVICES ;;
  d) builtin_data ;;
  c2|c4|c4b) builtin_data
     echo "== $part: 300 iterations on the built-in corpus, global batch 16, bf16 (dropout 0.1)" | tee "$OUT/${part}_curves.txt"
     C="$M345 --micro-batch-size 4 --global-batch-size 16 --train-iters 300 --bf16 --compile $OPT --data-path /tmp/data/builtin_text_document"
     if [ $part = c2 ]; then
       export CUDA_VISIBLE_DEVICES=${CGPUS:-2,3}
       layouts=("1:" "2:--tensor-model-parallel-size 2" "2:--pipeline-model-parallel-size 2")
     elif [ $part = c4b ]; then
       layouts=("4:--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" "4:--tensor-model-parallel-size 4 --micro-batch-size 16"
                "4:--pipeline-model-parallel-size 4 --micro-batch-size 2" "4:--zero-stage 3")
     else
       layouts=("4:" "4:--tensor-model-parallel-size 2" "4:--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel"
                "4:--tensor-model-parallel-size 4" "4:--pipeline-model-parallel-size 4 --micro-batch-size 2" "4:--zero-stage 3")
     fi
     for v in "${layouts[@]}"; do
       n=${v%%:*}; f=${v#*:}; echo "-- $n GPUs: $f" | tee -a "$OUT/c_curves.txt"
       name=c_$(echo "$n $f" | tr -c 'a-z0-9\n' '_')
       timeout ${CT:-150} python3 -m torch.distributed.run --standalone --nproc-per-node $n -m gptrain train $C $f 2>&1 | curve $name
     done
     unset CUDA_VISIBLE_DEVICES ;;
  f) echo "== f: throughput of the 4-GPU layouts" | tee "$OUT/f_throughput4.txt"
     for v in "4:16:64:" "4:16:32:--tensor-model-parallel-size 2" "4:16:64:--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel" \
              "4:16:16:--tensor-model-parallel-size 4 --sequence-parallel" "4:8:128:--pipeline-model-parallel-size 4" \
              "4:8:128:--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 3" "4:16:64:--zero-stage 3"; do
       IFS=: read -r n mbs gbs f <<< "$v"
       echo "-- $n GPUs, micro-batch $mbs, global batch $gbs: $f" | tee -a "$OUT/f_throughput4.txt"
       timeout 200 $RUN4 -m gptrain bench $BENCH --micro-batch-size $mbs --global-batch-size $gbs --no-baseline $f 2>&1 | show f_throughput4
     done ;;
  r) builtin_data
     echo "== r: save at TP2 x PP2 (iteration 100), resume at 4DP to 200" | tee "$OUT/r_resume.txt"
     R="$M345 --micro-batch-size 4 --global-batch-size 16 --train-iters 200 --bf16 $OPT --log-interval 20 --data-path /tmp/data/builtin_text_document"
     timeout ${CT:-150} $RUN4 -m gptrain train $R --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --exit-interval 100 --save /tmp/ckpt 2>&1 | rcurve
     timeout ${CT:-150} $RUN4 -m gptrain train $R --load /tmp/ckpt 2>&1 | rcurve
     timeout ${CT:-150} $RUN4 -m gptrain train $R --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 2>&1 | rcurve ;;
  esac
done
