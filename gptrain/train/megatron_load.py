"""``--load`` of a Megatron-LM checkpoint folder: its weights into the run's parameters at any
gptrain layout, its iteration and consumed samples into the trainer's state.

The architecture comes from the checkpoint's ``args``: a flag that contradicts it is an error
naming both values. Given the optimizer, Adam's state (moments, step) comes along where the checkpoint
holds it (torch_dist, interop/megatron_optim.py), with a half-precision or distributed-optimizer run's
fp32 main weights (the run continues from them, not from the rounded weights) and the lr schedule's
position; otherwise the log line says the optimizer starts fresh, and why.
"""
from __future__ import annotations

from pathlib import Path

import torch

from gptrain.config import RunConfig
from gptrain.parallel.shards import copy_full_into
from gptrain.checkpoint_kind import TRACKER
from gptrain.interop.megatron_optim import schedule_differences

# Megatron's args -> (gptrain's config attribute, the flag a user writes)
_ARCHITECTURE = {"num_layers": ("num_layers", "--num-layers"), "hidden_size": ("hidden_size", "--hidden-size"),
                 "num_attention_heads": ("num_attention_heads", "--num-attention-heads"),
                 "ffn_hidden_size": ("ffn_hidden_size", "--ffn-hidden-size"),
                 "max_position_embeddings": ("max_position_embeddings", "--max-position-embeddings")}


# the Llama-family fields a Hugging Face folder fixes -> the flag that sets them
_FAMILY = {"swiglu": "--swiglu", "normalization": "--normalization",
           "position_embedding_type": "--position-embedding-type", "num_query_groups": "--num-query-groups",
           "kv_channels": "--kv-channels", "rotary_base": "--rotary-base", "add_bias_linear": "--disable-bias-linear",
           "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
           "apply_layernorm_1p": "--apply-layernorm-1p"}


def check_architecture(args: dict, cfg: RunConfig, where: str) -> None:
    for key, (attr, flag) in _ARCHITECTURE.items():
        theirs, ours = args.get(key), getattr(cfg.model, attr)
        if theirs is not None and theirs != ours:
            raise ValueError(f"{flag} {ours} contradicts the checkpoint's {key} {theirs} ({where})")


def check_family(implied, cfg: RunConfig, where: str) -> None:
    """The Llama family's choices of the run against those a checkpoint implies (a GPTConfig)."""
    for attr, flag in _FAMILY.items():
        if getattr(implied, attr) != getattr(cfg.model, attr):
            raise ValueError(f"{flag}: the run has {attr} {getattr(cfg.model, attr)}, {where} implies "
                             f"{getattr(implied, attr)}")


def _full_shape(name: str, target: torch.Tensor, layout) -> tuple[int, ...]:
    return layout.full_shape(name, target.shape) if layout is not None else tuple(target.shape)


def _region(name: str, shape: tuple[int, ...], layout):
    return layout.region(name, shape) if layout is not None else None


def _fit_vocab_rows(name: str, full: torch.Tensor, shape: tuple[int, ...], cfg: RunConfig) -> torch.Tensor:
    """A vocabulary-sized tensor (weights or their Adam moments) padded for another tensor-parallel size:
    the real vocabulary's rows carry over, the rest is zero (as gptrain initialises its padding)."""
    if name not in ("word_embeddings.weight", "output_layer.weight") or full.shape[0] == shape[0]:
        return full
    rows = min(full.shape[0], shape[0], cfg.model.padded_vocab_size)
    padded = torch.zeros(shape)
    padded[:rows] = full[:rows]
    return padded


def _precision(cfg: RunConfig) -> str:
    return "bf16" if cfg.precision.bf16 else "fp16" if cfg.precision.fp16 else "fp32"


def _precision_note(saved, cfg: RunConfig) -> str:
    """What became of the weights where the checkpoint's precision and the run's differ (gptrain's optimizer
    always updates fp32 weights: a half-precision run's main copies, an fp32 run's parameters)."""
    ours, theirs = _precision(cfg), saved.precision
    notes = []
    if theirs != ours:
        notes.append(f"the checkpoint is {'a' if theirs == 'bf16' else 'an'} {theirs} run's: its {'fp32 main ' if saved.main else ''}weights "
                     f"become this {ours} run's {'fp32 main weights' if ours != 'fp32' else 'weights'}")
    if ours == "fp16":
        notes += _loss_scale_note(saved, cfg)
    return "".join(f"; {n}" for n in notes)


def _imported_loss_scale(saved, cfg: RunConfig) -> dict | None:
    """The checkpoint's dynamic loss scale where this run is fp16 with a dynamic scale of its own."""
    dynamic = cfg.precision.fp16 and cfg.precision.loss_scale is None
    return saved.loss_scale if dynamic else None


def _loss_scale_note(saved, cfg: RunConfig) -> list[str]:
    if _imported_loss_scale(saved, cfg):
        s = saved.loss_scale
        return [f"loss scale {s['scale']:g} (growth tracker {s['growth_tracker']}, hysteresis tracker "
                f"{s['hysteresis_tracker']}) from the checkpoint"]
    if saved.loss_scale:
        return ["the checkpoint's loss scale is not used (--loss-scale)"]
    return ["the loss scale starts at --initial-loss-scale"] if saved.precision == "fp16" else []


def _copy_full(name: str, target: torch.Tensor, full: torch.Tensor, cfg: RunConfig, layout, what: str) -> None:
    shape = _full_shape(name, target, layout)
    full = _fit_vocab_rows(name, full.float(), shape, cfg)
    if tuple(full.shape) != shape:
        raise ValueError(f"{name}'s {what} is {tuple(full.shape)} in the checkpoint, {shape} here")
    copy_full_into(target, full, _region(name, shape, layout))


def _load_optimizer(root, params: dict[str, torch.Tensor], optimizer, cfg: RunConfig,
                    layout) -> tuple[dict | None, dict | None, str]:
    """Megatron's Adam state into ``optimizer`` (by parameter, as the weights) and, where the checkpoint
    keeps them, its fp32 main weights into ``params`` (over the half-precision weights already there);
    (its lr schedule state or None, its loss scale for this run or None, what the log line says)."""
    from gptrain.interop.megatron import find_megatron_iteration_dir
    from gptrain.interop.megatron_optim import MOMENTS, OptimizerNotImported, read_optimizer_state
    from gptrain.train.checkpoint import init_optimizer_state

    folder, _ = find_megatron_iteration_dir(root)
    try:
        saved = read_optimizer_state(folder)
    except OptimizerNotImported as e:
        return None, None, f"optimizer state not imported ({e}): the optimizer starts fresh"
    if saved is None:
        return None, None, ("the checkpoint holds no optimizer state gptrain reads (saved with --no-save-optim): "
                            "the optimizer starts fresh")
    missing = sorted(set(params) - set(saved.moments))
    if missing:
        raise ValueError(f"{folder}: the optimizer state lacks {missing[:3]} ({len(missing)} in all)")
    init_optimizer_state(params, optimizer)
    try:
        for name, target in params.items():
            if saved.main is not None:
                _copy_full(name, target, saved.main[name], cfg, layout, "fp32 main weight")
            state = optimizer.state[target]
            for moment in MOMENTS:
                _copy_full(name, state[moment], saved.moments[name][moment], cfg, layout, moment)
            state["step"].fill_(float(saved.step))
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
    what = "fp32 main weights, Adam's moments" if saved.main is not None else "Adam's moments"
    return saved.scheduler, _imported_loss_scale(saved, cfg), (f"optimizer state imported ({saved.source}: {what}, step {saved.step})"
                             + _precision_note(saved, cfg))


@torch.no_grad()
def load_megatron(root, params: dict[str, torch.Tensor], cfg: RunConfig, layout=None, optimizer=None,
                  schedule=None) -> dict:
    """Copy a Megatron checkpoint's weights into ``params`` (plain or sharded: ``layout`` is the
    tensor-parallel ShardLayout) and, given ``optimizer``, its Adam state; returns the trainer state it
    implies (iteration, consumed samples, ``scheduler``: Megatron's lr-schedule state or None,
    ``loss_scale``: its fp16 loss scaler's state for this fp16 run's dynamic scaler, or None,
    ``optimizer``: what became of the optimizer state and schedule, for the log line; the run's
    ``schedule`` (LRSchedule) is compared with the checkpoint's)."""
    from gptrain.interop.megatron import read_megatron_checkpoint

    ckpt = read_megatron_checkpoint(root)
    where = str(Path(root) / TRACKER)
    check_architecture(ckpt.args, cfg, where)
    check_family(ckpt.gpt_config(vocab_size=cfg.model.vocab_size), cfg, f"the checkpoint's args ({where})")
    missing = sorted(set(params) - set(ckpt.state))
    if missing:
        raise ValueError(f"{root}: the Megatron checkpoint lacks {missing[:3]} ({len(missing)} in all)")
    for name, target in params.items():
        shape = _full_shape(name, target, layout)
        full = _fit_vocab_rows(name, ckpt.state[name].float(), shape, cfg)
        if tuple(full.shape) != shape:
            raise ValueError(f"{root}: {name} is {tuple(full.shape)} in the checkpoint, {shape} here")
        copy_full_into(target, full, _region(name, shape, layout))
    scheduler, loss_scale, note = (None, None, "optimizer state starts fresh") if optimizer is None else \
        _load_optimizer(root, params, optimizer, cfg, layout)
    if scheduler is not None:
        note += f"; lr schedule at {scheduler.get('num_steps')} samples"
        differences = schedule_differences(scheduler, schedule) if schedule is not None else []
        if differences:
            note += f" (the run's flags kept where the checkpoint's differ: {', '.join(differences)})"
    args = ckpt.args
    return {"scheduler": scheduler, "loss_scale": loss_scale, "optimizer": note, "iteration": ckpt.iteration,
            "consumed_train_samples": int(args.get("consumed_train_samples") or 0),
            "consumed_valid_samples": int(args.get("consumed_valid_samples") or 0),
            "layout": f"TP{ckpt.tp} x PP{ckpt.pp}, {ckpt.layout} layout"}


@torch.no_grad()
def load_hf(root, params: dict[str, torch.Tensor], cfg: RunConfig, layout=None) -> None:
    """``--load`` of a Hugging Face GPT-2 folder: its weights into ``params`` (plain or sharded);
    a flag contradicting its config.json is an error naming both values."""
    from gptrain.interop.hf import load_hf_folder

    model = load_hf_folder(root)
    theirs = {key: getattr(model.cfg, attr) for key, (attr, _) in _ARCHITECTURE.items()}
    check_architecture(theirs, cfg, str(Path(root) / "config.json"))
    check_family(model.cfg, cfg, f"{root}/config.json")
    if model.cfg.vocab_size != cfg.model.vocab_size:
        raise ValueError(f"{root}: a {model.cfg.vocab_size}-token vocabulary, the tokenizer has {cfg.model.vocab_size} "
                         "(give the folder's vocab.json and merges.txt as --vocab-file and --merge-file)")
    weights = dict(model.named_parameters())
    for name, target in params.items():
        full = weights[name].float()
        shape = _full_shape(name, target, layout)
        if name in ("word_embeddings.weight", "output_layer.weight"):  # real rows; this layout's padding is zero
            rows = min(full.shape[0], shape[0])
            full, padded = torch.zeros(shape), full
            full[:rows] = padded[:rows]
        copy_full_into(target, full, _region(name, shape, layout))
