#!/usr/bin/env bash
# Session 6's last device call, on one H200 x4 host, everything at once on separate GPUs: the built-in
# corpus as this machine kind writes it (the Megatron fixtures' data), the GPU lane (GPU 0), the demo
# (GPU 1), decode speed against HF generate (GPU 2), and TP2 throughput (GPUs 2-3, after decode).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 --version | tee "$OUT/python.txt"
python3 -c "import importlib.util as u; s=u.spec_from_file_location('b','gptrain/data/builtin.py'); m=u.module_from_spec(s); s.loader.exec_module(m); print(m.write_builtin_corpus('$OUT/builtin.jsonl'))" | tee -a "$OUT/python.txt"
(CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_gpu_kernels.py > "$OUT/gpu_lane.txt" 2>&1) &
(CUDA_VISIBLE_DEVICES=1 bash -c "time timeout 170 python3 -m gptrain demo --out /tmp/demo_out" > "$OUT/demo.txt" 2>&1; cp /tmp/demo_out/loss_curve.png "$OUT/" 2>/dev/null) &
(CUDA_VISIBLE_DEVICES=2 timeout 90 python3 benchmarks/decode_speed.py --batch-sizes 1 32 --prompt-tokens 32 --new-tokens 128 --repeats 1 > "$OUT/decode.txt" 2>&1
 if [ -n "${TP:-}" ]; then CUDA_VISIBLE_DEVICES=2,3 timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m gptrain bench \
   --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 \
   --hidden-dropout 0 --attention-dropout 0 --bf16 --compile --warmup 5 --iters 10 --micro-batch-size 16 \
   --global-batch-size 16 --no-baseline --tensor-model-parallel-size 2 > "$OUT/tp2.txt" 2>&1; fi) &
wait
tail -5 "$OUT/gpu_lane.txt"; grep -E "^real|loss|perplexity|rror" "$OUT/demo.txt" | tail -8; tail -8 "$OUT/decode.txt"; grep -E "^\| gptrain|rror" "$OUT/tp2.txt" 2>/dev/null
