#!/bin/bash
# GPT-2 345M on 4 GPUs, 4-way data parallel (TP 1 x PP 1 x DP 4), with gptrain.
#
# Seed:    seeds/001 -- Megatron-LM core_r0.8.0 examples/gpt3/train_gpt2_345m_1dp1pp_distributed.sh
#          (the document's section 6, the text generation server, is not part of this example).
#          seeds/004's "4DP" run is the same layout (with seeds/000's flags and --global-batch-size 8);
#          Megatron printed 354871296 parameters on rank (0, 0) there.
# Machine: one node with 4 GPUs.
# gptrain: trains this today (data parallelism: every rank holds the whole model, gradients averaged
#          in fp32).
#
# Every Megatron flag of the seed is kept unchanged; none was refused (--attention-softmax-in-fp32 is
# accepted and changes nothing: gptrain prints "SDPA computes the softmax in fp32"). What differs:
#   - the launcher: `torchrun ... -m gptrain train` instead of `torchrun ... pretrain_gpt.py`;
#   - paths come from the environment (defaults: the seed's paths); VOCAB_FILE/MERGE_FILE default to
#     empty, and then gptrain's bundled GPT-2 vocabulary and merges are used (the same GPT-2 BPE files);
#   - the seed's `export CUDA_DEVICE_MAX_CONNECTIONS=1` (Megatron's setting for its own overlapped
#     tensor-parallel kernels; gptrain does not ask for it) is not set;
#   - extra flags are passed through: `GPTRAIN_LAUNCH=python3 bash pretrain_gpt_345m_4gpu_dp.sh
#     --dry-run --world-size 4` checks the flags and the layout on any machine without reading data.
#
# Environment: DATA_PATH CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE MASTER_ADDR
#              MASTER_PORT, GPTRAIN_LAUNCH (default: torchrun --nproc_per_node 4 --nnodes 1 ...).
set -eo pipefail

GPUS_PER_NODE=4
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=1

CHECKPOINT_PATH=${CHECKPOINT_PATH:-/workspace/model/megatron-models/345m-1dp-out}
TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-/workspace/tensorboard_logs}
VOCAB_FILE=${VOCAB_FILE:-}   # seed: /workspace/model/gpt2-vocab/gpt2-vocab.json
MERGE_FILE=${MERGE_FILE:-}   # seed: /workspace/model/gpt2-vocab/gpt2-merges.txt
DATA_PATH=${DATA_PATH:-/workspace/data/my-gpt2_text_document}

GPT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 1024
    --max-position-embeddings 1024
    --attention-softmax-in-fp32
)

# tensor 1 x pipeline 1 on 4 GPUs: the data-parallel size is 4, and the global batch must be a
# multiple of micro-batch x data-parallel size (4 x 4)
TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 32
    --train-iters 3000
    --weight-decay 0.1
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-iters 430000
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --split 949,50,1
)
if [ -n "$VOCAB_FILE" ] || [ -n "$MERGE_FILE" ]; then
    DATA_ARGS+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --save-interval 1000
    --eval-interval 1000
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
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
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "$@"
