#!/bin/bash
# GPT-3 175B on 64 GPUs (8 nodes x 8 GPUs), tensor parallel 8 x pipeline parallel 8 (DP 1), with gptrain.
# Run this same script on each of the 8 nodes, with MASTER_ADDR set to the first node's address; under
# SLURM use pretrain_gpt3_175b_64gpu.sbatch instead. The flags live in gpt3_175b_flags.sh (shared).
#
# Seed:    seeds/002 -- train_gpt3_175b_distributed.sh for Megatron-DeepSpeed: wikipedia + openwebtext
#          blended 0.35/0.65, a data cache path, global batch 1536, micro-batch 1, fp16, TP 8 x PP 8.
# Machine: 8 nodes with 8 GPUs each (64 GPUs), with a fast interconnect between the nodes.
# gptrain: trains this layout (tensor parallel 8 with sequence parallelism, pipeline parallel 8 with
#          1F1B). The dry run checks it and prints all 64 ranks' parameter counts (vocabulary padded
#          to 51200 = multiple of 128 x 8). Not yet run on 64 GPUs (the layouts are checked on CPU).
#
# The seed's --rampup-batch-size 16 16 433870, --lr-decay-samples and --lr-warmup-samples are passed.
# Every seed flag is passed (--use-flash-attn-v2 and --log-validation-ppl-to-tensorboard change nothing
# here; details in gpt3_175b_flags.sh).
# What else differs from the seed:
#   - the launcher: torchrun's c10d rendezvous (`--rdzv-backend c10d --rdzv-endpoint
#     $MASTER_ADDR:$MASTER_PORT`, node ranks assigned by the rendezvous) and `-m gptrain train`
#     instead of --master_addr/--master_port/NODE_RANK and pretrain_gpt.py;
#   - paths come from the environment instead of positional arguments (see gpt3_175b_flags.sh);
#   - the seed's `export CUDA_DEVICE_MAX_CONNECTIONS=1` (Megatron's setting for its own overlapped
#     tensor-parallel kernels; gptrain does not ask for it) is not set;
#   - extra flags are passed through: `GPTRAIN_LAUNCH=python3 bash pretrain_gpt3_175b_64gpu.sh
#     --dry-run --world-size 64` checks the whole 64-GPU layout on any machine without reading data.
#
# Environment: MASTER_ADDR MASTER_PORT, the paths of gpt3_175b_flags.sh,
#              GPTRAIN_LAUNCH (default: torchrun --nnodes 8 --nproc_per_node 8 --rdzv-backend c10d ...).
set -eo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

GPUS_PER_NODE=8
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-localhost}  # change to master node addr
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=8

# shellcheck source=gpt3_175b_flags.sh
source "$SCRIPT_DIR/gpt3_175b_flags.sh"

DISTRIBUTED_ARGS=(
    --nnodes $NUM_NODES
    --nproc_per_node $GPUS_PER_NODE
    --rdzv-backend c10d
    --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT
)

# GPTRAIN_LAUNCH=python3 (with --dry-run) checks this script without launching anything
if [ -n "${GPTRAIN_LAUNCH:-}" ]; then
    read -r -a LAUNCH <<< "$GPTRAIN_LAUNCH"
else
    LAUNCH=(torchrun "${DISTRIBUTED_ARGS[@]}")
fi

exec "${LAUNCH[@]}" -m gptrain train "${GPT3_175B_ARGS[@]}" "$@"
