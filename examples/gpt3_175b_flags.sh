# shellcheck shell=bash
# The GPT-3 175B training flags shared by pretrain_gpt3_175b_64gpu.sh (torchrun on each node) and
# pretrain_gpt3_175b_64gpu.sbatch (SLURM). Sourced, not run: it defines the array GPT3_175B_ARGS.
#
# Seed: seeds/002 -- GPT-3 175B pretraining with Megatron-DeepSpeed: wikipedia + openwebtext blended
# 0.35/0.65, a data cache path, global batch 1536, micro-batch 1, fp16, flash attention v2, TP 8 x PP 8
# on 64 GPUs. The seed shows the variables of its train_gpt3_175b_distributed.sh and elides the rest
# ("..."); the flags below are that script's, as in a public copy of the same document set.
#
# The seed's batch-size ramp-up and sample-based schedule are passed as written: --rampup-batch-size
# 16 16 433870 (global batch 16, growing by 16 every 433870 / 95 = 4,567 samples to 1536: 8,247
# iterations in all where a constant 1536 makes 7,061),
# --lr-decay-samples 9400526, --lr-warmup-samples 13558.
# Every seed flag is passed; two change nothing here (`gptrain train --help` says why):
# --use-flash-attn-v2 (attention runs on --attention-backend's kernels: cuDNN's forward and
# FlashAttention-4's backward where they run) and --log-validation-ppl-to-tensorboard (validation
# perplexity is always written to TensorBoard).
#
# Environment (the seed took the first four as positional arguments $1..$4):
#   CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATASET_PATH DATASETCACHE
#   DATASET (the whole blend, default "0.35 <wikipedia> 0.65 <openwebtext>")
#   ACTIVATION_CHECKPOINT DISTRIBUTED_OPTIMIZER (true/false, default false as in the seed)
# VOCAB_FILE/MERGE_FILE default to empty, and then gptrain's bundled GPT-2 vocabulary and merges are used.

CHECKPOINT_PATH=${CHECKPOINT_PATH:-./checkpoints/gpt3_175b}
TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-./tensorboard/gpt3_175b}
VOCAB_FILE=${VOCAB_FILE:-}   # seed: <Specify path to file>/gpt2-vocab.json
MERGE_FILE=${MERGE_FILE:-}   # seed: <Specify path to file>/gpt2-merges.txt

DATASET_PATH=${DATASET_PATH:-./data}
DATASET_1="$DATASET_PATH/wikipedia_20220301_en_text_document"
DATASET_2="$DATASET_PATH/openwebtext_Skylion007_text_document"
DATASET=${DATASET:-"0.35 ${DATASET_1} 0.65 ${DATASET_2}"}
DATASETCACHE=${DATASETCACHE:-$DATASET_PATH/gptcache}   # seed: $PATH_TO/gptcache
read -r -a DATASET_ARGS <<< "$DATASET"

log_interval=10
batch_size=1
global_batch_size=1536

mp_size=8
pp_size=8

## Activation checkpointing saves GPU memory, but reduces training speed
activation_checkpoint=${ACTIVATION_CHECKPOINT:-false}

## use distributed optimizer (zero liked method)
distributed_optimizer=${DISTRIBUTED_OPTIMIZER:-false}

GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
)

TRAINING_ARGS=(
    --micro-batch-size $batch_size
    --global-batch-size $global_batch_size
    --train-samples 10846761
    --rampup-batch-size 16 16 433870
    --lr-decay-samples 9400526
    --lr-warmup-samples 13558
    --lr 6.0e-5
    --min-lr 6.0e-6
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --fp16
    --use-flash-attn-v2
)
if [ "${activation_checkpoint}" = "true" ]; then
    TRAINING_ARGS+=(--recompute-activations)
fi
if [ "${distributed_optimizer}" = "true" ]; then
    TRAINING_ARGS+=(--use-distributed-optimizer)
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size $mp_size
    --pipeline-model-parallel-size $pp_size
)

DATA_ARGS=(
    --data-path "${DATASET_ARGS[@]}"
    --data-cache-path "$DATASETCACHE"
    --split 98,2,0
)
if [ -n "$VOCAB_FILE" ] || [ -n "$MERGE_FILE" ]; then
    DATA_ARGS+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval $log_interval
    --save-interval 1000
    --eval-interval 100
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --eval-iters 40
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
    --log-validation-ppl-to-tensorboard
)

GPT3_175B_ARGS=(
    "${GPT_MODEL_ARGS[@]}"
    "${TRAINING_ARGS[@]}"
    "${MODEL_PARALLEL_ARGS[@]}"
    "${DATA_ARGS[@]}"
    "${EVAL_AND_LOGGING_ARGS[@]}"
)
