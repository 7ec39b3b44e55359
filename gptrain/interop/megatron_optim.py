"""Megatron-LM's optimizer state and lr schedule from a ``--ckpt-format torch_dist`` checkpoint, in
gptrain's parameter names, for training's ``--load`` (a Megatron run continues in gptrain).

What megatron-core saves without the distributed optimizer (``FP32Optimizer`` for fp32 runs,
``Float16OptimizerWithFloat16Params`` for bf16/fp16, alone or in a ``ChainedOptimizer``): per parameter,
Adam's moments at the parameter's global shape under ``optimizer.state.{exp_avg,exp_avg_sq}.<model key>``
(the model's own sharding: layers stacked, TP shards joined, vocabulary padded as the model's), a
half-precision run's fp32 main weights under ``optimizer.state.fp32_param.<model key>``, and in the common
state the step shared by all parameters (``optimizer.state.common_step``) and ``opt_param_scheduler`` (its
``num_steps`` counts samples). The distributed optimizer's ``fully_reshardable`` format is the same per
parameter (main weights as ``optimizer.state.param``, the step in the param_groups); its default
``dp_reshardable`` buffers are read by :mod:`megatron_distopt`. Everything goes through the weights' key
mapping (:func:`gptrain.interop.megatron_dist.gptrain_tensors`), so it lands where the weights do.

Not imported (:class:`OptimizerNotImported` names the format; the weights load and the optimizer starts
fresh): the distributed optimizer's dp_zero_gather_scatter and fully_sharded_model_space formats,
dp_reshardable buffers of uneven or virtual pipeline splits, another optimizer's state. An fp16 run's DynamicGradScaler
state (``grad_scaler`` in the common state) comes along as ``loss_scale``. The legacy ``--ckpt-format
torch`` optimizer is read by :mod:`megatron_legacy_optim`.
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
_PER_PARAMETER = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "main", "param": "main"}
_STATE = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.([A-Za-z0-9_]+)\.(.+)$")
_DISTRIBUTED = re.compile(r"^(?:chained_\d+\.)?optimizer\.distributed\.")
# the lr schedule's settings: Megatron's opt_param_scheduler key -> gptrain's LRSchedule field
_SCHEDULE = {"max_lr": "max_lr", "min_lr": "min_lr", "lr_warmup_steps": "warmup_steps",
             "lr_decay_steps": "decay_steps", "lr_decay_style": "style"}


class OptimizerNotImported(Exception):
    """The checkpoint's optimizer state is in a form gptrain does not import; the message says which
    (training's --load then loads the weights and starts the optimizer fresh)."""


@dataclass
class MegatronOptimizerState:
    moments: dict[str, dict[str, torch.Tensor]]  # gptrain name -> exp_avg, exp_avg_sq (full tensors)
    main: dict[str, torch.Tensor] | None  # gptrain name -> fp32 main weights (half-precision runs, distributed)
    step: int  # Adam's step, the same for every parameter
    scheduler: dict | None  # Megatron's opt_param_scheduler.state_dict()
    precision: str  # the saving run's parameters: fp32, bf16 or fp16
    source: str  # the optimizer and format, for the log line
    loss_scale: dict | None = None  # an fp16 run's DynamicGradScaler state, as gptrain's LossScaler keeps it


def loss_scale_state(scaler, materialize=lambda t: t) -> dict | None:
    """Megatron's DynamicGradScaler.state_dict() as gptrain's LossScaler.state_dict() (None for a
    ConstantGradScaler's, which saves nothing); ``materialize`` reads a lazily loaded tensor."""
    if not isinstance(scaler, dict) or "scale" not in scaler:
        return None
    scale = scaler["scale"]
    scale = float(materialize(scale).reshape(-1)[0]) if isinstance(scale, torch.Tensor) else float(scale)
    return {"scale": scale, "growth_tracker": int(scaler.get("growth_tracker", 0)),
            "hysteresis_tracker": int(scaler.get("hysteresis_tracker", 0))}


def _dicts(tree):
    """Every dict of a nested structure of dicts, lists and tuples (an optimizer's common state), in
    pre-order."""
    if isinstance(tree, dict):
        yield tree
        for value in tree.values():
            yield from _dicts(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _dicts(value)


def _grad_scalers(tree) -> list:
    """Every ``grad_scaler`` entry in an optimizer's common state (one per chained optimizer)."""
    return [d["grad_scaler"] for d in _dicts(tree) if isinstance(d.get("grad_scaler"), dict)]


def _steps(tree) -> list:
    """Every step in an optimizer's saved state: ``common_step`` (one per chained optimizer), or the
    param_groups' ``step`` (the distributed optimizer's)."""
    found = []
    for d in _dicts(tree):
        if "common_step" in d:
            found.append(d["common_step"])
        if isinstance(d.get("param_groups"), list):
            found += [g["step"] for g in d["param_groups"] if isinstance(g, dict) and "step" in g]
    return found


def _sharding_types(tree) -> set:
    """The distributed optimizer's ``param_state_sharding_type`` values in the common state."""
    return {d["param_state_sharding_type"] for d in _dicts(tree) if "param_state_sharding_type" in d}


def _gptrain_names(tensors: dict[str, torch.Tensor], args: dict, folder: Path) -> dict[str, torch.Tensor]:
    state, _ = gptrain_tensors(tensors, args, folder)  # a tied output layer shares the embeddings' state
    if args.get("swiglu"):
        llama.split_fc1(state, int(args["num_layers"]))
    return state


def _per_parameter(folder: Path, keys: dict, args: dict) -> dict[str, dict[str, torch.Tensor]]:
    """gptrain name -> {exp_avg, exp_avg_sq[, main]} from ``optimizer.state.<kind>.<model key>`` entries."""
    entries: dict[str, dict] = {}
    for key, entry in keys.items():
        m = _STATE.match(key)
        if m:
            entries.setdefault(m.group(1), {})[key] = (m.group(2), entry)
    other = sorted(set(entries) - set(_PER_PARAMETER))
    if other:
        raise OptimizerNotImported(f"per-parameter optimizer state {other} beside Adam's (another optimizer)")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for kind, named in entries.items():
        tensors = read_entries(folder, {key: entry for key, (_, entry) in named.items()})
        by_model_key = {named[key][0]: tensor for key, tensor in tensors.items()}
        for name, tensor in _gptrain_names(by_model_key, args, folder).items():
            out.setdefault(name, {})[_PER_PARAMETER[kind]] = tensor
    return out


def _distributed(folder: Path, metadata, args: dict, sharding: str) -> tuple[dict, list]:
    from gptrain.interop.megatron_distopt import LayoutNotRecovered, read_dp_reshardable

    if sharding != "dp_reshardable":
        raise OptimizerNotImported(f"the distributed optimizer's {sharding} format is not read")
    try:
        state, groups = read_dp_reshardable(folder, metadata, args)
    except LayoutNotRecovered as e:
        raise OptimizerNotImported(f"the distributed optimizer's dp_reshardable buffers: {e}") from None
    if args.get("swiglu"):  # fc1 [gate; up] split as the weights are
        for kind in ("main", *MOMENTS):
            split = {name: kinds.pop(kind) for name, kinds in state.items() if ".mlp.fc1." in name}
            llama.split_fc1(split, int(args["num_layers"]))
            for name, tensor in split.items():
                state.setdefault(name, {})[kind] = tensor
        state = {name: kinds for name, kinds in state.items() if kinds}
    return state, groups


def read_optimizer_state(folder) -> MegatronOptimizerState | None:
    """The optimizer state of a Megatron iteration folder; None where it holds none (a run saved with
    ``--no-save-optim``). Raises :class:`OptimizerNotImported` for a format gptrain does not import."""
    folder = Path(folder)
    if not is_torch_dist(folder):
        from gptrain.interop.megatron_legacy_optim import read_legacy_optimizer_state

        return read_legacy_optimizer_state(folder)
    metadata = read_metadata_safely(folder, allow_bytes=True)
    keys = metadata.state_dict_metadata
    common = common_state(folder, metadata)
    raw_args = common.get("args")
    args = dict(vars(raw_args)) if isinstance(raw_args, argparse.Namespace) else dict(raw_args or {})
    shardings = _sharding_types(common.get("optimizer"))
    saved_steps = _steps(common.get("optimizer"))
    if len(shardings) > 1:
        raise OptimizerNotImported(f"the distributed optimizer's formats {sorted(shardings)} in one checkpoint")
    sharding = shardings.pop() if shardings else None
    if sharding not in (None, "fully_reshardable"):
        per_param, groups = _distributed(folder, metadata, args, sharding)
        saved_steps += _steps({"param_groups": groups})
    elif any(_DISTRIBUTED.match(k) for k in keys):
        raise OptimizerNotImported("the distributed optimizer's buffers (optimizer.distributed.*) in a format "
                                   "not named in the common state")
    else:
        per_param = _per_parameter(folder, keys, args)
    if not per_param:
        return None
    steps = {float(s) for s in saved_steps}
    if len(steps) != 1:
        raise ValueError(f"{folder}: the optimizer's common step is {sorted(steps) or 'missing'}, not one value")
    precision = "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"
    has_main = [name for name, kinds in per_param.items() if "main" in kinds]
    if has_main and len(has_main) != len(per_param):
        raise OptimizerNotImported("fp32 main weights for some parameters only")
    tp, pp = int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)
    shards = f", TP{tp} x PP{pp}" if sharding == "dp_reshardable" and tp * pp > 1 else ""  # per-rank buffers, joined
    source = f"distributed optimizer, {sharding}{shards}" if sharding else \
        "Float16OptimizerWithFloat16Params" if has_main else "FP32Optimizer"
    scheduler = common.get("opt_param_scheduler")
    scalers = _grad_scalers(common.get("optimizer"))
    return MegatronOptimizerState(
        moments={name: {m: kinds[m] for m in MOMENTS} for name, kinds in per_param.items()},
        main={name: kinds["main"] for name, kinds in per_param.items()} if has_main else None,
        step=int(steps.pop()), scheduler=dict(scheduler) if isinstance(scheduler, dict) else None,
        precision=precision, source=source, loss_scale=loss_scale_state(scalers[0]) if scalers else None)


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
