#!/usr/bin/env bash
# One H200 x4 call with independent jobs on separate GPUs: GPU 0 the GPU lane, checkpoint save/load
# timings and decode speed; GPU 1 the demo; GPUs 2-3 a profile of the TP2 step (graph breaks,
# recompiles, host syncs, eager DTensor dispatches) and TP2 / TP2+SP throughput; on the host the
# built-in corpus as this machine's Python writes it (the Megatron fixtures' data). Logs in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M345="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
BENCH="$M345 --hidden-dropout 0 --attention-dropout 0 --bf16 --compile --warmup 6 --iters 15 --no-baseline"
RUN2="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
nvidia-smi -L > "$OUT/device.txt"; python3 --version >> "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__)" >> "$OUT/device.txt"
python3 -c "import importlib.util as u; s=u.spec_from_file_location('b','gptrain/data/builtin.py'); m=u.module_from_spec(s); s.loader.exec_module(m); print(m.write_builtin_corpus('$OUT/builtin.jsonl'))" > "$OUT/corpus.txt" 2>&1
(export CUDA_VISIBLE_DEVICES=0
 timeout 170 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --durations=0 tests/test_gpu_kernels.py > "$OUT/gpu_lane.txt" 2>&1
 timeout 120 python3 benchmarks/ckpt_save.py --dir /tmp/ckpt_bench --repeats 3 > "$OUT/ckpt_save.txt" 2>&1
 timeout 150 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --prompt-tokens 32 --new-tokens 256 > "$OUT/decode.txt" 2>&1) &
(export CUDA_VISIBLE_DEVICES=1
 { time timeout 300 python3 -m gptrain demo --out /tmp/demo_out; } > "$OUT/demo.txt" 2>&1
 cp /tmp/demo_out/loss_curve.png "$OUT/" 2>/dev/null; ls -la /tmp/demo_out >> "$OUT/demo.txt" 2>&1) &
(export CUDA_VISIBLE_DEVICES=2,3
 TORCH_LOGS=graph_breaks,recompiles timeout 200 $RUN2 benchmarks/profile_step.py --micro-batch-size 16 --global-batch-size 16 \
   --bf16 --compile --tensor-model-parallel-size 2 > "$OUT/tp2_profile.txt" 2>&1
 timeout 150 $RUN2 -m gptrain bench $BENCH --micro-batch-size 16 --global-batch-size 16 --tensor-model-parallel-size 2 > "$OUT/tp2.txt" 2>&1
 timeout 150 $RUN2 -m gptrain bench $BENCH --micro-batch-size 16 --global-batch-size 16 --tensor-model-parallel-size 2 --sequence-parallel > "$OUT/tp2_sp.txt" 2>&1) &
wait
cat "$OUT/corpus.txt"; tail -4 "$OUT/gpu_lane.txt"; tail -6 "$OUT/ckpt_save.txt"; tail -6 "$OUT/decode.txt"
grep -E "^real|loss|perplexity|rror" "$OUT/demo.txt" | tail -8
grep -v -i warn "$OUT/tp2_profile.txt" | grep -E "wall|host per|device time|\| |Graph break|Recompil|rror" | head -40
grep -E "^\| gptrain|rror" "$OUT/tp2.txt" "$OUT/tp2_sp.txt"
