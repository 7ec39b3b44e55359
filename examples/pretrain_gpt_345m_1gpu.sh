#!/bin/bash
# GPT-2 345M on one GPU, with gptrain.
#
# Seed:    seeds/000 -- Megatron-LM's examples/pretrain_gpt.sh as that document ran it (the "345M"
#          model; Megatron printed 354871296 parameters on rank (0, 0)). seeds/004's single-GPU run is
#          the same script.
# Machine: one node with 1 GPU (the seeds ran it on one A800 80GB).
# gptrain: trains this today (single device).
#
# Every Megatron flag of the seed is kept unchanged; none was refused. What differs from the seed:
#   - the launcher: `python3 -m gptrain train` instead of `torchrun pretrain_gpt.py`;
#   - paths come from the environment (defaults: the seed's paths); VOCAB_FILE/MERGE_FILE default to
#     empty, and then gptrain's bundled GPT-2 vocabulary and merges are used (the same GPT-2 BPE files);
#   - the seed's `export CUDA_DEVICE_MAX_CONNECTIONS=1` (Megatron's setting for its own overlapped
#     tensor-parallel kernels; gptrain does not ask for it) is not set;
#   - extra flags are passed through: `bash pretrain_gpt_345m_1gpu.sh --dry-run` checks everything and
#     prints the layout without reading data.
#
# Environment: DATA_PATH CHECKPOINT_PATH VOCAB_FILE MERGE_FILE, GPTRAIN_LAUNCH (default: python3).
set -eo pipefail

CHECKPOINT_PATH=${CHECKPOINT_PATH:-/workspace/model/megatron-models/345m}
VOCAB_FILE=${VOCAB_FILE:-}   # seed: /workspace/model/gpt2-vocab/gpt2-vocab.json
MERGE_FILE=${MERGE_FILE:-}   # seed: /workspace/model/gpt2-vocab/gpt2-merges.txt
DATA_PATH=${DATA_PATH:-/workspace/data/my-gpt2_text_document}

GPT_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 1024
    --max-position-embeddings 1024
    --micro-batch-size 1
    --global-batch-size 2
    --lr 0.00015
    --train-iters 5000
    --lr-decay-iters 320000
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
    --fp16
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --data-impl mmap
    --split 700,200,100
)
if [ -n "$VOCAB_FILE" ] || [ -n "$MERGE_FILE" ]; then
    DATA_ARGS+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
fi

OUTPUT_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
)

read -r -a LAUNCH <<< "${GPTRAIN_LAUNCH:-python3}"

exec "${LAUNCH[@]}" -m gptrain train \
    "${GPT_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH" \
    "$@"
