#!/bin/bash
# A ~1B Llama-style model on one GPU, with gptrain.
#
# Seed:    none -- issue 32 (Llama-family models), launched as seeds/000's examples/pretrain_gpt.sh is
#          (pretrain_gpt_345m_1gpu.sh). The architecture is Llama's in Megatron's flags: 16 layers,
#          hidden 2048, 32 query heads in 8 K/V groups, SwiGLU MLP of 5632, RMSNorm, RoPE, no biases,
#          an output layer untied from the embeddings; sequence 2048, bf16.
# Machine: one node with 1 GPU (80 GB).
# gptrain: trains this (single device; the Llama-family layers are compiled, no fused SwiGLU/RMSNorm/RoPE kernels).
#
# Parameters: 721.5M in the blocks plus 2 x vocabulary x 2048 (embeddings and output layer): 0.93B with
# GPT-2's 50257 tokens, 1.25B with Llama 3's 128256.
#
# Data: a Megatron indexed dataset made with the same tokenizer, e.g. from the built-in corpus:
#     python3 -m gptrain data builtin --output docs.jsonl
#     python3 -m gptrain preprocess --input docs.jsonl --output-prefix my-llama --append-eod \
#         --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
#     DATA_PATH=my-llama_text_document TOKENIZER_MODEL=... bash examples/pretrain_llama_1b.sh
# TOKENIZER_MODEL is a folder holding tokenizer.json (or the file); empty: gptrain's bundled GPT-2 BPE.
# Extra flags are passed through: `GPTRAIN_LAUNCH=python3 bash pretrain_llama_1b.sh --dry-run` checks
# everything and prints the parameter count without reading data.
#
# Environment: DATA_PATH CHECKPOINT_PATH TOKENIZER_MODEL, GPTRAIN_LAUNCH (default: python3).
set -eo pipefail

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama-1b}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
DATA_PATH=${DATA_PATH:-my-llama_text_document}

LLAMA_ARGS=(
    --num-layers 16
    --hidden-size 2048
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --swiglu
    --ffn-hidden-size 5632
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --position-embedding-type rope
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
    --seq-length 2048
    --max-position-embeddings 2048
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 128
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

read -r -a LAUNCH <<< "${GPTRAIN_LAUNCH:-python3}"

exec "${LAUNCH[@]}" -m gptrain train \
    "${LLAMA_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH" \
    "$@"
