#!/usr/bin/env bash
# Device calls for issue 4. Usage on the GPU machine: bash benchmarks/gpu_session.sh PART; logs go to $OUT.
#   c: levers at micro-batch 16 (default vs autocast, fused loss, attention backends), with the baseline
#   d: micro-batch 32 and fp8 (BEST: extra flags chosen from part c)
#   f: micro-batch 16 and 32 again with the baseline, and the profile, after an optimizer change
#   g: micro-batch 48 and 64 with the baseline; FlashAttention-2 instead of cuDNN attention
#   h: micro-batch 64 with Inductor coordinate-descent tuning, with fp8, with the chunked loss
#   i: micro-batch 16 with torch.compile mode max-autotune
#   j: micro-batch 16 with selective and with full activation recompute
#   k: fp16 parameters + fp32 main params vs fp16 autocast, 300 iterations of the seeds/000 flags (eager)
#   l: cuBLASLt ops: kernel check and GEMM timing, then micro-batch 16 cuBLASLt (+ bias-GELU) vs torch
#   m: micro-batch 16 cuBLASLt (+ bias-GELU) vs torch again, and micro-batch 64 against the baseline
#   n: on an H100: micro-batch 64 and 16 against the baseline; 16 with --linear-impl torch
#   o: kernel check, micro-batch 16, and the 300-iteration loss with cuBLASLt linears vs torch's
#   p: FlashAttention-4 (flash-attn-4's CuTe kernels) on packed QKV: kernel check and timing against
#      SDPA's cuDNN and FA2, micro-batch 64 against the baseline, micro-batch 16 (needs setup_fa4 below)
#   q: the same after putting cuDNN's forward before FlashAttention-4's backward (the default): kernel
#      check, micro-batch 64 against the baseline, micro-batch 16 with it and with cuDNN alone
#   r: loss over 300 iterations (micro-batch 16, no dropout, real data): cuDNN, FA2 (SDPA), flash4
#   s: the loss gradient written in the forward pass (kernels/xent.py): kernel check, micro-batch 64
#      against the baseline twice, micro-batch 16, and the 300-iteration loss of part r
#   t: the same with the gradient written over the logits (peak memory): check, micro-batch 16,
#      micro-batch 64 against the baseline twice
#   u: real indexed data vs synthetic on the final code (micro-batch 16 and 64)
#   e: real indexed data vs synthetic step time; fp8 vs bf16 loss over 300 iterations
# (parts a and b of the first session measured the first version; their logs are in benchmarks/logs/)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
G="python3 -m gptrain"
M345="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024"
ND="--hidden-dropout 0 --attention-dropout 0"  # the baseline has no dropout: compare like with like
BEST=${BEST:-}
# the seeds/000 optimizer and split flags for the loss runs on the built-in corpus
OPT="--lr 0.00015 --lr-decay-iters 5000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2
  --lr-warmup-fraction .01 --clip-grad 1.0 --bf16 --compile --split 949,50,1 --eval-iters 0 --eval-interval 100000"
builtin_data() {  # the built-in corpus, preprocessed to /tmp/d/builtin_text_document
  mkdir -p /tmp/d && $G data builtin --output /tmp/d/builtin.jsonl >/dev/null &&
    $G preprocess --input /tmp/d/builtin.jsonl --output-prefix /tmp/d/builtin --append-eod --workers 8 --no-progress >/dev/null
}
bench() {  # NAME LIMIT_S FLAGS...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" | tee "$OUT/$name.txt"
  timeout "$limit" $G bench $M345 $ND --bf16 --compile "$@" 2>&1 | grep -v -i "warn" | tee -a "$OUT/$name.txt" | grep -E "^\| gptrain|^\| baseline|ratio|x$|Error|error" 
}
# flash-attn-4 and its CuTe DSL runtime travel in two device calls (together over the 64 MiB limit):
# first `.fa4a` (the cu13 runtime, tar.xz) unpacked to /tmp/fa4site, then `.fa4b` (the wheels)
setup_fa4() {
  test -f /tmp/fa4site/nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so || { echo "no CuTe runtime in /tmp/fa4site"; return 1; }
  test -d /tmp/fa4w/flash_attn || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa4w .fa4b/*.whl || return 1
  cp -a /tmp/fa4site/nvidia_cutlass_dsl/. /tmp/fa4w/nvidia_cutlass_dsl/
  export PYTHONPATH=$PYTHONPATH:/tmp/fa4w:/tmp/fa4w/nvidia_cutlass_dsl/dsl_packages
}
case "$1" in
u)  # session 4: real data vs --mock-data with FlashAttention-4, cuBLASLt and the forward-pass loss gradient
  setup_fa4 || exit 3
  builtin_data
  TRAIN="$M345 $ND $OPT"
  for run in "16 100" "64 60"; do set -- $run
    for src in "--data-path /tmp/d/builtin_text_document" "--mock-data"; do
      echo "== micro-batch $1, $src" | tee -a "$OUT/u1_real_vs_mock.txt"
      timeout 140 $G train $TRAIN --micro-batch-size $1 --train-iters $2 --log-interval 20 $src 2>&1 \
        | grep -E "iteration|attention:|Error" | tee -a "$OUT/u1_real_vs_mock.txt" | grep -E "iteration +($2)/|Error"
    done
  done
  ;;
t)  # session 4: final code
  setup_fa4 || exit 3
  timeout 100 python3 benchmarks/check_xent.py 2>&1 | grep -v -i warn | tee "$OUT/t0_check_xent.txt" || exit 4
  bench t1_mbs16 90 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline
  bench t2_mbs64 220 --micro-batch-size 64 --warmup 5 --iters 10
  bench t3_mbs64_again 220 --micro-batch-size 64 --warmup 5 --iters 10
  ;;
s)  # session 4: loss + gradient in one kernel in the forward pass (with FlashAttention-4 and cuBLASLt)
  setup_fa4 || exit 3
  timeout 100 python3 benchmarks/check_xent.py 2>&1 | grep -v -i warn | tee "$OUT/s0_check_xent.txt" || exit 4
  bench s1_mbs64 220 --micro-batch-size 64 --warmup 5 --iters 10
  bench s2_mbs16 90 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline
  builtin_data
  timeout 110 $G train $M345 $ND $OPT --micro-batch-size 16 --train-iters 300 --log-interval 25 \
    --data-path /tmp/d/builtin_text_document 2>&1 | grep -E "iteration|attention:|linear layers:|Error" \
    | tee "$OUT/s3_loss.txt" | grep -E "attention:|linear|iteration +(25|150|300)/|Error"
  bench s4_mbs64_again 220 --micro-batch-size 64 --warmup 5 --iters 10
  ;;
q)  # session 4: cuDNN forward + FlashAttention-4 backward on packed QKV (auto's pick when installed)
  setup_fa4 || exit 3
  timeout 150 python3 benchmarks/check_flash4.py 2>&1 | grep -v -i warn | tee "$OUT/q0_check_flash4.txt"
  bench q1_mbs64 250 --micro-batch-size 64 --warmup 5 --iters 10
  bench q2_mbs16 100 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline
  bench q3_mbs16_cudnn 100 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline --attention-backend fused
  ;;
r)  # the loss with each attention kernel (no dropout: FlashAttention-4 has none)
  setup_fa4 || exit 3
  builtin_data
  TRAIN="$M345 $ND $OPT"
  for b in fused flash flash4; do
    timeout 150 $G train $TRAIN --attention-backend $b --micro-batch-size 16 --train-iters 300 --log-interval 25 \
      --data-path /tmp/d/builtin_text_document 2>&1 | grep -E "iteration|attention:|Error" | tee -a "$OUT/r1_loss_attention.txt" \
      | grep -E "attention:|iteration +(25|150|300)/|Error"
  done
  ;;
p)  # session 4: FlashAttention-4 on packed QKV vs SDPA (cuDNN)
  setup_fa4 || exit 3
  timeout 220 python3 benchmarks/check_flash4.py 2>&1 | grep -v -i warn | tee "$OUT/p0_check_flash4.txt"
  bench p1_mbs64_flash4 250 --micro-batch-size 64 --warmup 5 --iters 10 --attention-backend flash4
  bench p2_mbs16_flash4 110 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline --attention-backend flash4
  ;;
l)  # session 3: fc1 bias + GELU in cuBLASLt epilogues (default) vs --no-bias-gelu-fusion
  timeout 200 python3 benchmarks/check_cublaslt.py 2>&1 | grep -v -i warn | tee "$OUT/l0_check_cublaslt.txt"
  bench l1_mbs16_cublaslt 130 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline --no-bias-gelu-fusion
  bench l2_mbs16_cublaslt_gelu 130 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline
  bench l3_mbs16_torch 130 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline --linear-impl torch
  ;;
m)  # after moving bias gradients out of the wgrad epilogue
  bench m1_mbs16_cublaslt_gelu 130 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline
  bench m2_mbs16_torch 130 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline --linear-impl torch
  bench m3_mbs16_cublaslt 130 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline --no-bias-gelu-fusion
  bench m4_mbs64 300 --micro-batch-size 64 --warmup 4 --iters 8 $BEST
  ;;
c)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
  python3 -c "import torch; q = torch.randn(16, 16, 1024, 64, device='cuda', dtype=torch.bfloat16)
print('torch', torch.__version__, '| SDPA auto choice (1 flash, 2 efficient, 3 cudnn):',
      torch._fused_sdp_choice(q, q, q, is_causal=True))" | tee -a "$OUT/device.txt"
  bench c1_mbs16_default 180 --micro-batch-size 16 --warmup 6 --iters 15
  bench c2_mbs16_autocast 130 --micro-batch-size 16 --warmup 6 --iters 15 --bf16-autocast --no-baseline
  bench c3_mbs16_fusedce 130 --micro-batch-size 16 --warmup 6 --iters 15 --fused-cross-entropy --no-baseline
  bench c4_mbs16_cudnn 130 --micro-batch-size 16 --warmup 6 --iters 15 --attention-backend fused --no-baseline
  ;;
d)
  timeout 150 python3 benchmarks/profile_step.py --micro-batch-size 16 --bf16 --compile $BEST 2>&1 | grep -v -i warn \
    | tee "$OUT/d0_profile_mbs16.txt" | head -12
  bench d1_mbs32 220 --micro-batch-size 32 --warmup 5 --iters 10 $BEST
  bench d2_mbs32_fusedce 150 --micro-batch-size 32 --warmup 5 --iters 10 --fused-cross-entropy --no-baseline $BEST
  bench d3_mbs16_fp8 180 --micro-batch-size 16 --warmup 6 --iters 15 --fp8 --no-baseline $BEST
  bench d4_mbs32_fp8 180 --micro-batch-size 32 --warmup 5 --iters 10 --fp8 --no-baseline $BEST
  ;;
f)  # after folding the clip into AdamW and the flat fp32 main-gradient buffer
  bench f1_mbs16 180 --micro-batch-size 16 --warmup 6 --iters 15 $BEST
  bench f2_mbs32 220 --micro-batch-size 32 --warmup 5 --iters 10 $BEST
  timeout 150 python3 benchmarks/profile_step.py --micro-batch-size 16 --bf16 --compile $BEST 2>&1 | grep -v -i warn \
    | tee "$OUT/f3_profile_mbs16.txt" | head -12
  ;;
g)  # larger micro-batches (the fixed per-step optimizer cost amortised), and FlashAttention-2 vs cuDNN
  bench g1_mbs64 280 --micro-batch-size 64 --warmup 4 --iters 8 $BEST
  bench g2_mbs48 260 --micro-batch-size 48 --warmup 4 --iters 8 $BEST
  bench g3_mbs16_flash 130 --micro-batch-size 16 --warmup 6 --iters 15 --attention-backend flash --no-baseline $BEST
  ;;
h)  # at micro-batch 64: Inductor's coordinate-descent tuning of its kernels, fp8, the chunked loss
  TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 bench h1_mbs64_cdtune 300 --micro-batch-size 64 --warmup 4 --iters 8 $BEST
  bench h2_mbs64_fp8 200 --micro-batch-size 64 --warmup 4 --iters 8 --fp8 --no-baseline $BEST
  bench h3_mbs64_fusedce 150 --micro-batch-size 64 --warmup 4 --iters 8 --fused-cross-entropy --no-baseline $BEST
  ;;
i)  # torch.compile's max-autotune (Triton GEMM templates with fused epilogues, CUDA graphs), mbs 16
  bench i1_mbs16_maxautotune 540 --micro-batch-size 16 --warmup 6 --iters 15 --compile-mode max-autotune --no-baseline $BEST
  ;;
j)  # activation recompute at micro-batch 16: selective (core attention) and full (whole blocks)
  bench j1_mbs16_selective 130 --micro-batch-size 16 --warmup 6 --iters 15 --recompute-activations --no-baseline $BEST
  bench j2_mbs16_full 130 --micro-batch-size 16 --warmup 6 --iters 15 --checkpoint-activations --no-baseline $BEST
  ;;
k)  # fp16 with fp16 parameters + fp32 main params (Megatron's --fp16) vs fp16 autocast: seeds/000 flags
  builtin_data
  for mode in "" "--autocast"; do
    echo "== fp16 $mode" | tee -a "$OUT/k1_fp16_modes.txt"
    timeout 150 $G train $M345 --micro-batch-size 8 --global-batch-size 8 --lr 0.00015 --train-iters 300 \
      --lr-decay-iters 5000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 \
      --clip-grad 1.0 --fp16 $mode --data-path /tmp/d/builtin_text_document --split 949,50,1 \
      --log-interval 25 --eval-interval 100000 --eval-iters 0 2>&1 | grep -E "iteration|memory|precision" \
      | tee -a "$OUT/k1_fp16_modes.txt" | grep -E "iteration +(25|100|300)/"
  done
  ;;
n)  # the same on an H100 (the device): micro-batch 64 and 16 against the baseline, 16 with torch's linears
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
  bench n1_mbs64 300 --micro-batch-size 64 --warmup 4 --iters 8 $BEST
  bench n2_mbs16 200 --micro-batch-size 16 --warmup 6 --iters 15 $BEST
  bench n3_mbs16_torch 130 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline --linear-impl torch
  ;;
o)  # after the alignment change: kernel check, micro-batch 16, and the loss over 300 iterations of the
    # seeds/000 flags (micro-batch 8, dropout 0.1, real data) with cuBLASLt linears vs torch's
  timeout 150 python3 benchmarks/check_cublaslt.py 2>&1 | grep -v -i warn | tee "$OUT/o0_check_cublaslt.txt" | head -6
  bench o1_mbs16 130 --micro-batch-size 16 --warmup 6 --iters 15 --no-baseline
  builtin_data
  TRAIN="$M345 $OPT"
  for impl in cublaslt torch; do
    timeout 200 $G train $TRAIN --linear-impl $impl --micro-batch-size 8 --train-iters 300 --log-interval 25 \
      --data-path /tmp/d/builtin_text_document 2>&1 | grep -E "iteration|memory|linear layers" | tee -a "$OUT/o2_loss_cublaslt_vs_torch.txt" \
      | grep -E "linear layers|iteration +(25|150|300)/"
  done
  ;;
e)
  builtin_data
  TRAIN="$M345 $OPT"
  # real data vs synthetic: same step, 100 iterations at micro-batch 16, logged every 20
  for src in "--data-path /tmp/d/builtin_text_document" "--mock-data"; do
    timeout 200 $G train $TRAIN $ND $BEST --micro-batch-size 16 --train-iters 100 --log-interval 20 $src 2>&1 \
      | grep -E "iteration|memory" | tee -a "$OUT/e1_real_vs_mock.txt"
  done
  # fp8 vs bf16: seeds/000 flags, 300 iterations, micro-batch 8, dropout as Megatron's default
  for p in "" "--fp8"; do
    timeout 200 $G train $TRAIN $BEST $p --micro-batch-size 8 --train-iters 300 --log-interval 25 \
      --data-path /tmp/d/builtin_text_document 2>&1 | grep -E "iteration|memory" | tee -a "$OUT/e2_bf16_vs_fp8.txt"
  done
  ;;
esac
