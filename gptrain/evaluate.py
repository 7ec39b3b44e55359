"""``gptrain evaluate --load CKPT``: perplexity and bits per byte on an indexed dataset or a JSONL
file, and LAMBADA-style cloze accuracy (Megatron's tasks/zeroshot_gpt with ``--strict-lambada``).

Perplexity: the documents become one token stream (each followed by ``<|endoftext|>``, as
``preprocess --append-eod`` writes them), read in ``--seq-length`` windows. Windows start
``--stride`` tokens apart (at most seq_length - 1, the default) and each scores only the tokens the
previous one did not, so every token after the first is scored exactly once, with the overlap as
extra context. Bits per
byte divide the summed loss (in bits) by the UTF-8 bytes of the scored tokens (``<|endoftext|>``
counts its loss and no bytes).

Cloze: each passage's last word is the target; a passage counts when greedy decoding from the
context produces every token of that word (strict, as Megatron's --strict-lambada).

``--split`` / ``--split-name`` with ``--data-path``: only the documents of that split, as Megatron's
``--split`` divides them for training (megatron-core's rule, data/gpt_dataset.parse_split): ``--split
949,50,1 --split-name valid`` scores the documents Megatron validated on. Progress lines (Megatron's
``Evaluating iter i/n``) go to stderr; flag errors are one line, a typo answered with the closest flag.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch


def read_jsonl_texts(path: str | Path, key: str) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)[key]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{n}: not a JSON object with a {key!r} string") from None
            if not isinstance(value, str):
                raise ValueError(f"{path}:{n}: {key!r} is not a string")
            texts.append(value)
    if not texts:
        raise ValueError(f"{path}: no documents")
    return texts


SPLIT_NAMES = ("train", "valid", "test")


def split_documents(num_documents: int, split: str, name: str) -> range:
    """The documents of split ``name`` (train, valid or test) under ``--split``, as training divides them."""
    from gptrain.data.gpt_dataset import parse_split

    lo, hi = parse_split(split, num_documents)[SPLIT_NAMES.index(name)]
    if hi == lo:
        raise ValueError(f"--split {split} leaves no {name} documents (of {num_documents})")
    return range(lo, hi)


def token_stream(args, tokenizer) -> np.ndarray:
    if args.data_path:
        from gptrain.data.indexed import IndexedDataset

        data = IndexedDataset(args.data_path)
        docs = range(len(data)) if args.split is None else split_documents(len(data), args.split, args.split_name)
        return np.concatenate([np.asarray(data[i], dtype=np.int64) for i in docs])
    ids: list[int] = []
    for text in read_jsonl_texts(args.jsonl, args.json_key):
        ids += tokenizer.encode(text) + [tokenizer.eod]
    return np.asarray(ids, dtype=np.int64)


@torch.no_grad()
def perplexity(model, tokens: np.ndarray, seq_length: int, stride: int, token_bytes: np.ndarray,
               batch_size: int = 8, progress=None) -> dict:
    """Summed loss over every token after the first, scored in windows (see the module docstring)."""
    n = len(tokens)
    if n < 2:
        raise ValueError("need at least 2 tokens")
    windows = []  # (begin, end, first scored target index within the window)
    begin, scored_to = 0, 1  # tokens [1, scored_to) are scored
    while scored_to < n:
        end = min(begin + seq_length, n)
        windows.append((begin, end, scored_to - begin))
        scored_to = end
        begin = min(begin + stride, scored_to - 1)  # a window's first token is context only
    device = model.word_embeddings.weight.device
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        group = windows[i:i + batch_size]
        width = max(e - b for b, e, _ in group)
        batch = torch.zeros(len(group), width, dtype=torch.long)
        for r, (b, e, _) in enumerate(group):
            batch[r, : e - b] = torch.from_numpy(tokens[b:e])
        logp = torch.log_softmax(model.logits(batch.to(device)).float(), dim=-1)
        for r, (b, e, first) in enumerate(group):
            targets = batch[r, first:e - b].to(device)
            total -= logp[r, first - 1:e - b - 1].gather(1, targets[:, None]).sum().item()
            count += e - b - first
        if progress is not None:
            progress(i // batch_size + 1, (len(windows) + batch_size - 1) // batch_size)
    scored_bytes = int(token_bytes[tokens[1:]].sum())
    loss = total / count
    return {"tokens": count, "loss": loss, "ppl": math.exp(min(loss, 700)),
            "bytes": scored_bytes, "bits_per_byte": total / math.log(2) / max(scored_bytes, 1),
            "windows": len(windows)}


def token_byte_lengths(tokenizer) -> np.ndarray:
    if hasattr(tokenizer, "token_byte_lengths"):  # a Hugging Face tokenizer.json
        return tokenizer.token_byte_lengths()
    out = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for i in range(tokenizer.vocab_size):
        if i != tokenizer.eod:
            out[i] = len(tokenizer._enc.decode_single_token_bytes(i)) if hasattr(tokenizer, "_enc") else \
                len(tokenizer.decode([i]).encode())  # NullTokenizer: the id's digits
    return out


@torch.no_grad()
def cloze_accuracy(model, tokenizer, texts: list[str]) -> dict:
    """Strict last-word accuracy: every token of the last word must be the argmax."""
    device = model.word_embeddings.weight.device
    window = model.cfg.max_position_embeddings
    correct = 0
    for text in texts:
        text = text.rstrip()
        cut = text.rfind(" ")
        if cut <= 0:
            raise ValueError(f"cloze passage without a context before its last word: {text[:60]!r}")
        context, target = tokenizer.encode(text[:cut]), tokenizer.encode(text[cut:])
        ids = (context + target)[-window:]
        logits = model.logits(torch.tensor([ids], device=device))[0]
        predicted = logits[len(ids) - len(target) - 1:len(ids) - 1].argmax(dim=-1).tolist()
        correct += predicted == target
    return {"passages": len(texts), "correct": correct, "accuracy": correct / len(texts)}


class Progress:
    """Megatron's ``Evaluating iter i/n`` lines on stderr: the first, the last, and one every few seconds."""

    def __init__(self, every_s: float = 5.0):
        self.every_s, self.last = every_s, None

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.last is None or done == total or now - self.last >= self.every_s:
            print(f"Evaluating iter {done}/{total}", file=sys.stderr, flush=True)
            self.last = now


def _parse(p: argparse.ArgumentParser, argv: list[str]):
    """The flags, or one ValueError line (a typo answered with the closest flag)."""
    from gptrain.flags import suggest

    args, unknown = p.parse_known_args(argv)
    if unknown:
        flag = unknown[0].split("=")[0]
        known = [o for action in p._actions for o in action.option_strings]
        close = suggest(flag, known) if flag.startswith("--") else None
        raise ValueError(f"unknown flag {flag}: did you mean {close}?" if close else
                         f"unrecognized arguments: {' '.join(unknown)} (see `gptrain evaluate --help`)")
    if (args.split is not None or args.split_name is not None) and not args.data_path:
        raise ValueError("--split and --split-name choose documents of a --data-path dataset")
    if args.split_name is not None and args.split is None:
        args.split = "969,30,1"  # Megatron's default --split
    args.split_name = args.split_name or "valid"
    return args


def evaluate_main(argv: list[str]) -> int:
    from gptrain.flags import OneLineErrors
    from gptrain.inference.generate_cli import add_model_flags, load_from_flags

    p = OneLineErrors(prog="gptrain evaluate", description=__doc__.splitlines()[0], allow_abbrev=False)
    add_model_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data-path", help="an indexed dataset prefix (.bin/.idx): perplexity")
    src.add_argument("--jsonl", help="a JSONL file of documents: perplexity")
    src.add_argument("--cloze", help="a JSONL file of passages: LAMBADA-style last-word accuracy (strict)")
    p.add_argument("--json-key", default="text")
    p.add_argument("--seq-length", type=int, default=None, help="window length (default: the model's positions)")
    p.add_argument("--stride", type=int, default=None, help="window start spacing (default: --seq-length, no overlap)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--split", default=None, help="with --data-path: train,valid,test document weights as training's "
                   "--split (Megatron's default 969,30,1); only --split-name's documents are scored")
    p.add_argument("--split-name", choices=SPLIT_NAMES, default=None, help="with --split: which split (default valid)")
    try:
        args = _parse(p, argv)
    except ValueError as err:
        print(f"gptrain evaluate: error: {err}", file=sys.stderr)
        return 2
    try:
        loaded = load_from_flags(args, decode=False)
        model, tok = loaded.model, loaded.tokenizer
        if args.cloze:
            result = cloze_accuracy(model, tok, read_jsonl_texts(args.cloze, args.json_key))
            print(f"cloze (strict last word) on {args.cloze}: {result['correct']} / {result['passages']} correct, "
                  f"accuracy {result['accuracy']:.4f}")
            return 0
        window = model.cfg.max_position_embeddings
        seq = args.seq_length or window
        stride = args.stride or seq
        if not 1 < seq <= window:
            raise ValueError(f"--seq-length {seq}: must be in [2, {window}] (the model's positions)")
        if not 1 <= stride <= seq:
            raise ValueError(f"--stride {stride}: must be in [1, --seq-length {seq}]")
        if args.micro_batch_size < 1:
            raise ValueError("--micro-batch-size must be >= 1")
        tokens = token_stream(args, tok)
        if tokens.max(initial=0) >= model.cfg.vocab_size:
            raise ValueError(f"token id {int(tokens.max())} is outside the model's vocabulary of "
                             f"{model.cfg.vocab_size}")
        print(f"Evaluating on {len(tokens)} tokens", file=sys.stderr, flush=True)
        result = perplexity(model, tokens, seq, stride, token_byte_lengths(tok), args.micro_batch_size, Progress())
    except (OSError, ValueError) as err:
        print(f"gptrain evaluate: error: {err}", file=sys.stderr)
        return 2
    where = args.data_path or args.jsonl
    if args.data_path and args.split is not None:
        where += f" ({args.split_name} split of --split {args.split})"
    print(f"perplexity on {where}: {result['tokens']} tokens scored in {result['windows']} "
          f"windows of {seq} (stride {stride}) | loss {result['loss']:.6f} | PPL {result['ppl']:.4f} | "
          f"bits per byte {result['bits_per_byte']:.6f} ({result['bytes']} bytes)")
    return 0
