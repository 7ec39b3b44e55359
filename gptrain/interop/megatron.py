"""Read Megatron-LM checkpoints (``--ckpt-format torch``: ``model_optim_rng.pt`` per rank; torch_dist
through :mod:`gptrain.interop.megatron_dist`) into full gptrain tensors, without importing Megatron
and without running code named by the pickle.

Each rank's file is loaded through the restricted unpickler (:mod:`gptrain.interop.safe_unpickle`),
its storages on the meta device: only the bytes of the tensors that become gptrain parameters are
read, so the optimizer state a checkpoint may also hold costs no memory. Nothing is written next
to the checkpoint.

The keys of megatron-core's ``GPTModel`` and of the legacy GPT model map to gptrain's names
(:mod:`gptrain.interop.megatron_keys`); tensor-parallel shards are concatenated, pipeline stages
(and virtual-pipeline chunks, ``model0``, ``model1``, ...) merged with stage-local layer numbers
made global, and the result checked against the checkpoint's ``args``.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from gptrain.checkpoint_kind import TRACKER as TRACKER_FILENAME  # the one name, Megatron's
from gptrain.interop.megatron_dist import BACKEND_FILE, is_torch_dist, read_torch_dist
from gptrain.interop import megatron_llama as llama
from gptrain.interop.megatron_keys import flatten, layout_of, legacy_qkv_to_per_head, map_key, merge_shards
from gptrain.interop.safe_unpickle import load_pickle_lazily

CHECKPOINT_FILENAME = "model_optim_rng.pt"

__all__ = ["MegatronCheckpoint", "find_megatron_iteration_dir", "read_megatron_checkpoint"]


# ----------------------------------------------------------------------------------------------
# locating a checkpoint


_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def _iteration_dir(root: Path, iteration) -> Path:
    return root / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")


def _available(root: Path) -> str:
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and (_ITER_DIR.match(p.name) or p.name == "release"))
    return ", ".join(found) if found else "none"


def _normalize_iteration(iteration, where) -> int | str:
    if isinstance(iteration, bool):
        raise ValueError(f"{where}: iteration must be a number or 'release', got {iteration!r}")
    if isinstance(iteration, int):
        if iteration < 0:
            raise ValueError(f"{where}: iteration must be >= 0, got {iteration}")
        return iteration
    text = str(iteration).strip()
    if text == "release":
        return "release"
    if text.isdigit():
        return int(text)
    raise ValueError(f"{where}: iteration must be a number or 'release', got {iteration!r}")


def find_megatron_iteration_dir(root, iteration: int | str | None = None) -> tuple[Path, int | str]:
    """The folder holding one iteration's ``mp_rank_*`` folders, and that iteration.

    ``root`` is what Megatron's ``--load`` names: the iteration comes from ``iteration`` (like
    ``--ckpt-step``: a number or ``'release'``), else from ``latest_checkpointed_iteration.txt``
    (a number or ``release``), else (no tracker) the latest ``iter_XXXXXXX`` folder or ``release``.
    ``root`` may also be an iteration folder itself (``.../iter_0000020``).
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such checkpoint directory")
    if is_torch_dist(root) or any(p.name.startswith("mp_rank_") for p in root.iterdir()):  # an iteration folder
        m = _ITER_DIR.match(root.name)
        found = int(m.group(1)) if m else ("release" if root.name == "release" else root.name)
        if iteration is not None and _normalize_iteration(iteration, root) != found:
            raise ValueError(f"{root}: is the folder of iteration {found}, not {iteration!r}")
        return root, found
    if iteration is not None:
        it = _normalize_iteration(iteration, root)
        folder = _iteration_dir(root, it)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: no checkpoint of iteration {it} (available: {_available(root)})")
        return folder, it
    tracker = root / TRACKER_FILENAME
    if tracker.is_file():
        text = tracker.read_text().strip()
        try:
            it = _normalize_iteration(text, tracker)
        except ValueError:
            raise ValueError(f"{tracker}: expected an iteration number or 'release', got {text!r}") from None
        folder = _iteration_dir(root, it)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: missing, though {tracker} names iteration {it}")
        return folder, it
    iters = sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _ITER_DIR.match(p.name)))
    if iters:
        return _iteration_dir(root, iters[-1]), iters[-1]
    if (root / "release").is_dir():
        return root / "release", "release"
    raise FileNotFoundError(f"{root}: no {TRACKER_FILENAME}, iter_XXXXXXX/ or release/ folder: "
                            f"not a Megatron checkpoint")


# ----------------------------------------------------------------------------------------------
# reading a whole checkpoint


@dataclass
class MegatronCheckpoint:
    args: dict
    iteration: int | str
    state: dict[str, torch.Tensor]
    checkpoint_version: float | None
    layout: str
    tp: int
    pp: int
    output_layer_matches_embeddings: bool | None

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """``state`` plus the tied ``output_layer.weight``, for ``GPT.load_state_dict(strict=True)``."""
        if "output_layer.weight" in self.state:  # untied: its own
            return dict(self.state)
        return {**self.state, "output_layer.weight": self.state["word_embeddings.weight"]}

    def gpt_config(self, vocab_size: int | None = None, **overrides):
        """A ``GPTConfig`` describing this checkpoint. ``vocab_size`` (the unpadded vocabulary) comes
        from ``args`` for Megatron's NullTokenizer (``--vocab-size`` + 1) and GPT2BPETokenizer (50257);
        give it for other tokenizers. Its padding must give the checkpoint's embedding rows."""
        from gptrain.model.gpt import GPTConfig

        a = self.args
        if vocab_size is None:
            tok = a.get("tokenizer_type")
            if tok == "NullTokenizer" and isinstance(a.get("vocab_size"), int):
                vocab_size = a["vocab_size"] + 1
            elif tok in ("GPT2BPETokenizer", None):
                vocab_size = 50257
            else:
                raise ValueError(f"give vocab_size: the checkpoint's tokenizer {tok!r} does not say it")
        hidden = self.state["word_embeddings.weight"].shape[1]
        fc1 = self.state.get("layers.0.mlp.fc1.weight", self.state.get("layers.0.mlp.up.weight"))
        positions = self.state.get("position_embeddings.weight")
        max_pos = positions.shape[0] if positions is not None else a.get("max_position_embeddings") or a["seq_length"]
        cfg = dict(
            num_layers=a["num_layers"], hidden_size=hidden, num_attention_heads=a["num_attention_heads"],
            ffn_hidden_size=fc1.shape[0], seq_length=a.get("seq_length") or max_pos, max_position_embeddings=max_pos,
            vocab_size=vocab_size, make_vocab_size_divisible_by=a.get("make_vocab_size_divisible_by") or 128,
            tensor_parallel_size=self.tp,
            layernorm_epsilon=a.get("norm_epsilon") or a.get("layernorm_epsilon") or 1e-5,
        )
        cfg.update(llama.family(a))
        for name in ("init_method_std", "attention_dropout", "hidden_dropout"):
            if isinstance(a.get(name), float):
                cfg[name] = a[name]
        cfg.update(overrides)
        config = GPTConfig(**cfg)
        rows = self.state["word_embeddings.weight"].shape[0]
        if config.padded_vocab_size != rows:
            raise ValueError(f"vocab_size {vocab_size} pads to {config.padded_vocab_size}, but the "
                             f"checkpoint's word embeddings have {rows} rows")
        return config


def _args_dict(obj) -> dict:
    if isinstance(obj, argparse.Namespace):
        return dict(vars(obj))
    if isinstance(obj, dict):
        return dict(obj)
    return {}


def check_supported(args: dict, where) -> None:
    """Refuse architectures gptrain's GPT cannot represent (one line naming the option)."""
    problems = llama.unsupported(args)  # the Llama family's options are read (megatron_llama)
    if args.get("num_experts"):
        problems.append(f"--num-experts {args['num_experts']}")
    if args.get("multi_latent_attention"):
        problems.append("--multi-latent-attention")
    if args.get("qk_layernorm"):
        problems.append("--qk-layernorm")
    if args.get("squared_relu"):
        problems.append("--squared-relu")
    if problems:
        raise ValueError(f"{where}: gptrain's GPT does not support {', '.join(problems)}")


def _rank_file(folder: Path, tp_rank: int, pp_rank: int, pp: int) -> Path:
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return folder / name / CHECKPOINT_FILENAME


_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?$")


def read_megatron_checkpoint(root, iteration=None, *, overrides: dict | None = None) -> MegatronCheckpoint:
    """Read every rank of one Megatron checkpoint into full tensors in gptrain's names.

    ``overrides`` fill or replace ``args`` entries (a release checkpoint without ``args`` needs at
    least ``num_attention_heads`` for a legacy QKV reorder; tensor/pipeline sizes are otherwise
    taken from the ``mp_rank_*`` folders).
    """
    folder, it = find_megatron_iteration_dir(root, iteration)
    if is_torch_dist(folder):
        ckpt = read_torch_dist(folder, it)
        if overrides:
            ckpt.args.update(overrides)
        return ckpt
    entries = [p.name for p in folder.iterdir() if p.is_dir()]
    if not any(n.startswith("mp_rank_") for n in entries):
        if (folder / BACKEND_FILE).is_file():
            raise ValueError(f"{folder}: a distributed checkpoint of another backend ({BACKEND_FILE}: "
                             f"{(folder / BACKEND_FILE).read_text()[:120].strip()}); only torch_dist and "
                             f"--ckpt-format torch (mp_rank_XX/{CHECKPOINT_FILENAME}) are read")
        raise FileNotFoundError(f"{folder}: no mp_rank_XX folders and no torch_dist {BACKEND_FILE}")
    ranks = [m for n in entries if (m := _RANK_DIR.match(n))]
    if any(m.group(3) for m in ranks):
        raise ValueError(f"{folder}: expert-parallel (mp_rank_XX_YYY_ZZZ) checkpoints are not supported")
    staged = any(m.group(2) is not None for m in ranks)

    first_path = folder / ("mp_rank_00_000" if staged else "mp_rank_00") / CHECKPOINT_FILENAME
    if not first_path.is_file():
        raise FileNotFoundError(f"{first_path}: missing (the first rank's checkpoint file)")
    first, first_lazy = load_pickle_lazily(first_path)
    if not isinstance(first, dict):
        raise ValueError(f"{first_path}: holds a {type(first).__name__}, not Megatron's checkpoint dict")
    args = _args_dict(first.get("args"))
    args.update(overrides or {})
    tp = int(args.get("tensor_model_parallel_size") or 1 + max(int(m.group(1)) for m in ranks))
    pp = int(args.get("pipeline_model_parallel_size")
             or (1 + max(int(m.group(2)) for m in ranks if m.group(2)) if staged else 1))
    if staged != (pp > 1):
        raise FileNotFoundError(f"{_rank_file(folder, 0, 0, pp)}: missing: args say tensor parallel "
                                f"{tp} x pipeline {pp}, the folder has {', '.join(sorted(entries))}")
    check_supported(args, first_path)
    version = first.get("checkpoint_version")
    heads = args.get("num_attention_heads")

    # per (chunk, stage): {gptrain name with local layer index: [tensor per tp rank]}
    chunks: dict[tuple[int, int], dict[tuple[str, int | None], list]] = {}
    rules: dict[str, str] = {}
    layout = None
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            path = _rank_file(folder, tp_rank, pp_rank, pp)
            if path == first_path:
                sd, lazy = first, first_lazy
            else:
                if not path.is_file():
                    raise FileNotFoundError(f"{path}: missing: the checkpoint's args say tensor parallel "
                                            f"{tp} x pipeline {pp}")
                sd, lazy = load_pickle_lazily(path)
                if not isinstance(sd, dict):
                    raise ValueError(f"{path}: holds a {type(sd).__name__}, not Megatron's checkpoint dict")
            models = {k: v for k, v in sd.items() if isinstance(k, str) and re.fullmatch(r"model\d*", k)}
            if not models:
                raise ValueError(f"{path}: no 'model' entry (keys: {sorted(map(str, sd))[:8]})")
            for model_key, model in models.items():
                chunk = int(model_key[5:] or 0)
                flat = flatten(model)
                try:
                    this_layout = layout_of(flat)
                except ValueError as e:
                    raise ValueError(f"{path}: {e}") from None
                if layout is None:
                    layout = this_layout
                elif this_layout != layout:
                    raise ValueError(f"{path}: {this_layout} keys, but other ranks are {layout}")
                if layout == "legacy" and (version is None or version < 2.0) and llama.groups_of(args) != heads:
                    raise ValueError(f"{path}: checkpoint_version {version} with grouped-query attention: "
                                     "no known QKV order")
                if layout == "legacy" and version is not None and version < 2.0 and not heads:
                    raise ValueError(f"{path}: checkpoint_version {version} needs num_attention_heads "
                                     f"to reorder QKV; pass overrides={{'num_attention_heads': N}}")
                bucket = chunks.setdefault((chunk, pp_rank), {})
                for key, value in flat.items():
                    try:
                        mapped = map_key(key, layout)
                    except KeyError:
                        raise ValueError(f"{path}: unsupported model key {key!r} (gptrain's GPT has no "
                                         f"such parameter)") from None
                    if mapped is None or not isinstance(value, torch.Tensor):
                        continue
                    name, layer, rule = mapped
                    untied = args.get("untie_embeddings_and_output_weights")
                    if name == "untied_output_layer.weight":
                        if not untied:
                            raise ValueError(f"{path}: an untied output layer ({key}), but args do not say "
                                             "--untie-embeddings-and-output-weights")
                        name = "output_layer.weight"
                    if name.startswith("mlp.fc1.") and args.get("swiglu"):
                        rule = llama.GLU  # [gate_i; up_i] per rank
                    shards = bucket.setdefault((name, layer), [None] * tp)
                    if shards[tp_rank] is not None:
                        raise ValueError(f"{path}: two keys map to {name} (layer {layer})")
                    t = lazy.materialize(value)
                    if rule == "qkv" and (version is None or version < 2.0):
                        t = legacy_qkv_to_per_head(t, 0.0 if version is None else float(version), heads // tp)
                    shards[tp_rank] = t
                    rules[name] = rule
            lazy.close()
            del sd, lazy
    del first
    state: dict[str, torch.Tensor] = {}
    output_copy = None
    offset = 0
    vp = max(c for c, _ in chunks) + 1
    for chunk in range(vp):
        for pp_rank in range(pp):
            bucket = chunks.get((chunk, pp_rank), {})
            local = sorted({layer for _, layer in bucket if layer is not None})
            if local and local != list(range(local[0], local[0] + len(local))):
                raise ValueError(f"{folder}: stage {pp_rank} holds non-contiguous layers {local}")
            if local and local[0] not in (0, offset):
                raise ValueError(f"{folder}: stage {pp_rank} starts at layer {local[0]}, expected 0 "
                                 f"(stage-local) or {offset} (global)")
            shift = offset if local and local[0] == 0 else 0
            for (name, layer), shards in bucket.items():
                missing = [r for r, s in enumerate(shards) if s is None]
                if missing:
                    raise FileNotFoundError(
                        f"{_rank_file(folder, missing[0], pp_rank, pp)}: lacks {name} that rank 0 of the "
                        f"same stage has")
                rule = rules[name]
                full = llama.merge_glu(shards) if rule == llama.GLU else merge_shards(shards, rule, name, folder)
                if name == "output_layer.weight" and not args.get("untie_embeddings_and_output_weights"):
                    output_copy = full
                    continue
                gname = f"layers.{layer + shift}.{name}" if layer is not None else name
                if gname in state:
                    if name.startswith(("word_embeddings", "position_embeddings", "output_layer")):
                        continue  # a later chunk's copy (embeddings live on the first stage)
                    raise ValueError(f"{folder}: {gname} appears on two pipeline stages")
                state[gname] = full
            offset += len(local)

    finish_state(state, args, folder, tp, pp, offset)
    emb = state["word_embeddings.weight"]

    matches = None
    if output_copy is not None:
        matches = bool(output_copy.shape == emb.shape and torch.equal(output_copy, emb))
    return MegatronCheckpoint(args=args, iteration=it, state=state,
                              checkpoint_version=None if version is None else float(version),
                              layout=layout, tp=tp, pp=pp, output_layer_matches_embeddings=matches)


def finish_state(state: dict[str, torch.Tensor], args: dict, folder, tp: int, pp: int,
                 layers_found: int | None = None) -> None:
    """Check a read checkpoint's tensors against its ``args`` (every parameter present, shapes as the
    args say) and fill the ``args`` a checkpoint may lack from the tensors."""
    offset = layers_found if layers_found is not None else len(
        {int(k.split(".")[1]) for k in state if k.startswith("layers.")})
    heads = args.get("num_attention_heads")
    num_layers = args.get("num_layers")
    if num_layers is None:
        args["num_layers"] = num_layers = offset
    if offset != num_layers:
        raise ValueError(f"{folder}: the stages hold {offset} layers, args say num_layers {num_layers}")
    required = llama.required(args, num_layers)
    missing = [n for n in required if n not in state]
    if missing:
        raise ValueError(f"{folder}: no tensor for {missing[0]}" +
                         (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(state) - set(required))
    if extra:
        raise ValueError(f"{folder}: {extra[0]} is in the checkpoint, but its args (normalization, biases, "
                         "position embeddings) leave no place for it in gptrain's GPT")
    emb = state["word_embeddings.weight"]
    swiglu = bool(args.get("swiglu"))
    checks = [("hidden_size", emb.shape[1]), ("padded_vocab_size", emb.shape[0]),
              ("ffn_hidden_size", state["layers.0.mlp.fc1.weight"].shape[0] // (2 if swiglu else 1))]
    if "position_embeddings.weight" in state:
        checks.append(("max_position_embeddings", state["position_embeddings.weight"].shape[0]))
    for key, value in checks:
        if args.get(key) is None:
            args[key] = value
        elif args[key] != value:
            raise ValueError(f"{folder}: args say {key} {args[key]}, the tensors say {value}")
    args.setdefault("tensor_model_parallel_size", tp)
    args.setdefault("pipeline_model_parallel_size", pp)
    if heads:
        kv = args.get("kv_channels") or emb.shape[1] // heads
        groups = llama.groups_of(args)
        rows = state["layers.0.attn.qkv.weight"].shape[0]
        if (args.get("kv_channels") is None and emb.shape[1] % heads) or rows != (heads + 2 * groups) * kv:
            raise ValueError(f"{folder}: fused QKV has {rows} rows, expected ({heads} heads + 2 x {groups} K/V "
                             f"groups) x {kv} channels")
    if swiglu:
        llama.split_fc1(state, num_layers)

