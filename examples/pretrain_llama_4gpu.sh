#!/bin/bash
# A ~3B Llama-style model on 4 GPUs: tensor parallel 2 with sequence parallelism x pipeline parallel 2
# (DP 1), with gptrain.
#
# Seed:    none -- issue 32 (Llama-family models), launched as seeds/004's 4-GPU runs are
#          (pretrain_gpt_345m_4gpu_tp2_pp2.sh). The architecture is Llama 3.2 3B's shape in Megatron's
#          flags: 28 layers, hidden 3072, 24 query heads in 8 K/V groups, SwiGLU MLP of 8192, RMSNorm,
#          RoPE (base 500000), no biases, an output layer untied from the embeddings; sequence 4096, bf16.
#          TP 2 gives each rank 12 query heads and 4 whole K/V groups; PP 2 puts 14 layers on each
#          stage, the untied output layer on the last one only.
# Machine: one node with 4 GPUs (80 GB each).
# gptrain: trains this layout (the Llama-family layers under TP, SP and PP equal one process on CPU; not yet
#          measured on GPUs). The dry run prints each rank's parameters.
#
# Data: a Megatron indexed dataset made with the same tokenizer, e.g. from the built-in corpus:
#     python3 -m gptrain data builtin --output docs.jsonl
#     python3 -m gptrain preprocess --input docs.jsonl --output-prefix my-llama --append-eod \
#         --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
#     DATA_PATH=my-llama_text_document TOKENIZER_MODEL=... bash examples/pretrain_llama_4gpu.sh
# TOKENIZER_MODEL is a folder holding tokenizer.json (or the file); empty: gptrain's bundled GPT-2 BPE.
# Extra flags are passed through:
#     GPTRAIN_LAUNCH=python3 bash pretrain_llama_4gpu.sh --dry-run --world-size 4
# checks the flags and the layout on any machine (no GPU) without reading data.
#
# Environment: DATA_PATH CHECKPOINT_PATH TOKENIZER_MODEL MASTER_ADDR MASTER_PORT,
#              GPTRAIN_LAUNCH (default: torchrun --nproc_per_node 4 --nnodes 1 ...).
set -eo pipefail

GPUS_PER_NODE=4
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=1
NODE_RANK=0

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama-3b-tp2-pp2}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
DATA_PATH=${DATA_PATH:-my-llama_text_document}

LLAMA_ARGS=(
    --tensor-model-parallel-size 2
    --sequence-parallel
    --pipeline-model-parallel-size 2
    --num-layers 28
    --hidden-size 3072
    --num-attention-heads 24
    --group-query-attention
    --num-query-groups 8
    --swiglu
    --ffn-hidden-size 8192
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --position-embedding-type rope
    --rotary-base 500000
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
    --seq-length 4096
    --max-position-embeddings 4096
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 64
    --lr 3e-4
    --min-lr 3e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --train-iters 50000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --split 990,9,1
)
if [ -n "$TOKENIZER_MODEL" ]; then
    DATA_ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
fi

OUTPUT_ARGS=(
    --log-interval 10
    --save-interval 1000
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
    "${LLAMA_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH" \
    "$@"
