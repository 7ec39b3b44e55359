"""Dataset assembly from the training flags: Megatron's target sizes per split, the train /
validation / test datasets (one indexed prefix split by document, or a weighted blend; mock data),
and ``gptrain data build-cache``. ``gptrain train`` (train/run.py) and ``gptrain data samples``
build their datasets here, so both read the same samples."""
from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np

from gptrain.config import RunConfig, parse_megatron_args
from gptrain.data.blend import BlendedDataset, parse_data_path, samples_per_dataset
from gptrain.data.gpt_dataset import GPTDataset, MockGPTDataset, parse_split
from gptrain.data.indexed import IndexedDataset
from gptrain.data.provenance import check_tokenizer
from gptrain.data.token_check import check_token_ids
from gptrain.tokenizer import GPT2Tokenizer, NullTokenizer, build_tokenizer as make_tokenizer
from gptrain.train.resume import with_checkpoint_args


def build_tokenizer(cfg: RunConfig):
    """The training flags' tokenizer: GPT-2's BPE (its files), a Hugging Face tokenizer.json
    (--tokenizer-model) or Megatron's NullTokenizer (--vocab-size)."""
    data = cfg.data
    tokenizer = make_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file, merge_file=data.merge_file,
                               vocab_size=data.vocab_size, tokenizer_model=data.tokenizer_model)
    if tokenizer.eod is None and data.eod_mask_loss:
        raise ValueError(f"--eod-mask-loss: the tokenizer {data.tokenizer_model} has no end-of-text token")
    return tokenizer


def setup(argv: list[str], log=print):
    """The run config from the training flags, with its tokenizer's vocabulary, and that tokenizer."""
    cfg, notes = parse_megatron_args(argv)
    for note in notes:
        log(f" > {note}")
    tokenizer = build_tokenizer(cfg)
    if cfg.train.use_checkpoint_args:
        cfg = with_checkpoint_args(cfg, log)
    cfg = cfg.with_tokenizer(tokenizer.vocab_size, tokenizer.eod, tokenizer.fingerprint)  # a new config, checked again
    if cfg.data.tokenizer_model:  # saved whole: generate/serve/convert find it from any folder
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer_model=str(tokenizer.path.resolve())))
    log(f"> building {cfg.data.tokenizer_type} tokenizer ...")
    return cfg, tokenizer


def target_samples(cfg: RunConfig) -> tuple[int, int, int]:
    """Megatron's dataset target sizes for train / validation / test (--train-samples itself where given)."""
    t = cfg.train
    train = t.train_samples if t.train_samples is not None else t.train_iters * t.global_batch_size
    valid = (t.train_iters // t.eval_interval + 1) * t.eval_iters * t.global_batch_size if t.eval_interval else 0
    test = t.eval_iters * t.global_batch_size
    return train, valid, test


class IndexCacheLines:
    """A log that collapses the index-cache file lines (three per split) into one summary line;
    --verbose keeps each."""

    def __init__(self, log, verbose: bool):
        self.log, self.verbose, self.paths = log, verbose, []

    def __call__(self, line: str) -> None:
        if line.startswith(" > loading ") and "-idx mapping from " in line:
            self.paths.append(line.split("-idx mapping from ", 1)[1])
            if not self.verbose:
                return
        self.log(line)

    def summary(self) -> str | None:
        if not self.paths:
            return None
        folders = sorted({os.path.dirname(p) or "." for p in self.paths})
        return (f" > index cache: {len(self.paths)} files in {', '.join(folders)}"
                + ("" if self.verbose else " (--verbose lists them)"))


def build_datasets(cfg: RunConfig, tokenizer: GPT2Tokenizer, log=print):
    targets = target_samples(cfg)
    cache_log = IndexCacheLines(log, cfg.train.verbose)
    log("> building train, validation, and test datasets ...")
    log(" > datasets target sizes (minimum size):")
    log(f"    train:      {targets[0]}\n    validation: {targets[1]}\n    test:       {targets[2]}")
    if cfg.data.mock_data:
        return [MockGPTDataset(name, max(n, 1), cfg.model.seq_length, tokenizer.vocab_size, cfg.data.seed)
                if n else None for name, n in zip(("train", "valid", "test"), targets)]
    weights, prefixes = parse_data_path(cfg.data.data_path)
    blended = len(cfg.data.data_path) > 1  # weights given (even for one prefix): megatron-core blends
    per_split: list[list] = [[], [], []]
    for weight, prefix in zip(weights, prefixes):
        indexed = IndexedDataset(prefix)
        # token ids under NullTokenizer are the data's own: only their range is checked (below)
        warning = None if isinstance(tokenizer, NullTokenizer) else check_tokenizer(prefix, tokenizer)
        if warning:
            log(f"WARNING: {warning}")
        if tokenizer.vocab_size > np.iinfo(indexed.dtype).max + 1:
            raise ValueError(f"{prefix}: token dtype {indexed.dtype} cannot hold a {tokenizer.vocab_size} vocabulary")
        check_token_ids(indexed, tokenizer.vocab_size, cfg.data.data_cache_path, log)
        # Megatron splits and counts a GPT dataset by sequence (a non-empty document here)
        log(f"    number of documents: {indexed.num_sequences}")
        ranges = parse_split(cfg.data.split, indexed.num_sequences)
        log(" > dataset split:")
        for name, (lo, hi) in zip(("train", "validation", "test"), ranges):
            log(f"    {name}:\n     document indices in [{lo}, {hi}) total of {hi - lo} documents")
        for i, (name, (lo, hi)) in enumerate(zip(("train", "valid", "test"), ranges)):
            n = samples_per_dataset([weight], targets[i])[0] if blended else targets[i]
            if n == 0 or hi == lo:
                per_split[i].append(None)
                continue
            per_split[i].append(GPTDataset(name, indexed, np.arange(lo, hi, dtype=np.int32), n,
                                           cfg.model.seq_length, cfg.data.seed, cfg.data.split,
                                           cfg.data.data_cache_path, cache_log))
    out = []
    for i, parts in enumerate(per_split):
        if any(p is None for p in parts) or targets[i] == 0:
            out.append(None)
        elif not blended:
            out.append(parts[0])
        else:
            out.append(BlendedDataset(parts, weights, targets[i]))
    if out[0] is None:
        raise ValueError(f"--split {cfg.data.split} leaves no training documents")
    if cache_log.summary():
        log(cache_log.summary())
    log("> finished creating GPT datasets ...")
    return out


def build_cache(argv: list[str]) -> int:
    """``gptrain data build-cache`` with the training flags: build the index maps, train nothing."""
    try:
        cfg, tokenizer = setup(argv)
        build_datasets(cfg, tokenizer)
    except (ValueError, FileNotFoundError) as err:
        print(f"gptrain: error: {err}", file=sys.stderr)
        return 2
    return 0
