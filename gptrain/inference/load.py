"""A model for inference from any checkpoint gptrain reads: its own (DCP, with the run config in
``state.json``), a Megatron-LM folder (``mp_rank_XX/model_optim_rng.pt``, through the restricted
reader), or a Hugging Face GPT-2 folder (``config.json`` + ``model.safetensors``). Nothing pickled
is executed and nothing is downloaded. With a tensor-parallel mesh each rank builds the model with
the training stack's split and keeps its shards: gptrain checkpoints are read sharded by DCP (at any
saved layout), the others read whole on the CPU and cut (inference/tensor_parallel.py).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from gptrain.checkpoint_kind import checkpoint_kind
from gptrain.model.gpt import GPT, GPTConfig
from gptrain.tokenizer import GPT2Tokenizer, build_tokenizer, run_tokenizer


@dataclass
class Loaded:
    model: GPT
    tokenizer: GPT2Tokenizer
    kind: str  # "gptrain", "megatron" or "huggingface"
    name: str  # what the server calls the model
    group: object = None  # the tensor-parallel process group (None: one process)


def _inference_config(cfg: GPTConfig) -> GPTConfig:
    cfg.hidden_dropout = cfg.attention_dropout = 0.0
    return cfg


def load_for_inference(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       vocab_file: str | None = None, merge_file: str | None = None, tp_mesh=None,
                       tokenizer_type: str | None = None, tokenizer_model: str | None = None) -> Loaded:
    """The model in eval mode on ``device`` in ``dtype``; with ``tp_mesh`` (a 1-D DeviceMesh over the
    tensor-parallel ranks) this rank's shard of it. The tokenizer: the flags', else the checkpoint's."""
    path = Path(path)
    kind = checkpoint_kind(path)  # NoCheckpoint (a FileNotFoundError) where there is none
    tokenizer = None
    if vocab_file or merge_file or tokenizer_type or tokenizer_model:
        tokenizer = build_tokenizer(tokenizer_type or ("HuggingFaceTokenizer" if tokenizer_model else "GPT2BPETokenizer"),
                                    vocab_file=vocab_file, merge_file=merge_file, tokenizer_model=tokenizer_model)
    full, root = None, None  # the whole model (read on the CPU), or a gptrain checkpoint folder to read into shards
    if kind == "huggingface":  # convert's reader: its refusals and checks of the weights against config.json
        from gptrain.interop.hf import load_hf_folder

        full = load_hf_folder(path, inference=True)
        cfg = full.cfg
        if tokenizer is None and (path / "tokenizer.json").is_file() and not (path / "vocab.json").is_file():
            tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)  # a Llama folder's
    elif kind == "megatron":
        from gptrain.interop.megatron import read_megatron_checkpoint

        ckpt = read_megatron_checkpoint(path)
        cfg = _inference_config(ckpt.gpt_config(tokenizer.vocab_size if tokenizer else None))
        full = GPT.unset(cfg)
        full.load_state_dict({k: v.float() for k, v in ckpt.model_state_dict().items()}, strict=True)
    else:
        cfg, data, root = _gptrain_config(path)
        if tokenizer is None:
            tokenizer = run_tokenizer(data)
    tokenizer = tokenizer or GPT2Tokenizer()
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"{path}: the model's vocabulary has {cfg.vocab_size} tokens, the tokenizer "
                         f"{tokenizer.vocab_size} (give the checkpoint's --vocab-file and --merge-file, or "
                         "--tokenizer-type HuggingFaceTokenizer --tokenizer-model)")
    if tp_mesh is not None:
        model = _load_sharded(cfg, tp_mesh, torch.device(device), full, root)
    else:
        model = full
        if model is None and torch.device(device).type == "cuda":
            # straight onto the GPU in its dtype where the direct reader can (no CPU copy of the model)
            model = GPT.unset(cfg, device, dtype)
            if not _read_weights_directly(root, dict(model.named_parameters()), cfg.vocab_size):
                model = None
        if model is None:
            model = GPT.unset(cfg)
            params = dict(model.named_parameters())
            if not _read_weights_directly(root, params, cfg.vocab_size):
                from gptrain.train.checkpoint import load_checkpoint

                load_checkpoint(path, params, None, cfg.vocab_size, load_rng=False, path=root)
    model = model.to(device=device, dtype=dtype).eval()
    if tp_mesh is not None:
        model.tie_output_layer()
    return Loaded(model, tokenizer, kind, path.resolve().name, None if tp_mesh is None else tp_mesh.get_group())


def _read_weights_directly(folder: Path, params: dict[str, torch.Tensor], vocab_size: int) -> bool:
    """The weights of a gptrain checkpoint into ``params`` (one process, whole tensors) without
    importing DCP (``dcp_direct``); False where that reader cannot, and DCP reads them."""
    from gptrain.train.checkpoint_files import UNPADDED
    from gptrain.train.dcp_direct import UnsafeDCPMetadata, read_tensors

    targets = {}
    with torch.no_grad():
        for name, param in params.items():
            if name in UNPADDED and param.dim() == 2:  # stored at the real vocabulary's size
                param[vocab_size:].zero_()
                param = param[:vocab_size]
            targets[f"model/{name}"] = param.detach()
        try:
            return read_tensors(folder, targets)
        except UnsafeDCPMetadata:
            raise
        except Exception:  # noqa: BLE001 - a damaged file: DCP's reader says so in its own words
            return False


def check_layout(cfg: GPTConfig, tp: int) -> None:
    """The split must give every rank whole heads and an equal share of the MLP."""
    if cfg.num_attention_heads % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp}: the model's {cfg.num_attention_heads} attention heads "
                         "are not divisible by it")
    if cfg.ffn_hidden_size % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp}: the model's ffn hidden size {cfg.ffn_hidden_size} "
                         "is not divisible by it")


def _load_sharded(cfg: GPTConfig, mesh, device: torch.device, full: GPT | None, root: Path | None) -> GPT:
    from gptrain.inference.tensor_parallel import localize
    from gptrain.parallel.shards import copy_full_into
    from gptrain.parallel.tensor_parallel import apply_tensor_parallel

    tp = mesh.size()
    check_layout(cfg, tp)
    cfg = dataclasses.replace(cfg, tensor_parallel_size=tp)  # Megatron pads the vocabulary to 128 x tp
    with torch.device("meta"):
        model = GPT(cfg)
    layout = apply_tensor_parallel(model, mesh)
    model.to_empty(device=device)
    model.tie_output_layer()
    with torch.no_grad():
        if full is None:
            from gptrain.train.checkpoint import load_checkpoint

            load_checkpoint(root.parent, dict(model.named_parameters()), None, cfg.vocab_size, load_rng=False,
                            layout=layout, path=root)
        else:
            whole = dict(full.named_parameters())
            for name, param in model.named_parameters():
                source = whole[name]
                if name in ("word_embeddings.weight", "output_layer.weight"):  # re-padded for this TP size
                    padded = torch.zeros((cfg.padded_vocab_size, source.shape[1]), dtype=source.dtype)
                    padded[: cfg.vocab_size] = source[: cfg.vocab_size]
                    source = padded
                copy_full_into(param, source, layout.region(name, tuple(source.shape)))
    return localize(model.eval(), mesh.get_group())


def _gptrain_config(root: Path) -> tuple[GPTConfig, dict, Path]:
    """The architecture and data settings of the run that wrote a gptrain checkpoint, and its
    iteration folder: the tracker's, or the newest complete and intact one where that is missing
    or damaged (as training resumes, with the same warning)."""
    from gptrain.train.checkpoint_files import find_gptrain_iteration_dir

    folder = find_gptrain_iteration_dir(root)
    if folder is None:
        raise FileNotFoundError(f"{root}: no gptrain checkpoint")
    state_file = folder / "state.json"
    config = json.loads(state_file.read_text()).get("config") or {}
    if "model" not in config:
        raise ValueError(f"{state_file}: no run config (written by an older gptrain)")
    known = {f.name for f in fields(GPTConfig)}
    cfg = _inference_config(GPTConfig(**{k: v for k, v in config["model"].items() if k in known}))
    cfg.tensor_parallel_size = 1  # the padding of this process; the checkpoint stores the real rows
    return cfg, config.get("data") or {}, folder
