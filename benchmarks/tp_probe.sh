#!/usr/bin/env bash
# Why TP2 is slow (nvidia-h200-x4; GPUs 0-1): the links between the GPUs and NCCL's speed, then a
# profile of the TP2 step at one and two micro-batches and throughput at micro-batch 8/16/32; GPUs
# 2-3 meanwhile run the demo sweep. Everything lands in $OUT/tp_probe.tar.gz; a summary on stdout.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; L=/tmp/logs; mkdir -p "$OUT" $L
M345="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
RUN2="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
(OUT=$L GPUS="2 3" bash benchmarks/demo_sweep.sh) &
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi topo -m > $L/topo.txt 2>&1
NCCL_DEBUG=INFO timeout 90 $RUN2 benchmarks/nccl_bench.py > $L/nccl.txt 2>&1
for g in 16 32; do
  TORCH_LOGS=graph_breaks,recompiles timeout 200 $RUN2 benchmarks/profile_step.py --micro-batch-size 16 --global-batch-size $g \
    --bf16 --compile --tensor-model-parallel-size 2 ${EXTRA:-} > $L/tp2_profile_gbs$g.txt 2>&1
done
for m in 8 16 32; do
  timeout 150 $RUN2 -m gptrain bench $M345 --hidden-dropout 0 --attention-dropout 0 --bf16 --compile --warmup 6 --iters 15 \
    --no-baseline --micro-batch-size $m --global-batch-size $m --tensor-model-parallel-size 2 ${EXTRA:-} > $L/tp2_mbs$m.txt 2>&1
done
wait
tar czf "$OUT/tp_probe.tar.gz" -C $L .
cat $L/topo.txt | head -8; grep -E "via|Channel 00" $L/nccl.txt | head -6; grep "^|" $L/nccl.txt
for g in 16 32; do echo "== profile gbs $g"; grep -v -i warn $L/tp2_profile_gbs$g.txt | grep -E "wall|timeline|host per|device time|^\| |Graph break|Recompil|rror" | head -30
  grep -A14 "top kernels" $L/tp2_profile_gbs$g.txt; done
grep -h -E "^\| gptrain|rror" $L/tp2_mbs*.txt
for f in $L/sweep_?.txt; do grep -E "^==|validation loss at iteration|^real" $f | cut -c1-120; done
