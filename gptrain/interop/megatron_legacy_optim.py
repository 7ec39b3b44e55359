"""Megatron-LM's optimizer state from a legacy ``--ckpt-format torch`` checkpoint
(``mp_rank_XX[_YYY]/model_optim_rng.pt``, each rank's file with its own optimizer entry), in gptrain's
parameter names, for training's ``--load``.

The ``optimizer`` entry is the optimizer's own ``state_dict()``: an fp32 run's FP32Optimizer gives the
inner Adam's (``state`` keyed by integer index over the param_groups in order); a half-precision run's
Float16OptimizerWithFloat16Params wraps it as ``{'optimizer', 'grad_scaler', 'fp32_from_fp16_params'}``.
Nothing names which parameter an index is, so the order is rebuilt as Megatron built it: the model's
parameters in registration order (the saved model's key order), split into the weight-decay group
(matrices) and the no-weight-decay group (biases and 1-D parameters, LayerNorm's): megatron-core's
``_get_param_groups`` (``wd_mult`` 1 before 0) and the 2021-2022 ``_get_params_for_weight_decay_optimization``
alike. Every moment's shape is checked against its parameter, and an fp16/bf16 run's fp32 main weights
must round to the saved weights exactly: a checkpoint whose order differs is not imported (the load
goes on with a fresh optimizer) rather than imported wrongly. Each rank's order is its own model's; the
shards are then joined as the weights are (tensor-parallel rules, stage-local layers numbered globally).
Not imported: virtual pipeline chunks, expert-parallel ranks, param groups other than those two.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from gptrain.interop import megatron_llama as llama
from gptrain.interop.megatron_keys import flatten, layout_of, legacy_qkv_to_per_head, map_key, merge_shards
from gptrain.interop.megatron_optim import MegatronOptimizerState, OptimizerNotImported, loss_scale_state
from gptrain.interop.safe_unpickle import load_pickle_lazily

KINDS = ("exp_avg", "exp_avg_sq", "main")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def _parameters(model: dict, args: dict, version) -> list[tuple[str, int | None, torch.Tensor, str]]:
    """(gptrain name, stage-local layer, saved weight, merge rule) per parameter of one rank, in the
    model's registration order (a tied output layer's copy on the last stage included: it has a slot)."""
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
        if rule == "qkv" and (version is None or float(version) < 2.0):
            rule = "legacy_qkv"  # reordered per shard as the weights are
        elif name.startswith("mlp.fc1.") and args.get("swiglu"):
            rule = llama.GLU  # [gate_i; up_i] per rank
        out.append((name, layer, value, rule))
    return out


def _decays(group: dict, position: int) -> bool:
    """Whether a saved param group is the weight-decay one: megatron-core says so with ``wd_mult``;
    the 2021-2022 Megatron-LM put the weight-decay group first."""
    if "wd_mult" in group:
        return float(group["wd_mult"]) != 0.0
    return position == 0


def _ordered(groups: list, params: list) -> list[tuple[int, tuple]]:
    """(saved index, parameter) for every parameter, by Megatron's grouping."""
    decays = [p[2].dim() > 1 and not p[0].endswith(".bias") for p in params]
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


@dataclass
class _Rank:
    kinds: dict  # (name, stage-local layer) -> {exp_avg, exp_avg_sq[, main]}
    rules: dict  # name -> merge rule
    step: float
    loss_scale: dict | None
    scheduler: dict | None
    args: dict
    source: str


def _read_rank(path: Path, tp: int) -> _Rank | None:
    """One rank file's optimizer state by parameter (its shards); None where it holds none."""
    sd, lazy = load_pickle_lazily(path)
    try:
        if sd.get("optimizer") is None:
            return None
        if any(re.fullmatch(r"model\d+", str(k)) for k in sd):
            raise OptimizerNotImported("virtual pipeline chunks (model0, model1, ...)")
        raw = sd.get("args")
        args = dict(vars(raw)) if isinstance(raw, argparse.Namespace) else dict(raw or {})
        version = sd.get("checkpoint_version")
        inner, mains, scaler, source = _unwrap(sd["optimizer"])
        params = _parameters(sd["model"], args, version)
        groups = inner["param_groups"]
        if mains is not None and [len(g) for g in mains] != [len(g["params"]) for g in groups]:
            raise OptimizerNotImported("fp32_from_fp16_params are not grouped as the param groups")
        main_of = {i: t for g, ts in zip(groups, mains or []) for i, t in zip(g["params"], ts)}
        group_step = {i: g.get("step") for g in groups for i in g["params"]}  # apex FusedAdam keeps it there
        per_param, rules, steps = {}, {}, set()
        for index, (name, layer, weight, rule) in _ordered(groups, params):
            state = inner["state"].get(index)
            step = state.get("step", group_step[index]) if isinstance(state, dict) else None
            if step is None or any(k not in state for k in ("exp_avg", "exp_avg_sq")):
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
            if rule == "legacy_qkv":
                kinds = {k: legacy_qkv_to_per_head(t, float(version or 0.0), int(args["num_attention_heads"]) // tp)
                         for k, t in kinds.items()}
            per_param[(name, layer)], rules[name] = kinds, rule
            steps.add(float(lazy.materialize(step)) if isinstance(step, torch.Tensor) else float(step))
        if len(steps) != 1:
            raise OptimizerNotImported(f"Adam's steps differ between parameters ({sorted(steps)[:4]})")
        scheduler = sd.get("opt_param_scheduler", sd.get("lr_scheduler"))
        return _Rank(per_param, rules, steps.pop(), loss_scale_state(scaler, lazy.materialize),
                     dict(scheduler) if isinstance(scheduler, dict) else None, args, source)
    finally:
        lazy.close()


def _merge(ranks: dict, tp: int, pp: int, args: dict, folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Full tensors per gptrain name: tensor-parallel shards joined by the weights' rules, stage-local
    layers numbered globally; a tied output layer's last-stage copy dropped (the embeddings' state)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    for stage in range(pp):
        shards = [ranks[(t, stage)] for t in range(tp)]
        keys = list(shards[0].kinds)
        if any(list(r.kinds) != keys for r in shards):
            raise OptimizerNotImported(f"the tensor-parallel ranks of stage {stage} hold different parameters")
        local = sorted({layer for _, layer in keys if layer is not None})
        shift = offset if local and local[0] == 0 else 0
        for name, layer in keys:
            if name == "output_layer.weight" and not args.get("untie_embeddings_and_output_weights"):
                continue
            full = name if layer is None else f"layers.{layer + shift}.{name}"
            rule = shards[0].rules[name]
            if full not in out:
                out[full] = {kind: llama.merge_glu(parts) if rule == llama.GLU else merge_shards(parts, rule, name, folder)
                             for kind in shards[0].kinds[(name, layer)]
                             for parts in [[r.kinds[(name, layer)][kind] for r in shards]]}
        offset += len(local)
    return out


def read_legacy_optimizer_state(folder) -> MegatronOptimizerState | None:
    """The optimizer state of a legacy Megatron iteration folder (every rank's file); None where it holds
    none (``--no-save-optim``). Raises :class:`OptimizerNotImported` for what is not imported."""
    folder = Path(folder)
    paths = {}
    for entry in (p for p in folder.iterdir() if p.is_dir() and p.name.startswith("mp_rank_")):
        m = _RANK_DIR.match(entry.name)
        if not m:
            raise OptimizerNotImported(f"{entry.name}: expert-parallel ranks")
        paths[(int(m.group(1)), int(m.group(2) or 0))] = entry / "model_optim_rng.pt"
    tp, pp = 1 + max(t for t, _ in paths), 1 + max(s for _, s in paths)
    if len(paths) != tp * pp or not all(p.is_file() for p in paths.values()):
        raise OptimizerNotImported(f"rank files missing for TP{tp} x PP{pp}")
    ranks = {rank: _read_rank(path, tp) for rank, path in sorted(paths.items())}
    if all(r is None for r in ranks.values()):
        return None
    if any(r is None for r in ranks.values()):
        raise OptimizerNotImported("some ranks' files hold optimizer state, others none")
    first = ranks[(0, 0)]
    steps = {r.step for r in ranks.values()}
    if len(steps) != 1:
        raise OptimizerNotImported(f"Adam's steps differ between ranks ({sorted(steps)})")
    per_param = _merge(ranks, tp, pp, first.args, folder)
    args = first.args
    if args.get("swiglu"):
        for kind in KINDS:
            split = {name: kinds.pop(kind) for name, kinds in per_param.items() if ".mlp.fc1." in name and kind in kinds}
            llama.split_fc1(split, int(args["num_layers"]))
            for name, tensor in split.items():
                per_param.setdefault(name, {})[kind] = tensor
        per_param = {name: kinds for name, kinds in per_param.items() if kinds}
    has_main = first.source == "Float16OptimizerWithFloat16Params"
    precision = "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"
    layout = "" if tp * pp == 1 else f", TP{tp} x PP{pp}"
    return MegatronOptimizerState(
        moments={name: {k: kinds[k] for k in KINDS[:2]} for name, kinds in per_param.items()},
        main={name: kinds["main"] for name, kinds in per_param.items()} if has_main else None,
        step=int(steps.pop()), scheduler=first.scheduler, precision=precision,
        source=f"{first.source}, --ckpt-format torch{layout}", loss_scale=first.loss_scale)
