"""``gptrain convert``: gptrain checkpoint -> Hugging Face GPT-2 folder, HF folder -> gptrain
checkpoint, Megatron-LM folder -> gptrain checkpoint, gptrain checkpoint -> Megatron-LM folder
(:mod:`gptrain.interop.megatron_write`).

Each conversion writes into a temporary folder beside OUT, reads what it wrote back, compares the
logits of a fixed prompt against the source (transformers' own GPT2LMHeadModel where HF is on one
side and it is installed), prints the largest absolute difference, and renames the folder into
place only if they agree. Nothing is written into the source folder.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields
from pathlib import Path

import torch

from gptrain.checkpoint_kind import checkpoint_kind
from gptrain.interop.hf import HF_WEIGHTS, hf_config_dict, load_hf_folder, to_hf_state_dict
from gptrain.model.gpt import GPT, GPTConfig
from gptrain.tokenizer import GPT2Tokenizer, run_tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog. Megatron-LM checkpoints become Hugging Face models:"
TOLERANCE = 1e-3  # fp32 on both sides: different attention kernels, nothing more


class ConversionError(ValueError):
    pass


def _prompt_tokens(cfg: GPTConfig, tokenizer: GPT2Tokenizer | None) -> torch.Tensor:
    ids = tokenizer.encode(PROMPT) if tokenizer is not None else [(i * 7919) % cfg.vocab_size for i in range(24)]
    return torch.tensor([ids[: cfg.seq_length]], dtype=torch.long)


@torch.no_grad()
def _logits(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    return model.eval().logits(tokens)[..., : model.cfg.vocab_size].float()


def _compare(reference: torch.Tensor, got: torch.Tensor, what: str, log) -> float:
    diff = (reference - got).abs().max().item()
    log(f"check: logits of a {reference.shape[1]}-token prompt, {what}: max abs difference {diff:.3e}")
    if not diff <= TOLERANCE:
        raise ConversionError(f"the converted model's logits differ from the source's by {diff:.3e} "
                              f"(more than {TOLERANCE:g}); nothing was written")
    return diff


def _staging(out: Path) -> Path:
    if out.exists():
        raise ConversionError(f"{out} exists: give a new folder")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    from gptrain.train.durable import fsync_dir, fsync_tree

    for d in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
        fsync_tree(d)
    os.replace(tmp, out)
    fsync_dir(out.parent)


# ---- gptrain checkpoints
def read_gptrain(root) -> tuple[GPT, dict]:
    """A plain fp32 GPT from a gptrain checkpoint folder (any layout it was saved at), and its state."""
    from gptrain.train.checkpoint import load_checkpoint
    from gptrain.train.checkpoint_files import find_gptrain_iteration_dir

    root = Path(root)
    path = find_gptrain_iteration_dir(root)
    if path is None:
        raise FileNotFoundError(f"{root}: no gptrain checkpoint (no latest_checkpointed_iteration.txt)")
    state = json.loads((path / "state.json").read_text())
    model_cfg = (state.get("config") or {}).get("model")
    if not model_cfg:
        raise ConversionError(f"{path}/state.json has no run config (written by an older gptrain)")
    known = {f.name for f in fields(GPTConfig)}
    cfg = GPTConfig(**{k: v for k, v in model_cfg.items() if k in known})
    cfg.tensor_parallel_size = 1  # this process's padding; the checkpoint stores the real rows
    model = GPT(cfg)
    load_checkpoint(root, dict(model.named_parameters()), None, cfg.vocab_size, load_rng=False, path=path)
    return model, state


def write_gptrain(model: GPT, out: Path, iteration, extra_state: dict, data_config: dict | None = None) -> None:
    """A weights-only gptrain checkpoint (no optimizer state: a run loading it starts the optimizer fresh)."""
    from gptrain.config import DataConfig
    from gptrain.train.checkpoint import save_checkpoint

    config = {"model": {f.name: getattr(model.cfg, f.name) for f in fields(GPTConfig)},
              "data": data_config or {f.name: getattr(DataConfig(), f.name) for f in fields(DataConfig)}}
    state = {"consumed_train_samples": 0, "consumed_valid_samples": 0,
             "schedule": {"num_steps": 0}, "scaler": None, "config": config,
             "layout": {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0}, **extra_state}
    save_checkpoint(out, iteration, dict(model.named_parameters()), None, state, model.cfg.vocab_size)


def _write_checked(model: GPT, out: Path, iteration, extra_state: dict, data_config: dict | None,
                   reference: torch.Tensor, tokens: torch.Tensor, what: str, log) -> float:
    """``write_gptrain`` into a staging folder beside ``out``, renamed into place once the checkpoint
    read back gives ``reference``'s logits for ``tokens``; the largest difference."""
    tmp = _staging(out)
    try:
        write_gptrain(model, tmp, iteration, extra_state, data_config)
        written, _ = read_gptrain(tmp)
        diff = _compare(reference, _logits(written, tokens), what, log)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return diff


def _tokenizer_of(state: dict) -> GPT2Tokenizer:
    """The run's Hugging Face tokenizer.json, else GPT-2's files (the run's, or the built-in ones)."""
    data = (state.get("config") or {}).get("data") or {}
    if data.get("tokenizer_type") == "HuggingFaceTokenizer":
        return run_tokenizer(data)
    return GPT2Tokenizer(data.get("vocab_file"), data.get("merge_file"))


# ---- Hugging Face folders
def _write_tokenizer(tokenizer: GPT2Tokenizer, out: Path, max_length: int) -> None:
    """The tokenizer files as transformers reads them: a Hugging Face tokenizer.json (and the
    transformers files beside it) copied, or GPT-2's vocab.json and merges.txt (the same bytes
    gptrain tokenizes with) and the special tokens."""
    if hasattr(tokenizer, "path"):  # a tokenizer.json (HuggingFaceTokenizer)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            source = tokenizer.path if name == "tokenizer.json" else tokenizer.path.parent / name
            if source.is_file():
                shutil.copyfile(source, out / name)
        return
    shutil.copyfile(tokenizer.files.vocab_file, out / "vocab.json")
    shutil.copyfile(tokenizer.files.merge_file, out / "merges.txt")
    eod = "<|endoftext|>"
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "model_max_length": max_length, "bos_token": eod, "eos_token": eod,
         "unk_token": eod, "add_prefix_space": False}, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": eod, "eos_token": eod, "unk_token": eod}, indent=1))


def _transformers_logits(folder: Path, tokens: torch.Tensor, tokenizer: GPT2Tokenizer | None):
    """Logits (and the prompt's tokens) from transformers' own GPT-2 reading ``folder``, or None
    without transformers."""
    try:
        from transformers import AutoTokenizer, GPT2LMHeadModel, LlamaForCausalLM
    except ImportError:
        return None
    llama = json.loads((folder / "config.json").read_text()).get("model_type") == "llama"
    model_class = LlamaForCausalLM if llama else GPT2LMHeadModel
    model = model_class.from_pretrained(folder, local_files_only=True, torch_dtype=torch.float32).eval()
    if tokenizer is not None and (folder / "vocab.json").is_file():
        hf_ids = AutoTokenizer.from_pretrained(folder, local_files_only=True)(PROMPT)["input_ids"]
        if hf_ids[: tokens.shape[1]] != tokens[0].tolist():
            raise ConversionError("transformers' tokenizer reading the written files encodes the prompt "
                                  "differently from gptrain's tokenizer")
    with torch.no_grad():
        return model(tokens).logits.float()


def to_hf(ckpt, out, log=print) -> float:
    """``gptrain convert --to hf CKPT OUT``."""
    from gptrain.train.durable import save_safetensors

    out = Path(out)
    model, state = read_gptrain(ckpt)
    tokenizer = _tokenizer_of(state)
    if tokenizer.vocab_size != model.cfg.vocab_size:
        raise ConversionError(f"{ckpt}: the model's vocabulary has {model.cfg.vocab_size} tokens, its tokenizer "
                              f"{tokenizer.vocab_size}")
    tokens = _prompt_tokens(model.cfg, tokenizer)
    reference = _logits(model, tokens)
    tmp = _staging(out)
    try:
        weights = to_hf_state_dict(model)
        if not model.cfg.untie_embeddings_and_output_weights:
            weights.pop("lm_head.weight")  # tied to the word embeddings (tie_word_embeddings)
        save_safetensors(weights, tmp / HF_WEIGHTS, metadata={"format": "pt"})
        config = hf_config_dict(model.cfg, tokenizer.eod)
        bos = getattr(tokenizer, "bos", None)  # a tokenizer.json's own; GPT-2 begins with its eod
        if bos is not None:
            config["bos_token_id"] = bos
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": tokenizer.eod}, indent=1))
        _write_tokenizer(tokenizer, tmp, model.cfg.max_position_embeddings)
        got = _transformers_logits(tmp, tokens, tokenizer)
        what = f"transformers' {'GPT2LMHeadModel' if model.cfg.gpt2_layout else 'LlamaForCausalLM'} reading OUT " \
               "vs the gptrain checkpoint"
        if got is None:
            got, what = _logits(load_hf_folder(tmp), tokens), "OUT read back (transformers is not installed)"
        diff = _compare(reference, got, what, log)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return diff


def from_hf(folder, out, log=print) -> float:
    """``gptrain convert --from hf DIR OUT``: a weights-only gptrain checkpoint (``release``)."""
    folder, out = Path(folder), Path(out)
    model = load_hf_folder(folder)
    tokenizer = None
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        tokenizer = GPT2Tokenizer(folder / "vocab.json", folder / "merges.txt")
    tokens = _prompt_tokens(model.cfg, tokenizer)
    reference = _transformers_logits(folder, tokens, tokenizer)
    what = f"the gptrain checkpoint vs transformers' {'GPT2LMHeadModel' if model.cfg.gpt2_layout else 'LlamaForCausalLM'} " \
           "reading DIR"
    if reference is None:
        reference, what = _logits(model, tokens), "the gptrain checkpoint read back vs DIR (transformers is not installed)"
    data = {"vocab_file": str(folder.resolve() / "vocab.json"), "merge_file": str(folder.resolve() / "merges.txt")} \
        if tokenizer is not None else None
    if tokenizer is None and (folder / "tokenizer.json").is_file():  # a Llama folder's: the checkpoint names it
        data = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(folder.resolve())}
    return _write_checked(model, out, "release", {"source": f"huggingface:{folder.resolve()}"}, data,
                          reference, tokens, what, log)


def from_megatron(folder, out, log=print) -> float:
    """``gptrain convert --from megatron DIR OUT``: its weights, iteration and consumed samples."""
    from gptrain.interop.megatron import read_megatron_checkpoint

    folder, out = Path(folder), Path(out)
    ckpt = read_megatron_checkpoint(folder)
    cfg = ckpt.gpt_config()
    model = GPT(cfg)
    model.load_state_dict({k: v.float() for k, v in ckpt.model_state_dict().items()}, strict=True)
    tokens = _prompt_tokens(cfg, GPT2Tokenizer() if cfg.vocab_size == 50257 else None)  # GPT-2's vocabulary
    reference = _logits(model, tokens)
    padding = ckpt.state["word_embeddings.weight"][cfg.vocab_size:]
    if padding.abs().sum() > 0:
        log(f"note: the {padding.shape[0]} padding rows of the word embeddings are dropped (gptrain stores the real "
            "vocabulary): with --softmax-over-padded-vocab the converted checkpoint no longer evaluates exactly as "
            "Megatron does (--load DIR keeps them)")
    args = ckpt.args
    extra = {"consumed_train_samples": int(args.get("consumed_train_samples") or 0),
             "consumed_valid_samples": int(args.get("consumed_valid_samples") or 0),
             "source": f"megatron:{folder.resolve()} (TP{ckpt.tp} x PP{ckpt.pp}, {ckpt.layout} layout)"}
    return _write_checked(model, out, ckpt.iteration, extra, None, reference, tokens,
                          "the gptrain checkpoint read back vs the Megatron weights", log)


def convert_main(argv: list[str]) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="gptrain convert", description="convert checkpoints; each conversion checks "
                                "the logits of a fixed prompt against its source before it reports success")
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=["hf", "megatron"],
                     help="a gptrain checkpoint -> a Hugging Face GPT-2 folder or a Megatron-LM checkpoint")
    way.add_argument("--from", dest="source", choices=["hf", "megatron"],
                     help="a Hugging Face GPT-2 folder or a Megatron-LM checkpoint -> a gptrain checkpoint")
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist",
                   help="--to megatron: Megatron's checkpoint format (default: torch_dist, Megatron's default)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="--to megatron: the TP it is saved at")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="--to megatron: the PP it is saved at")
    args = p.parse_args(argv)
    run = to_hf if args.to == "hf" else from_hf if args.source == "hf" else from_megatron
    if args.to != "megatron" and (args.ckpt_format, args.tensor_model_parallel_size,
                                  args.pipeline_model_parallel_size) != ("torch_dist", 1, 1):
        p.error("--ckpt-format and the parallel sizes choose what --to megatron writes")
    if args.to == "megatron":
        from functools import partial

        from gptrain.interop.megatron_write import to_megatron

        run = partial(to_megatron, ckpt_format=args.ckpt_format, tp=args.tensor_model_parallel_size,
                      pp=args.pipeline_model_parallel_size)
    expected = "gptrain" if args.to else {"hf": "huggingface", "megatron": "megatron"}[args.source]
    try:
        # None, or a tracker without mp_rank_* folders read as Megatron's: the reader says what is missing
        kind = checkpoint_kind(args.input, none_ok=True)
        if kind not in (None, expected) and not (kind == "gptrain" and expected == "megatron"):
            way = "--to hf or --to megatron" if kind == "gptrain" else f"--from {'hf' if kind == 'huggingface' else kind}"
            raise ValueError(f"{args.input} is a {kind} checkpoint, not a {expected} one (convert it with {way})")
        run(args.input, args.output, log=lambda s: print(s, flush=True))
    except (ValueError, OSError) as err:
        print(f"gptrain: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0
