"""Benchmark: the whole ``gptrain preprocess`` command against raw tiktoken, same texts, same run.

Builds a JSONL corpus of at least ``--mb`` MB (the built-in corpus, repeated with a varying tag so
lines differ), then times
  * raw tiktoken ``encode_ordinary_batch`` over the same texts with 1 and 2 threads (in memory),
  * ``gptrain preprocess`` as a subprocess with ``--workers`` 1 and 2 (reading, parsing, writing),
and reports MB of text per second, tokens per second, the ratio, and the command's peak RSS for
the full input and for a tenth of it, and for ``--tiny-docs`` one-line documents and a tenth of them
(memory must stay flat as the input grows, in bytes and in documents).
Usage: python benchmarks/preprocess.py [--mb 100] [--record]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gptrain.data.builtin import builtin_documents
from gptrain.tokenizer import GPT2Tokenizer


ROUNDS = 2


def build_corpus(path: Path, target_mb: float) -> list[str]:
    base = list(builtin_documents())
    texts, size, rep = [], 0, 0
    while size < target_mb * 1e6:
        for doc in base:
            text = f"[copy {rep}] {doc}"
            texts.append(text)
            size += len(text.encode())
        rep += 1
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return texts


def time_command(src: Path, prefix: Path, workers: int) -> tuple[float, int]:
    code = ("import sys, time; from gptrain.cli import main; t = time.perf_counter(); "
            f"rc = main(['preprocess', '--input', {str(src)!r}, '--output-prefix', {str(prefix)!r}, "
            f"'--append-eod', '--workers', '{workers}', '--no-progress', '--overwrite']); "
            "print(time.perf_counter() - t, [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')][0]); sys.exit(rc)")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - start  # the whole command, interpreter start-up included
    rss_kb = int(out.strip().splitlines()[-1].split()[1])
    return wall, rss_kb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    ap.add_argument("--tiny-docs", type=int, default=2_000_000, help="documents of the tiny-document memory check")
    args = ap.parse_args()
    tok = GPT2Tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        texts = build_corpus(tmp / "corpus.jsonl", args.mb)
        tenth = tmp / "tenth.jsonl"
        with open(tmp / "corpus.jsonl", "rb") as src, open(tenth, "wb") as dst:
            lines = src.readlines()
            dst.writelines(lines[: len(lines) // 10])
        text_mb = sum(len(t.encode()) for t in texts) / 1e6
        jsonl_mb = (tmp / "corpus.jsonl").stat().st_size / 1e6
        # this machine's speed drifts: interleave the variants and keep each one's best of ROUNDS
        best: dict[tuple[str, int], tuple[float, int | None]] = {}
        for _ in range(ROUNDS):
            for n in (1, 2):
                start = time.perf_counter()
                ids = tok._enc.encode_ordinary_batch(texts, num_threads=n)
                seconds = time.perf_counter() - start
                tokens = sum(map(len, ids)) + len(texts)  # + one eod per document, as the command writes
                del ids
                key = ("raw tiktoken encode_ordinary_batch", n)
                best[key] = min(best.get(key, (float("inf"), None)), (seconds, None))
                seconds, rss = time_command(tmp / "corpus.jsonl", tmp / f"out{n}", n)
                key = ("gptrain preprocess (whole command)", n)
                best[key] = min(best.get(key, (float("inf"), None)), (seconds, rss))
        rows = [(name, n, seconds, tokens, rss) for (name, n), (seconds, rss) in sorted(best.items())]
        _, rss_tenth = time_command(tenth, tmp / "tenth_out", 2)
        # memory flat in documents too: many tiny documents, and a tenth of them
        tiny_rss = {}
        for n in (args.tiny_docs // 10, args.tiny_docs):
            path = tmp / f"tiny{n}.jsonl"
            with open(path, "w") as f:
                f.writelines(f'{{"text": "doc {i % 97}"}}\n' for i in range(n))
            tiny_rss[n] = time_command(path, tmp / f"tiny_out{n}", 2)
            path.unlink()
    raw = {r[1]: text_mb / r[2] for r in rows if r[0].startswith("raw")}
    table = [
        f"corpus: {len(texts)} documents, {text_mb:.1f} MB of text ({jsonl_mb:.1f} MB JSONL); "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "",
        "| what | threads/workers | seconds | MB text/s | M tokens/s | vs raw tiktoken | peak RSS MB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, n, seconds, tokens, rss in rows:
        mbs = text_mb / seconds
        table.append(f"| {name} | {n} | {seconds:.2f} | {mbs:.2f} | {tokens / seconds / 1e6:.2f} | "
                     f"{mbs / raw[n]:.0%} | {'' if rss is None else f'{rss / 1024:.0f}'} |")
    table.append("")
    table.append(f"peak RSS of the command (2 workers): {rss_tenth / 1024:.0f} MB for a tenth of the input, "
                 f"{best[('gptrain preprocess (whole command)', 2)][1] / 1024:.0f} MB for all of it")
    for n, (seconds, rss) in tiny_rss.items():
        table.append(f"tiny documents: {n} documents in {seconds:.1f} s, peak RSS {rss / 1024:.0f} MB")
    text = "\n".join(table)
    print(text)
    if args.record:
        results = Path(__file__).with_name("RESULTS.md")
        with open(results, "a") as f:
            f.write(f"\n## preprocess throughput, {dt.date.today()}, this 2-core CPU machine\n\n"
                    f"command: `python benchmarks/preprocess.py --mb {args.mb:g} --record`\n\n{text}\n")


if __name__ == "__main__":
    main()
