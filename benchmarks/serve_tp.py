"""Tensor-parallel serving on GPUs against one GPU: the 345M GPT (random init, saved as a gptrain
checkpoint; nothing downloaded) served by ``torchrun --nproc-per-node N -m gptrain serve
--tensor-model-parallel-size N`` and by one process. In fp32 the greedy tokens and log-probabilities
of both are compared; in bf16 the decode tokens/s through PUT /api at batch 1 and 32 are printed, then serve_load.py's
``--clients`` concurrent clients against each server.
The TP server is stopped with SIGTERM to rank 0 and must exit 0.

    python3 benchmarks/serve_tp.py [--nproc 2] [--new-tokens 128] [--batch-sizes 1 32] [--clients 32]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPTS = ["The history of the city", "In 1998, the company", "Scientists have found that", "Once upon a time"]


def make_checkpoint(root: Path) -> Path:
    import torch

    from gptrain.model.gpt import GPT, GPTConfig
    from gptrain.train.checkpoint import save_checkpoint

    cfg = GPTConfig(hidden_dropout=0.0, attention_dropout=0.0)  # 24 x 1024, 16 heads, 1024 positions
    model = GPT(cfg)
    model.init_weights(1234)
    params = dict(model.named_parameters())
    state = {"config": {"model": dataclasses.asdict(cfg), "data": {"vocab_file": None}}}
    save_checkpoint(root, 1, params, None, state, cfg.vocab_size)
    del model, params
    torch.cuda.empty_cache()
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def put(base: str, body: dict) -> dict:
    req = urllib.request.Request(base + "/api", data=json.dumps(body).encode(), method="PUT",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _rank0(torchrun_pid: int) -> int:
    for task in Path(f"/proc/{torchrun_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return int(pid)
    raise LookupError("rank 0 not found")


@contextlib.contextmanager
def server(load: Path, nproc: int, *extra: str):
    port = free_port()
    argv = ["serve", "--load", str(load), "--port", str(port), *extra]
    if nproc > 1:
        argv += ["--tensor-model-parallel-size", str(nproc)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "gptrain", *argv]
    else:
        cmd = [sys.executable, "-m", "gptrain", *argv]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited {proc.returncode}: {log.read().decode()[-3000:]}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("server did not start in 600 s") from None
                time.sleep(0.5)
        yield base
    finally:
        if proc.poll() is None:
            os.kill(_rank0(proc.pid) if nproc > 1 else proc.pid, signal.SIGTERM)
            start = time.monotonic()
            try:
                proc.wait(timeout=120)
                print(f"  stopped {time.monotonic() - start:.1f} s after SIGTERM", flush=True)
            except subprocess.TimeoutExpired:
                print("  still running 120 s after SIGTERM: killed", flush=True)
                proc.kill()
                proc.wait()
        log.seek(0)
        lines = [ln for ln in log.read().decode(errors="replace").splitlines() if ln.startswith("gptrain serve")]
        print(f"  [{nproc} process{'es' if nproc > 1 else ''}] exit {proc.returncode}; " + " | ".join(lines), flush=True)


def greedy(base: str, new_tokens: int) -> dict:
    return put(base, {"prompts": PROMPTS, "tokens_to_generate": new_tokens, "top_k": 1, "logprobs": True,
                      "no_log": True})


def tokens_per_s(base: str, batch: int, new_tokens: int, repeats: int = 3) -> float:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} number {i}" for i in range(batch)]
    body = {"prompts": prompts, "tokens_to_generate": new_tokens, "top_k": 1, "no_log": True}
    prompt_tokens = sum(len(t) for t in put(base, {**body, "tokens_to_generate": 0})["tokens"])
    put(base, {**body, "tokens_to_generate": 4})  # warm-up
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        out = put(base, body)
        seconds = time.perf_counter() - start
        best = max(best, (sum(len(t) for t in out["tokens"]) - prompt_tokens) / seconds)  # rows may stop early
    return best


def fp32_check(ckpt: Path, nproc: int, new_tokens: int) -> None:
    """fp32: TP equals one GPU (bf16 partial sums would differ in the last bits and a random model's near-flat
    logits can then pick another token)."""
    with server(ckpt, 1, "--dtype", "fp32") as base:
        one = greedy(base, new_tokens)
    with server(ckpt, nproc, "--dtype", "fp32") as base:
        tp = greedy(base, new_tokens)
    same = sum(a == b for a, b in zip(one["tokens"], tp["tokens"]))
    diff = max(abs(x - y) for a, b in zip(one["logprobs"], tp["logprobs"]) for x, y in zip(a, b))
    print(f"fp32 greedy, {len(PROMPTS)} prompts x {new_tokens} tokens: {same}/{len(PROMPTS)} rows identical, "
          f"max |logprob difference| {diff:.2e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--clients", type=int, default=32, help="serve_load.py's concurrent clients (0: none)")
    p.add_argument("--load-seconds", type=float, default=20)
    p.add_argument("--workdir", default="/tmp/gptrain_serve_tp")
    p.add_argument("--skip-fp32-check", action="store_true",
                   help="leave out the fp32 comparison of TP with one GPU (two server starts; run.sh table's time)")
    args = p.parse_args()
    import torch

    assert torch.cuda.device_count() >= args.nproc, f"needs {args.nproc} GPUs"
    print(f"devices: {args.nproc} x {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    ckpt = make_checkpoint(Path(args.workdir) / "gpt345m")

    if not args.skip_fp32_check:
        fp32_check(ckpt, args.nproc, args.new_tokens)

    for nproc in (1, args.nproc):
        how = "1 GPU" if nproc == 1 else f"TP{nproc}"
        with server(ckpt, nproc) as base:
            for batch in args.batch_sizes:
                rate = tokens_per_s(base, batch, args.new_tokens)
                print(f"bf16 {how}: batch {batch}: {rate:,.0f} tokens/s over HTTP", flush=True)
            if args.clients:
                load = subprocess.run([sys.executable, str(Path(__file__).with_name("serve_load.py")), "--url", base,
                                       "--clients", str(args.clients), "--seconds", str(args.load_seconds),
                                       "--tokens", "64"], capture_output=True, text=True)
                for line in load.stdout.splitlines():
                    print(f"bf16 {how} load: {line}", flush=True)
                if load.returncode:
                    print(f"bf16 {how} load: exit {load.returncode}: {load.stderr[-2000:]}", flush=True)


if __name__ == "__main__":
    main()
