"""Where `gptrain generate` and `gptrain serve` spend their start-up. Each runs as a user runs it (a new
process), ``--repeats`` times in a row: the first on the caches as the machine has them, the next on
warm ones (Triton's and inductor's kernels, the checkpoint's verified checksums). For each run: the wall
time to the last generated token (generate) or to ``/health`` answering (serve), and the command's own
start line (imports, load, warm-up), and for serve when its background warm-up (the decode graphs)
ended. With ``--profile``: one in-process load and in-flight warm-up
under cProfile, the functions with the most own time.

    python3 benchmarks/start_up.py --load CHECKPOINT [--repeats 2] [--tokens 256] [--profile]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_generate(load: str, tokens: int) -> str:
    begin = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gptrain", "generate", "--load", load, "--prompt", "Hello, my name is",
                           "--max-new-tokens", str(tokens), "--greedy"], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - begin
    line = next((ln for ln in done.stderr.splitlines() if "done in" in ln), done.stderr.strip()[-300:])
    return f"generate {tokens} tokens: wall {wall:.1f} s, exit {done.returncode}; {line}"


def _health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return json.loads(r.read())
    except OSError:
        return None


def run_serve(load: str, port: int, limit_s: float = 300) -> str:
    begin = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "gptrain", "serve", "--load", load, "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    health = warm = None
    while time.perf_counter() - begin < limit_s and server.poll() is None:
        answer = _health(port)
        if answer is not None and health is None:
            health = time.perf_counter() - begin
        if answer is not None and not answer.get("warming"):
            warm = time.perf_counter() - begin
            break
        time.sleep(0.05)
    server.send_signal(signal.SIGINT)
    try:
        out, _ = server.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        out, _ = server.communicate()
    lines = [ln for ln in out.splitlines() if "ready in" in ln or "decode graphs" in ln]
    if health is None:
        return f"serve: /health never answered (exit {server.returncode}); the log ends: {out.strip()[-500:]}"
    warmed = f", its decode graphs all captured at {warm:.1f} s" if warm is not None else ""
    return f"serve: /health answered {health:.1f} s after the start{warmed}; " + " | ".join(lines)


def profile(load: str, top: int) -> None:
    import cProfile
    import pstats

    import torch

    from gptrain.inference.load import load_for_inference
    from gptrain.serve.inflight import InflightEngine

    prof = cProfile.Profile()
    begin = time.perf_counter()
    prof.enable()
    loaded = load_for_inference(load, "cuda", torch.bfloat16)
    loaded_at = time.perf_counter()
    engine = InflightEngine(loaded.model, loaded.tokenizer)
    engine.warm_up()
    torch.cuda.synchronize()
    prof.disable()
    end = time.perf_counter()
    stats = engine.decoder.rows.stats
    print(f"in process, profiled: load {loaded_at - begin:.1f} s, warm-up {end - loaded_at:.1f} s "
          f"({stats['graphs']} step graphs)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    engine.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--port", type=int, default=5066)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    print(f"PYTHONPYCACHEPREFIX={os.environ.get('PYTHONPYCACHEPREFIX', '')}", flush=True)
    for i in range(args.repeats):
        print(f"[{i + 1}] {run_generate(args.load, args.tokens)}", flush=True)
    for i in range(args.repeats):
        print(f"[{i + 1}] {run_serve(args.load, args.port)}", flush=True)
    if args.profile:
        profile(args.load, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
