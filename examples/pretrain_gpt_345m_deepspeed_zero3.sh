#!/bin/bash
# GPT-2 345M with a DeepSpeed ZeRO-3 + CPU-offload config and tensor parallel 4, with gptrain.
#
# Seed:    seeds/003 -- Megatron-DeepSpeed (bigscience-workshop) pretrain_gpt2.sh, section "Use deepspeed
#          ZeRO": TP 4, ZeRO stage 3 with "cpu_offload": true from deepspeed_config.json (next to this
#          script, byte for byte the seed's file).
# Machine: one node with 4 GPUs, as the seed: TP 4 leaves one data-parallel rank, and ZeRO-3 with CPU
#          offload there is ZeRO-Offload (FSDP2 over a group of one, the state in host memory). With
#          N_GPUS=8 the same flags make TP 4 x ZeRO-3 over 2 data-parallel ranks.
# gptrain: trains this today (ZeRO-3 on PyTorch FSDP2 with CPU offload, composed with tensor and
#          data parallelism, one data-parallel rank included; checked on CPU against one process, not yet
#          measured on GPUs). gptrain reads the ds.json's ZeRO stage, cpu_offload and fp16; for the six DeepSpeed engine knobs (allgather_partitions,
#          allgather_bucket_size, overlap_comm, reduce_scatter, reduce_bucket_size, contiguous_gradients)
#          it prints "tunes DeepSpeed's own ZeRO engine; gptrain shards with PyTorch FSDP2, which has no
#          such setting" and goes on.
#
# Every Megatron flag of the seed is kept unchanged; none was refused (--checkpoint-activations,
# --data-impl mmap and --distributed-backend nccl are accepted). What differs from the seed:
#   - the launcher: `torchrun --nproc_per_node $N_GPUS -m gptrain train` instead of
#     `deepspeed --num_gpus $N_GPUS pretrain_gpt.py`;
#   - paths come from the environment (defaults: the seed's paths, relative to the working directory,
#     except CONFIG_JSON: the deepspeed_config.json beside this script); VOCAB_FILE/MERGE_FILE default
#     to empty, and then gptrain's bundled GPT-2 vocabulary and merges are used;
#   - extra flags are passed through: `GPTRAIN_LAUNCH=python3 bash pretrain_gpt_345m_deepspeed_zero3.sh
#     --dry-run --world-size 8` checks the flags, the ds.json and the layout without reading data.
#
# Environment: N_GPUS DATA_PATH CHECKPOINT_PATH VOCAB_FILE MERGE_FILE CONFIG_JSON,
#              GPTRAIN_LAUNCH (default: torchrun --nproc_per_node $N_GPUS).
set -eo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# adjust to the number of GPUs to use
N_GPUS=${N_GPUS:-4}

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2}
VOCAB_FILE=${VOCAB_FILE:-}   # seed: data/gpt2-vocab.json
MERGE_FILE=${MERGE_FILE:-}   # seed: data/gpt2-merges.txt
DATA_PATH=${DATA_PATH:-data/meg-gpt2_text_document}
CONFIG_JSON=${CONFIG_JSON:-$SCRIPT_DIR/deepspeed_config.json}

GPT_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 1024
    --max-position-embeddings 1024
    --tensor-model-parallel-size 4
    --pipeline-model-parallel-size 1
    --micro-batch-size 1
    --global-batch-size 4
    --lr-decay-iters 320000
    --lr 0.00015
    --min-lr 1.0e-5
    --lr-decay-style cosine
    --train-iters 5000
    --data-impl mmap
    --split 949,50,1
    --distributed-backend nccl
    --weight-decay 1e-2
    --clip-grad 1.0
    --lr-warmup-fraction .01
    --fp16
)
if [ -n "$VOCAB_FILE" ] || [ -n "$MERGE_FILE" ]; then
    GPT_ARGS+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
fi

OUTPUT_ARGS=(
    --log-interval 10
    --save-interval 500
    --eval-interval 100
    --eval-iters 10
    --checkpoint-activations
)

DATA_ARGS=(
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --data-path "$DATA_PATH"
)

ALL_ARGS=("${GPT_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${DATA_ARGS[@]}" --deepspeed_config "$CONFIG_JSON")

read -r -a LAUNCH <<< "${GPTRAIN_LAUNCH:-torchrun --nproc_per_node $N_GPUS}"

echo "${LAUNCH[*]} -m gptrain train ${ALL_ARGS[*]} $*"

exec "${LAUNCH[@]}" -m gptrain train "${ALL_ARGS[@]}" "$@"
