"""Megatron-LM's optimizer state and lr schedule from a ``--ckpt-format torch_dist`` checkpoint, in
gptrain's parameter names, for training's ``--load`` (a Megatron run continues in gptrain).

What megatron-core saves for an fp32 run without the distributed optimizer (``FP32Optimizer``, alone or
in a ``ChainedOptimizer``): per parameter, Adam's moments at the parameter's global shape under
``optimizer.state.{exp_avg,exp_avg_sq}.<model key>`` (the model's own sharding: layers stacked, TP shards
joined, vocabulary padded as the model's), and in the common state the step shared by all parameters
(``optimizer.state.common_step``) and ``opt_param_scheduler`` (its ``num_steps`` counts samples). The moments go through the weights' key
mapping (:func:`gptrain.interop.megatron_dist.gptrain_tensors`), so they land where the weights do.

Not imported yet, refused by name (``--no-load-optim`` loads the weights alone): an fp16/bf16 run's
fp32 main weights beside the moments (``Float16OptimizerWithFloat16Params``' ``optimizer.state.fp32_param``,
and its loss scaler), and the distributed optimizer's formats (``optimizer.distributed.*`` buffers of
dp_reshardable / dp_zero_gather_scatter; per-parameter ``param`` state of fully_reshardable, flattened
shards of fully_sharded_model_space).
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from gptrain.interop import megatron_llama as llama
from gptrain.interop.megatron_dist import common_state, gptrain_tensors, is_torch_dist, read_entries
from gptrain.train.safe_dcp import read_metadata_safely

MOMENTS = ("exp_avg", "exp_avg_sq")
_STATE = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.([A-Za-z0-9_]+)\.(.+)$")
_DISTRIBUTED = re.compile(r"^(?:chained_\d+\.)?optimizer\.distributed\.")
# the lr schedule's settings: Megatron's opt_param_scheduler key -> gptrain's LRSchedule field
_SCHEDULE = {"max_lr": "max_lr", "min_lr": "min_lr", "lr_warmup_steps": "warmup_steps",
             "lr_decay_steps": "decay_steps", "lr_decay_style": "style"}


@dataclass
class MegatronOptimizerState:
    moments: dict[str, dict[str, torch.Tensor]]  # gptrain name -> exp_avg, exp_avg_sq (full tensors)
    step: int  # Adam's step, the same for every parameter
    scheduler: dict | None  # Megatron's opt_param_scheduler.state_dict()


def _common_steps(tree) -> list:
    """Every ``common_step`` in the optimizer's common state (one per chained optimizer)."""
    if isinstance(tree, dict):
        found = [tree["common_step"]] if "common_step" in tree else []
        return found + [s for v in tree.values() for s in _common_steps(v)]
    if isinstance(tree, (list, tuple)):
        return [s for v in tree for s in _common_steps(v)]
    return []


def read_optimizer_state(folder) -> MegatronOptimizerState | None:
    """The optimizer state of a Megatron iteration folder; None where it holds none (a run saved with
    ``--no-save-optim``, or the legacy format, whose import is not written yet)."""
    folder = Path(folder)
    if not is_torch_dist(folder):
        return None
    metadata = read_metadata_safely(folder, allow_bytes=True)
    keys = metadata.state_dict_metadata
    if any(_DISTRIBUTED.match(k) for k in keys):
        raise ValueError(f"{folder}: the optimizer state is the distributed optimizer's buffers (dp_reshardable or "
                         "dp_zero_gather_scatter), which gptrain does not import: --no-load-optim loads the weights "
                         "and starts the optimizer fresh")
    entries: dict[str, dict] = {}
    for key, entry in keys.items():
        m = _STATE.match(key)
        if m:
            entries.setdefault(m.group(1), {})[key] = (m.group(2), entry)
    if not entries:
        return None
    other = sorted(set(entries) - set(MOMENTS))
    if other:
        raise ValueError(f"{folder}: optimizer state {other} beside Adam's moments (an fp16/bf16 run's fp32 main "
                         "weights, the distributed optimizer's fully_reshardable format, or another optimizer) is not "
                         "imported: --no-load-optim loads the weights and starts the optimizer fresh")
    common = common_state(folder, metadata)
    raw_args = common.get("args")
    args = dict(vars(raw_args)) if isinstance(raw_args, argparse.Namespace) else dict(raw_args or {})
    steps = {float(s) for s in _common_steps(common.get("optimizer"))}
    if len(steps) != 1:
        raise ValueError(f"{folder}: the optimizer's common step is {sorted(steps) or 'missing'}, not one value")
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for moment in MOMENTS:
        named = entries.get(moment, {})
        tensors = read_entries(folder, {key: entry for key, (_, entry) in named.items()})
        by_model_key = {named[key][0]: tensor for key, tensor in tensors.items()}
        state, _ = gptrain_tensors(by_model_key, args, folder)  # a tied output layer shares the embeddings' state
        if args.get("swiglu"):
            llama.split_fc1(state, int(args["num_layers"]))
        for name, tensor in state.items():
            moments.setdefault(name, {})[moment] = tensor
    scheduler = common.get("opt_param_scheduler")
    return MegatronOptimizerState(moments=moments, step=int(steps.pop()),
                                  scheduler=dict(scheduler) if isinstance(scheduler, dict) else None)


def schedule_differences(scheduler: dict, schedule) -> list[str]:
    """The checkpoint's lr-schedule settings that differ from the run's (gptrain's LRSchedule): the
    run's flags are used, as for gptrain's own checkpoints (Megatron-LM would stop without
    --override-opt-param-scheduler)."""
    out = []
    for theirs, ours in _SCHEDULE.items():
        if theirs in scheduler and scheduler[theirs] != getattr(schedule, ours):
            mine, saved = getattr(schedule, ours), scheduler[theirs]
            numbers = all(isinstance(v, (int, float)) for v in (saved, mine))
            if numbers and abs(saved - mine) <= 1e-12 * abs(mine):  # warmup/decay steps: float products
                continue
            out.append(f"{theirs} {saved} (the run: {mine})")
    return out
