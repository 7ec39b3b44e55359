"""A model for inference from any checkpoint gptrain reads: its own (DCP, with the run config in
``state.json``), a Megatron-LM folder (``mp_rank_XX/model_optim_rng.pt``, through the restricted
reader), or a Hugging Face GPT-2 folder (``config.json`` + ``model.safetensors``). Nothing pickled
is executed and nothing is downloaded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from gptrain.model.gpt import GPT, GPTConfig
from gptrain.tokenizer import GPT2Tokenizer


@dataclass
class Loaded:
    model: GPT
    tokenizer: GPT2Tokenizer
    kind: str  # "gptrain", "megatron" or "huggingface"
    name: str  # what the server calls the model


def _inference_config(cfg: GPTConfig) -> GPTConfig:
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    return cfg


def load_for_inference(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       vocab_file: str | None = None, merge_file: str | None = None) -> Loaded:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    tokenizer = GPT2Tokenizer(vocab_file, merge_file) if vocab_file or merge_file else None
    if (path / "config.json").is_file():
        model = _load_hf(path)
        kind = "huggingface"
    else:
        from gptrain.train.megatron_load import is_megatron_checkpoint

        if is_megatron_checkpoint(path):
            from gptrain.interop.megatron import read_megatron_checkpoint

            ckpt = read_megatron_checkpoint(path)
            cfg = _inference_config(ckpt.gpt_config(tokenizer.vocab_size if tokenizer else None))
            model = GPT(cfg)
            model.load_state_dict({k: v.float() for k, v in ckpt.model_state_dict().items()}, strict=True)
            kind = "megatron"
        else:
            model, data = _load_gptrain(path)
            kind = "gptrain"
            if tokenizer is None and data.get("vocab_file"):
                tokenizer = GPT2Tokenizer(data["vocab_file"], data.get("merge_file"))
    tokenizer = tokenizer or GPT2Tokenizer()
    if tokenizer.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"{path}: the model's vocabulary has {model.cfg.vocab_size} tokens, the tokenizer "
                         f"{tokenizer.vocab_size} (give the checkpoint's --vocab-file and --merge-file)")
    model = model.to(device=device, dtype=dtype).eval()
    return Loaded(model, tokenizer, kind, path.resolve().name)


def _load_gptrain(root: Path) -> tuple[GPT, dict]:
    from gptrain.train.checkpoint import iteration_dir, load_checkpoint, read_tracker

    iteration = read_tracker(root)
    if iteration is None:
        raise FileNotFoundError(f"{root}: neither a gptrain/Megatron checkpoint (no latest_checkpointed_iteration.txt) "
                                "nor a Hugging Face folder (no config.json)")
    state_file = iteration_dir(root, iteration) / "state.json"
    if not state_file.is_file():
        raise FileNotFoundError(f"{state_file}: missing (not a gptrain checkpoint)")
    config = json.loads(state_file.read_text()).get("config") or {}
    if "model" not in config:
        raise ValueError(f"{state_file}: no run config (written by an older gptrain)")
    known = {f.name for f in fields(GPTConfig)}
    cfg = _inference_config(GPTConfig(**{k: v for k, v in config["model"].items() if k in known}))
    cfg.tensor_parallel_size = 1  # the padding of this process; the checkpoint stores the real rows
    model = GPT(cfg)
    load_checkpoint(root, dict(model.named_parameters()), None, cfg.vocab_size, load_rng=False)
    return model, config.get("data") or {}


def _load_hf(folder: Path) -> GPT:
    """GPT-2 in transformers' layout (``GPT2LMHeadModel`` / ``GPT2Model`` weights)."""
    from safetensors.torch import load_file

    from gptrain.interop.hf import from_hf_state_dict

    hf = json.loads((folder / "config.json").read_text())
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{folder}/config.json: model_type {hf.get('model_type')!r}; only gpt2 is supported")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"{folder}/config.json: activation_function {hf['activation_function']!r}; "
                         "gptrain's MLP is the tanh GELU (gelu_new)")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: missing (only safetensors weights are read, never pickles)")
    n_embd = hf.get("n_embd", 768)
    cfg = _inference_config(GPTConfig(
        num_layers=hf.get("n_layer", 12), hidden_size=n_embd, num_attention_heads=hf.get("n_head", 12),
        ffn_hidden_size=hf.get("n_inner") or 4 * n_embd, seq_length=hf.get("n_positions", 1024),
        max_position_embeddings=hf.get("n_positions", 1024), vocab_size=hf.get("vocab_size", 50257),
        layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5)))
    state = {k: v.float() for k, v in load_file(weights).items() if not k.endswith((".attn.bias", ".masked_bias"))}
    return from_hf_state_dict(state, cfg)
