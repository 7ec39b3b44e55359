"""Typed run configuration and the thin Megatron ``pretrain_gpt.py`` flag translation onto it.

The dataclasses are the source of truth (checked in ``__post_init__``); ``parse_megatron_args``
only maps flag names onto them. A Megatron flag gptrain does not implement is refused with its
name, never silently ignored; flags that change nothing here are accepted with the reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from gptrain.model.gpt import GPTConfig


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list)
    split: str = "969,30,1"
    mock_data: bool = False
    vocab_file: str | None = None
    merge_file: str | None = None
    data_cache_path: str | None = None
    seed: int = 1234
    eod_mask_loss: bool = False  # tokens whose input is the end-of-document token do not count
    eod_token: int | None = None  # set from the tokenizer


@dataclass
class OptimConfig:
    lr: float = 1.5e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None

    def __post_init__(self):
        if self.lr_decay_style not in ("constant", "linear", "cosine", "inverse-square-root"):
            raise ValueError(f"--lr-decay-style {self.lr_decay_style}: use constant, linear, cosine or "
                             "inverse-square-root")
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters:
            raise ValueError("give --lr-warmup-fraction or --lr-warmup-iters, not both")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}")


@dataclass
class PrecisionConfig:
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None  # static scale; None means dynamic
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # --bf16/--fp16 as Megatron runs them: half-precision parameters and activations, fp32 main
    # parameters and gradients in the optimizer. True keeps fp32 parameters under autocast instead.
    autocast: bool = False
    fp8: str | None = None  # None, "hybrid" (e4m3 forward, e5m2 gradients) or "e4m3"
    fp8_recipe: str = "tensorwise"

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
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    train_iters: int | None = None
    train_samples: int | None = None
    eval_interval: int = 1000
    eval_iters: int = 100
    log_interval: int = 100
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    max_nan_iterations: int = 10
    tensorboard_dir: str | None = None
    compile: bool = False
    compile_mode: str | None = None  # torch.compile mode; None is its default
    peak_tflops: float | None = None
    device: str | None = None  # default: cuda if available
    dry_run: bool = False  # validate and print the layout, build nothing
    skip_train: bool = False  # Megatron's --skip-train: evaluate the validation and test splits only
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    exit_signal_handler: bool = False  # SIGTERM/SIGINT: save at the end of the iteration and exit 0
    async_save: bool = False  # checkpoints written by a background thread (DCP's async_save)
    verbose: bool = False  # start-up details: kernel choices with their reasons, index-cache files

    def __post_init__(self):
        if self.global_batch_size is None:
            self.global_batch_size = self.micro_batch_size
        if self.micro_batch_size < 1 or self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"--global-batch-size {self.global_batch_size} must be a multiple of "
                             f"--micro-batch-size {self.micro_batch_size} (times the data-parallel size)")
        if self.train_iters is None and self.train_samples is None:
            raise ValueError("give --train-iters or --train-samples")
        if self.train_iters is None:
            self.train_iters = self.train_samples // self.global_batch_size
        if self.log_interval < 1:
            raise ValueError("--log-interval must be positive")

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


@dataclass
class KernelConfig:
    """How the model's math runs (never what it computes): kernels, the loss's implementation,
    activation recompute. Installed on a built model by kernels/convert.py and parallel/parallelize.py."""
    # Megatron's names: auto, flash, fused (cuDNN), unfused/local (math); flash4: FlashAttention-4
    attention_backend: str = "auto"
    # "cublaslt": every linear layer's matmuls autotuned through cuBLASLt where the device allows
    # (model/linear.py), "torch": PyTorch's own, "auto": cublaslt for micro-batches large enough to
    # hide its host cost; with cublaslt, fc1's bias and GELU go into its epilogues
    linear_impl: str = "auto"
    bias_gelu_fusion: bool = True
    # chunked loss that never holds the whole batch's logits (benchmarks/RESULTS.md has its cost)
    fused_cross_entropy: bool = False
    recompute: str | None = None  # None, "full" (whole blocks) or "selective" (core attention)
    # Megatron's loss: softmax over the padded vocabulary too (its numbers depend on the TP padding)
    softmax_over_padded_vocab: bool = False

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
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: bool = False  # with TP: LayerNorms and dropout on sequence shards
    layers_per_virtual_stage: int | None = None  # interleaved 1F1B (Megatron's virtual pipeline stages)
    first_stage_layers: int | None = None  # uneven split: the first / last pipeline stage's layers
    last_stage_layers: int | None = None
    zero_stage: int = 0  # 1: optimizer state sharded, 2: + gradients, 3: + parameters (FSDP2)
    cpu_offload: bool = False  # stage 3: parameters, gradients and optimizer state in host memory
    deepspeed_config: str | None = None  # the ds.json it came from, if any


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


# flags that exist in Megatron and change nothing here, with the reason printed once
ACCEPTED_NO_OP = {
    "--use-flash-attn": "attention always runs through scaled_dot_product_attention (flash on GPU)",
    "--attention-softmax-in-fp32": "SDPA computes the softmax in fp32",
    "--no-masked-softmax-fusion": "no separate softmax kernel",
    "--no-bias-dropout-fusion": "fused by torch.compile", "--no-gradient-accumulation-fusion": "not applicable",
    "--apply-query-key-layer-scaling": "a fp16 overflow guard that SDPA does not need",
    "--accumulate-allreduce-grads-in-fp32": "gradients are always reduced in fp32",
    "--no-async-tensor-model-parallel-allreduce": "not applicable",
    "--overlap-grad-reduce": "gradient reduction always overlaps the backward pass (FSDP2)",
    "--overlap-param-gather": "parameter gathers always overlap compute (FSDP2 prefetch)",
}
ACCEPTED_NO_OP_WITH_VALUE = {
    "--data-impl": ("mmap",), "--dataset-impl": ("mmap",), "--DDP-impl": ("local", "torch"),
    "--distributed-backend": ("nccl", "gloo"), "--tokenizer-type": ("GPT2BPETokenizer",),
    "--num-workers": None, "--distributed-timeout-minutes": None,
}
NOT_IMPLEMENTED = {
    "--rampup-batch-size": "batch-size ramp-up is not implemented",
    "--swiglu": "only the GPT-2 MLP is implemented", "--use-rotary-position-embeddings": "only learned positions",
    "--position-embedding-type": "only learned absolute positions", "--normalization": "only LayerNorm",
    "--untie-embeddings-and-output-weights": "the output layer is tied to the embeddings",
    "--split-sentences": "sentence splitting is not implemented", "--reset-position-ids": "not implemented",
    "--reset-attention-mask": "not implemented",
    "--override-opt_param-scheduler": "not implemented", "--use-checkpoint-opt_param-scheduler": "not implemented",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gptrain train", description="GPT pretraining with pretrain_gpt.py flags",
                                allow_abbrev=False)
    a = p.add_argument
    # model
    a("--num-layers", type=int, default=24)
    a("--hidden-size", type=int, default=1024)
    a("--num-attention-heads", type=int, default=16)
    a("--ffn-hidden-size", type=int, default=None)
    a("--seq-length", type=int, default=1024)
    a("--max-position-embeddings", type=int, default=None)
    a("--make-vocab-size-divisible-by", type=int, default=128)
    a("--init-method-std", type=float, default=0.02)
    a("--attention-dropout", type=float, default=0.1)
    a("--hidden-dropout", type=float, default=0.1)
    a("--layernorm-epsilon", type=float, default=1e-5)
    # Megatron's two generations of flags: --checkpoint-activations recomputed whole blocks;
    # --recompute-activations now means selective (core attention) recompute
    a("--checkpoint-activations", action="store_true")
    a("--recompute-activations", action="store_true")
    a("--recompute-granularity", choices=["full", "selective"], default=None,
      help="full: recompute whole blocks; selective: recompute only attention (Megatron's meanings)")
    a("--recompute-method", choices=["uniform", "block"], default=None)
    a("--recompute-num-layers", type=int, default=None)
    a("--fused-cross-entropy", action="store_true",
      help="chunked loss that never materialises all logits (less memory)")
    a("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local", "flash4"], default="auto",
      help="SDPA kernel: flash (FlashAttention-2), fused (cuDNN), unfused/local (math); flash4: "
           "FlashAttention-4's kernels (pip install 'gptrain[flash4]'; Hopper/Blackwell, no attention "
           "dropout); auto: flash4 where it can run, else PyTorch's pick")
    a("--linear-impl", choices=["auto", "cublaslt", "torch"], default="auto",
      help="cublaslt: linear layers' matmuls autotuned through cuBLASLt where the device allows (CUDA, "
           "bf16/fp16 parameters); torch: PyTorch's own; auto: cublaslt from 16384 tokens per micro-batch")
    a("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
      help="plain fc1 -> GELU -> fc2 instead of fc1's bias and GELU in its cuBLASLt matmul epilogues")
    # parallelism (the data-parallel size is what the world size leaves)
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
      help="interleaved 1F1B: each pipeline rank runs several stages of this many layers")
    a("--decoder-first-pipeline-num-layers", type=int, default=None,
      help="layers on the first pipeline stage (the rest split evenly over the others)")
    a("--decoder-last-pipeline-num-layers", type=int, default=None,
      help="layers on the last pipeline stage, which also runs the output layer and loss: fewer balances the pipeline")
    a("--sequence-parallel", action="store_true",
      help="with tensor parallelism: LayerNorms, dropout and the residual stream on sequence shards")
    a("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3],
      help="ZeRO sharding on FSDP2: 1 optimizer state, 2 + gradients, 3 + parameters")
    a("--use-distributed-optimizer", action="store_true", help="Megatron's sharded optimizer (= --zero-stage 1)")
    a("--cpu-offload", action="store_true", help="with --zero-stage 3: parameters and optimizer state in host memory")
    a("--deepspeed", action="store_true", help="Megatron-DeepSpeed: take ZeRO and precision from --deepspeed_config")
    a("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
      help="a DeepSpeed ds.json: zero_optimization, fp16/bf16, batch sizes and clipping are honoured")
    # data
    a("--data-path", nargs="+", default=[])
    a("--split", default="969,30,1")
    a("--mock-data", action="store_true")
    a("--vocab-file", default=None)
    a("--merge-file", default=None)
    a("--data-cache-path", default=None)
    a("--seed", type=int, default=1234)
    a("--eod-mask-loss", action="store_true", help="tokens whose input is the end-of-document token do not count")
    # optimisation
    a("--micro-batch-size", type=int, default=None, help="default 1")
    a("--global-batch-size", type=int, default=None)
    a("--train-iters", type=int, default=None)
    a("--train-samples", type=int, default=None)
    a("--lr", type=float, default=1.5e-4)
    a("--min-lr", type=float, default=0.0)
    a("--weight-decay", type=float, default=0.01)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.999)
    a("--adam-eps", type=float, default=1e-8)
    a("--clip-grad", type=float, default=1.0)
    a("--lr-decay-style", default="linear")
    a("--lr-decay-iters", type=int, default=None)
    a("--lr-warmup-iters", type=int, default=0)
    a("--lr-warmup-fraction", type=float, default=None)
    a("--optimizer", default="adam", choices=["adam"])
    # precision
    a("--fp16", action="store_true")
    a("--bf16", action="store_true")
    a("--loss-scale", type=float, default=None)
    a("--initial-loss-scale", type=float, default=2.0 ** 32)
    a("--min-loss-scale", type=float, default=1.0)
    a("--loss-scale-window", type=int, default=1000)
    a("--hysteresis", type=int, default=2)
    a("--autocast", "--bf16-autocast", action="store_true", dest="autocast",
      help="with --bf16/--fp16: keep fp32 parameters and run under autocast instead of half-precision parameters")
    a("--fp8", action="store_const", const="hybrid", dest="fp8_format",
      help="fp8 matmuls in the transformer layers through torchao (same as --fp8-format hybrid)")
    a("--fp8-format", choices=["hybrid", "e4m3"], default=None, dest="fp8_format")
    a("--fp8-recipe", default="tensorwise")
    # run
    a("--eval-interval", type=int, default=1000)
    a("--eval-iters", type=int, default=100)
    a("--log-interval", type=int, default=100)
    a("--save", default=None)
    a("--load", default=None)
    a("--save-interval", type=int, default=None)
    a("--exit-interval", type=int, default=None)
    a("--exit-duration-in-mins", type=float, default=None)
    a("--max-nan-iterations", type=int, default=10)
    a("--tensorboard-dir", default=None)
    a("--compile", action="store_true", help="torch.compile the model")
    a("--compile-mode", default=None, choices=["default", "reduce-overhead", "max-autotune",
                                               "max-autotune-no-cudagraphs"],
      help="torch.compile mode (implies --compile); max-autotune compiles for many minutes")
    a("--peak-tflops", type=float, default=None, help="device peak for MFU (default: known from the device name)")
    a("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    a("--skip-train", action="store_true",
      help="no training: evaluate the validation and test splits (of a --load checkpoint) and print Megatron's lines")
    a("--softmax-over-padded-vocab", action="store_true",
      help="the loss's softmax over all padded vocabulary rows, as Megatron computes it (default: the real "
           "vocabulary only, layout-independent)")
    a("--dry-run", action="store_true",
      help="check the flags and the layout, print it and each rank's parameter count, build and train nothing")
    a("--world-size", type=int, default=None,
      help="with --dry-run: the number of processes to plan for (default: torchrun's WORLD_SIZE, else 1)")
    a("--no-load-optim", action="store_true")
    a("--no-load-rng", action="store_true")
    a("--finetune", action="store_true", help="--load weights only: iteration, optimizer and schedule start fresh")
    a("--exit-signal-handler", action="store_true",
      help="on SIGTERM/SIGINT: finish the iteration, save a checkpoint and exit 0")
    a("--async-save", action="store_true",
      help="write checkpoints in a background thread; published once durable")
    # accepted for compatibility (see ACCEPTED_NO_OP*)
    for flag in ACCEPTED_NO_OP:
        a(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in ACCEPTED_NO_OP_WITH_VALUE:
        a(flag, default=None, help=argparse.SUPPRESS)
    a("--verbose", action="store_true")
    from gptrain.flag_help import apply as apply_flag_help  # groups and help lines (gptrain/flag_help.py)

    return apply_flag_help(p)


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
    ``world_size`` (default: torchrun's WORLD_SIZE) resolves a ds.json's batch sizes."""
    if world_size is None:
        world_size = planned_world_size(argv)
    for flag in NOT_IMPLEMENTED:
        if flag in argv:
            raise ValueError(f"{flag} is a Megatron flag gptrain does not implement: {NOT_IMPLEMENTED[flag]}")
    known_flags = {o for action in _parser()._actions for o in action.option_strings}
    unknown = [x.split("=")[0] for x in argv if x.startswith("--") and x.split("=")[0] not in known_flags]
    if unknown:
        raise ValueError(f"unknown flag(s) {', '.join(unknown)}: gptrain refuses flags it does not implement "
                         "rather than ignoring them (see `gptrain train --help`)")
    args = _parser().parse_args(argv)
    notes = []
    for flag, reason in ACCEPTED_NO_OP.items():
        if flag in argv:
            notes.append(f"{flag}: accepted, {reason}")
    for flag, allowed in ACCEPTED_NO_OP_WITH_VALUE.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None and allowed is not None and value not in allowed:
            raise ValueError(f"{flag} {value}: only {' or '.join(allowed)} is supported")
    if not args.mock_data and not args.data_path:
        raise ValueError("give --data-path PREFIX (or weight/prefix pairs), or --mock-data")
    if args.deepspeed and not args.deepspeed_config:
        raise ValueError("--deepspeed needs --deepspeed_config ds.json")
    zero_stage = args.zero_stage if args.zero_stage is not None else 1 if args.use_distributed_optimizer else 0
    if args.use_distributed_optimizer and zero_stage == 0:
        raise ValueError("--use-distributed-optimizer is ZeRO stage 1; it contradicts --zero-stage 0")
    parallel = ParallelConfig(tensor_parallel=args.tensor_model_parallel_size,
                              sequence_parallel=args.sequence_parallel,
                              pipeline_parallel=args.pipeline_model_parallel_size,
                              layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
                              first_stage_layers=args.decoder_first_pipeline_num_layers,
                              last_stage_layers=args.decoder_last_pipeline_num_layers,
                              zero_stage=zero_stage,
                              cpu_offload=args.cpu_offload, deepspeed_config=args.deepspeed_config)
    if args.deepspeed_config:
        notes += _apply_deepspeed_config(args, parallel, world_size)
    if args.micro_batch_size is None:
        args.micro_batch_size = 1
    if args.global_batch_size is None:  # Megatron's default: one micro-batch per data-parallel rank
        model_parallel = max(1, args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
        args.global_batch_size = args.micro_batch_size * max(1, world_size // model_parallel)
    model = GPTConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        tensor_parallel_size=args.tensor_model_parallel_size, init_method_std=args.init_method_std,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        layernorm_epsilon=args.layernorm_epsilon,
    )
    kernels = KernelConfig(recompute=_recompute_mode(args), fused_cross_entropy=args.fused_cross_entropy,
                           attention_backend=args.attention_backend, linear_impl=args.linear_impl,
                           bias_gelu_fusion=args.bias_gelu_fusion,
                           softmax_over_padded_vocab=args.softmax_over_padded_vocab)
    data = DataConfig(data_path=args.data_path, split=args.split, mock_data=args.mock_data,
                      vocab_file=args.vocab_file, merge_file=args.merge_file,
                      data_cache_path=args.data_cache_path, seed=args.seed, eod_mask_loss=args.eod_mask_loss)
    optim = OptimConfig(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
                        lr_decay_style=args.lr_decay_style, lr_decay_iters=args.lr_decay_iters,
                        lr_warmup_iters=args.lr_warmup_iters, lr_warmup_fraction=args.lr_warmup_fraction)
    precision = PrecisionConfig(fp16=args.fp16, bf16=args.bf16, loss_scale=args.loss_scale,
                                initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
                                loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
                                autocast=args.autocast, fp8=args.fp8_format, fp8_recipe=args.fp8_recipe)
    train = TrainConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, train_samples=args.train_samples, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, log_interval=args.log_interval, save=args.save, load=args.load,
        save_interval=args.save_interval, exit_interval=args.exit_interval,
        exit_duration_in_mins=args.exit_duration_in_mins, max_nan_iterations=args.max_nan_iterations,
        tensorboard_dir=args.tensorboard_dir, compile=args.compile or args.compile_mode is not None,
        compile_mode=args.compile_mode, peak_tflops=args.peak_tflops,
        device=args.device, dry_run=args.dry_run, skip_train=args.skip_train, no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng, finetune=args.finetune, exit_signal_handler=args.exit_signal_handler,
        async_save=args.async_save, verbose=args.verbose,
    )
    return RunConfig(model, data, optim, precision, train, kernels, parallel), notes


def planned_world_size(argv: list[str]) -> int:
    """--world-size N (for a dry run), else torchrun's WORLD_SIZE, else 1."""
    if "--world-size" in argv and argv.index("--world-size") + 1 < len(argv):
        try:
            return int(argv[argv.index("--world-size") + 1])
        except ValueError:
            raise ValueError(f"--world-size {argv[argv.index('--world-size') + 1]}: expected a number") from None
    return int(os.environ.get("WORLD_SIZE", "1"))


def _apply_deepspeed_config(args, parallel: ParallelConfig, world_size: int) -> list[str]:
    """Fold a ds.json into the flags (precision, loss scaling, batch sizes, clipping) and the layout
    (ZeRO stage, CPU offload); a value that contradicts a flag is an error naming both."""
    from gptrain.parallel.deepspeed_config import read_deepspeed_config, resolve_batch_sizes

    ds = read_deepspeed_config(args.deepspeed_config)
    name = args.deepspeed_config
    if ds.fp16 and args.bf16 or ds.bf16 and args.fp16:
        raise ValueError(f"{name}: {'fp16' if ds.fp16 else 'bf16'}.enabled contradicts "
                         f"{'--bf16' if args.bf16 else '--fp16'}")
    args.fp16 = args.fp16 or bool(ds.fp16)
    args.bf16 = args.bf16 or bool(ds.bf16)
    for field_name in ("loss_scale", "initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale"):
        value = getattr(ds, field_name)
        if value is not None:
            setattr(args, field_name, value)
    if ds.gradient_clipping is not None:
        args.clip_grad = ds.gradient_clipping
    if args.zero_stage is not None and args.zero_stage != ds.zero_stage:
        raise ValueError(f"{name}: zero_optimization.stage {ds.zero_stage} contradicts --zero-stage {args.zero_stage}")
    parallel.zero_stage = max(parallel.zero_stage, ds.zero_stage)
    parallel.cpu_offload = parallel.cpu_offload or ds.cpu_offload
    dp = max(1, world_size // max(1, args.tensor_model_parallel_size * args.pipeline_model_parallel_size))
    args.micro_batch_size, args.global_batch_size = resolve_batch_sizes(ds, dp, args.micro_batch_size,
                                                                        args.global_batch_size)
    return list(ds.notes) + [
        f"{name}: ZeRO stage {parallel.zero_stage}" + (", CPU offload" if parallel.cpu_offload else "")
        + f", micro-batch {args.micro_batch_size}, global batch {args.global_batch_size}"]
