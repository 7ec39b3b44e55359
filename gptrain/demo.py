"""``gptrain demo``: the main job end to end on built-in data, no download.

Exports the built-in corpus (Python's documentation), preprocesses it, trains a small GPT with
``gptrain train`` (on the GPU when there is one), prints the log lines and the final validation
and test perplexity, generates a greedy sample from the checkpoint, and fails unless the training
loss fell by a clear margin.
"""
from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import torch

from gptrain.data.builtin import write_builtin_corpus
from gptrain.data.preprocess import PreprocessConfig, preprocess
from gptrain.inference.generate import greedy
from gptrain.tokenizer import GPT2Tokenizer
from gptrain.train.checkpoint import load_checkpoint
from gptrain.train.run import build_model, setup, train_main

MIN_LOSS_DROP = 2.0


def demo_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gptrain demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="demo_out", help="working directory (replaced)")
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--prompt", default="The list")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    docs, size = write_builtin_corpus(out / "builtin.jsonl")
    print(f"== built-in corpus: {docs} documents, {size / 1e6:.2f} MB -> {out / 'builtin.jsonl'}")
    report = preprocess(PreprocessConfig(inputs=[str(out / "builtin.jsonl")], output_prefix=str(out / "builtin"),
                                         append_eod=True, workers=2, progress=False))
    print(f"== preprocess: {report.summary()}")
    flags = (f"--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
             f"--max-position-embeddings 128 --micro-batch-size 8 --global-batch-size 8 "
             f"--train-iters {args.train_iters} --lr 2e-3 --min-lr 1e-4 --lr-decay-style cosine "
             f"--lr-warmup-iters 20 --weight-decay 0.01 --clip-grad 1.0 --hidden-dropout 0.0 "
             f"--attention-dropout 0.0 --split 949,50,1 --log-interval 20 --eval-interval 100 --eval-iters 5 "
             f"--data-path {out / 'builtin_text_document'} --save {out / 'checkpoints'} "
             f"--tensorboard-dir {out / 'tensorboard'}").split()
    if torch.cuda.is_available():
        flags.append("--bf16")
    print("== gptrain train " + " ".join(flags))
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    rc = train_main(flags, log=log)
    if rc:
        return rc
    losses = [float(m.group(1)) for m in (re.search(r"\| lm loss: (\S+) \|", s) for s in lines) if m]
    cfg, tokenizer = setup(flags, log=lambda s: None)
    model = build_model(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu"), log=lambda s: None)
    load_checkpoint(cfg.train.save, dict(model.named_parameters()), None, cfg.model.vocab_size, load_rng=False)
    tok = GPT2Tokenizer()
    sample = tok.decode(greedy(model, tok.encode(args.prompt), 40, stop_id=tok.eod))
    print(f"== sample (greedy) for {args.prompt!r}:\n{args.prompt}{sample}")
    drop = losses[0] - losses[-1]
    print(f"== lm loss {losses[0]:.3f} -> {losses[-1]:.3f} (fell by {drop:.3f}; the demo requires {MIN_LOSS_DROP})")
    if drop < MIN_LOSS_DROP:
        print("gptrain demo: FAILED: the loss did not fall enough")
        return 1
    print("gptrain demo: OK")
    return 0
