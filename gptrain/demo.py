"""``gptrain demo``: the main job end to end on built-in data, no download.

Exports the built-in corpus (Python's documentation, whitespace flattened), preprocesses it,
trains a GPT with ``gptrain train`` (on a GPU: 51M parameters, bf16, compiled; on a CPU: 7M
parameters in fp32, training capped at 75 seconds), prints the log lines and the validation and
test perplexity, samples text for a few prompts from the checkpoint, draws the loss curve, and
fails unless the training loss fell by a clear margin.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from gptrain.data.builtin import write_builtin_corpus
from gptrain.data.preprocess import PreprocessConfig, preprocess
from gptrain.train.run import train_main

MIN_LOSS_DROP = 2.0
PROMPTS = ("This module provides", "The list", "If the argument is")
# split 90,5,5: about 56 documents each for validation and test (949,50,1 left one test document)
SPLIT = "90,5,5"
TEMPERATURE, TOP_K = 0.9, 40

# The demo corpus holds about 240,000 tokens: on a GPU a GPT-2-small-shaped model sees it about 10 times,
# with dropout (longer only memorises it: validation loss rises; benchmarks/RESULTS.md, demo sweep);
# on a CPU the step is dominated by the 50,304-row output layer, so the model stays small and the
# micro-batch short to take many steps in the time. Logging every 10 (GPU) / 5 (CPU) iterations
# makes the first logged interval about the untrained model's loss.
GPU = dict(flags="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 256 "
                 "--max-position-embeddings 256 --micro-batch-size 32 --global-batch-size 32 --lr 3e-4 "
                 "--min-lr 1e-4 --lr-warmup-iters 60 --weight-decay 0.1 --hidden-dropout 0.1 "
                 "--attention-dropout 0.0 --log-interval 10 --eval-interval 100 --eval-iters 4 --bf16 --compile",
           train_iters=300, minutes=3.0, new_tokens=64)
CPU = dict(flags="--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
                 "--max-position-embeddings 128 --micro-batch-size 4 --global-batch-size 4 --lr 5e-3 "
                 "--min-lr 5e-4 --lr-warmup-iters 10 --weight-decay 0.01 --hidden-dropout 0.0 "
                 "--attention-dropout 0.0 --log-interval 5 --eval-interval 1000 --eval-iters 6",
           train_iters=150, minutes=1.25, new_tokens=48)


def flatten_whitespace(text: str) -> str:
    """Indentation and runs of spaces out, hard-wrapped prose paragraphs joined into one line: GPT-2's
    tokenizer spends a token per space and per line break (22% of the built-in corpus's tokens, 6%
    after), which a small model learns first and then samples. Code and lists keep their lines."""
    paragraphs = []
    for paragraph in re.split(r"\n[ \t]*\n", text):
        lines = [line.strip() for line in paragraph.split("\n")]
        indents = {len(raw) - len(raw.lstrip()) for raw in paragraph.split("\n") if raw.strip()}
        prose = (len(indents) == 1 and sum(map(len, lines)) >= 40 * len(lines)
                 and not any(line.startswith(">>>") for line in lines))
        paragraphs.append(re.sub(r"[ \t]{2,}", " ", (" " if prose else "\n").join(lines)))
    return "\n\n".join(paragraphs)


def write_demo_corpus(path: Path) -> tuple[int, int]:
    """The built-in corpus as JSONL, whitespace flattened; returns (documents, bytes)."""
    raw = path.with_name(path.name + ".raw")
    docs, _ = write_builtin_corpus(raw)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(raw, encoding="utf-8") as src, open(tmp, "w", encoding="utf-8") as dst:
        for line in src:
            text = flatten_whitespace(json.loads(line)["text"])
            dst.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    raw.unlink()
    os.replace(tmp, path)
    return docs, path.stat().st_size


def final_test(result) -> list[tuple[int, float]]:
    """The end of training's test loss as the loss curve's one test point (none without one)."""
    return [] if result.test_loss is None else [(result.iteration, result.test_loss)]


def loss_fell(losses: list[tuple[int, float]], final_validation: float | None = None,
              min_drop: float = MIN_LOSS_DROP) -> tuple[bool, str]:
    """Whether the loss fell by ``min_drop`` from the first logged training interval (about the
    untrained model's) to the final validation loss on held-out documents, or without one to the
    last training interval (a few small batches: noisier)."""
    if not losses or (final_validation is None and len(losses) < 2):
        return False, f"only {len(losses)} logged interval(s): too few iterations to see the loss fall"
    first = losses[0][1]
    last, what = (losses[-1][1], "last training interval") if final_validation is None else \
        (final_validation, "final validation")
    return (first - last >= min_drop, f"lm loss {first:.3f} (first training interval) -> {last:.3f} ({what}): "
                                      f"fell by {first - last:.3f}; the demo requires {min_drop}")


def plot_losses(path: Path, losses: list[tuple[int, float]], val: dict[str, list[tuple[int, float]]],
                title: str) -> str:
    """The loss curve as a PNG; returns what was written (or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no loss curve: matplotlib is missing (python3 -m pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    ax.plot(*zip(*losses), marker=".", label="training (mean over each log interval)")
    for name, marker in (("val", "o"), ("test", "s")):
        if val[name]:
            ax.plot(*zip(*val[name]), marker=marker, linestyle="--" if name == "val" else "none",
                    label="validation" if name == "val" else "test (end of training)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"loss curve: {path}"


def sample_texts(checkpoints: Path, device: torch.device, new_tokens: int, seed: int) -> list[tuple[str, str]]:
    """Sampled continuations (``TEMPERATURE``, ``TOP_K``) of ``PROMPTS`` from the last checkpoint."""
    from gptrain.inference.generate import SamplingParams, generate
    from gptrain.inference.load import load_for_inference

    loaded = load_for_inference(checkpoints, device=device)
    tok = loaded.tokenizer
    # one seed per prompt: the sampler's noise is keyed by (seed, position)
    params = [SamplingParams(max_new_tokens=new_tokens, temperature=TEMPERATURE, top_k=TOP_K, seed=seed + i,
                             stop_ids=(tok.eod,)) for i in range(len(PROMPTS))]
    gens = generate(loaded.model, [tok.encode(p) for p in PROMPTS], params)
    return [(p, tok.decode([t for t in g.generated if t != tok.eod])) for p, g in zip(PROMPTS, gens)]


def busy_cpu_threads() -> str | None:
    """On a CPU whose cores are already busy (1-minute load average at least the core count), train
    on one thread: PyTorch's threads then wait on each other for their share of the cores (measured
    3x slower per step than one thread at a load of 7 on 2 cores). Returns what was done."""
    cores, load = os.cpu_count() or 1, os.getloadavg()[0]
    if load < cores or torch.get_num_threads() == 1:
        return None
    torch.set_num_threads(1)
    return f"busy CPU (load average {load:.1f} on {cores} cores): one thread"


def _minutes(seconds: float) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def demo_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gptrain demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="demo_out", help="working directory (replaced): corpus, dataset, "
                                                     "checkpoints, tensorboard/, loss_curve.png")
    p.add_argument("--train-iters", type=int, default=None,
                   help=f"iterations (default: {GPU['train_iters']} on a GPU, {CPU['train_iters']} on a CPU)")
    p.add_argument("--minutes", type=float, default=None,
                   help=f"training stops after this many minutes (default: {GPU['minutes']} on a GPU, "
                        f"{CPU['minutes']} on a CPU); validation and test follow")
    p.add_argument("--cpu", action="store_true", help="run the CPU demo even where a GPU is present")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    try:
        return _demo(args)
    finally:
        torch.set_num_threads(threads)  # busy_cpu_threads may have changed it for this process


def _demo(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    on_gpu = torch.cuda.is_available() and not args.cpu
    setting = GPU if on_gpu else CPU
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not (out / "builtin.jsonl").exists():
        print(f"gptrain demo: error: --out {out} holds files that are not a previous demo's; give a new folder",
              file=sys.stderr)
        return 2
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    docs, size = write_demo_corpus(out / "builtin.jsonl")
    print(f"== built-in corpus (whitespace flattened): {docs} documents, {size / 1e6:.2f} MB -> "
          f"{out / 'builtin.jsonl'}")
    report = preprocess(PreprocessConfig(inputs=[str(out / "builtin.jsonl")], output_prefix=str(out / "builtin"),
                                         append_eod=True, workers=2, progress=False))
    print(f"== preprocess: {report.summary()}")
    threads = None if on_gpu else busy_cpu_threads()
    if threads:
        print(f"== {threads}")
    iters = args.train_iters or setting["train_iters"]
    minutes = setting["minutes"] if args.minutes is None else args.minutes
    data = f"--data-path {out / 'builtin_text_document'} --split {SPLIT} --seed {args.seed}".split()
    flags = (setting["flags"].split() + data + ["--train-iters", str(iters), "--lr-decay-style", "cosine",
             "--clip-grad", "1.0", "--exit-duration-in-mins", str(minutes), "--device", "cuda" if on_gpu else "cpu"])
    flags_train = flags + ["--save", str(out / "checkpoints"), "--tensorboard-dir", str(out / "tensorboard")]
    print("== gptrain train " + " ".join(flags_train))
    trained = train_main(flags_train, log=lambda line: print(line, flush=True))
    if trained.exit_code:
        return trained.exit_code
    losses = trained.train_losses
    val = {"val": list(trained.validation_losses), "test": final_test(trained)}
    if trained.exit_reason:
        # Megatron's time limit skips the final evaluation: evaluate the saved checkpoint instead
        print(f"== the {minutes}-minute limit stopped training at iteration {trained.iteration}; "
              "evaluating the checkpoint")
        lines: list[str] = []
        eval_flags = [f for f in flags if f != "--compile"]  # evaluation alone is not worth compiling
        evaluated = train_main(eval_flags + ["--load", str(out / "checkpoints"), "--skip-train"], log=lines.append)
        if evaluated.exit_code:
            return evaluated.exit_code
        for line in lines:
            if "validation loss at" in line or (line.startswith("-" * 20) and set(line.strip()) == {"-"}):
                print(line, flush=True)
        val = {"val": val["val"] + evaluated.validation_losses, "test": final_test(evaluated)}
    print(f"== TensorBoard logs: {out / 'tensorboard'} (open with: tensorboard --logdir {out / 'tensorboard'}, "
          "then http://localhost:6006)")
    if losses:
        device_name = torch.cuda.get_device_name() if on_gpu else "CPU"
        print("== " + plot_losses(out / "loss_curve.png", losses, val, f"gptrain demo on {device_name}"))
    ok, verdict = loss_fell(losses, val["val"][-1][1] if val["val"] else None)
    if ok:
        device = torch.device("cuda" if on_gpu else "cpu")
        for prompt, text in sample_texts(out / "checkpoints", device, setting["new_tokens"], args.seed):
            print(f"== sample (temperature {TEMPERATURE}, top-k {TOP_K}) for {prompt!r}:\n{prompt}{text}\n")
    print(f"== {verdict}")
    print(f"== total time {_minutes(time.perf_counter() - start)}")
    if not ok:
        print("gptrain demo: FAILED: the loss did not fall enough")
        return 1
    print("gptrain demo: OK. Next: your own text as JSONL -> `gptrain preprocess --input my.jsonl --output-prefix "
          "my --append-eod` -> `gptrain train ... --data-path my_text_document` (`gptrain train --help`)")
    return 0
