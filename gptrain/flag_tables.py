"""The ``gptrain train`` flags that are not declared on a config field (gptrain/config.py has
those): ``MODEL_FLAGS``, the flags of ``GPTConfig``'s fields (model/gpt.py keeps the dataclass and
its defaults, free of flags); ``DERIVED_FLAGS``, those that set no single field (Megatron's recompute
flags, ``--fp8``, ``--deepspeed``, ...), translated by ``config.parse_megatron_args``; and
``COMPATIBILITY``, the Megatron flags accepted without effect or refused, each with its reason.
"""
from __future__ import annotations

from gptrain.flags import Compat, Flag


# the flags of GPTConfig's fields (model/gpt.py holds their defaults); --tensor-model-parallel-size
# also sets tensor_parallel_size (the vocabulary padding), and the tokenizer vocab_size
MODEL_FLAGS: dict[str, Flag] = {
    "num_layers": Flag(("--num-layers",), "network size", "transformer layers"),
    "hidden_size": Flag(("--hidden-size",), "network size", "width of the residual stream"),
    "num_attention_heads": Flag(("--num-attention-heads",), "network size",
                                "attention heads (the hidden size must divide by them)"),
    "ffn_hidden_size": Flag(("--ffn-hidden-size",), "network size", "MLP width (default: 4 x hidden size)"),
    "seq_length": Flag(("--seq-length",), "data and dataloader", "tokens per sample"),
    "max_position_embeddings": Flag(("--max-position-embeddings",), "network size",
                                    "rows of the learned position table (default: --seq-length)"),
    "make_vocab_size_divisible_by": Flag(("--make-vocab-size-divisible-by",), "network size",
                                         "pad the vocabulary to a multiple of this x the tensor-parallel size "
                                         "(GPT-2: 50257 -> 50304)"),
    "init_method_std": Flag(("--init-method-std",), "initialization", "standard deviation of the normal weight init"),
    "attention_dropout": Flag(("--attention-dropout",), "regularization",
                              "dropout on the attention probabilities (0 lets FlashAttention-4 run)"),
    "hidden_dropout": Flag(("--hidden-dropout",), "regularization",
                           "dropout on the embeddings and each block's outputs"),
    "layernorm_epsilon": Flag(("--layernorm-epsilon", "--norm-epsilon"), "network size",
                              "epsilon of the LayerNorms / RMSNorms"),
    # the Llama family (Megatron's names, meanings and defaults)
    "swiglu": Flag(("--swiglu",), "network size", "SwiGLU MLP: fc2(silu(gate x) * up x); --ffn-hidden-size "
                   "defaults to int(4 h 2/3 / 64) x 64"),
    "normalization": Flag(("--normalization",), "network size", "LayerNorm or RMSNorm",
                          choices=("LayerNorm", "RMSNorm")),
    "position_embedding_type": Flag(("--position-embedding-type",), "network size", "learned_absolute (a table), "
                                    "rope (rotary, split halves) or none", choices=("learned_absolute", "rope", "none")),
    "rotary_base": Flag(("--rotary-base",), "network size", "RoPE's base (theta)"),
    "rotary_percent": Flag(("--rotary-percent",), "network size", "the share of each head's channels RoPE rotates"),
    "group_query_attention": Flag(("--group-query-attention",), "network size",
                                  "grouped-query attention: --num-query-groups K/V heads"),
    "num_query_groups": Flag(("--num-query-groups",), "network size",
                             "K/V groups with --group-query-attention (default 1, Megatron's)"),
    "untie_embeddings_and_output_weights": Flag(("--untie-embeddings-and-output-weights",), "network size",
                                                "an output layer of its own instead of the word embeddings"),
    "add_bias_linear": Flag(("--disable-bias-linear",), "network size", "no biases in the linear layers",
                            action="store_false"),
    "add_qkv_bias": Flag(("--add-qkv-bias",), "network size", "a bias on QKV even with --disable-bias-linear"),
    "kv_channels": Flag(("--kv-channels",), "network size", "channels per attention head (default: hidden / heads)"),
    "apply_layernorm_1p": Flag(("--apply-layernorm-1p",), "network size", "zero-centred LayerNorm / RMSNorm "
                               "weights: each norm scales by 1 + its weight, which starts at 0"),
}

# flags that set no single field: translated by config.parse_megatron_args (each dest is read there)
DERIVED_FLAGS: tuple[Flag, ...] = (
    # Megatron's two generations of recompute flags onto KernelConfig.recompute (config._recompute_mode):
    # --checkpoint-activations recomputed whole blocks; --recompute-activations now means selective
    Flag(("--checkpoint-activations",), "training", "recompute whole blocks in the backward pass (older Megatron)",
         action="store_true", dest="checkpoint_activations"),
    Flag(("--recompute-activations",), "training", "recompute core attention in the backward pass (selective)",
         action="store_true", dest="recompute_activations"),
    Flag(("--recompute-granularity",), "training", "full: recompute whole blocks; selective: recompute only "
         "attention (Megatron's meanings)", choices=("full", "selective"), default=None, dest="recompute_granularity"),
    Flag(("--recompute-method",), "training", "with --recompute-granularity full: uniform (the only one implemented)",
         choices=("uniform", "block"), default=None, dest="recompute_method"),
    Flag(("--recompute-num-layers",), "training", "with --recompute-method uniform: 1 (every block)", type=int,
         default=None, dest="recompute_num_layers"),
    # Megatron's older switch for rope (sets --position-embedding-type's field)
    Flag(("--use-rotary-position-embeddings",), "network size", "same as --position-embedding-type rope",
         action="store_const", const="rope", dest="position_embedding_type"),
    Flag(("--optimizer",), "training", "adam (AdamW, fused)", choices=("adam",), default="adam", dest="optimizer"),
    Flag(("--fp8",), "mixed precision", "fp8 matmuls in the transformer layers through torchao (same as --fp8-format "
         "hybrid)", action="store_const", const="hybrid", dest="fp8"),  # PrecisionConfig.fp8
    # the positive and negative halves of switches declared on a field (the last one given wins)
    Flag(("--no-fp16",), "mixed precision", "undo an earlier --fp16 (the last of the two wins): override an example "
         "script's precision", action="store_const", const=False, default=False, dest="fp16"),
    Flag(("--no-bf16",), "mixed precision", "undo an earlier --bf16 (the last of the two wins)",
         action="store_const", const=False, default=False, dest="bf16"),
    Flag(("--bias-gelu-fusion",), "kernels and speed (gptrain)", "fc1's bias and GELU in its cuBLASLt matmul "
         "epilogues (the default; undoes an earlier --no-bias-gelu-fusion)", action="store_const", const=True,
         default=True, dest="bias_gelu_fusion"),
    Flag(("--use-distributed-optimizer",), "distributed", "Megatron's sharded optimizer (= --zero-stage 1)",
         action="store_true", dest="use_distributed_optimizer"),
    Flag(("--deepspeed",), "distributed", "Megatron-DeepSpeed: take ZeRO and precision from --deepspeed_config",
         action="store_true", dest="deepspeed"),
    Flag(("--world-size",), "run (gptrain)", "with --dry-run: the number of processes to plan for (default: "
         "torchrun's WORLD_SIZE, else 1)", type=int, default=None, dest="world_size"),
    # the rank simulator's pair, taken by parallel/simulate.py before the flags are parsed (listed here
    # so --help shows them)
    Flag(("--simulate-world-size",), "run (gptrain)", "run one rank of a world of N processes alone through a fake "
         "process group (collectives return at once): its own time, launches and memory", type=int, default=None,
         dest="simulate_world_size"),
    Flag(("--simulate-rank",), "run (gptrain)", "with --simulate-world-size: which rank to run (default 0)",
         type=int, default=0, dest="simulate_rank"),
)

# Megatron flags that change nothing here (accepted, the reason printed once) or that gptrain
# refuses (an error naming the reason); each reason states what the code does (tests/test_help.py)
COMPATIBILITY: tuple[Compat, ...] = (
    Compat("--use-flash-attn", "attention runs on --attention-backend's kernels: by default cuDNN's forward and "
           "FlashAttention-4's backward where flash-attn-4 can run, else PyTorch SDPA's pick (cuDNN on H100); "
           "--attention-backend flash forces FlashAttention-2"),
    Compat("--use-flash-attn-v2", "attention runs on --attention-backend's kernels: by default cuDNN's forward and "
           "FlashAttention-4's backward where flash-attn-4 can run, else PyTorch SDPA's pick (cuDNN on H100); "
           "--attention-backend flash forces FlashAttention-2"),
    Compat("--use-precision-aware-optimizer", "gptrain's optimizer keeps fp32 main parameters, gradients and AdamW "
           "moments, the precision-aware optimizer's defaults (Megatron-LM requires the flag with "
           "--optimizer-cpu-offload); lower-precision state is refused"),
    Compat("--main-grads-dtype", "main gradients are fp32", "value", ("fp32",)),
    Compat("--main-params-dtype", "main parameters are fp32", "value", ("fp32",)),
    Compat("--exp-avg-dtype", "AdamW's first moment is fp32", "value", ("fp32",)),
    Compat("--exp-avg-sq-dtype", "AdamW's second moment is fp32", "value", ("fp32",)),
    Compat("--use-torch-optimizer-for-cpu-offload", "the offloaded optimizer is always torch's fused AdamW, on the host "
           "and on the GPU"),
    Compat("--check-for-nan-in-loss-and-grad", "on by default (Megatron-LM's default): a rank whose own loss or "
           "gradients go NaN/Inf names itself, the step is skipped on every rank and counted; "
           "--no-check-for-nan-in-loss-and-grad turns the naming off"),
    Compat("--log-validation-ppl-to-tensorboard", "validation perplexity is always written to TensorBoard, as "
           "'lm loss validation ppl' (Megatron's tag), beside the validation loss"),
    Compat("--attention-softmax-in-fp32", "the attention kernels (SDPA's, FlashAttention-4's) take the softmax of "
           "bf16/fp16 scores in fp32"),
    Compat("--no-masked-softmax-fusion", "masking and softmax happen inside the causal attention call (SDPA or "
           "FlashAttention-4): there is no masked-softmax kernel to turn off"),
    Compat("--no-bias-dropout-fusion", "the dropout after attention and MLP is a separate op (fused with its "
           "neighbours only by torch.compile, under --compile): there is no bias-dropout kernel to turn off"),
    Compat("--no-gradient-accumulation-fusion", "weight gradients come from autograd; with --bf16/--fp16 they are "
           "added into fp32 main gradients (train/main_params.py), not by Megatron's fused kernel"),
    Compat("--apply-query-key-layer-scaling", "Megatron's guard against fp16 overflow in the attention scores; "
           "the attention kernels here accumulate the scores and the softmax in fp32"),
    Compat("--accumulate-allreduce-grads-in-fp32", "data-parallel gradients are reduced in fp32 unless "
           "--grad-reduce-in-bf16"),
    Compat("--no-async-tensor-model-parallel-allreduce", "a column-parallel layer's input-gradient all-reduce always "
           "runs while its weight-gradient matmul computes (parallel/tensor_parallel.py): not turned off"),
    Compat("--override-opt_param-scheduler", "the learning-rate schedule always takes its settings from the "
           "flags; a checkpoint gives only its step count"),
    Compat("--use-mcore-models", "gptrain has one GPT implementation (model/gpt.py): there is no legacy or "
           "megatron-core model class to choose"),
    Compat("--use-legacy-models", "gptrain has one GPT implementation (model/gpt.py): there is no legacy or "
           "megatron-core model class to choose"),
    Compat("--no-persist-layer-norm", "LayerNorm is torch's layer_norm (fused with its neighbours only by "
           "torch.compile, under --compile): there is no persistent LayerNorm kernel to turn off"),
    Compat("--transformer-impl", "the layers are gptrain's own (model/gpt.py) on the kernels --attention-backend "
           "and --linear-impl choose; TransformerEngine is never used", "value", ("local", "transformer_engine")),
    Compat("--timing-log-level", "gptrain times the whole iteration only (the iteration line's elapsed time, "
           "Megatron's level-0 timer); there are no per-phase timers for levels 1 and 2", "value", ("0", "1", "2")),
    Compat("--dataloader-type", "batches are read as Megatron's single sampler reads them (the split's shuffled "
           "sample order, from the consumed samples on, each data-parallel rank its slice); cyclic's new random "
           "order every epoch is not implemented", "value", ("single",)),
    Compat("--ckpt-format", "gptrain saves torch.distributed.checkpoint folders (torch_dist) in its own parameter "
           "names; `gptrain convert --to megatron --ckpt-format torch_dist|torch` writes Megatron-LM's, and --load "
           "reads both of Megatron's", "value", ("torch_dist",)),
    Compat("--data-impl", "only mmap files exist", "value", ("mmap",)),
    Compat("--dataset-impl", "only mmap files exist", "value", ("mmap",)),
    Compat("--DDP-impl", "data parallelism is gptrain's own", "value", ("local", "torch")),
    Compat("--distributed-backend", "NCCL on GPUs, gloo on CPUs, chosen by device", "value", ("nccl", "gloo")),
    Compat("--num-workers", "batches are assembled in a background thread", "value"),
    Compat("--context-parallel-size", "context parallelism (a sequence split over ranks) is not implemented", "value",
           ("1",)),
    Compat("--no-create-attention-mask-in-dataloader", "no attention mask is built anywhere: the attention kernels "
           "are causal themselves"),
    Compat("--no-mmap-bin-files", "the .bin token files are always memory-mapped (the same tokens, read on use)"),
    Compat("--cross-entropy-loss-fusion", "under --compile torch.compile fuses the loss's softmax and cross-entropy; "
           "with tensor parallelism the vocabulary-parallel loss never gathers the logits; --fused-cross-entropy also "
           "chunks them"),
    Compat("--tiktoken-pattern", "the split pattern of Megatron's TikTokenizer, which gptrain does not read (its "
           "NullTokenizer and HuggingFaceTokenizer runs never use it)", "value", ("v1", "v2")),
    Compat("--rotary-interleaved", "not implemented: RoPE rotates split halves (Megatron's default, Hugging Face "
           "Llama's)", "refused"),
    Compat("--qk-layernorm", "not implemented: no normalization of queries and keys", "refused"),
    Compat("--split-sentences", "sentence splitting is not implemented", "refused"),
    Compat("--reset-position-ids", "not implemented", "refused"),
    Compat("--reset-attention-mask", "not implemented", "refused"),
    Compat("--use-checkpoint-opt_param-scheduler", "not implemented: the learning-rate schedule always takes its "
           "settings from the flags (a checkpoint gives only its step count)", "refused"),
)
