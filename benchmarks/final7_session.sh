#!/usr/bin/env bash
# Session 7's last call on one H200 x4 host. Phase 1, side by side on separate GPUs: the demo then
# the kernel-path PP2 check (GPU 0 / GPUs 2-3: PP2 with the last stage given fewer layers), decode
# speed and checkpoint save timings (GPU 1). Phase 2, alone on the host: the throughput of every
# 4-GPU layout of seeds/004 at its best micro-batch beside 1 GPU. Logs in $OUT/final7.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
FINAL=${OUT:-/tmp/out}; L=/tmp/logs; mkdir -p "$FINAL" $L
M345="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
BENCH="$M345 --hidden-dropout 0 --attention-dropout 0 --bf16 --compile --warmup ${WARMUP:-3} --iters ${ITERS:-6} --no-baseline"
RUN="python3 -m torch.distributed.run --standalone --nproc-per-node"
pack() { tar czf "$FINAL/final7.tgz" -C $L .; }
(export CUDA_VISIBLE_DEVICES=0
 { time timeout 110 python3 -m gptrain demo --out /tmp/demo_out; } > $L/demo.txt 2>&1
 cp /tmp/demo_out/loss_curve.png $L/ 2>/dev/null) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 90 python3 benchmarks/decode_speed.py ${DECODE_ARGS:---batch-sizes 1 32 --prompt-tokens 32 --new-tokens 256} > $L/decode.txt 2>&1
 timeout 100 python3 benchmarks/ckpt_save.py --dir /tmp/ckpt_bench --repeats 3 > $L/ckpt_save.txt 2>&1) &
(export CUDA_VISIBLE_DEVICES=2,3
 for last in 10; do
   timeout 100 $RUN 2 -m gptrain bench $BENCH --micro-batch-size 16 --global-batch-size 128 --pipeline-model-parallel-size 2 \
     --decoder-last-pipeline-num-layers $last > $L/pp2_last$last.txt 2>&1
 done) &
wait; pack
echo "== phase 2: 4-GPU layouts" > $L/f.txt
for v in "1:16:32:" "4:16:128:" "4:32:64:--tensor-model-parallel-size 2" \
         "4:16:128:--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" \
         "4:32:32:--tensor-model-parallel-size 4" "4:8:128:--pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 3" \
         "4:16:128:--zero-stage 3"; do
  IFS=: read -r n mbs gbs f <<< "$v"
  echo "-- $n GPUs, micro-batch $mbs, global batch $gbs: $f" >> $L/f.txt
  f2=${f/--fp16/}; [ "$f2" != "$f" ] && BENCHX=${BENCH/--bf16/--fp16} || BENCHX=$BENCH
  timeout 50 $RUN $n -m gptrain bench $BENCHX --micro-batch-size $mbs --global-batch-size $gbs $f2 2>&1 | grep -v -i warn \
    | grep -E "^\| gptrain|^device|rror|Traceback|bubble" >> $L/f.txt
  pack
done
cat $L/f.txt; grep -h -E "^\| gptrain|rror" $L/pp2_last*.txt; tail -4 $L/decode.txt; tail -8 $L/ckpt_save.txt
grep -E "^real|lm loss .*fell|sample|FAILED|OK" $L/demo.txt | head -8
