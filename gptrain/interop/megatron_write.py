"""Write Megatron-LM checkpoints from gptrain weights (``gptrain convert --to megatron``).

Two formats, both with megatron-core's ``GPTModel`` names (the layer spec of ``--transformer-impl
local``, ``get_gpt_layer_local_spec()``):

* ``torch_dist`` (Megatron's default ``--ckpt-format``): one ``torch.distributed.checkpoint`` folder
  per iteration written by a single process (``no_dist``), holding the keys megatron-core's
  ``GPTModel.sharded_state_dict()`` asks for: every tensor at its global shape (the layout of the
  run that loads it does not matter), the per-layer tensors of ``decoder.layers.*`` stacked on a
  leading layer dimension under the sharded names of the local spec (the LayerNorms as
  ``self_attention.linear_qkv.layer_norm_*`` and ``mlp.linear_fc1.layer_norm_*``), the linear
  layers' ``_extra_state`` objects (``None``), the word embeddings padded as Megatron pads them for
  the target TP (``make_vocab_size_divisible_by`` x TP, zero rows), ``metadata.json`` naming the
  backend, and Megatron's common state (``args``, ``iteration``, ``checkpoint_version``) twice: as
  ``common.pt`` (read by megatron-core's ``dist_checkpointing.load``) and as the
  ``common_state/shard_0_1`` byte entry that Megatron-LM of today writes.
* ``torch`` (legacy): ``mp_rank_TT[_PPP]/model_optim_rng.pt`` per (tensor, pipeline) rank, the
  tensor-parallel shards cut by the merge rules of :mod:`megatron_keys` (the fused QKV rows are per
  head, so a plain cut on dim 0 gives each rank whole heads), stage-local layer numbers, the last
  stage's own copy of the word embeddings as ``output_layer.weight`` when PP > 1.

The pickles hold only dicts, ``argparse.Namespace``, tensors, dtypes and plain values, so gptrain's
allow-list readers (and ``torch.load(weights_only=True)`` with Megatron's safe globals) read them.
"""
from __future__ import annotations

import argparse
import json
import warnings
from collections import OrderedDict
from pathlib import Path

import torch

from gptrain.checkpoint_kind import TRACKER
from gptrain.interop import megatron_llama as llama
from gptrain.interop.megatron_keys import _CORE_GLOBAL, _CORE_LAYER
from gptrain.model.config import padded_vocab_size

CHECKPOINT_VERSION = 3.0
FORMATS = ("torch_dist", "torch")
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def _layer_names() -> dict[str, tuple[str, str, str]]:
    """gptrain layer parameter -> (module key of the local spec, its sharded key, merge rule)."""
    out: dict[str, list] = {}
    for key, (gname, rule) in _CORE_LAYER.items():
        entry = out.setdefault(gname, [key, key, rule])
        if "layer_norm_" in key:  # the local spec saves its LayerNorms under Transformer Engine's names
            entry[1] = key
    return {g: tuple(v) for g, v in out.items()}


_LAYER = _layer_names()
_GLOBAL = {gname: (key, rule) for key, (gname, rule) in _CORE_GLOBAL.items()}


class MegatronWriteError(ValueError):
    pass


def check_layout(cfg, tp: int, pp: int) -> None:
    """Refuse (one line) a layout Megatron cannot split this model into."""
    if tp < 1 or pp < 1:
        raise MegatronWriteError(f"--tensor-model-parallel-size {tp} / --pipeline-model-parallel-size {pp}: "
                                 "both must be at least 1; nothing was written")
    problems = []
    if cfg.num_attention_heads % tp:
        problems.append(f"{cfg.num_attention_heads} attention heads are not divisible by "
                        f"--tensor-model-parallel-size {tp}")
    if cfg.num_query_groups % tp:
        problems.append(f"{cfg.num_query_groups} K/V groups are not divisible by --tensor-model-parallel-size {tp}")
    if cfg.ffn_hidden_size % tp:
        problems.append(f"ffn hidden size {cfg.ffn_hidden_size} is not divisible by "
                        f"--tensor-model-parallel-size {tp}")
    if cfg.num_layers % pp:
        problems.append(f"{cfg.num_layers} layers are not divisible by --pipeline-model-parallel-size {pp}")
    if problems:
        raise MegatronWriteError("; ".join(problems) + "; nothing was written")


def megatron_args(cfg, tp: int, pp: int, iteration: int, ckpt_format: str, tokenizer_files=None,
                  consumed_train: int = 0, consumed_valid: int = 0) -> argparse.Namespace:
    """Megatron-LM's ``args`` for this model (the names ``arguments.py`` gives them). The GPT-2
    vocabulary (50257 tokens) is ``GPT2BPETokenizer`` with its files; any other size is
    ``NullTokenizer`` with ``--vocab-size`` one less (Megatron adds the end-of-document token)."""
    gpt2 = cfg.vocab_size == 50257 and tokenizer_files is not None
    a = dict(
        num_layers=cfg.num_layers, encoder_num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
        kv_channels=cfg.head_dim, num_query_groups=cfg.num_attention_heads, group_query_attention=False,
        seq_length=cfg.seq_length, encoder_seq_length=cfg.seq_length,
        max_position_embeddings=cfg.max_position_embeddings,
        padded_vocab_size=padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp),
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        tokenizer_type="GPT2BPETokenizer" if gpt2 else "NullTokenizer",
        vocab_size=None if gpt2 else cfg.vocab_size - 1,
        vocab_file=str(tokenizer_files.vocab_file) if gpt2 else None,
        merge_file=str(tokenizer_files.merge_file) if gpt2 else None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, data_parallel_size=1, world_size=tp * pp,
        context_parallel_size=1, expert_model_parallel_size=1, sequence_parallel=False,
        consumed_train_samples=consumed_train, consumed_valid_samples=consumed_valid, iteration=iteration,
        layernorm_epsilon=cfg.layernorm_epsilon, norm_epsilon=cfg.layernorm_epsilon, normalization="LayerNorm",
        apply_layernorm_1p=False, init_method_std=cfg.init_method_std,
        attention_dropout=cfg.attention_dropout, hidden_dropout=cfg.hidden_dropout,
        position_embedding_type="learned_absolute", add_position_embedding=True,
        use_rotary_position_embeddings=False, add_bias_linear=True, add_qkv_bias=True, swiglu=False,
        squared_relu=False, openai_gelu=False, untie_embeddings_and_output_weights=False, num_experts=None,
        qk_layernorm=False, multi_latent_attention=False, apply_query_key_layer_scaling=False,
        apply_residual_connection_post_layernorm=False, fp32_residual_connection=False,
        transformer_impl="local", use_legacy_models=False, ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format != "torch", params_dtype=torch.float32, fp16=False, bf16=False,
    )
    a.update(llama.writer_args(cfg))  # the GPT-2 values above for a GPT-2 model
    return argparse.Namespace(**a)


def common_state(args: argparse.Namespace, iteration: int) -> dict:
    return {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
            "num_floating_point_operations_so_far": 0,
            "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}}


def _padded_embeddings(model, rows: int, name: str = "word_embeddings.weight") -> torch.Tensor:
    real = model.get_parameter(name).detach()[: model.cfg.vocab_size]
    out = torch.zeros(rows, real.shape[1], dtype=real.dtype)
    out[: real.shape[0]] = real
    return out


def full_tensors(model, tp: int) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str]]:
    """megatron-core's tensors of the whole model (global layer numbers, module key names), the
    merge rule of each key and the sharded (torch_dist) name of each layer key's suffix."""
    cfg = model.cfg
    tensors: dict[str, torch.Tensor] = {}
    rules: dict[str, str] = {}
    rows = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp)
    params = dict(model.named_parameters())
    for name, param in params.items():
        padded = name in ("word_embeddings.weight", "output_layer.weight")  # (untied) output rows as the embeddings'
        value = _padded_embeddings(model, rows, name) if padded else param.detach()
        if name.startswith("layers.") and ".mlp.up." in name:
            continue  # written with its gate
        if name.startswith("layers.") and ".mlp.gate." in name:  # SwiGLU: megatron-core's fc1 is [gate; up]
            value = torch.cat([value, params[name.replace(".mlp.gate.", ".mlp.up.")].detach()])
            _, layer, rest = name.replace(".mlp.gate.", ".mlp.fc1.").split(".", 2)
            key, rule = f"decoder.layers.{layer}.{_LAYER[rest][0]}", llama.GLU
        elif name.startswith("layers."):
            _, layer, rest = name.split(".", 2)
            key, _, rule = _LAYER[rest]
            key = f"decoder.layers.{layer}.{key}"
        else:
            key, rule = _GLOBAL[name]
        tensors[key] = value.contiguous()
        rules[key] = rule
    return tensors, rules, {module: sharded for module, sharded, _ in _LAYER.values()}


# ---- torch_dist


def write_torch_dist(folder: Path, model, args: argparse.Namespace, iteration: int) -> None:
    """One iteration folder of Megatron's torch_dist format (``folder`` is ``iter_XXXXXXX``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    tp = args.tensor_model_parallel_size
    tensors, _, sharded = full_tensors(model, tp)
    layers = model.cfg.num_layers
    state: dict = {}
    stacked: dict[str, list] = {}
    for key, value in tensors.items():
        if key.startswith("decoder.layers."):
            _, _, layer, rest = key.split(".", 3)
            stacked.setdefault(f"decoder.layers.{sharded[rest]}", [None] * layers)[int(layer)] = value
        else:
            state[key] = value
    for key, values in stacked.items():
        state[key] = torch.stack(values)
    for linear in _LINEARS:  # megatron-core's ShardedObject per layer: torch.save([None])
        for layer in range(layers):
            state[f"decoder.layers.{linear}._extra_state/shard_{layer}_{layers}"] = [None]
    common = common_state(args, iteration)
    state["common_state/shard_0_1"] = [common]  # Megatron-LM of today: a one-object list
    folder.mkdir(parents=True)
    # flatten off: the byte entries stay whole (DCP torch.saves each as Megatron does)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(folder),
                 planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    torch.save(common, folder / "common.pt")  # what megatron-core's dist_checkpointing.load reads
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                      "sharded_backend_version": 1}))


# ---- torch (legacy)


def _shard(value: torch.Tensor, rule: str, tp: int, rank: int) -> torch.Tensor:
    if rule == llama.GLU and tp > 1:
        return llama.shard_glu(value, tp, rank)
    if tp == 1 or rule == "rank0":
        return value.clone()
    return value.chunk(tp, dim=1 if rule == "cat1" else 0)[rank].clone()


def write_legacy(folder: Path, model, args: argparse.Namespace, iteration: int) -> list[Path]:
    """``mp_rank_TT[_PPP]/model_optim_rng.pt`` for every (tensor, pipeline) rank; the files."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    tensors, rules, _ = full_tensors(model, tp)
    per_stage = model.cfg.num_layers // pp
    written = []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        for rank in range(tp):
            sd: OrderedDict = OrderedDict()

            def put(key, value, rule, sd=sd, rank=rank):
                sd[key] = _shard(value, rule, tp, rank)

            if first:
                for key in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
                    if key in tensors:  # no position embeddings with rope
                        put(key, tensors[key], rules[key])
            for local in range(per_stage):
                prefix = f"decoder.layers.{stage * per_stage + local}."
                for key, value in tensors.items():
                    if key.startswith(prefix):
                        rest = key[len(prefix):]
                        put(f"decoder.layers.{local}.{rest}", value, rules[key])
                        linear = rest.rsplit(".", 1)[0]
                        if linear in _LINEARS:
                            sd[f"decoder.layers.{local}.{linear}._extra_state"] = None
            if last:
                for key in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
                    if key in tensors:  # RMSNorm has no bias
                        put(key, tensors[key], rules[key])
                if "output_layer.weight" in tensors:  # untied
                    put("output_layer.weight", tensors["output_layer.weight"], "cat0")
                elif pp > 1:  # the last stage's own copy of the tied word embeddings
                    put("output_layer.weight", tensors["embedding.word_embeddings.weight"], "cat0")
                sd["output_layer._extra_state"] = None
            name = f"mp_rank_{rank:02d}" if pp == 1 else f"mp_rank_{rank:02d}_{stage:03d}"
            (folder / name).mkdir(parents=True)
            path = folder / name / "model_optim_rng.pt"
            torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                        "model": sd, "num_floating_point_operations_so_far": 0}, path)
            written.append(path)
    return written


def write_megatron(root: Path, model, ckpt_format: str, tp: int, pp: int, iteration, tokenizer_files=None,
                   consumed_train: int = 0, consumed_valid: int = 0) -> Path:
    """A whole Megatron checkpoint folder at ``root`` (created): the tracker and one iteration
    (``release`` stays ``release``, at iteration 0 as Megatron reads it). The iteration folder."""
    if ckpt_format not in FORMATS:
        raise MegatronWriteError(f"--ckpt-format {ckpt_format}: gptrain writes {' or '.join(FORMATS)}")
    check_layout(model.cfg, tp, pp)
    release = iteration == "release"
    number = 0 if release else int(iteration)
    args = megatron_args(model.cfg, tp, pp, number, ckpt_format, tokenizer_files, consumed_train, consumed_valid)
    folder = root / ("release" if release else f"iter_{number:07d}")
    if ckpt_format == "torch_dist":
        write_torch_dist(folder, model, args, number)
    else:
        folder.mkdir(parents=True)
        write_legacy(folder, model, args, number)
    (root / TRACKER).write_text("release" if release else str(number))
    return folder


def to_megatron(ckpt, out, log=print, ckpt_format: str = "torch_dist", tp: int = 1, pp: int = 1) -> float:
    """``gptrain convert --to megatron CKPT OUT``: written into a staging folder beside OUT, read back
    through gptrain's Megatron reader, published once its logits are the source's and its
    parameters the source's bit for bit; the largest logit difference."""
    import shutil

    from gptrain.interop import convert as c
    from gptrain.interop.megatron import read_megatron_checkpoint
    from gptrain.model.gpt import GPT
    from gptrain.train.checkpoint_files import find_gptrain_iteration_dir

    out = Path(out)
    if out.exists():
        raise c.ConversionError(f"{out} exists: give a new folder")
    if ckpt_format not in FORMATS:
        raise MegatronWriteError(f"--ckpt-format {ckpt_format}: gptrain writes {' or '.join(FORMATS)}")
    model, state = c.read_gptrain(ckpt)
    check_layout(model.cfg, tp, pp)
    name = find_gptrain_iteration_dir(ckpt).name
    iteration = "release" if name == "release" else int(name.removeprefix("iter_"))
    tokenizer = None
    if model.cfg.vocab_size == 50257:  # GPT-2's: Megatron's GPT2BPETokenizer with the checkpoint's files
        try:
            tokenizer = c._tokenizer_of(state)
        except (OSError, ValueError) as err:
            log(f"note: the checkpoint's tokenizer files cannot be read ({err}); args name NullTokenizer "
                "--vocab-size 50256 (the same 50257 tokens)")
    tokens = c._prompt_tokens(model.cfg, tokenizer)
    reference = c._logits(model, tokens)
    tmp = c._staging(out)
    try:
        write_megatron(tmp, model, ckpt_format, tp, pp, iteration, tokenizer.files if tokenizer else None,
                       int(state.get("consumed_train_samples") or 0), int(state.get("consumed_valid_samples") or 0))
        written = read_megatron_checkpoint(tmp)
        back = GPT(written.gpt_config())
        back.load_state_dict(written.model_state_dict(), strict=True)
        vocab = model.cfg.vocab_size
        for key, param in model.named_parameters():
            got = back.get_parameter(key)
            if key in ("word_embeddings.weight", "output_layer.weight"):
                param, got = param[:vocab], got[:vocab]
            if not torch.equal(param, got):
                raise c.ConversionError(f"{key} read back from the written checkpoint differs from the source's; "
                                        "nothing was written")
        layout = f"{ckpt_format}, TP{tp} x PP{pp}"
        what = f"OUT ({layout}) read back vs the gptrain checkpoint"
        diff = c._compare(reference, c._logits(back, tokens), what, log)
        c._publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return diff
