"""Weights between gptrain's GPT and Hugging Face ``transformers`` ``GPT2LMHeadModel``, both ways
(``LlamaForCausalLM`` for the Llama-style layers: interop/hf_llama.py, chosen here by config).

HF's GPT-2 stores linear weights as ``Conv1D`` (input x output), so every matrix is transposed;
its fused QKV is ordered ``[3, heads, head_dim]`` where gptrain (like Megatron) uses per-head
``[heads, 3, head_dim]``, so those rows are permuted; its vocabulary is unpadded, so the padded rows
of gptrain's embedding are dropped (export) or zero-filled (import).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from gptrain.interop import hf_llama
from gptrain.model.gpt import GPT, GPTConfig

_LAYER_MAP = {  # gptrain name -> (HF name, transposed)
    "ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True), "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
    "mlp.fc1.weight": ("mlp.c_fc.weight", True), "mlp.fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.fc2.weight": ("mlp.c_proj.weight", True), "mlp.fc2.bias": ("mlp.c_proj.bias", False),
}


def qkv_to_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Fused QKV rows (weight or bias, rows first) from [3, heads, dim] to [heads, 3, dim]."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def qkv_from_per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Fused QKV rows from [heads, 3, dim] back to [3, heads, dim]."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def hf_config_kwargs(cfg: GPTConfig) -> dict:
    """Arguments for ``transformers.GPT2Config`` describing the same architecture."""
    return dict(vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
                n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_hidden_size,
                activation_function="gelu_new", layer_norm_epsilon=cfg.layernorm_epsilon,
                resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout,
                initializer_range=cfg.init_method_std, tie_word_embeddings=True)


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    if not model.cfg.gpt2_layout:
        return hf_llama.to_llama_state_dict(model)
    cfg, sd = model.cfg, model.state_dict()
    out = {
        "transformer.wte.weight": sd["word_embeddings.weight"][: cfg.vocab_size].clone(),
        "transformer.wpe.weight": sd["position_embeddings.weight"].clone(),
        "transformer.ln_f.weight": sd["final_layernorm.weight"].clone(),
        "transformer.ln_f.bias": sd["final_layernorm.bias"].clone(),
    }
    for i in range(cfg.num_layers):
        for ours, (theirs, transposed) in _LAYER_MAP.items():
            t = sd[f"layers.{i}.{ours}"]
            if ours.startswith("attn.qkv."):
                t = qkv_from_per_head(t, cfg.num_attention_heads)
            out[f"transformer.h.{i}.{theirs}"] = (t.t() if transposed else t).contiguous().clone()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], cfg: GPTConfig, where: str = "the weights") -> GPT:
    """A gptrain GPT holding the weights of a HF GPT-2 state dict (``transformer.`` prefix optional):
    every tensor used and every parameter found (check_hf_weights), an lm_head equal to the word
    embeddings (tied) or absent."""
    check_hf_weights({k: tuple(v.shape) for k, v in hf_sd.items()}, cfg, where)
    if not cfg.gpt2_layout:
        return hf_llama.from_llama_state_dict(hf_sd, cfg, where)
    sd = {_canonical(k): v for k, v in hf_sd.items() if not k.endswith(_SKIPPED)}
    wte = sd["transformer.wte.weight"]
    if "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"].to(wte.dtype), wte):
        raise ValueError(f"{where}: lm_head.weight differs from transformer.wte.weight (an untied output layer); "
                         "gptrain's output layer is the word embeddings")
    model = GPT.unset(cfg)  # every weight loaded below (strict)
    word = torch.zeros(cfg.padded_vocab_size, cfg.hidden_size, dtype=wte.dtype)
    word[: cfg.vocab_size] = wte
    ours = {"word_embeddings.weight": word, "position_embeddings.weight": sd["transformer.wpe.weight"],
            "final_layernorm.weight": sd["transformer.ln_f.weight"], "final_layernorm.bias": sd["transformer.ln_f.bias"]}
    for i in range(cfg.num_layers):
        for name, (theirs, transposed) in _LAYER_MAP.items():
            t = sd[f"transformer.h.{i}.{theirs}"]
            t = t.t().contiguous() if transposed else t
            ours[f"layers.{i}.{name}"] = qkv_to_per_head(t, cfg.num_attention_heads) if name.startswith("attn.qkv.") else t
    ours["output_layer.weight"] = word  # the same parameter (tied)
    model.load_state_dict(ours, strict=True)
    return model


HF_WEIGHTS = "model.safetensors"
_SKIPPED = (".attn.bias", ".attn.masked_bias") + hf_llama.SKIPPED  # buffers some exports carry


def hf_config_dict(cfg: GPTConfig, eod: int) -> dict:
    """``config.json`` of transformers' GPT-2 (or Llama) for ``cfg`` (written without importing transformers)."""
    if not cfg.gpt2_layout:
        problems = hf_llama.llama_problems(cfg)
        if problems:
            raise ValueError("neither GPT-2 nor Llama can hold this architecture: " + "; ".join(problems))
        return hf_llama.llama_config_dict(cfg, eod, eod)
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **hf_config_kwargs(cfg),
            "bos_token_id": eod, "eos_token_id": eod, "torch_dtype": "float32"}


_REQUIRED = object()


def _setting(hf: dict, key: str, kind: str, where: str, default=_REQUIRED):
    """``hf[key]`` checked to be of ``kind`` (count: a positive integer; number: a finite number >= 0;
    flag: true/false; text: a string); a missing required key or a wrong type is one line naming both."""
    if key not in hf or (hf[key] is None and default is not _REQUIRED):
        if default is _REQUIRED:
            raise ValueError(f"{where}: no {key!r} (a GPT-2 config.json gives n_layer, n_embd, n_head, n_positions "
                             "and vocab_size)")
        return default
    v = hf[key]
    ok = {"count": lambda: isinstance(v, int) and not isinstance(v, bool) and v > 0,
          "number": lambda: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf"),
          "flag": lambda: isinstance(v, bool),
          "text": lambda: isinstance(v, str)}[kind]()
    if not ok:
        expected = {"count": "a positive integer", "number": "a number >= 0", "flag": "true or false",
                    "text": "a string"}[kind]
        raise ValueError(f"{where}: {key} is {json.dumps(v)}; expected {expected}")
    return v


def gpt_config_from_hf(hf: dict, where: str) -> GPTConfig:
    """The GPTConfig of a transformers GPT-2 ``config.json`` (dict); anything gptrain cannot
    represent, a missing architecture key or a value of the wrong type is an error naming the key."""
    if not isinstance(hf, dict):
        raise ValueError(f"{where}: not a JSON object of GPT-2 settings")
    if _setting(hf, "model_type", "text", where, "gpt2") == "llama":
        try:
            return hf_llama.gpt_config_from_llama(hf, where, _setting)
        except (TypeError, ValueError) as err:
            raise ValueError(err if str(err).startswith(where) else f"{where}: {err}") from None
    if _setting(hf, "model_type", "text", where, "gpt2") != "gpt2":
        raise ValueError(f"{where}: model_type {hf.get('model_type')!r}; only gpt2 and llama are supported")
    if _setting(hf, "activation_function", "text", where, "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"{where}: activation_function {hf['activation_function']!r}; gptrain's MLP is the tanh "
                         "GELU (gelu_new)")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if _setting(hf, key, "flag", where, False):
            raise ValueError(f"{where}: {key} is set; gptrain's GPT-2 does not implement it")
    if _setting(hf, "scale_attn_weights", "flag", where, True) is False:
        raise ValueError(f"{where}: scale_attn_weights is false; gptrain's attention scales by 1/sqrt(head dim)")
    if _setting(hf, "tie_word_embeddings", "flag", where, True) is False:
        raise ValueError(f"{where}: tie_word_embeddings is false; gptrain's output layer is the word embeddings")
    n_embd, n_positions = _setting(hf, "n_embd", "count", where), _setting(hf, "n_positions", "count", where)
    try:
        return GPTConfig(
            num_layers=_setting(hf, "n_layer", "count", where), hidden_size=n_embd,
            num_attention_heads=_setting(hf, "n_head", "count", where),
            ffn_hidden_size=_setting(hf, "n_inner", "count", where, 4 * n_embd), seq_length=n_positions,
            max_position_embeddings=n_positions, vocab_size=_setting(hf, "vocab_size", "count", where),
            layernorm_epsilon=_setting(hf, "layer_norm_epsilon", "number", where, 1e-5),
            init_method_std=_setting(hf, "initializer_range", "number", where, 0.02),
            hidden_dropout=_setting(hf, "resid_pdrop", "number", where, 0.1),
            attention_dropout=_setting(hf, "attn_pdrop", "number", where, 0.1))
    except (TypeError, ValueError) as err:
        if str(err).startswith(where):
            raise
        raise ValueError(f"{where}: {err}") from None


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                         f"{what}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text; {what}") from None


def read_hf_config(folder: str | os.PathLike) -> GPTConfig:
    """The architecture of a Hugging Face GPT-2 folder, from its ``config.json``: the one reader of it
    (convert, --load, generate, serve and megatron-scripts all come here)."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config}: missing (not a Hugging Face model folder)")
    return gpt_config_from_hf(_read_json(config, "a Hugging Face config.json is a JSON object"), str(config))


def expected_hf_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``cfg``'s GPT2LMHeadModel (or LlamaForCausalLM) as its safetensors hold it (a tied
    lm_head aside)."""
    if not cfg.gpt2_layout:
        return hf_llama.expected_llama_shapes(cfg)
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    out = {"transformer.wte.weight": (v, h), "transformer.wpe.weight": (cfg.max_position_embeddings, h),
           "transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)}
    layer = {"ln_1.weight": (h,), "ln_1.bias": (h,), "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,),
             "attn.c_proj.weight": (h, h), "attn.c_proj.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
             "mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,), "mlp.c_proj.weight": (f, h), "mlp.c_proj.bias": (h,)}
    for i in range(cfg.num_layers):
        out.update({f"transformer.h.{i}.{name}": shape for name, shape in layer.items()})
    return out


def _canonical(name: str) -> str:
    return name if name.startswith(("transformer.", "lm_head.", "model.")) else f"transformer.{name}"


def _natural(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _some(items: list[str], at_most: int = 4) -> str:
    return ", ".join(items[:at_most]) + (f" and {len(items) - at_most} more ({len(items)} in all)"
                                         if len(items) > at_most else "")


def check_hf_weights(shapes: dict[str, tuple[int, ...]], cfg: GPTConfig, where: str) -> None:
    """Every tensor of the files (``shapes``: name -> shape) is a parameter of ``cfg``'s model at its
    shape, and every parameter is there; else one line naming the missing, leftover and misshapen ones."""
    expected = expected_hf_shapes(cfg)
    given = {_canonical(k): (k, tuple(s)) for k, s in shapes.items() if not k.endswith(_SKIPPED)}
    head = given.pop("lm_head.weight", None) if "lm_head.weight" not in expected else None
    embeddings = expected.get("transformer.wte.weight", expected.get("model.embed_tokens.weight"))
    if head is not None and head[1] != embeddings:
        given["lm_head.weight"] = head  # reported below as not used
    problems = []
    layers = {int(n.split(".")[2]) for n in given if re.fullmatch(r"(transformer\.h|model\.layers)\.\d+\..+", n)}
    if layers and max(layers) + 1 != cfg.num_layers:
        problems.append(f"config.json says n_layer {cfg.num_layers}, the weights hold {max(layers) + 1} layers")
    missing = sorted(set(expected) - set(given), key=_natural)
    if missing:
        problems.append(f"missing {_some(missing)}")
    leftover = sorted((given[n][0] for n in set(given) - set(expected)), key=_natural)
    if leftover:
        problems.append(f"not used {_some(leftover)}")
    wrong = sorted((n for n in set(given) & set(expected) if given[n][1] != expected[n]), key=_natural)
    if wrong:
        problems.append("other shapes: " + _some([f"{given[n][0]} {list(given[n][1])} (config.json: "
                                                  f"{list(expected[n])})" for n in wrong]))
    if problems:
        raise ValueError(f"{where}: the weights do not match config.json: " + "; ".join(problems))


def _shard_files(folder: Path, index: Path) -> list[Path]:
    """The shard files a ``model.safetensors.index.json`` names: plain file names of regular files in
    ``folder`` (no path separators, no ``..``, no symbolic links)."""
    data = _read_json(index, "a sharded model's index is a JSON object with a weight_map")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: no weight_map (tensor name -> shard file name)")
    files = []
    for name in sorted(set(weight_map.values())):
        path = folder / name
        if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
            raise ValueError(f"{index} names shard {name!r}: a shard must be a plain file name inside {folder}")
        if path.is_symlink():
            raise ValueError(f"{index} names shard {name}, a symbolic link: shards must be files inside {folder} "
                             "(copy a Hugging Face cache snapshot with cp -rL first)")
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing (named by {index.name})")
        files.append(path)
    return files


def _weight_files(folder: Path) -> list[Path]:
    index = folder / f"{HF_WEIGHTS}.index.json"
    if (folder / HF_WEIGHTS).is_file():
        return [folder / HF_WEIGHTS]
    if index.is_file():
        return _shard_files(folder, index)
    pickled = " (pytorch_model.bin is a pickle and is not read: save the model with safetensors)" \
        if (folder / "pytorch_model.bin").exists() else ""
    raise FileNotFoundError(f"{folder / HF_WEIGHTS}: missing{pickled}")


def load_hf_folder(path, inference: bool = False) -> GPT:
    """A gptrain GPT (fp32, on the CPU) from a Hugging Face GPT-2 folder: ``config.json`` and
    ``model.safetensors`` (or its sharded index). Pickled weights (``pytorch_model.bin``) are refused;
    the tensors' names and shapes are checked against the config (from the files' headers) before
    anything is read. ``inference``: dropout off."""
    from safetensors import SafetensorError, safe_open

    folder = Path(path)
    cfg = read_hf_config(folder)
    if inference:
        cfg.hidden_dropout = cfg.attention_dropout = 0.0
    files = _weight_files(folder)
    shapes: dict[str, tuple[int, ...]] = {}
    origin: dict[str, Path] = {}
    try:
        for f in files:
            with safe_open(f, "pt") as s:
                for k in s.keys():
                    if k in origin:
                        raise ValueError(f"{folder}: tensor {k} is in both {origin[k].name} and {f.name}")
                    origin[k], shapes[k] = f, tuple(s.get_slice(k).get_shape())
        check_hf_weights(shapes, cfg, str(folder))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(f, "pt") as s:
                state.update({k: s.get_tensor(k).float() for k in s.keys() if not k.endswith(_SKIPPED)})
    except SafetensorError as err:
        raise ValueError(f"{folder}: a weight file is not readable safetensors ({err})") from None
    return from_hf_state_dict(state, cfg, str(folder))
