"""``--load`` of a Megatron-LM checkpoint folder: its weights into the run's parameters at any
gptrain layout, its iteration and consumed samples into the trainer's state.

The architecture comes from the checkpoint's ``args``: a flag that contradicts it is an error
naming both values. Optimizer state is not imported (the run says it starts the optimizer fresh).
"""
from __future__ import annotations

from pathlib import Path

import torch

from gptrain.config import RunConfig
from gptrain.parallel.shards import copy_full_into
from gptrain.checkpoint_kind import TRACKER

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


@torch.no_grad()
def load_megatron(root, params: dict[str, torch.Tensor], cfg: RunConfig, layout=None) -> dict:
    """Copy a Megatron checkpoint's weights into ``params`` (plain or sharded: ``layout`` is the
    tensor-parallel ShardLayout); returns the trainer state it implies (iteration, consumed samples)."""
    from gptrain.interop.megatron import read_megatron_checkpoint

    ckpt = read_megatron_checkpoint(root)
    where = str(Path(root) / TRACKER)
    check_architecture(ckpt.args, cfg, where)
    check_family(ckpt.gpt_config(vocab_size=cfg.model.vocab_size), cfg, f"the checkpoint's args ({where})")
    missing = sorted(set(params) - set(ckpt.state))
    if missing:
        raise ValueError(f"{root}: the Megatron checkpoint lacks {missing[:3]} ({len(missing)} in all)")
    for name, target in params.items():
        full = ckpt.state[name].float()
        shape = _full_shape(name, target, layout)
        if name in ("word_embeddings.weight", "output_layer.weight") and full.shape[0] != shape[0]:
            # another tensor-parallel padding: the real vocabulary's rows carry over, the rest is zero
            rows = min(full.shape[0], shape[0], cfg.model.padded_vocab_size)
            padded = torch.zeros(shape)
            padded[:rows] = full[:rows]
            full = padded
        if tuple(full.shape) != shape:
            raise ValueError(f"{root}: {name} is {tuple(full.shape)} in the checkpoint, {shape} here")
        copy_full_into(target, full, _region(name, shape, layout))
    args = ckpt.args
    return {"iteration": ckpt.iteration, "consumed_train_samples": int(args.get("consumed_train_samples") or 0),
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
