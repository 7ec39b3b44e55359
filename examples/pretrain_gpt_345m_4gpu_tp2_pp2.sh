#!/bin/bash
# GPT-2 345M on 4 GPUs, tensor parallel 2 x pipeline parallel 2 (DP 1), with gptrain.
#
# Seed:    seeds/004 -- a 345M run on 4 A800s; the document shows Megatron's logs, not the script,
#          so the flags here are the non-default values of the argument dump it printed
#          (the flags of seeds/000's examples/pretrain_gpt.sh plus the parallel layout).
#          Section "模型并行（2TP+2DP）" (model parallel); its log says world size 4,
#          data-parallel-size 1, tensor 2, pipeline 2, and Megatron printed 102483968 parameters
#          on the first pipeline stage and 101437440 on the last (ranks (t, 0) and (t, 1)).
# Machine: one node with 4 GPUs.
# gptrain: trains this layout: tensor parallel 2 with sequence parallelism inside each of 2 pipeline
#          stages (1F1B). The dry run prints each rank's parameters.
#
# Every Megatron flag is kept as the seed's run had it; none was refused. What differs from the seed:
#   - the launcher: `torchrun ... -m gptrain train` instead of `torchrun ... pretrain_gpt.py`;
#   - paths come from the environment (defaults: the seed's paths); VOCAB_FILE/MERGE_FILE default to
#     empty, and then gptrain's bundled GPT-2 vocabulary and merges are used (the same GPT-2 BPE files);
#   - the `export CUDA_DEVICE_MAX_CONNECTIONS=1` of Megatron's scripts (its setting for its own
#     overlapped tensor-parallel kernels; gptrain does not ask for it) is not set;
#   - extra flags are passed through:
#         GPTRAIN_LAUNCH=python3 bash pretrain_gpt_345m_4gpu_tp2_pp2.sh --dry-run --world-size 4
#     checks the flags and the layout on any machine (no GPU) without reading data.
#
# Environment: DATA_PATH CHECKPOINT_PATH VOCAB_FILE MERGE_FILE MASTER_ADDR MASTER_PORT,
#              GPTRAIN_LAUNCH (default: torchrun --nproc_per_node 4 --nnodes 1 ...).
set -eo pipefail

GPUS_PER_NODE=4
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=1
NODE_RANK=0

CHECKPOINT_PATH=${CHECKPOINT_PATH:-/workspace/model/megatron-models/345m-init-mp}
VOCAB_FILE=${VOCAB_FILE:-}   # seed: /workspace/model/gpt2-vocab/gpt2-vocab.json
MERGE_FILE=${MERGE_FILE:-}   # seed: /workspace/model/gpt2-vocab/gpt2-merges.txt
DATA_PATH=${DATA_PATH:-/workspace/data/my-gpt2_text_document}

GPT_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --sequence-parallel
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 1024
    --max-position-embeddings 1024
    --micro-batch-size 4
    --global-batch-size 16
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
    --save-interval 2000
    --eval-interval 1000
    --eval-iters 10
)

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

# GPTRAIN_LAUNCH=python3 (with --dry-run) checks this script without launching anything
if [ -n "${GPTRAIN_LAUNCH:-}" ]; then
    read -r -a LAUNCH <<< "$GPTRAIN_LAUNCH"
else
    LAUNCH=(torchrun "${DISTRIBUTED_ARGS[@]}")
fi

exec "${LAUNCH[@]}" -m gptrain train \
    "${GPT_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH" \
    "$@"
