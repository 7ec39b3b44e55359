"""``gptrain data samples``: the token ids training reads at given positions of a split.

Takes the training flags as they are and builds the datasets exactly as ``gptrain train`` does
(data/assemble.py), so a user can see what the model saw: iteration k (from 0) of training reads the
train split's positions [k x global batch, (k + 1) x global batch). Positions past the end wrap
around, as the training loader does."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

SPLITS = {"train": 0, "valid": 1, "test": 2}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gptrain data samples", allow_abbrev=False,
                                description="write the samples training reads at positions of a split as int64 "
                                            ".npy [count, seq-length + 1]; other flags are the training flags")
    p.add_argument("--split-name", choices=tuple(SPLITS), default="train")
    p.add_argument("--start", type=int, required=True, help="first position in the split (a sample index)")
    p.add_argument("--count", type=int, required=True, help="how many consecutive positions")
    p.add_argument("--output", required=True, help="FILE.npy")
    return p


def read_samples(dataset, start: int, count: int) -> np.ndarray:
    n = len(dataset)
    return np.stack([np.asarray(dataset[(start + k) % n], dtype=np.int64) for k in range(count)])


def samples_main(argv: list[str]) -> int:
    from gptrain.data.assemble import build_datasets, setup

    args, train_argv = _parser().parse_known_args(argv)
    try:
        if args.start < 0 or args.count < 1:
            raise ValueError(f"--start must be >= 0 and --count >= 1 (got {args.start}, {args.count})")
        output = Path(args.output)
        if output.suffix != ".npy":
            raise ValueError(f"--output {output}: name a .npy file")
        if not output.parent.is_dir():
            raise ValueError(f"--output {output}: directory {output.parent} does not exist")
        cfg, tokenizer = setup(train_argv, log=lambda _: None)
        dataset = build_datasets(cfg, tokenizer, log=lambda _: None)[SPLITS[args.split_name]]
        if dataset is None:
            raise ValueError(f"the {args.split_name} split is empty with these flags (--split {cfg.data.split}, "
                             f"--eval-iters {cfg.train.eval_iters})")
        samples = read_samples(dataset, args.start, args.count)
        tmp = output.with_name(f"{output.name}.tmp-{os.getpid()}.npy")
        try:
            np.save(tmp, samples, allow_pickle=False)
            os.replace(tmp, output)
        finally:
            tmp.unlink(missing_ok=True)
    except (OSError, ValueError) as err:
        print(f"gptrain: error: {err}", file=sys.stderr)
        return 2
    wrapped = " (wrapping around)" if args.start + args.count > len(dataset) else ""
    print(f"wrote {output}: {samples.shape[0]} samples x {samples.shape[1]} tokens, positions "
          f"[{args.start}, {args.start + args.count}) of the {args.split_name} split of {len(dataset)}{wrapped}")
    return 0
