"""``--load`` of a Megatron-LM checkpoint folder: its weights into the run's parameters at any
gptrain layout, its iteration and consumed samples into the trainer's state.

The architecture comes from the checkpoint's ``args``: a flag that contradicts it is an error
naming both values. Given the optimizer, Adam's state (moments, step) comes along where the checkpoint
holds it (torch_dist, interop/megatron_optim.py), and with it the lr schedule's position; otherwise
the run says the optimizer starts fresh.
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
           "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights"}


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


def _load_optimizer(root, params: dict[str, torch.Tensor], optimizer, cfg: RunConfig,
                    layout) -> tuple[dict | None, str]:
    """Megatron's Adam state into ``optimizer`` (by parameter, as the weights); (its lr schedule state or
    None, what the log line says)."""
    from gptrain.interop.megatron import find_megatron_iteration_dir
    from gptrain.interop.megatron_dist import is_torch_dist
    from gptrain.interop.megatron_optim import MOMENTS, read_optimizer_state
    from gptrain.train.checkpoint import init_optimizer_state

    folder, _ = find_megatron_iteration_dir(root)
    saved = read_optimizer_state(folder)
    if saved is None:
        why = "saved with --no-save-optim" if is_torch_dist(folder) else "a --ckpt-format torch optimizer is not read"
        return None, f"the checkpoint holds no optimizer state gptrain reads ({why}): the optimizer starts fresh"
    missing = sorted(set(params) - set(saved.moments))
    if missing:
        raise ValueError(f"{folder}: the optimizer state lacks {missing[:3]} ({len(missing)} in all)")
    init_optimizer_state(params, optimizer)
    for name, target in params.items():
        shape = _full_shape(name, target, layout)
        state = optimizer.state[target]
        for moment in MOMENTS:
            full = _fit_vocab_rows(name, saved.moments[name][moment].float(), shape, cfg)
            if tuple(full.shape) != shape:
                raise ValueError(f"{folder}: {name}'s {moment} is {tuple(full.shape)} in the checkpoint, {shape} here")
            copy_full_into(state[moment], full, _region(name, shape, layout))
        state["step"].fill_(float(saved.step))
    return saved.scheduler, f"optimizer state imported (Adam's moments, step {saved.step})"


@torch.no_grad()
def load_megatron(root, params: dict[str, torch.Tensor], cfg: RunConfig, layout=None, optimizer=None,
                  schedule=None) -> dict:
    """Copy a Megatron checkpoint's weights into ``params`` (plain or sharded: ``layout`` is the
    tensor-parallel ShardLayout) and, given ``optimizer``, its Adam state; returns the trainer state it
    implies (iteration, consumed samples, ``scheduler``: Megatron's lr-schedule state or None,
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
    scheduler, note = (None, "optimizer state starts fresh") if optimizer is None else \
        _load_optimizer(root, params, optimizer, cfg, layout)
    if scheduler is not None:
        note += f"; lr schedule at {scheduler.get('num_steps')} samples"
        differences = schedule_differences(scheduler, schedule) if schedule is not None else []
        if differences:
            note += f" (the run's flags kept where the checkpoint's differ: {', '.join(differences)})"
    args = ckpt.args
    return {"scheduler": scheduler, "optimizer": note, "iteration": ckpt.iteration,
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
