#!/usr/bin/env bash
# Issue 11's GPU table in one call on nvidia-h200-x2: 1 GPU and DP2 of the same build, TP2 and TP2+SP
# at their best micro-batch, PP2 1F1B with even stages (12 + 12 layers) and with the last stage
# given 10 layers (--decoder-last-pipeline-num-layers 10: the output layer and loss weigh about
# 3.5 layers); then tensor-parallel serving on the two GPUs against one (benchmarks/serve_tp.py).
# Logs in $OUT/x2.tgz.   bash benchmarks/issue11_x2.sh      (carry .whl: fastapi, uvicorn, ...)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
FINAL=${OUT:-/tmp/out}; L=/tmp/logs; mkdir -p "$FINAL" $L
pack() { tar czf "$FINAL/x2.tgz" -C $L .; }
M345="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
BENCH="$M345 --hidden-dropout 0 --attention-dropout 0 --bf16 --compile --warmup ${WARMUP:-3} --iters ${ITERS:-8} --no-baseline"
nvidia-smi -L | tee $L/device.txt
for v in "1:16:16:" "2:16:32:" "2:32:32:--tensor-model-parallel-size 2" "2:32:32:--tensor-model-parallel-size 2 --sequence-parallel" \
         "2:16:128:--pipeline-model-parallel-size 2" "2:16:128:--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 10"; do
  IFS=: read -r n mbs gbs f <<< "$v"
  echo "-- $n GPUs, micro-batch $mbs, global batch $gbs: $f" | tee -a $L/table.txt
  timeout 110 python3 -m torch.distributed.run --standalone --nproc-per-node $n -m gptrain bench $BENCH \
    --micro-batch-size $mbs --global-batch-size $gbs $f 2>&1 | grep -v -i warn > $L/run.txt
  cat $L/run.txt >> $L/all.txt
  grep -E "^device|^\| gptrain|bubble|pipeline:|rror|Traceback" $L/run.txt | tee -a $L/table.txt
  pack
done
timeout 200 python3 benchmarks/serve_tp.py --nproc 2 --new-tokens 128 --batch-sizes 1 32 > $L/serve_tp.txt 2>&1
echo "serve_tp rc $?" >> $L/serve_tp.txt; pack
tail -25 $L/serve_tp.txt
