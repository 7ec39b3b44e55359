"""Megatron-LM's optimizer state from a legacy ``--ckpt-format torch`` checkpoint (TP1 x PP1:
``mp_rank_00/model_optim_rng.pt``), in gptrain's parameter names, for training's ``--load``.

The ``optimizer`` entry is the optimizer's own ``state_dict()``: an fp32 run's FP32Optimizer gives the
inner Adam's (``state`` keyed by integer index over the param_groups in order); a half-precision run's
Float16OptimizerWithFloat16Params wraps it as ``{'optimizer', 'grad_scaler', 'fp32_from_fp16_params'}``.
Nothing names which parameter an index is, so the order is rebuilt as Megatron built it: the model's
parameters in registration order (the saved model's key order), split into the weight-decay group
(matrices) and the no-weight-decay group (biases and 1-D parameters, LayerNorm's): megatron-core's
``_get_param_groups`` (``wd_mult`` 1 before 0) and the 2021-2022 ``_get_params_for_weight_decay_optimization``
alike. Every moment's shape is checked against its parameter, and an fp16/bf16 run's fp32 main weights
must round to the saved weights exactly: a checkpoint whose order differs is not imported (the load
goes on with a fresh optimizer) rather than imported wrongly.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from gptrain.interop import megatron_llama as llama
from gptrain.interop.megatron_keys import flatten, layout_of, legacy_qkv_to_per_head, map_key
from gptrain.interop.megatron_optim import MegatronOptimizerState, OptimizerNotImported, loss_scale_state
from gptrain.interop.safe_unpickle import load_pickle_lazily

KINDS = ("exp_avg", "exp_avg_sq", "main")


def _parameters(model: dict, args: dict, version) -> list[tuple[str, torch.Tensor, str]]:
    """(gptrain name, saved weight, merge rule) per parameter, in the model's registration order."""
    flat = flatten(model)
    layout = layout_of(flat)
    out = []
    for key, value in flat.items():
        mapped = map_key(key, layout) if isinstance(value, torch.Tensor) else None
        if mapped is None:
            continue
        name, layer, rule = mapped
        if name == "untied_output_layer.weight":
            name = "output_layer.weight"
        elif name == "output_layer.weight" and not args.get("untie_embeddings_and_output_weights"):
            continue  # the first stage's tied copy is not a parameter of its own
        legacy_qkv = rule == "qkv" and (version is None or float(version) < 2.0)
        out.append((name if layer is None else f"layers.{layer}.{name}", value, "qkv" if legacy_qkv else ""))
    return out


def _decays(group: dict, position: int) -> bool:
    """Whether a saved param group is the weight-decay one: megatron-core says so with ``wd_mult``;
    the 2021-2022 Megatron-LM put the weight-decay group first."""
    if "wd_mult" in group:
        return float(group["wd_mult"]) != 0.0
    return position == 0


def _ordered(groups: list, params: list) -> list[tuple[int, tuple]]:
    """(saved index, parameter) for every parameter, by Megatron's grouping."""
    decays = [p[1].dim() > 1 and not p[0].endswith(".bias") for p in params]
    decayed = [p for p, d in zip(params, decays) if d]
    rest = [p for p, d in zip(params, decays) if not d]
    if len(groups) > 2:
        raise OptimizerNotImported(f"{len(groups)} param groups (lr/wd overrides: the order is not rebuilt)")
    out, used = [], set()
    for position, group in enumerate(groups):
        decays = _decays(group, position)
        if decays in used:
            raise OptimizerNotImported("two weight-decay groups alike (the order is not rebuilt)")
        used.add(decays)
        mine = decayed if decays else rest
        if len(group["params"]) != len(mine):
            raise OptimizerNotImported(f"a param group of {len(group['params'])} parameters, the model's has "
                                       f"{len(mine)} (megatron-core's grouping not recognised)")
        out += list(zip(group["params"], mine))
    if len(out) != len(params):
        raise OptimizerNotImported(f"{len(out)} parameters in the param groups, {len(params)} in the model")
    return out


def _unwrap(optimizer) -> tuple[dict, list | None, dict | None, str]:
    """(the inner Adam's state_dict, fp32 main weights per group or None, the grad scaler's state, source)."""
    if isinstance(optimizer, (list, tuple)):
        raise OptimizerNotImported(f"a chained optimizer of {len(optimizer)} optimizers")
    if not isinstance(optimizer, dict):
        raise OptimizerNotImported(f"an optimizer entry of type {type(optimizer).__name__}")
    if "state" in optimizer and "param_groups" in optimizer:
        return optimizer, None, None, "FP32Optimizer"
    inner = optimizer.get("optimizer", optimizer.get("optimizer_state_dict"))
    mains = optimizer.get("fp32_from_fp16_params", optimizer.get("fp32_from_fp16"))
    if not isinstance(inner, dict) or "state" not in inner or mains is None:
        raise OptimizerNotImported(f"an optimizer entry with keys {sorted(map(str, optimizer))}")
    return inner, mains, optimizer.get("grad_scaler"), "Float16OptimizerWithFloat16Params"


def read_legacy_optimizer_state(folder) -> MegatronOptimizerState | None:
    """The optimizer state of a legacy Megatron iteration folder; None where it holds none
    (``--no-save-optim``). Raises :class:`OptimizerNotImported` for what is not imported."""
    folder = Path(folder)
    ranks = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name.startswith("mp_rank_"))
    if ranks != ["mp_rank_00"]:
        raise OptimizerNotImported(f"the --ckpt-format torch optimizer state of {len(ranks)} model-parallel "
                                   "ranks (only TP1 x PP1 is read)")
    sd, lazy = load_pickle_lazily(folder / "mp_rank_00" / "model_optim_rng.pt")
    try:
        if sd.get("optimizer") is None:
            return None
        raw = sd.get("args")
        args = dict(vars(raw)) if isinstance(raw, argparse.Namespace) else dict(raw or {})
        inner, mains, scaler, source = _unwrap(sd["optimizer"])
        params = _parameters(sd["model"], args, sd.get("checkpoint_version"))
        groups = inner["param_groups"]
        if mains is not None and [len(g) for g in mains] != [len(g["params"]) for g in groups]:
            raise OptimizerNotImported("fp32_from_fp16_params are not grouped as the param groups")
        main_of = {i: t for g, ts in zip(groups, mains or []) for i, t in zip(g["params"], ts)}
        per_param, steps = {}, set()
        for index, (name, weight, rule) in _ordered(groups, params):
            state = inner["state"].get(index)
            if not isinstance(state, dict) or any(k not in state for k in ("exp_avg", "exp_avg_sq", "step")):
                raise OptimizerNotImported(f"no Adam state for parameter {index} ({name})")
            kinds = {k: state[k] for k in ("exp_avg", "exp_avg_sq")}
            if mains is not None:
                kinds["main"] = main_of[index]
            for kind, tensor in kinds.items():
                if tuple(tensor.shape) != tuple(weight.shape):
                    raise OptimizerNotImported(f"parameter {index}'s {kind} is {tuple(tensor.shape)}, {name} is "
                                               f"{tuple(weight.shape)} (the parameter order is not megatron-core's)")
            kinds = {k: lazy.materialize(t).float() for k, t in kinds.items()}
            if mains is not None and not torch.equal(kinds["main"].to(weight.dtype), lazy.materialize(weight)):
                raise OptimizerNotImported(f"parameter {index}'s fp32 main weight does not round to {name} "
                                           "(the parameter order is not megatron-core's)")
            if rule == "qkv":
                version = float(sd.get("checkpoint_version") or 0.0)
                kinds = {k: legacy_qkv_to_per_head(t, version, int(args["num_attention_heads"]))
                         for k, t in kinds.items()}
            per_param[name] = kinds
            step = state["step"]
            steps.add(float(lazy.materialize(step)) if isinstance(step, torch.Tensor) else float(step))
        if len(steps) != 1:
            raise OptimizerNotImported(f"Adam's steps differ between parameters ({sorted(steps)[:4]})")
        loss_scale = loss_scale_state(scaler, lazy.materialize)
        scheduler = sd.get("opt_param_scheduler", sd.get("lr_scheduler"))
    finally:
        lazy.close()
    if args.get("swiglu"):
        for kind in KINDS if mains is not None else KINDS[:2]:
            split = {name: kinds.pop(kind) for name, kinds in per_param.items() if ".mlp.fc1." in name}
            llama.split_fc1(split, int(args["num_layers"]))
            for name, tensor in split.items():
                per_param.setdefault(name, {})[kind] = tensor
        per_param = {name: kinds for name, kinds in per_param.items() if kinds}
    precision = "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"
    return MegatronOptimizerState(
        moments={name: {k: kinds[k] for k in KINDS[:2]} for name, kinds in per_param.items()},
        main={name: kinds["main"] for name, kinds in per_param.items()} if mains is not None else None,
        step=int(steps.pop()), scheduler=dict(scheduler) if isinstance(scheduler, dict) else None,
        precision=precision, source=f"{source}, --ckpt-format torch", loss_scale=loss_scale)
