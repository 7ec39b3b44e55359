#!/usr/bin/env bash
# gptrain's benchmarks behind one entry. Runs on a GPU machine after the README's install
# (`python3 -m pip install -e .`; the `lane` suite also needs pytest).
#
#   benchmarks/run.sh SUITE [extra args]
#
#   train       gptrain's training step against the in-process plain-PyTorch baseline (nanoGPT's
#               recipe, compiled, same process): the 345M, seq 1024, bf16, compiled, no dropout, at
#               micro-batch 16 and 64 (benchmarks/train_throughput.py = `gptrain bench`)
#   scaling     train_throughput.py under torchrun at the DP/ZeRO/TP/PP layouts beside a 1-GPU row of the
#               same run (nccl_bench.py and comm_overlap.py first: an all-reduce beside a matmul); 2-GPU
#               layouts from 2 GPUs, 4-GPU layouts from 4; with one GPU it says so and exits 0;
#               ONLY="1gpu dp2 ..." picks layouts (and nccl, comm_overlap); with
#               MEGATRON_LM=<a Megatron-LM checkout> also Megatron-LM's own step (megatron_lm_throughput.py:
#               megatron_1gpu megatron_dp2 megatron_tp2 megatron_tp2_sp megatron_pp2)
#   table       every 2-GPU layout in one call (issue 36's table): benchmarks/layout_table.py under one torchrun
#               of 2 processes that stay up from row to row (1 GPU, DP2, DP2 overlapped, TP2, TP2+SP (each by default
#               and on NCCL), PP2 1F1B and
#               interleaved, ZeRO-1/2/3; each also at the planner's fastest micro-batch; nanoGPT beside the 1-GPU
#               and DP2 rows; the planner's prediction beside every row), after the restart suite and serve_tp.py
#               (TP2 serving beside 1 GPU's, batch 1 and 32, 32 clients; its fp32 comparison left to `run.sh
#               serve`; needs fastapi and uvicorn, which the lent machines lack: carry them as wheels), which come
#               first so that a call's time limit cuts rows, not them. No row starts after TABLE_ROWS_SECONDS
#               (default 300), or, with TABLE_CALL_SECONDS (which overrides it), after what is left of that many
#               seconds from run.sh's start less 60 (BEST_MICRO_BATCH="tp2 dp2" limits the best-micro-batch rows
#               to those layouts). Extra args go to
#               layout_table.py (--rows "1gpu tp2" ...). Its compilation dominates: on a machine whose caches are
#               cold, warm them first with `table_warm` (in a call before, on the same machine, held)
#   table_warm  warms this machine's compile caches for `table`: its rows split over four concurrent
#               layout_table.py runs at --warmup 2 --iters 1 (their timings meaningless, and not printed as
#               results), with the restart suite and serve_tp.py beside them (two at a time on GPUs under
#               130 GiB); its first form, without the restart and serving, took 283 s on 2 x H200
#   ranks       the rank simulator on one GPU: one rank of DP2 (one all-reduce after the backward, and
#               --overlap-grad-reduce at two bucket sizes) and of TP2 / TP2+SP (345M, micro-batch 16; TP
#               with and without CUDA graphs, their default under TP) beside the 1-GPU step, a TP8+SP rank
#               of a 175B pipeline stage (12 layers, 8 micro-batches), and the start-up of a rank of the
#               175B TP8 x PP8 plan (world 64); ONLY="1gpu dp2 dp2_overlap dp2_overlap_100m tp2 tp2_sp
#               tp2_no_graphs tp2_sp_no_graphs 175b_stage 175b_pp8 175b_startup" picks rows
#   decode      decode_speed.py: the 345M (bf16, random init) at batch 1 and 32, 32-token prompts,
#               256 new tokens, greedy: the fused loop (and its variants), eager and HF generate (if
#               transformers is installed), --profile
#   serve       a 345M checkpoint (2 training iterations on synthetic data), `gptrain serve` on it,
#               serve_load.py with 32 clients then 1, the server stopped; serve_host_profile.py (the same load
#               with a stack sampler in the server's process); the engine's batch-32 rate (decode_speed.py)
#               and the server's share of it (serve_share.py); with 2 GPUs serve_tp.py too
#   startup     start_up.py: `gptrain generate` and `gptrain serve` start-up from a new process, cold then
#               warm caches (bytecode cached as a pip install leaves it), where the seconds go
#   checkpoint  ckpt_save.py: the 345M training state saved (sync, async) and loaded, 3 times each
#   preprocess  preprocess.py: `gptrain preprocess` against raw tiktoken on 100 MB of text (CPU)
#   lane        the GPU test lane (pytest -m gpu on the kernel, decode and weight-loading tests), then `gptrain demo`
#   kernels     each GPU kernel against its reference, then timed: check_cublaslt.py, check_xent.py,
#               check_flash4.py (if flash-attn-4 is installed), decode_gemv.py, decode_kernels.py --quick
#   restart     rank_restart.py: a 2-GPU run under torchrun --max-restarts 1, one worker killed with SIGKILL
#   profile     profile_step.py: where one 345M training step's device and host time go (micro-batch 16)
#   offload     ZeRO-Offload on one GPU (--zero-stage 3 --cpu-offload): a GPT-2-shaped 2.7B (seq 1024,
#               full recompute) at micro-batch 8 with 1 and 8 micro-batches per step beside the same model
#               without offload, at ZeRO-3 and ZeRO-2; then the largest of SIZES ("layers:hidden ...",
#               default 7.5B, 6.7B, 5.2B) that trains at ZeRO-2; z2_overlap / z2x8_overlap add
#               --overlap-cpu-optimizer-d2h-h2d, z2_overlap_f90/f75/f50 --optimizer-offload-fraction 0.9/0.75/0.5;
#               deepspeed_z2 / deepspeed_z2x8: DeepSpeed's ZeRO-2 offload on the same model where deepspeed is
#               installed (deepspeed_offload.py), deepspeed_z3_r50 its ZeRO-3 with offload ratio 0.5;
#               ONLY="plain z3 z3x8 z2 z2x8 z2_overlap z2x8_overlap z2_overlap_f90 z2_overlap_f75 z2_overlap_f50
#               deepspeed_z2 deepspeed_z2x8 deepspeed_z3_r50 largest" picks rows
#   llama       a ~1B Llama-style model (16 x 2048, 32 heads, 8 K/V groups, SwiGLU 5632, RMSNorm, RoPE,
#               untied, seq 2048) against torchtitan-style plain PyTorch, the GPT-2-style model of the
#               same shape against nanoGPT's, micro-batch 8; then decode_llama.py (against HF's static cache)
#   calibrate   gptrain plan --calibrate on this GPU (the table it writes is printed)
#   memory      memory_peak.py: what is live at the peak of the 2.7B's step (full recompute) at micro-batch
#               8 and 16 (MBS="8 16"), grouped by where it was allocated, beside the planner's terms; then
#               with ZeRO-2/3 offload at micro-batch 8 (OFFLOAD_STAGES="2 3"; blocks grouped by size)
#   all         lane train ranks decode serve checkpoint preprocess scaling, in turn (no extra args)
#
# Extra args go to the suite's benchmark command(s) and, given last, override its defaults (e.g.
# `run.sh train --iters 30`, `run.sh preprocess --mb 20`, `run.sh decode --batch-sizes 1`).
# Compilation: inductor's caches live in ${TORCHINDUCTOR_CACHE_DIR:-$WORK/compile_cache}, shared by the rows of
# one call; COMPILE_CACHE_IN=<a .tgz of them> starts from a saved copy, COMPILE_CACHE_OUT=<file.tgz> saves them
# at the end, so that a later call's rows can skip most of their compilation (the cache's keys name the GPU and
# the software, so a copy should serve a machine of the same kind and image; not yet tried across machines).
# Logs: ${OUT:-benchmarks/out}/SUITE/*.txt (git-ignored; a relative OUT is taken from the repository
# root) and OUT/device.txt (device, versions, commit, date). Large scratch files (checkpoints, the
# demo's folder) go under ${WORK:-${TMPDIR:-/tmp}/gptrain_bench}. Each command is printed before it runs ("+ ...").
# Results and how they were measured: benchmarks/RESULTS.md.
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-benchmarks/out}
WORK=${WORK:-${TMPDIR:-/tmp}/gptrain_bench}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

M345=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024)
BENCH=("${M345[@]}" --hidden-dropout 0 --attention-dropout 0 --bf16 --compile)
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node)
SERVER_PID=

usage() { sed -n '2,/^# Results and how/p' "$0" | sed 's/^# \{0,1\}//'; }

# run LOG CMD...: print the command, run it, its output to the screen and to $OUT/LOG
run() {
  local log=$OUT/$1 start=$SECONDS rc
  shift
  mkdir -p "$(dirname "$log")"
  { printf '+'; printf ' %q' "$@"; printf '\n'; } | tee "$log"
  "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  echo "(exit $rc after $((SECONDS - start)) s; log $log)" | tee -a "$log"
  return "$rc"
}

gpu_count() { "$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0; }

need_gpu() {
  [ "$(gpu_count)" -ge 1 ] && return 0
  echo "$1: needs a CUDA GPU (torch sees none)"
  return 2
}

device_info() {
  mkdir -p "$OUT" "$WORK"
  {
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD -- gptrain benchmarks 2>/dev/null || echo ' (with local changes)')"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$PY" - <<'EOF' 2>&1
import platform, sys
import torch
line = f"python {platform.python_version()}, torch {torch.__version__} (cuda {torch.version.cuda})"
for name in ("triton", "transformers"):
    try:
        line += f", {name} {__import__(name).__version__}"
    except ImportError:
        pass
print(line)
EOF
  } > "$OUT/device.txt"
  cat "$OUT/device.txt"
}

# the table rows of gptrain bench logs
bench_rows() { grep -h -E "^\| (gptrain|baseline)|baseline tokens/s|bubble" "$@" 2>/dev/null; }

suite_train() {
  need_gpu train || return
  local rc=0
  run train/mbs16.txt "$PY" benchmarks/train_throughput.py "${BENCH[@]}" --micro-batch-size 16 --warmup 6 --iters 15 "$@" || rc=1
  run train/mbs64.txt "$PY" benchmarks/train_throughput.py "${BENCH[@]}" --micro-batch-size 64 --warmup 5 --iters 10 "$@" || rc=1
  echo "== train"; bench_rows "$OUT"/train/mbs*.txt
  return $rc
}

# LAYOUT list: "GPUS:MICRO_BATCH:GLOBAL_BATCH:NAME:FLAGS"; the baseline (nanoGPT, under DDP at DP) runs
# beside the 1-GPU and plain data-parallel rows only. Names ending _mbN are the layout at another micro-batch,
# _gbN at another global batch (128: the pipeline rows', several micro-batches a step, so data parallelism's
# one reduction a step is spread over them as a training run at that batch spreads it). _hp: the TP group's NCCL
# on high-priority streams (inside CUDA graphs only with CUDA_GRAPHS_USE_NODE_PRIORITY=1 exported). _ce: the
# overlapped buckets all-reduced by the copy engines (--grad-reduce-copy-engine), or TP's input gradients summed
# by them beside the weight gradients (--tp-comm-copy-engine; with --sequence-parallel: _sp_ce, the regions'
# gathers and scatters as copy-engine trades under the matmuls).
NO_GRAPHS="--compile-mode default"  # tensor parallelism runs CUDA graphs by default (train/build.py)
GRAPHS="--compile-mode reduce-overhead"
LAYOUTS2=("1:16:16:1gpu:" "2:16:32:dp2:" "2:16:32:dp2_overlap:--overlap-grad-reduce --no-baseline"
          "2:16:32:dp2_overlap_100m:--overlap-grad-reduce --ddp-bucket-size 100000000 --no-baseline"
          "2:16:32:dp2_bf16:--grad-reduce-in-bf16 --no-baseline"
          "2:16:32:dp2_overlap_bf16:--overlap-grad-reduce --grad-reduce-in-bf16 --no-baseline"
          "2:16:32:dp2_overlap_graphs:--overlap-grad-reduce $GRAPHS --no-baseline"
          "2:16:32:dp2_overlap_ce:--overlap-grad-reduce --grad-reduce-copy-engine --no-baseline"
          "2:16:32:dp2_overlap_bf16_ce:--overlap-grad-reduce --grad-reduce-in-bf16 --grad-reduce-copy-engine --no-baseline"
          "1:16:128:1gpu_gb128:--no-baseline" "2:16:128:dp2_gb128:--no-baseline"
          "2:16:128:dp2_overlap_gb128:--overlap-grad-reduce --no-baseline"
          "2:16:32:zero1_dp2:--zero-stage 1 --no-baseline" "2:16:32:zero2_dp2:--zero-stage 2 --no-baseline"
          "2:16:32:zero3_dp2:--zero-stage 3 --no-baseline"
          "2:16:16:tp2:--tensor-model-parallel-size 2 --no-baseline"
          "2:16:16:tp2_no_graphs:--tensor-model-parallel-size 2 $NO_GRAPHS --no-baseline"
          "2:16:16:tp2_ce:--tensor-model-parallel-size 2 --tp-comm-copy-engine --no-baseline"
          "2:16:16:tp2_ce_no_graphs:--tensor-model-parallel-size 2 --tp-comm-copy-engine $NO_GRAPHS --no-baseline"
          "2:16:16:tp2_hp:--tensor-model-parallel-size 2 --high-priority-stream-groups tp --no-baseline"
          "2:16:16:tp2_hp_no_graphs:--tensor-model-parallel-size 2 --high-priority-stream-groups tp $NO_GRAPHS --no-baseline"
          "2:16:16:tp2_sp:--tensor-model-parallel-size 2 --sequence-parallel --no-baseline"
          "2:16:16:tp2_sp_no_graphs:--tensor-model-parallel-size 2 --sequence-parallel $NO_GRAPHS --no-baseline"
          "2:16:16:tp2_sp_async:--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap --no-baseline"
          "2:16:16:tp2_sp_ce:--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-copy-engine --no-baseline"
          "2:64:64:tp2_sp_ce_mb64:--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-copy-engine --no-baseline"
          "2:16:128:pp2:--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 10 --no-baseline"
          "2:16:128:pp2_interleaved:--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 6 --no-baseline"
          "1:32:32:1gpu_mb32:" "2:32:64:dp2_mb32:" "2:32:64:zero3_dp2_mb32:--zero-stage 3 --no-baseline"
          "2:32:32:tp2_mb32:--tensor-model-parallel-size 2 --no-baseline"
          "2:32:32:tp2_sp_mb32:--tensor-model-parallel-size 2 --sequence-parallel --no-baseline"
          "1:64:64:1gpu_mb64:--no-baseline" "2:64:64:tp2_mb64:--tensor-model-parallel-size 2 --no-baseline"
          "2:16:32:zero1_dp2_cublaslt:--zero-stage 1 --linear-impl cublaslt --no-baseline"
          "2:16:32:zero2_dp2_cublaslt:--zero-stage 2 --linear-impl cublaslt --no-baseline")
LAYOUTS4=("4:16:128:dp4:--no-baseline" "4:32:64:tp2_dp2:--tensor-model-parallel-size 2 --no-baseline"
          "4:16:128:tp2_pp2:--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --no-baseline"
          "4:32:32:tp4:--tensor-model-parallel-size 4 --no-baseline"
          "4:8:128:pp4:--pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 3 --no-baseline"
          "4:16:128:zero3_dp4:--zero-stage 3 --no-baseline")
# Megatron-LM's own step on the same model (benchmarks/megatron_lm_throughput.py), where MEGATRON_LM names a
# source checkout: its local path (no TransformerEngine or apex; unfused attention)
MEGATRON2=("1:16:16:megatron_1gpu:" "2:16:32:megatron_dp2:"
           "2:16:16:megatron_tp2:--tensor-model-parallel-size 2"
           "2:16:16:megatron_tp2_sp:--tensor-model-parallel-size 2 --sequence-parallel"
           "2:16:128:megatron_pp2:--pipeline-model-parallel-size 2")

# ONLY="1gpu dp2 ..." runs those layouts alone (a long suite split over calls; keep a 1-GPU row in each)
selected() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }

suite_scaling() {
  need_gpu scaling || return
  local n rc=0 v gpus mbs gbs name flags
  n=$(gpu_count)
  if [ "$n" -lt 2 ]; then
    echo "scaling: $n GPU visible; the parallel layouts need several (DP2, ZeRO-3, TP2, PP2 on 2 GPUs;"
    echo "DP4, TP2 x DP2, TP2 x PP2, TP4, PP4, ZeRO-3 on 4). Nothing to run here."
    echo "(the per-rank cost of any layout on one GPU: run.sh ranks)"
    return 0
  fi
  selected nccl && { run scaling/nccl.txt "${TORCHRUN[@]}" "$n" benchmarks/nccl_bench.py || rc=1; }
  selected comm_overlap && { run scaling/comm_overlap.txt "${TORCHRUN[@]}" 2 benchmarks/comm_overlap.py || rc=1; }
  local layouts=("${LAYOUTS2[@]}")
  [ "$n" -ge 4 ] && layouts+=("${LAYOUTS4[@]}")
  for v in "${layouts[@]}"; do
    IFS=: read -r gpus mbs gbs name flags <<< "$v"
    selected "$name" || continue
    # shellcheck disable=SC2086  # flags split into words on purpose
    if [ "$gpus" = 1 ]; then
      run scaling/$name.txt timeout 240 "$PY" benchmarks/train_throughput.py "${BENCH[@]}" --warmup 3 --iters 8 \
        --micro-batch-size "$mbs" --global-batch-size "$gbs" $flags "$@" || rc=1
    else
      run scaling/$name.txt timeout 240 "${TORCHRUN[@]}" "$gpus" benchmarks/train_throughput.py "${BENCH[@]}" --warmup 3 --iters 8 \
        --micro-batch-size "$mbs" --global-batch-size "$gbs" $flags "$@" || rc=1
    fi
  done
  if [ -n "${MEGATRON_LM:-}" ]; then
    for v in "${MEGATRON2[@]}"; do
      IFS=: read -r gpus mbs gbs name flags <<< "$v"
      selected "$name" || continue
      # shellcheck disable=SC2086
      run scaling/$name.txt "$PY" benchmarks/megatron_lm_throughput.py --megatron-lm "$MEGATRON_LM" --nproc "$gpus" \
        --micro-batch-size "$mbs" --global-batch-size "$gbs" -- $flags || rc=1
    done
  fi
  echo "== scaling (tokens/s per GPU)"
  for v in "${layouts[@]}"; do
    IFS=: read -r gpus mbs gbs name flags <<< "$v"
    selected "$name" || continue
    echo "-- $name ($gpus GPUs, micro-batch $mbs, global batch $gbs)"; bench_rows "$OUT/scaling/$name.txt"
  done
  [ -n "${MEGATRON_LM:-}" ] && grep -h "^| Megatron-LM" "$OUT"/scaling/megatron_*.txt 2>/dev/null
  return $rc
}

suite_table() {
  need_gpu table || return
  [ "$(gpu_count)" -ge 2 ] || { echo "table: needs 2 GPUs"; return 0; }
  local rc=0 rows_s=${TABLE_ROWS_SECONDS:-300}
  if [ -n "${TABLE_CALL_SECONDS:-}" ] && ! [[ "$TABLE_CALL_SECONDS" =~ ^[0-9]+$ ]]; then
    echo "table: TABLE_CALL_SECONDS=$TABLE_CALL_SECONDS is not a whole number of seconds"; return 2
  fi
  suite_restart || rc=1
  run table/serve_tp.txt "$PY" benchmarks/serve_tp.py --nproc 2 --new-tokens 128 --batch-sizes 1 32 --clients 32 \
    --load-seconds 10 --skip-fp32-check --workdir "$WORK/serve_tp" || rc=1
  # SECONDS: since this script started; 60 s for the row under way at the limit, the table's print and the exit
  [ -n "${TABLE_CALL_SECONDS:-}" ] && rows_s=$((TABLE_CALL_SECONDS - SECONDS - 60))
  if [ "$rows_s" -le 0 ]; then
    echo "table: no time left for the rows (TABLE_CALL_SECONDS=$TABLE_CALL_SECONDS)"; return 1
  fi
  echo "rows: none started after ${rows_s} s"
  run table/layouts.txt "${TORCHRUN[@]}" 2 benchmarks/layout_table.py --best-micro-batch "${BEST_MICRO_BATCH:-}" \
    --time-limit "$rows_s" "$@" -- "${BENCH[@]}" || rc=1
  echo "== table"; sed -n '/^== the table/,$p' "$OUT/table/layouts.txt"
  grep -h -E "clients,|fp32 greedy|bf16 " "$OUT/table/serve_tp.txt" 2>/dev/null
  return $rc
}

suite_table_warm() {
  need_gpu table_warm || return
  [ "$(gpu_count)" -ge 2 ] || { echo "table_warm: needs 2 GPUs"; return 0; }
  local rows best extra rc=0 i=0 gib limit=6
  # all six jobs at once hold about 130 GiB on a GPU at their peaks (call B's set on 2 x H200): on smaller GPUs,
  # two at a time
  gib=$("$PY" -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory / 2 ** 30))")
  [ "$gib" -ge 130 ] || limit=2
  # rows:best: the layouts compiled as one graph also at their best micro-batch (compiling those from nothing costs
  # 30-50 s a row); the pipeline's and ZeRO's, compiled block by block, take seconds, and their big micro-batches
  # beside the others would crowd the GPUs' memory
  for rows in "1gpu dp2 dp2_overlap:1gpu dp2 dp2_overlap" "tp2 tp2_sp tp2_nccl tp2_sp_nccl:tp2 tp2_sp" "pp2 pp2_interleaved:-" \
              "zero1_dp2 zero2_dp2 zero3_dp2:-"; do
    IFS=: read -r rows best <<< "$rows"
    i=$((i + 1))
    extra=()
    [ "$best" = - ] || extra=(--best-micro-batch "$best")
    _warm_slot "$limit" || rc=1
    run table_warm/rows$i.txt "${TORCHRUN[@]}" 2 benchmarks/layout_table.py --rows "$rows" "${extra[@]}" \
      --warmup 2 --iters 1 "$@" -- "${BENCH[@]}" > /dev/null &
  done
  _warm_slot "$limit" || rc=1
  OUT=$OUT/table_warm suite_restart > /dev/null &
  _warm_slot "$limit" || rc=1
  run table_warm/serve_tp.txt "$PY" benchmarks/serve_tp.py --nproc 2 --new-tokens 128 --batch-sizes 1 32 --clients 32 \
    --load-seconds 5 --skip-fp32-check --workdir "$WORK/serve_tp" > /dev/null &
  _warm_slot 1 || rc=1
  echo "== table_warm (timings meaningless: the runs shared the GPUs)"
  grep -h -E "^\(exit" "$OUT"/table_warm/*.txt "$OUT"/table_warm/restart/*.txt
  return $rc
}

# _warm_slot N: wait until fewer than N background jobs run (1: all done); fails if one that ended failed
_warm_slot() {
  local ok=0
  while [ "$(jobs -rp | wc -l)" -ge "$1" ]; do wait -n || ok=1; done
  return $ok
}

suite_restart() {
  # a worker of a 2-GPU data-parallel run killed with SIGKILL under torchrun --max-restarts 1: the time
  # to the restarted run's first iteration line, its load time, the iterations run twice alike
  need_gpu restart || return
  [ "$(gpu_count)" -ge 2 ] || { echo "restart: needs 2 GPUs"; return 0; }
  rm -rf "$WORK/restart"
  run restart/rank_restart.txt "$PY" benchmarks/rank_restart.py --nproc 2 --save-interval 20 --kill-after 25 \
    --train-iters 30 --workdir "$WORK/restart" -- "${BENCH[@]}" --micro-batch-size 16 --global-batch-size 32 \
    --mock-data --lr 1e-4 --eval-iters 0 "$@"
  local rc=$?
  echo "== restart"; sed -n '/^== rank restart/,$p' "$OUT/restart/rank_restart.txt"
  return $rc
}

# the seeds/002 GPT-3 175B shape (96 heads of 128, seq 2048) and one of its TP8 x PP8 ranks
G175=(--hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
      --hidden-dropout 0 --attention-dropout 0 --bf16)

suite_ranks() {
  # one rank of a larger world alone on this GPU (gptrain's rank simulator: the fake process group,
  # every collective returns at once): the layout's own compute and host cost, without the network
  need_gpu ranks || return
  local rc=0
  selected 1gpu && { run ranks/1gpu_mb16.txt "$PY" benchmarks/train_throughput.py "${BENCH[@]}" --warmup 4 --iters 10 \
    --micro-batch-size 16 --global-batch-size 16 "$@" || rc=1; }
  # a DP2 rank: the step as one graph and one all-reduce after the backward, against
  # --overlap-grad-reduce (the compiled step cut where the buckets end) at two bucket sizes
  for v in "dp2::" "dp2_overlap::--overlap-grad-reduce" "dp2_overlap_100m::--overlap-grad-reduce --ddp-bucket-size 100000000"; do
    IFS=: read -r name _ flags <<< "$v"
    selected "$name" || continue
    # shellcheck disable=SC2086
    run ranks/sim_${name}_mb16.txt "$PY" benchmarks/train_throughput.py "${BENCH[@]}" --warmup 4 --iters 10 \
      --micro-batch-size 16 --global-batch-size 32 $flags --simulate-world-size 2 --no-baseline "$@" || rc=1
  done
  # each TP rank with CUDA graphs over the compiled step (the default for TP on GPUs, which takes the
  # host's launches off the critical path) and without them (--compile-mode default)
  for v in "tp2::" "tp2_sp::--sequence-parallel" "tp2_no_graphs::--compile-mode default" \
           "tp2_sp_no_graphs::--sequence-parallel --compile-mode default"; do
    IFS=: read -r name _ flags <<< "$v"
    selected "$name" || continue
    # shellcheck disable=SC2086
    run ranks/sim_${name}_mb16.txt "$PY" benchmarks/train_throughput.py "${BENCH[@]}" --warmup 4 --iters 10 \
      --micro-batch-size 16 --global-batch-size 16 --tensor-model-parallel-size 2 $flags \
      --simulate-world-size 2 "$@" || rc=1
  done
  # a TP8 + SP rank of one 175B pipeline stage: 12 layers, 8 micro-batches of 1
  if selected 175b_stage; then
    run ranks/sim_175b_tp8_sp_12layers.txt "$PY" benchmarks/train_throughput.py "${G175[@]}" --compile --num-layers 12 \
      --micro-batch-size 1 --global-batch-size 8 --tensor-model-parallel-size 8 --sequence-parallel \
      --recompute-activations --simulate-world-size 8 --warmup 3 --iters 6 "$@" || rc=1
  fi
  # a TP8 + SP rank of the first stage of the whole 175B plan (96 layers, TP8 x PP8, world 64), timed over
  # 1F1B steps of 8 micro-batches (the simulated rank never waits for its neighbours: no bubble)
  if selected 175b_pp8; then
    run ranks/sim_175b_tp8_pp8_stage.txt "$PY" benchmarks/train_throughput.py "${G175[@]}" --compile --num-layers 96 \
      --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --sequence-parallel --recompute-activations \
      --micro-batch-size 1 --global-batch-size 8 --simulate-world-size 64 --warmup 2 --iters 4 "$@" || rc=1
  fi
  # start-up of a rank of the whole 175B plan (96 layers, TP8 x PP8, world 64): build, initialise, one
  # evaluation iteration
  if selected 175b_startup; then
    run ranks/sim_175b_tp8_pp8_startup.txt /usr/bin/time -v "$PY" -m gptrain train "${G175[@]}" --num-layers 96 \
      --tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --sequence-parallel --recompute-activations \
      --micro-batch-size 1 --global-batch-size 8 --mock-data --train-iters 1 --skip-train --eval-iters 1 \
      --simulate-world-size 64 "$@" || rc=1
  fi
  return $rc
}

suite_decode() {
  need_gpu decode || return
  local hf=()
  if ! "$PY" -c "import transformers" 2>/dev/null; then
    echo "decode: transformers is not installed, so no HF generate column (pip install transformers)"
    hf=(--skip-hf)
  fi
  run decode/decode_speed.txt "$PY" benchmarks/decode_speed.py --batch-sizes 1 32 --prompt-tokens 32 --new-tokens 256 \
    --profile "${hf[@]}" "$@"
  local rc=$?
  echo "== decode"; grep -E "^batch" "$OUT/decode/decode_speed.txt" | cut -c1-220
  return $rc
}

stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=
}
trap stop_server EXIT
trap 'stop_server; exit 130' INT TERM

# a 345M checkpoint in $WORK/ck345: 2 iterations on synthetic data (random-looking weights; the numbers
# are the serving path's, not a trained model's)
serve_checkpoint() {
  local ck=$WORK/ck345
  [ -s "$ck/latest_checkpointed_iteration.txt" ] && return 0
  rm -rf "$ck"
  run serve/checkpoint.txt "$PY" -m gptrain train "${M345[@]}" --mock-data --micro-batch-size 4 --global-batch-size 4 \
    --train-iters 2 --lr 1e-4 --bf16 --eval-iters 2 --save "$ck" --save-interval 2
}

suite_startup() {
  # `gptrain generate` (256 tokens) and `gptrain serve` (to /health) from a new process, three times:
  # cold caches, then warm; Python's bytecode cached as a pip install leaves it (some images set
  # PYTHONDONTWRITEBYTECODE and ship no .pyc, which adds seconds of compiling to every start)
  need_gpu startup || return
  serve_checkpoint || return 1
  PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$WORK/pycache} \
    run startup/start_up.txt "$PY" benchmarks/start_up.py --load "$WORK/ck345" --repeats 3 "$@"
}

suite_serve() {
  need_gpu serve || return
  local ck=$WORK/ck345 port=${PORT:-5055} rc=0 i
  mkdir -p "$OUT/serve"
  serve_checkpoint || return 1
  echo "+ $PY -m gptrain serve --load $ck --port $port > $OUT/serve/server.txt 2>&1 &"
  "$PY" -m gptrain serve --load "$ck" --port "$port" > "$OUT/serve/server.txt" 2>&1 &
  SERVER_PID=$!
  for i in $(seq 300); do  # loading, compiling and warming up take a minute or two
    "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 1
  done
  echo "serve: /health answered $((i - 1)) s after the start (loading, graph capture and warm-up included)" | tee "$OUT/serve/health.txt"
  if ! "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; then
    echo "serve: the server did not come up; its log ($OUT/serve/server.txt) ends:"; tail -20 "$OUT/serve/server.txt"
    stop_server; return 1
  fi
  run serve/load32.txt "$PY" benchmarks/serve_load.py --url "http://127.0.0.1:$port" --clients 32 --seconds 30 --tokens 64 "$@" || rc=1
  run serve/load1.txt "$PY" benchmarks/serve_load.py --url "http://127.0.0.1:$port" --clients 1 --seconds 15 --tokens 64 "$@" || rc=1
  stop_server
  # the same load against the server built in one process with a stack sampler: where the host threads wait
  run serve/host_profile.txt "$PY" benchmarks/serve_host_profile.py --load "$ck" --clients 32 --seconds 15 --procs 2 || rc=1
  # the engine's own batch-32 rate in the same call (greedy, and sampled as the load's requests), and the
  # server's share of it
  run serve/engine.txt "$PY" benchmarks/decode_speed.py --batch-sizes 32 --skip-hf --repeats 3 || rc=1
  "$PY" benchmarks/serve_share.py "$OUT/serve/load32.txt" "$OUT/serve/engine.txt" | tee "$OUT/serve/share.txt"
  if [ "$(gpu_count)" -ge 2 ]; then
    run serve/serve_tp.txt "$PY" benchmarks/serve_tp.py --nproc 2 --new-tokens 128 --batch-sizes 1 32 \
      --workdir "$WORK/serve_tp" || rc=1
  fi
  echo "== serve"; grep -h -E "clients,|fp32 greedy|bf16 " "$OUT"/serve/load*.txt "$OUT/serve/serve_tp.txt" 2>/dev/null
  cat "$OUT/serve/share.txt" 2>/dev/null
  return $rc
}

suite_checkpoint() {
  need_gpu checkpoint || return
  # the folder is emptied first and removed after; CKPT_DIR picks the disk to measure
  run checkpoint/ckpt_save.txt "$PY" benchmarks/ckpt_save.py --dir "${CKPT_DIR:-$WORK/ckpt_bench}" --repeats 3 "$@"
}

suite_preprocess() {
  run preprocess/preprocess.txt "$PY" benchmarks/preprocess.py --mb 100 "$@"
}

suite_lane() {
  need_gpu lane || return
  if ! "$PY" -c "import pytest" 2>/dev/null; then
    echo "lane: needs pytest (python3 -m pip install pytest)"; return 2
  fi
  run lane/gpu_lane.txt "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --durations=10 \
    tests/test_gpu_kernels.py tests/test_row_decode.py tests/test_slot_join.py tests/test_server_inflight.py \
    tests/test_llama.py tests/test_dcp_direct.py tests/test_offload_split.py tests/test_comm_options.py \
    tests/test_copy_engine.py "$@"
  local lane=$?
  run lane/demo.txt "$PY" -m gptrain demo --out "$WORK/demo_out"
  local demo=$?
  cp "$WORK/demo_out/loss_curve.png" "$OUT/lane/" 2>/dev/null
  echo "== lane"; grep -E "[0-9]+ (passed|failed)" "$OUT/lane/gpu_lane.txt" | tail -1; grep -E "^real|validation|rror" "$OUT/lane/demo.txt" | tail -3
  [ "$lane" = 0 ] && return "$demo"
  return "$lane"
}

suite_kernels() {
  need_gpu kernels || return
  local rc=0
  run kernels/cublaslt.txt "$PY" benchmarks/check_cublaslt.py "$@" || rc=1
  run kernels/xent.txt "$PY" benchmarks/check_xent.py || rc=1
  if "$PY" -c "import flash_attn.cute" 2>/dev/null; then
    run kernels/flash4.txt "$PY" benchmarks/check_flash4.py || rc=1
  else
    echo "kernels: flash-attn-4 is not installed; check_flash4.py left out (pip install 'gptrain[flash4]')"
  fi
  run kernels/decode_gemv.txt "$PY" benchmarks/decode_gemv.py || rc=1
  run kernels/decode_tiles.txt "$PY" benchmarks/decode_kernels.py --quick || rc=1
  return $rc
}

suite_profile() {
  need_gpu profile || return
  run profile/step_mbs16.txt "$PY" benchmarks/profile_step.py "${BENCH[@]}" --micro-batch-size 16 "$@"
}

M27=(--num-layers 32 --hidden-size 2560 --num-attention-heads 32 --seq-length 1024 --max-position-embeddings 1024
     --hidden-dropout 0 --attention-dropout 0 --bf16 --compile --recompute-granularity full --micro-batch-size 8)
OFFLOAD=(--zero-stage 3 --cpu-offload --no-baseline)

suite_memory() {
  # what is live at the peak of the 2.7B's step (full recompute) at micro-batch 8 and 16, beside the
  # planner's memory terms (benchmarks/memory_peak.py)
  need_gpu memory || return
  local rc=0 mbs
  for mbs in ${MBS-8 16}; do
    run memory/2p7b_mbs$mbs.txt "$PY" benchmarks/memory_peak.py "${M27[@]}" --micro-batch-size "$mbs" \
      --global-batch-size "$mbs" "$@" || rc=1
  done
  # the offload rows' planned-over 0.4 GiB at one micro-batch (stacks fail under FSDP2's CPU offload)
  for stage in ${OFFLOAD_STAGES-2 3}; do
    run memory/2p7b_offload_z$stage.txt "$PY" benchmarks/memory_peak.py --no-stacks "${M27[@]}" --micro-batch-size 8 \
      --global-batch-size 8 --zero-stage "$stage" --cpu-offload "$@" || rc=1
  done
  return $rc
}

suite_offload() {
  need_gpu offload || return
  local rc=0 size layers hidden row stage gbs
  selected plain && { run offload/2p7b_plain.txt "$PY" benchmarks/train_throughput.py "${M27[@]}" --global-batch-size 8 \
    --no-baseline --warmup 3 --iters 5 "$@" || rc=1; }
  # ZeRO stage, 8 micro-batches per step, and _overlap: the host's AdamW overlapped with the next forward
  # _fNN: --optimizer-offload-fraction 0.NN (the last blocks offloaded, the rest updated on the GPU)
  for row in z3 z3x8 z2 z2x8 z2_overlap z2x8_overlap z2_overlap_f90 z2_overlap_f75 z2_overlap_f50; do
    selected $row || continue
    stage=${row:1:1} gbs=8 overlap=() fraction=()
    [[ $row == *x8* ]] && gbs=64
    [[ $row == *_overlap* ]] && overlap=(--overlap-cpu-optimizer-d2h-h2d)
    [[ $row == *_f* ]] && fraction=(--optimizer-offload-fraction "0.${row##*_f}")
    run "offload/2p7b_offload_$row.txt" "$PY" benchmarks/train_throughput.py "${M27[@]}" --global-batch-size $gbs \
      "${OFFLOAD[@]/3/$stage}" "${overlap[@]}" "${fraction[@]}" --warmup 2 --iters 3 "$@" || rc=1
  done
  # DeepSpeed's ZeRO-Offload on the same model, where deepspeed is installed (benchmarks/deepspeed_offload.py);
  # deepspeed_z3_r50: ZeRO-3 with half the optimizer state offloaded (DeepSpeed's ratio, ZeRO-3 only)
  for row in deepspeed_z2 deepspeed_z2x8 deepspeed_z3_r50; do
    selected $row || continue
    gbs=1 ds=(); [[ $row == *x8 ]] && gbs=8
    [[ $row == *_r* ]] && ds=(--zero-stage 3 --offload-ratio "0.${row##*_r}")
    run "offload/$row.txt" timeout 400 "${TORCHRUN[@]}" 1 benchmarks/deepspeed_offload.py --micro-batches $gbs \
      "${ds[@]}" || rc=1
  done
  for size in ${SIZES:-36:4096 32:4096 40:3200}; do
    selected largest || break
    layers=${size%%:*} hidden=${size##*:}
    if run "offload/largest_${layers}x${hidden}.txt" "$PY" benchmarks/train_throughput.py "${M27[@]/2560/$hidden}" \
        --num-layers "$layers" --num-attention-heads 32 --global-batch-size 8 "${OFFLOAD[@]/3/2}" --warmup 1 --iters 2 "$@"; then
      break
    fi
  done
  echo "== offload"; bench_rows "$OUT"/offload/*.txt; grep -h "^| DeepSpeed" "$OUT"/offload/deepspeed_*.txt 2>/dev/null
  return $rc
}

L1B=(--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048
     --hidden-dropout 0 --attention-dropout 0 --bf16 --compile --micro-batch-size 8 --global-batch-size 8)
LLAMA=(--group-query-attention --num-query-groups 8 --swiglu --ffn-hidden-size 5632 --normalization RMSNorm
       --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear)

suite_llama() {
  need_gpu llama || return
  local rc=0
  run llama/llama_1b.txt "$PY" benchmarks/train_throughput.py "${L1B[@]}" "${LLAMA[@]}" --warmup 5 --iters 10 "$@" || rc=1
  run llama/gpt2_style_1b.txt "$PY" benchmarks/train_throughput.py "${L1B[@]}" --warmup 5 --iters 10 "$@" || rc=1
  run llama/decode.txt "$PY" benchmarks/decode_llama.py || rc=1
  echo "== llama"; bench_rows "$OUT"/llama/*_1b.txt; grep -h "^batch" "$OUT"/llama/decode.txt
  return $rc
}

suite_calibrate() {
  need_gpu calibrate || return
  run calibrate/table.txt "$PY" -m gptrain plan --calibrate
}

export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/compile_cache}
if [ -n "${COMPILE_CACHE_IN:-}" ]; then
  if [ -f "$COMPILE_CACHE_IN" ]; then
    mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && tar xzf "$COMPILE_CACHE_IN" -C "$TORCHINDUCTOR_CACHE_DIR" \
      && echo "compile cache: $COMPILE_CACHE_IN unpacked into $TORCHINDUCTOR_CACHE_DIR"
  else
    echo "compile cache: $COMPILE_CACHE_IN not found; compiling from nothing"
  fi
fi
save_compile_cache() {
  [ -n "${COMPILE_CACHE_OUT:-}" ] && [ -d "$TORCHINDUCTOR_CACHE_DIR" ] || return 0
  tar czf "$COMPILE_CACHE_OUT" -C "$TORCHINDUCTOR_CACHE_DIR" . \
    && echo "compile cache: saved to $COMPILE_CACHE_OUT ($(du -h "$COMPILE_CACHE_OUT" | cut -f1))"
}
trap save_compile_cache EXIT

suite=${1:-}
[ $# -gt 0 ] && shift
case $suite in
  train|scaling|table|table_warm|ranks|decode|serve|startup|checkpoint|preprocess|lane|kernels|profile|restart|offload|llama|calibrate|memory)
    device_info
    "suite_$suite" "$@"
    exit $? ;;
  all)
    [ $# -gt 0 ] && echo "all: extra args are ignored ($*); give them to one suite"
    device_info
    failed=()
    for s in lane train ranks decode serve checkpoint preprocess scaling; do
      echo "==== $s"
      "suite_$s" || failed+=("$s")
    done
    [ ${#failed[@]} = 0 ] && { echo "all suites done; logs in $OUT"; exit 0; }
    echo "failed: ${failed[*]}; logs in $OUT"; exit 1 ;;
  -h|--help|help)
    usage; exit 0 ;;
  *)
    usage; exit 2 ;;
esac
